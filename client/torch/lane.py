"""A lane of the Pipeline: one order of collectives, and the thread that completes them and runs
the Future callbacks added from the lane, each in the order it was handed over.

The thread's callbacks issue their collectives into the next lane (pipeline.py), whose own
thread completes them: so a callback may wait on a collective it issues.
"""

import queue
import threading
from functools import partial
from typing import Any, Callable, List, Optional

import torch  # the real torch: imports are absolute

from ..communicator import Handle


def _as_exception(exc: BaseException) -> Exception:
    """exc, or a RuntimeError naming it where it is not an Exception (SystemExit, say), which a
    torch Future refuses: the completing thread would die, and every collective behind it hang."""
    if isinstance(exc, Exception):
        return exc
    error = RuntimeError(f"a collective's completion was interrupted by {exc!r}")
    error.__cause__ = exc
    return error


def _complete(handles: List[Handle], finish: Callable[[], Any], future: torch.futures.Future) -> None:
    """Wait for a collective's handles, copy its results out with finish() (on this thread's
    current stream) and complete its Future with finish()'s value or the error."""
    try:
        for handle in handles:
            handle.wait()
        value = finish()
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the Future
        future.set_exception(_as_exception(exc))
    else:
        future.set_result(value)


def _call(parent: torch.futures.Future, callback: Callable, child: Optional[torch.futures.Future]) -> None:
    """Run callback(parent) once parent has completed, through torch's own then() or
    add_done_callback() (so on CUDA its streams wait for parent's, as torch's do), and complete
    child, if any, with what it returns or raises."""
    try:
        parent.wait()
    except Exception:  # noqa: BLE001 - the callback meets the error in parent.value()
        pass
    if child is None:
        torch.futures.Future.add_done_callback(parent, callback)
        return
    done = torch.futures.Future.then(parent, callback)
    try:
        value = done.wait()  # on CUDA, this thread's current stream now waits for the callback's
    except Exception as exc:  # noqa: BLE001 - handed to whoever waits on the child
        child.set_exception(exc)
    else:
        child.set_result(value)


class Lane:
    """One order of a Pipeline's collectives and the thread that completes them."""

    def __init__(self, name: str) -> None:
        self.lock = threading.Lock()  # a collective's submission and its place in the queue are one step
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def complete(self, handles: List[Handle], finish: Callable[[], Any], future: torch.futures.Future) -> None:
        """Queue a submitted collective: its handles, the finish() that copies its results out,
        and its Future."""
        self._queue.put(partial(_complete, handles, finish, future))

    def call(self, parent: torch.futures.Future, callback: Callable, child: Optional[torch.futures.Future]) -> None:
        """Queue callback(parent), run once parent has completed; child (None for
        add_done_callback) completes with its value."""
        self._queue.put(partial(_call, parent, callback, child))

    def stop(self) -> None:
        """The thread ends after what is queued."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            item()
