"""DDP training under `torchrun --max-restarts` with the reduction_server backend, for
tests/jobs/test_torchrun_restart.py: `python torchrun_restart.py DIR STEPS KILL_STEP`.

Each step trains a small model on this rank's slice of a batch fixed by the step. Rank 0 saves
the model, the optimizer and the next step to DIR/checkpoint.pt after every step; a process that
torchrun's agent restarted (TORCHELASTIC_RESTART_COUNT > 0) resumes from it. On the first attempt
rank 1 SIGKILLs itself at step KILL_STEP (-1: never). Rank 0 writes the final parameters to
DIR/final.pt.
"""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from report import say
from torch.nn.parallel import DistributedDataParallel as DDP

import reduction_server.client.torch  # noqa: F401 - registers the backend


def main() -> None:
    directory, steps, kill_step = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.set_num_threads(1)
    dist.init_process_group("reduction_server")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    checkpoint = directory / "checkpoint.pt"
    start = 0
    if attempt > 0:
        saved = torch.load(checkpoint)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"]
    for step in range(start, steps):
        if attempt == 0 and rank == 1 and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(8 * world, 16, generator=data), torch.randn(8 * world, 1, generator=data)
        mine = slice(8 * rank, 8 * (rank + 1))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        optimizer.step()
        if rank == 0:
            torch.save(
                {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                directory / "checkpoint.tmp",
            )
            os.replace(directory / "checkpoint.tmp", checkpoint)  # whole or not at all
    if rank == 0:
        torch.save(model.module.state_dict(), directory / "final.pt")
    say(f"rank {rank} attempt {attempt} resumed from {start}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
