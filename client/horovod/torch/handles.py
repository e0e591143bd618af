"""Horovod's integer handles for torch collectives in flight: poll() and synchronize()."""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Dict, List, Tuple

from ..exceptions import as_horovod_errors

_handles: Dict[int, Tuple[List[Any], Callable[[], Any]]] = {}
_ids = itertools.count(1)
_lock = threading.Lock()


def new_handle(futures: List[Any], finish: Callable[[], Any]) -> int:
    """A handle for the collectives behind `futures`; synchronize() waits for them and returns finish()."""
    with _lock:
        handle = next(_ids)
        _handles[handle] = (futures, finish)
    return handle


def take(handle: int) -> Tuple[List[Any], Callable[[], Any]]:
    """The futures and finishing step behind `handle`, which is used up."""
    with _lock:
        try:
            return _handles.pop(handle)
        except KeyError:
            raise ValueError(f"unknown or already synchronized handle {handle!r}") from None


def poll(handle: int) -> bool:
    """True once the collective behind `handle` has finished (synchronize() will not block)."""
    with _lock:
        if handle not in _handles:
            raise ValueError(f"unknown or already synchronized handle {handle!r}")
        futures, _ = _handles[handle]
    return all(f.done() for f in futures)


def synchronize(handle: int) -> Any:
    """Wait for the collective behind `handle` and return its result; a failed collective
    raises HorovodInternalError."""
    futures, finish = take(handle)
    with as_horovod_errors():
        for future in futures:
            future.result()
    return finish()
