"""One rank of an FSDP2 job (torch.distributed.fsdp.fully_shard) on a backend: a small MLP
trained on this rank's slice of a fixed batch, every layer sharded, then the full weights
(gathered) and a single process's weights trained on the whole batch, printed as one JSON line.

argv: backend ("reduction_server" or "gloo"), mesh ("fsdp": 1-D over all ranks; "hsdp": 2-D,
replicate x shard, 2 x W/2), precision ("fp32", or "bf16": bf16 parameters, fp32 reduce).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
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
    backend, mesh_kind, precision = sys.argv[1:4]
    if backend == "reduction_server":
        os.environ.pop("MASTER_ADDR", None)  # the discovery-only rendezvous
    else:  # the peer: torch's own env:// rendezvous, at the test's MASTER_PORT
        os.environ.update(RANK=os.environ["RS_RANK"], WORLD_SIZE=os.environ["RS_WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if mesh_kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    data = batches(world)
    train(
        model,
        [(x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]) for x, y in data],
    )
    sharded = flat(p.full_tensor() for p in model.parameters())
    reference = make_model()
    train(reference, data)
    dist.destroy_process_group()
    report(
        {
            "rank": rank,
            "weights": sharded,
            "reference": flat(reference.parameters()),
            "initial": flat(make_model().parameters()),
        }
    )


if __name__ == "__main__":
    main()
