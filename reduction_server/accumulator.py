"""A pool of reusable accumulator buffers for the reducer.

Buffers are recycled by size: a training job all-reduces the same chunk sizes every step, so
after the first step no buffer is allocated (a fresh multi-MiB allocation per message is
page-faulted and zeroed by the kernel, which halves throughput). A buffer that went out as a
zero-copy result frame comes back only when libzmq has released every copy of it.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import numpy as np
import zmq

from .errors import ReductionServerError

_ALIGN = 64  # cache line: vector loads never straddle two lines at the start of a buffer


class PoolExhausted(ReductionServerError):
    """Taking a buffer would exceed the pool's memory budget."""


class AccumulatorPool:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: Dict[int, List[np.ndarray]] = defaultdict(list)
        self._pending: List[Tuple[zmq.MessageTracker, List[np.ndarray]]] = []
        self.in_use_bytes = 0  # lent out, or waiting for libzmq
        self.free_bytes = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of exactly nbytes, reused when one of that size is free."""
        free = self._free.get(nbytes)
        if free:
            buf = free.pop()
            self.free_bytes -= nbytes
        else:
            if self.in_use_bytes + nbytes > self.max_bytes:
                self.reap()
                if self.in_use_bytes + nbytes > self.max_bytes:
                    raise PoolExhausted(
                        f"accumulator memory budget of {self.max_bytes} bytes exhausted "
                        f"({self.in_use_bytes} in use, {nbytes} requested)")
            self._trim(self.max_bytes - self.in_use_bytes - nbytes)
            raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
            start = (-raw.ctypes.data) % _ALIGN
            buf = raw[start:start + nbytes]
        self.in_use_bytes += nbytes
        return buf

    def release(self, buffers: List[np.ndarray], tracker: Optional[zmq.MessageTracker] = None) -> None:
        """Give buffers back; with a tracker, only once libzmq is done sending them."""
        if tracker is not None and not tracker.done:
            self._pending.append((tracker, buffers))
            return
        for buf in buffers:
            self._free[buf.nbytes].append(buf)
            self.in_use_bytes -= buf.nbytes
            self.free_bytes += buf.nbytes

    def reap(self) -> None:
        """Return the buffers whose zero-copy sends libzmq has finished."""
        if not self._pending:
            return
        still = []
        for tracker, buffers in self._pending:
            if tracker.done:
                self.release(buffers)
            else:
                still.append((tracker, buffers))
        self._pending = still

    def _trim(self, room: int) -> None:
        """Drop free buffers (of sizes no longer asked for) until they fit in `room` bytes."""
        room = max(room, 0)
        for size in sorted(self._free, reverse=True):
            free = self._free[size]
            while free and self.free_bytes > room:
                free.pop()
                self.free_bytes -= size
