"""The completing thread: a Communicator, and one thread that completes torch Futures in
submission order (the collectives that run through it are in collectives.py).

Collectives are submitted on the calling thread (so every rank's order is its program order)
and never waited for there; the thread waits for each one's handles, copies staged results back
and completes its Future, which runs DDP's callbacks off the communication engine.
"""

import atexit
import queue
import threading
import weakref
from typing import Any, Callable, List, Optional, Tuple

import torch  # the real torch: imports are absolute

from ..communicator import Communicator, Handle

#: what a collective's start() returns: the handles it submitted, and the finish() that copies results out
Started = Tuple[List[Handle], Callable[[], Any]]


def _as_exception(exc: BaseException) -> Exception:
    """exc, or a RuntimeError naming it where it is not an Exception (SystemExit, say), which a
    torch Future refuses: the completing thread would die, and every collective behind it hang."""
    if isinstance(exc, Exception):
        return exc
    error = RuntimeError(f"a collective's completion was interrupted by {exc!r}")
    error.__cause__ = exc
    return error


class Pipeline:
    """A Communicator and one thread that completes torch Futures in submission order."""

    def __init__(self, communicator: Communicator, owns: bool) -> None:
        self.communicator = communicator
        self._owns = owns
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()  # submission and enqueueing happen as one step
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"rs-torch-rank{communicator.rank}", daemon=True)
        self._thread.start()
        _live.add(self)

    @classmethod
    def over(cls, communicator: Optional[Communicator], owns: Optional[bool]) -> "Pipeline":
        """A pipeline over `communicator`, or over Communicator.from_env() when None; it closes
        the communicator when `owns` says so (None: when it made it)."""
        owns = communicator is None if owns is None else owns
        return cls(communicator or Communicator.from_env(), owns)

    # Every collective: submit(start) under the lock, so the completion queue has submission order.
    def run(self, start: Callable[[], Started], future: torch.futures.Future) -> torch.futures.Future:
        """Call start() under the lock (it submits the collectives; returns their handles and a
        finish callback) and queue them; `future` completes with finish()'s value or the error.
        RuntimeError once closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the reduction_server process group has been shut down")
            handles, finish = start()
            self._queue.put((handles, finish, future))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handles, finish, future = item
            try:
                for handle in handles:
                    handle.wait()
                value = finish()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the Future
                future.set_exception(_as_exception(exc))
            else:
                future.set_result(value)

    def close(self) -> None:
        """Refuse new collectives, close the Communicator if owned (what is pending fails), and
        join the thread once it has completed the queue."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        if self._owns:  # first: it fails what is still pending, so the thread cannot wait on it
            self.communicator.close()
        if threading.current_thread() is not self._thread:
            self._thread.join(None if self._owns else 30)
        _live.discard(self)


_live: "weakref.WeakSet[Pipeline]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # say goodbye to the reducers even without destroy_process_group()
    for pipeline in list(_live):
        try:
            pipeline.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
