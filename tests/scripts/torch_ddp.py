"""One rank of a PyTorch test job: run the requested tasks in turn and print one JSON line.

Tasks: "ops" (torch_ops.py: plain collectives), "overlap" (torch_overlap.py: bucket all-reduces
against backward), and DDP setups, each training the same small model on this rank's slice of a
fixed batch and reporting the weights after DDP construction and at the end.

Setups: "gloo" (gloo process group), "rs" (init_process_group("reduction_server")), "hook",
"fp16", "bf16" (gloo process group with the reduction_server comm hooks), "int8" (the
reduction_server group with the int8 hook over its Communicator; every bucket's gradients, result
and residual recorded). Ranks seed their models differently, so identical starting weights show
DDP's initial broadcast worked.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch_ops  # noqa: E402
import torch_overlap  # noqa: E402
from report import report  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch_model import STEPS, batch, make_model, train  # noqa: E402

import reduction_server.client.torch as rst  # noqa: E402


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def recording(state, buckets, model):
    """The int8 hook, recording each bucket's parameters, gradients (before the hook adds the
    residual), result and residual."""
    names = {id(p): name for name, p in model.named_parameters()}

    def hook(state, bucket):
        grad = bucket.buffer().clone()
        params = [names[id(p)] for p in bucket.parameters()]
        assert sum(p.numel() for p in bucket.parameters()) == grad.numel(), "a padded bucket"
        future = rst.reduction_server_int8_hook(state, bucket)

        def record(done):
            out = done.value()
            residual = state.residual(bucket)
            buckets.append(
                {"params": params, "grad": grad.tolist(), "out": out.tolist(), "residual": residual.tolist()}
            )
            return out

        return future.then(record)

    return hook


def run(setup, spec, rank, world):
    backend = "reduction_server" if setup in ("rs", "int8") else "gloo"
    env_before = dict(os.environ)
    if setup == "rs" and spec.get("rs_without_master"):
        os.environ.pop("MASTER_ADDR", None)  # the discovery-only rendezvous (no TCP store)
        os.environ.pop("MASTER_PORT", None)
    dist.init_process_group(backend)
    os.environ.clear()
    os.environ.update(env_before)
    assert dist.get_rank() == rank and dist.get_world_size() == world
    model = make_model(seed=1000 + rank)  # a different start on every rank
    before = flat(model)
    ddp = DDP(model, bucket_cap_mb=spec.get("bucket_cap_mb"))
    state = None
    if setup in ("hook", "fp16", "bf16"):
        state = rst.ReductionServerHookState.from_env()
        hook = {
            "hook": rst.reduction_server_hook,
            "fp16": rst.reduction_server_fp16_hook,
            "bf16": rst.reduction_server_bf16_hook,
        }[setup]
        ddp.register_comm_hook(state, hook)
    buckets = []
    if setup == "int8":
        state = rst.ReductionServerInt8HookState.for_process_group()
        ddp.register_comm_hook(state, recording(state, buckets, model))
    initial = flat(model)
    x, y = batch(world)
    per = x.shape[0] // world
    train(ddp, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per], STEPS)
    result = {
        "initial": initial,
        "final": flat(model),
        "before": before,
        "buffers": {k: v.tolist() for k, v in model.named_buffers()},
    }
    if buckets:
        result["buckets"] = buckets
    if setup == "hook":  # over gloo: the int8 state has no group Communicator to take
        try:
            rst.ReductionServerInt8HookState.for_process_group()
        except ValueError as exc:
            result["refused"] = str(exc)
    if state is not None:
        state.close()
    dist.destroy_process_group()
    return result


def main():
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ["RS_RANK"]), int(os.environ["RS_WORLD_SIZE"])
    torch.set_num_threads(1)  # ranks and reducers share this machine's cores
    out = {"rank": rank}
    for setup, port in zip(spec["setups"], spec["master_ports"]):  # a fresh store for every group
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        print(f"rank {rank}: {setup} starts", file=sys.stderr, flush=True)
        if setup == "ops":
            out[setup] = torch_ops.main()
        elif setup == "overlap":
            out[setup] = torch_overlap.main(spec.get("overlap_bucket_cap_mb", 0.25))
        else:
            out[setup] = run(setup, spec, rank, world)
        print(f"rank {rank}: {setup} done", file=sys.stderr, flush=True)
    report(out)


if __name__ == "__main__":
    main()
