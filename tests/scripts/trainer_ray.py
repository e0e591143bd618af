"""A Ray Train job on CPU as Ray's documentation writes one: a TorchTrainer of 2 CPU workers whose
backend is `TorchConfig(backend=<name>)`, the model wrapped by `ray.train.torch.prepare_model`.
Nothing of reduction_server is imported, and no `worker_process_setup_hook` is set: in Ray's worker
processes torch's `torch.backends` entry point registers the backend, and the reducers are reached
through environment variables only, given to the workers as Ray passes any: `ray.init(
runtime_env={"env_vars": ...})` (this driver takes them out of its own environment first, so that
nothing else can carry them to the workers).

One local Ray cluster (ray.init, 2 CPUs per trainer) runs a TorchTrainer per backend named on the
command line, side by side: a small MLP trained for a few steps on fixed random data, each rank on its own
rows. Each rank writes its final parameters, the backend its process group has and the inputs it
saw to OUT/<backend>/rank<r>.json.

argv: OUT (a directory), then backends (e.g. "gloo" "reduction_server").
"""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from ray import train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer, prepare_model
from torch import nn

SAMPLES, BATCH, FEATURES, WIDTH = 64, 8, 8, 16  # 2 ranks x 8 per step: 4 steps
WORKERS = 2


def train_loop(config: dict) -> None:
    """Each worker's training (run in Ray's worker processes, pickled from here)."""
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    model = prepare_model(
        nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
    )
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    context = train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    seen, steps = 0.0, 0
    for start in range(rank * BATCH, SAMPLES, world * BATCH):  # this rank's rows of each step
        xb, yb = x[start : start + BATCH], y[start : start + BATCH]
        seen += xb.sum().item()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(xb), yb).backward()
        optimizer.step()
        steps += 1
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "world": dist.get_world_size(),
                "backend": dist.get_backend(),
                "steps": steps,
                "seen": seen,
                "params": params.tolist(),
            }
        )
    )


def fit(backend: str, out: Path) -> None:
    """One TorchTrainer on `backend`, as Ray's documentation writes one."""
    TorchTrainer(
        train_loop,
        train_loop_config={"out": str(out / backend)},
        torch_config=TorchConfig(backend=backend),
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
        run_config=RunConfig(name=backend, storage_path=str(out / "ray_results")),
    ).fit()


def main() -> None:
    out, backends = Path(sys.argv[1]), sys.argv[2:]
    # the reducers' address and the job token reach the workers through runtime_env only
    env_vars = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("RS_")}
    ray.init(num_cpus=WORKERS * len(backends), include_dashboard=False, runtime_env={"env_vars": env_vars})
    try:
        # the trainers side by side: each spends most of its time waiting on Ray to start processes
        with ThreadPoolExecutor(len(backends)) as pool:
            list(pool.map(fit, backends, [out] * len(backends)))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
