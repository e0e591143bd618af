"""One rank of an FSDP2 job (torch.distributed.fsdp.fully_shard) on a backend: for each setup in
turn, on a process group of its own, a small MLP trained on this rank's slice of a fixed batch,
every layer sharded, then the full weights (gathered) and a single process's weights trained on
the whole batch; all setups' results printed as one JSON line, by setup.

argv: one JSON object: "backend" ("reduction_server" or "gloo"), "setups" ("<mesh>:<precision>"
each) and "master_ports" (one per setup, a fresh store for each group). mesh: "fsdp" (1-D over
all ranks), "hsdp" (2-D, replicate x shard, 2 x W/2), "hsdp-hook" (FSDP over the shard dimension
only, the replicas averaged by this project's all-reduce hook). precision: "fp32"; "bf16" (bf16
parameters, fp32 reduce); "int8" (this project's int8 reduce-scatter, and int8 replicas' hook
for hsdp-hook, with error feedback), which also reports how much the residuals hold and what a
MAX reduce-scatter is told. Setups share the processes because starting W ranks that import
torch costs more than the training.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rank_end import end_rank  # noqa: E402
from report import report  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

import reduction_server.client.torch  # noqa: E402,F401  (registers the backend)

STEPS, PER_RANK, WIDTH = 5, 4, 32


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(16, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 8))


def batches(world: int):
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(world * PER_RANK, 16, generator=g), torch.randn(world * PER_RANK, 8, generator=g))
        for _ in range(STEPS)
    ]


def train(model: nn.Module, data) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        loss.backward()
        opt.step()


def flat(params) -> list:
    return torch.cat([p.detach().float().reshape(-1) for p in params]).tolist()


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ["RS_RANK"]), int(os.environ["RS_WORLD_SIZE"])
    torch.set_num_threads(1)
    out = {"rank": rank}
    for setup, port in zip(spec["setups"], spec["master_ports"]):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(spec["backend"])
        out[setup] = run(*setup.split(":"))
        dist.destroy_process_group()
    report(out)
    end_rank(spec["backend"])


def run(mesh_kind: str, precision: str) -> dict:
    """One setup on the default group: its weights, the single process's, the initial ones."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if mesh_kind.startswith("hsdp"):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    shard_mesh = mesh["shard"] if mesh_kind == "hsdp-hook" else mesh
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    extra = {}
    if precision == "int8":
        extra = compress(model, mesh if mesh_kind == "hsdp-hook" else None)
    data = batches(world)
    train(
        model,
        [(x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]) for x, y in data],
    )
    sharded = flat(p.full_tensor() for p in model.parameters())
    if precision == "int8":
        residuals = [c.residual() for c in extra.pop("comms") if c.residual() is not None]  # the root holds none
        extra.update(residual=sum(float(r.abs().sum()) for r in residuals), compressed=len(residuals))
    reference = make_model()
    train(reference, data)
    return {
        "weights": sharded,
        "reference": flat(reference.parameters()),
        "initial": flat(make_model().parameters()),
        **extra,
    }


def compress(model: nn.Module, mesh) -> dict:
    """This project's int8 reduce-scatter in every FSDP module, and with a 2-D `mesh` its int8
    hook over the replicate dimension; the communications (their residuals are read after
    training), and the refusal of a MAX reduce-scatter."""
    from torch.distributed.fsdp import FSDPModule

    from reduction_server.client.torch import (
        ReductionServerInt8AllReduce,
        ReductionServerInt8ReduceScatter,
        compress_reduce_scatter,
    )

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    comms = compress_reduce_scatter(model)
    assert len(comms) == len(modules) == 4  # three layers and the root
    if mesh is not None:
        replicas = mesh["replicate"].get_group()
        for module in modules:
            hook = ReductionServerInt8AllReduce(replicas)
            module.set_all_reduce_hook(hook)
            comms.append(hook)
    try:
        probe = torch.zeros(4 * dist.get_world_size())
        ReductionServerInt8ReduceScatter()(torch.zeros(4), probe, dist.group.WORLD, dist.ReduceOp.MAX)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"comms": comms, "refused": refused}


if __name__ == "__main__":
    main()
