"""Train a small model with DistributedDataParallel over the reduction_server backend.

Run it under the local launcher (reducers and workers on this machine):

    reduction-server run -np 2 --reducers 1 -- python examples/pytorch_ddp.py

or in any job where discovery finds the reducers (RS_REDUCERS, CLUSTER_SPEC, TF_CONFIG) and
torchrun or the cluster gives rank and world size. The only changes from a gloo/nccl script are
the import and the backend name. Synthetic data: each rank draws its own batches of a fixed
linear problem; the loss falls, and the weights stay identical on every rank.
"""

import argparse
import os
import time

try:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
except ModuleNotFoundError as missing:  # the framework is an extra of the package: say which
    if missing.name != "torch":
        raise
    raise SystemExit(f'{__file__} needs torch: pip install "reduction-server[torch]"') from None

import reduction_server.client.torch  # noqa: F401  (registers the "reduction_server" backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0, help="DDP's bucket size")
    parser.add_argument(
        "--hook",
        choices=["none", "fp16", "bf16"],
        default="none",
        help="keep gloo as the process group and all-reduce through a comm hook instead",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per rank (default: this host's cores shared by its ranks)"
    )
    args = parser.parse_args()
    # Ranks (and reducers) on one host share its cores; spinning intra-op threads would starve them.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // (local + 1)))

    if args.hook == "none":
        dist.init_process_group("reduction_server")  # rank, world size and reducers from the environment
    else:
        dist.init_process_group("gloo")  # needs MASTER_ADDR/MASTER_PORT (the launcher sets them)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(rank)  # different on every rank: DDP broadcasts rank 0's weights
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    )
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    if args.hook != "none":
        from reduction_server.client.torch import (
            ReductionServerHookState,
            reduction_server_bf16_hook,
            reduction_server_fp16_hook,
        )

        hook = reduction_server_fp16_hook if args.hook == "fp16" else reduction_server_bf16_hook
        ddp.register_comm_hook(ReductionServerHookState.from_env(), hook)

    truth = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))  # the same on every rank
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own samples
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    start = time.perf_counter()
    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=data)
        y = x @ truth + 0.01 * torch.randn(args.batch, 1, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.5f}", flush=True)
    elapsed = time.perf_counter() - start

    # Check that every rank holds the same weights: gather a checksum from each.
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sums, checksum)
    same = all(torch.equal(s, sums[0]) for s in sums)
    if rank == 0:
        print(f"{args.steps} steps on {world} ranks in {elapsed:.2f} s; weights identical on all ranks: {same}")
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
