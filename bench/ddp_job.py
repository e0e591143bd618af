"""One rank of a timed DistributedDataParallel training job: `python -m
reduction_server.bench.ddp_job BACKEND --width D --batch B --steps N`. Rank 0 prints one JSON
line: the mean seconds per training step after a warm-up, between barriers, the parameter count,
and the losses of its first and last steps.

The model is an MLP D -> 4D -> 4D -> D (24 D^2 + 9 D parameters: D = 1024 gives 25.2M) trained
with SGD on a fixed synthetic batch per rank: with a small batch the step is mostly DDP's
gradient all-reduce. Every backend starts from the same weights and data, so the losses agree.

BACKEND: rs (`init_process_group("reduction_server")`, placed by the RS_* variables), gloo
(placed by RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT). `--hook`: the DDP comm hook a user of
that backend would register for a format: rs this project's (int8 with error feedback, bf16,
fp16), gloo torch's own (fp16_compress_hook; its bf16 hook refuses any backend but NCCL's).
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from reduction_server.bench.gloo_exit import exit_now


def mlp(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width),
        torch.nn.ReLU(),
        torch.nn.Linear(4 * width, 4 * width),
        torch.nn.ReLU(),
        torch.nn.Linear(4 * width, width),
    )


def register_hook(model: DistributedDataParallel, backend: str, hook: str) -> None:
    """Register the comm hook that sends `hook`'s format over `backend` (none: DDP's own all-reduce)."""
    if hook == "none":
        return
    if backend == "gloo":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, getattr(default_hooks, f"{hook}_compress_hook"))
        return
    from reduction_server.client import torch as rs

    if hook == "int8":
        model.register_comm_hook(rs.ReductionServerInt8HookState.for_process_group(), rs.reduction_server_int8_hook)
    else:
        hook_fn = getattr(rs, f"reduction_server_{hook}_hook")
        model.register_comm_hook(rs.ReductionServerHookState.for_process_group(), hook_fn)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=["rs", "gloo"])
    parser.add_argument("--width", type=int, default=1024, help="D: the model has 24 D^2 + 9 D parameters")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (DDP rebuilds its buckets)")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    parser.add_argument("--hook", choices=["none", "int8", "bf16", "fp16"], default="none", help="gradients' format")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    if args.hook in ("int8", "bf16") and args.backend == "gloo":
        parser.error(f"--hook {args.hook} is this project's (rs): torch has no {args.hook} hook for Gloo")
    torch.set_num_threads(1)  # many ranks share few cores
    if args.backend == "rs":
        import reduction_server.client.torch  # noqa: F401  (registers the backend)

        dist.init_process_group("reduction_server")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(mlp(args.width))
    register_hook(model, args.backend, args.hook)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch, args.width, generator=data)
    y = torch.randn(args.batch, args.width, generator=data)

    def step() -> float:
        optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # returns once DDP's all-reduces are done
        optimizer.step()
        return loss.item()

    first_loss = step()
    for _ in range(args.warmup - 1):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    dist.barrier()
    seconds = (time.perf_counter() - start) / args.steps
    if rank == 0:
        print(
            json.dumps(
                {"step_seconds": seconds, "steps": args.steps, "params": params, "first_loss": first_loss, "loss": loss}
            ),
            flush=True,
        )
    dist.destroy_process_group()
    if args.backend == "gloo":
        exit_now()


if __name__ == "__main__":
    main()
