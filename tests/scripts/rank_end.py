"""The end of a torch test job's rank, once it has written its result."""

import os
import sys

import torch.distributed as dist


def end_rank(backend: str) -> None:
    """Destroy the default group if one is left, as torch asks of every job; over gloo (the
    job's `backend`), then leave at once.

    Gloo's reference runs have aborted on the way out ("terminate called without an active
    exception": a thread of torch's still joinable at exit, seen in CI), which is torch's own
    teardown, not what a test compares. A rank of this project's backend exits normally, so its
    teardown stays tested."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if backend == "gloo":
        leave()


def leave() -> None:
    """Exit at once, with what was printed flushed: no group is torn down, on any thread."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
