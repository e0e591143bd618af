"""A pool of reusable accumulator buffers for the reducer.

Buffers are recycled by size: a training job all-reduces the same chunk sizes every step, so
after the first step no buffer is allocated (a fresh multi-MiB allocation per message is
page-faulted and zeroed by the kernel, which halves throughput). A buffer that went out as a
zero-copy result frame comes back only when libzmq has released every copy of it.

The budget also counts memory the pool does not own but the reducer keeps on purpose (hold()):
received frames adopted as accumulators (summed into in place, then sent back as the result)
and frames held for a rank-ordered (deterministic) fold. Besides the total budget, each rank has its
own: each accumulator is charged to the rank whose contribution was loaded into it (the first to
arrive; rank 0 in deterministic mode), each held frame to its sender, so one misbehaving rank
runs out of its budget long before it can starve the others.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import numpy as np
import zmq

from ..errors import ReductionServerError

_ALIGN = 64  # cache line: vector loads never straddle two lines at the start of a buffer


class PoolExhausted(ReductionServerError):
    """Taking a buffer would exceed the pool's memory budget."""


class AccumulatorPool:
    def __init__(self, max_bytes: int, max_rank_bytes: Optional[int] = None) -> None:
        self.max_bytes = max_bytes
        self.max_rank_bytes = max_bytes if max_rank_bytes is None else max_rank_bytes
        self.by_rank: Dict[int, int] = {}  # bytes charged to each rank
        self._free: Dict[int, List[np.ndarray]] = defaultdict(list)
        self._pending: List[Tuple[zmq.MessageTracker, List[np.ndarray], int]] = []  # (tracker, buffers, held bytes)
        self.in_use_bytes = 0  # lent out, or waiting for libzmq
        self.free_bytes = 0
        self.held_bytes = 0  # received frames the reducer keeps: adopted accumulators, held contributions

    def acquire(self, nbytes: int, rank: Optional[int] = None) -> np.ndarray:
        """A uint8 buffer of exactly nbytes, reused when one of that size is free; charged to
        `rank` (until discharge()) when one is given."""
        if rank is not None:
            self._check_rank(rank, nbytes)
        free = self._free.get(nbytes)
        if free:
            buf = free.pop()
            self.free_bytes -= nbytes
        else:
            self._check(nbytes)
            self._trim(self.max_bytes - self.in_use_bytes - self.held_bytes - nbytes)
            raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
            start = (-raw.ctypes.data) % _ALIGN
            buf = raw[start : start + nbytes]
        self.in_use_bytes += nbytes
        if rank is not None:
            self.by_rank[rank] = self.by_rank.get(rank, 0) + nbytes
        return buf

    def hold(self, nbytes: int, rank: int) -> None:
        """Count nbytes of a received frame the reducer keeps for rank against the budgets."""
        self._check_rank(rank, nbytes)
        self._check(nbytes)
        self._trim(self.max_bytes - self.in_use_bytes - self.held_bytes - nbytes)
        self.held_bytes += nbytes
        self.by_rank[rank] = self.by_rank.get(rank, 0) + nbytes

    def unhold(self, nbytes: int, rank: int) -> None:
        self.held_bytes -= nbytes
        self.discharge(rank, nbytes)

    def discharge(self, rank: int, nbytes: int) -> None:
        """rank no longer accounts for nbytes (its round finished or failed)."""
        left = self.by_rank.get(rank, 0) - nbytes
        if left > 0:
            self.by_rank[rank] = left
        else:
            self.by_rank.pop(rank, None)

    def _check_rank(self, rank: int, nbytes: int) -> None:
        used = self.by_rank.get(rank, 0)
        if used + nbytes > self.max_rank_bytes:
            raise PoolExhausted(
                f"rank {rank} would hold {used + nbytes} bytes of reducer memory, over the per-rank budget of "
                f"{self.max_rank_bytes} bytes (RS_MAX_PEER_BYTES): the accumulators its contributions were "
                "loaded into (it reached those chunks first) and its contributions held for their turn "
                "(deterministic mode)"
            )

    def _check(self, nbytes: int) -> None:
        """Raise PoolExhausted if nbytes more would exceed the budget."""
        if self.in_use_bytes + self.held_bytes + nbytes > self.max_bytes:
            self.reap()
            if self.in_use_bytes + self.held_bytes + nbytes > self.max_bytes:
                raise PoolExhausted(
                    f"accumulator memory budget of {self.max_bytes} bytes (RS_MAX_ACCUMULATOR_BYTES) "
                    f"exhausted ({self.in_use_bytes} in use, {self.held_bytes} held, {nbytes} requested)"
                )

    def release(self, buffers: List[np.ndarray], tracker: Optional[zmq.MessageTracker] = None, held: int = 0) -> None:
        """Give buffers back, and stop counting `held` bytes of a kept frame (one adopted as an
        accumulator, whose sum went out as the result); with a tracker, only once libzmq is done
        sending them."""
        if tracker is not None and not tracker.done:
            self._pending.append((tracker, buffers, held))
            return
        for buf in buffers:
            self._free[buf.nbytes].append(buf)
            self.in_use_bytes -= buf.nbytes
            self.free_bytes += buf.nbytes
        self.held_bytes -= held

    def reap(self) -> None:
        """Return the memory whose zero-copy sends libzmq has finished."""
        if not self._pending:
            return
        still = []
        for pending in self._pending:
            if pending[0].done:
                self.release(pending[1], held=pending[2])
            else:
                still.append(pending)
        self._pending = still

    def _trim(self, room: int) -> None:
        """Drop free buffers (of sizes no longer asked for) until they fit in `room` bytes."""
        room = max(room, 0)
        if self.free_bytes <= room:
            return  # nothing to drop (hold() calls this for every held frame)
        for size in sorted(self._free, reverse=True):
            free = self._free[size]
            while free and self.free_bytes > room:
                free.pop()
                self.free_bytes -= size
