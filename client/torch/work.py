"""The Work the backend hands torch for each collective: it completes with the collective's Future."""

import time
from datetime import timedelta
from typing import Optional

import torch  # the real torch: imports are absolute
import torch.distributed as dist


class FutureWork(dist.Work):
    """A Work whose wait() raises its collective's error: torch's Work made from a Future
    (_create_work_from_future) returns True from wait() even when the Future failed."""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Wait for the collective; raises its error if it failed, and RuntimeError ("Timed
        out") if `timeout` passes first (the collective itself goes on)."""
        if timeout is not None and timeout.total_seconds() > 0:
            deadline = time.monotonic() + timeout.total_seconds()
            while not self._future.done():
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"Timed out after {timeout.total_seconds():g} s waiting for a collective")
                time.sleep(0.001)
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        """The Future that completes with the collective's result."""
        return self._future

    def is_completed(self) -> bool:
        """Whether the collective has ended, one way or the other."""
        return self._future.done()

    def is_success(self) -> bool:
        """Whether the collective has ended without an error."""
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:  # noqa: BLE001 - the question is only whether it failed
            return False
        return True
