"""A Hugging Face Accelerate job on CPU, 2 processes under torchrun, as Accelerate's documentation
writes one (Accelerator, prepare, accelerator.backward), with the backend passed in the one way that
works on CPU: the process group initialised first, then `Accelerator(cpu=True)`, which finds it
initialised and keeps it (it would otherwise replace any backend by gloo or mpi on CPU). Nothing of
reduction_server is imported: torch's `torch.backends` entry point registers the backend.

A small MLP trained for a few steps on fixed random data (the prepared DataLoader gives each rank
its own part); each rank writes its final parameters, the backend its process group has, what
Accelerate made of it, and the inputs it saw, to OUT/rank<r>.json.

argv: mode, OUT. mode: "gloo" (no group of ours: Accelerate's own choice on CPU, the reference);
any other backend name (e.g. "reduction_server"): the recipe, init_process_group(name) first;
"kwargs:<name>": Accelerate's documented way, InitProcessGroupKwargs(backend=<name>), which on CPU
is refused (the error is then written instead of parameters) unless Accelerate is patched
(docs/frameworks.md).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, set_seed
from rank_end import end_rank
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SAMPLES, BATCH, FEATURES, WIDTH = 64, 8, 8, 16  # 2 ranks x 8 per batch: 4 steps per epoch
EPOCHS = 2


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if mode.startswith("kwargs:"):  # Accelerate's documented way
        try:
            accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend=mode.split(":", 1)[1])])
        except Exception as exc:  # refused on CPU: reported, the test checks what Accelerate says
            rank = int(os.environ["RANK"])
            (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "error": f"{type(exc).__name__}: {exc}"}))
            return
    else:
        if mode != "gloo":
            if "OMPI_COMM_WORLD_RANK" in os.environ:  # under mpirun, which sets no RANK for torch's env://
                import reduction_server.client.torch  # noqa: F401  (its env:// reads mpirun's rank)
            dist.init_process_group(mode)  # first: Accelerator then keeps this group
        accelerator = Accelerator(cpu=True)
    set_seed(1234)
    model = nn.Sequential(
        nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)
    )
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    seen, steps = 0.0, 0
    for _epoch in range(EPOCHS):
        for xb, yb in data:
            seen += xb.sum().item()
            optimizer.zero_grad()
            accelerator.backward(nn.functional.mse_loss(model(xb), yb))
            optimizer.step()
            steps += 1
    params = [p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()]
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "world": dist.get_world_size(),
                "backend": dist.get_backend(),
                "accelerate": {
                    "distributed_type": str(accelerator.distributed_type),
                    "num_processes": accelerator.num_processes,
                    "wrapped": type(model).__name__,
                },
                "steps": steps,
                "seen": seen,
                "params": torch.cat(params).tolist(),
            }
        )
    )
    backend = dist.get_backend()
    accelerator.end_training()  # which destroys the group
    end_rank(backend)


if __name__ == "__main__":
    main()
