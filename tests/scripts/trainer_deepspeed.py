"""A DeepSpeed job on CPU (DS_ACCELERATOR=cpu), 2 processes under torchrun or DeepSpeed's own
launcher (`deepspeed --num_accelerators 2 trainer_deepspeed.py ...`, which adds `--local_rank=N`),
with the backend passed as DeepSpeed's documentation says: `deepspeed.init_distributed(
dist_backend=<name>)` before `deepspeed.initialize`. Nothing of reduction_server is imported: torch's
`torch.backends` entry point registers the backend.

One launch trains under ZeRO stage 1 and then under stage 2 (a fresh engine each, on the one process
group): a small MLP for a few steps on fixed random data, each rank on its own rows, with a plain
torch optimizer (SGD: no DeepSpeed op to build). Each rank writes the backend its process group
has, the local size its launcher gave it and, per stage, its final parameters (ZeRO gathers each
partition back into the module after every step) and the inputs it saw, to OUT/rank<r>.json.

DeepSpeed's communication layer on CPU JIT-builds a shared-memory C++ op (deepspeed_shm_comm) when it
starts, for its inference all-reduce only (training's collectives go to torch.distributed): about
80 CPU-seconds the first time on a host. The job skips it unless --shm-op is given, by telling
DeepSpeed that no op is buildable here, as on a host without a compiler: DeepSpeed then falls back to
torch.distributed for everything, which is what training used anyway.

argv: backend (e.g. "reduction_server" or "gloo"), OUT (a directory), [--shm-op].
"""

import argparse
import json
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

SAMPLES, BATCH, FEATURES, WIDTH = 64, 8, 8, 16  # 2 ranks x 8 per step: 4 steps
STAGES = (1, 2)


def train(stage: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One ZeRO `stage` run from the same initial model; this rank's steps, inputs and parameters."""
    torch.manual_seed(1234)
    model = nn.Sequential(
        nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)
    )
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # a torch optimizer: nothing to JIT-build on CPU
        "steps_per_print": 10**6,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    seen, steps = 0.0, 0
    for start in range(rank * BATCH, SAMPLES, world * BATCH):  # this rank's rows of each step
        xb, yb = x[start : start + BATCH], y[start : start + BATCH]
        seen += xb.sum().item()
        engine.backward(nn.functional.mse_loss(engine(xb), yb))
        engine.step()
        steps += 1
    params = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    return {"steps": steps, "seen": seen, "params": params.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend")
    parser.add_argument("out", type=Path)
    parser.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher passes it
    parser.add_argument("--shm-op", action="store_true", help="let DeepSpeed build its shared-memory op")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.shm_op:
        deepspeed.ops.__compatible_ops__ = {}  # no op buildable: no compiler run, no probe
    deepspeed.init_distributed(dist_backend=args.backend)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    zero = {str(stage): train(stage, x, y) for stage in STAGES}
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "world": dist.get_world_size(),
                "backend": dist.get_backend(),
                "placement": {name: os.environ.get(name) for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")},
                "zero": zero,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
