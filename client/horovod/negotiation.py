"""The negotiation: every cycle, each rank's new requests reach every rank, so that all hold
the same table of who asked for what and agree on what runs, in what order.

The table is an all-reduce of a small array in which each rank fills its own row (its
payload's length, a stopping flag, a joining flag and, when they fit in 512 bytes, the requests
themselves; an integer sum with zeros elsewhere, so exact), and only for longer payloads a second
all-reduce of a byte buffer filled the same way. Rank 0's clock travels in the table, so every
rank judges a name's staleness alike.

A rank that has joined (hvd.join()) counts as having asked for every name: a name is ready once
every rank that has not joined asked for it (the joined ranks add zeros to an allreduce; the
other kinds fail, as in Horovod). Once every rank has joined, the join completes everywhere,
naming the last.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

from reduction_server.config import settings
from reduction_server.wire.protocol import ReduceOp

from ..buffers import wire_view
from ..communicator import Communicator
from .requests import Request

#: request bytes a rank sends inside the per-cycle table (more take a second exchange)
_INLINE_BYTES = 512
#: a row's leading fields: payload length, stopping, rank 0's clock, joining
_FIELDS = 4


def cycle_time(environ: Optional[Mapping[str, str]] = None) -> float:
    """Seconds between cycles: RS_CYCLE_TIME, else HOROVOD_CYCLE_TIME (both in ms), else 1 ms."""
    return settings.first_set(("RS_CYCLE_TIME", "HOROVOD_CYCLE_TIME"), environ) / 1000.0


@dataclass
class _Pending:
    """A name some ranks have submitted: every rank keeps the same table."""

    first_seen: float  # rank 0's clock, so every rank judges staleness alike
    requests: Dict[int, Request] = field(default_factory=dict)


@dataclass
class Cycle:
    """What one cycle decided, the same on every rank."""

    ready: List[Tuple[str, Dict[int, Request]]]  # names every rank has asked for, in the order to run them
    stale: List[Tuple[str, str]]  # (name, why): asked for by some ranks only, for longer than the timeout
    leaving: List[int]  # ranks that shut down
    busy: bool  # whether anything was new or is still pending anywhere
    joined: Optional[int] = None  # the rank that joined last, in the cycle every rank had joined


class Negotiation:
    """The replicated table of names some ranks have asked for and others not yet."""

    def __init__(self, comm: Communicator, stall_timeout: float) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.world_size
        self.stall_timeout = stall_timeout
        self.pending: Dict[str, _Pending] = {}
        self.joined: Set[int] = set()  # ranks that joined and wait for the others to

    def forget(self) -> None:
        """Drop every name still waiting for other ranks (the coordinator has failed them all)."""
        self.pending.clear()
        self.joined.clear()

    def cycle(self, new: Sequence[Request], stopping: bool, joining: bool = False) -> Cycle:
        """Exchange this rank's new requests (and whether it stops, whether it joins) with every rank."""
        payload = json.dumps([r.encode() for r in new], separators=(",", ":")).encode() if new else b""
        # Each rank's row: its leading fields, then the payload itself when it fits (a few
        # requests): one collective per cycle, a second only for a longer payload.
        table = np.zeros((self.size, _FIELDS + _INLINE_BYTES // 8), np.int64)
        table[self.rank, :_FIELDS] = (
            len(payload),
            stopping,
            int(time.monotonic() * 1e6) if self.rank == 0 else 0,
            joining,
        )
        if len(payload) <= _INLINE_BYTES:
            table[self.rank, _FIELDS:].view(np.uint8)[: len(payload)] = np.frombuffer(payload, np.uint8)
        sum_in_place(self.comm, table, traced=False)  # every cycle: kept off the timeline
        clock = table[0, 2] / 1e6
        lengths = table[:, 0]
        ready: List[Tuple[str, Dict[int, Request]]] = []
        if lengths.any():
            blobs = (
                exchange_bytes(self.comm, payload, lengths, traced=False)
                if lengths.max() > _INLINE_BYTES
                else [row[_FIELDS:].view(np.uint8)[:n].tobytes() for row, n in zip(table, lengths)]
            )
            for r, blob in enumerate(blobs):
                for item in json.loads(blob) if blob else ():
                    self._arrived(r, Request.decode(item), clock, ready)
        joined = self._join([int(r) for r in np.flatnonzero(table[:, 3])], ready)
        stale = self._expire(clock)
        leaving = [int(r) for r in np.flatnonzero(table[:, 1])]
        return Cycle(ready, stale, leaving, bool(ready or self.pending or lengths.any() or self.joined), joined)

    def _complete(self, pending: _Pending) -> bool:
        return len(pending.requests) + len(self.joined - pending.requests.keys()) == self.size

    def _arrived(self, rank: int, request: Request, clock: float, ready: List[Tuple[str, Dict[int, Request]]]) -> None:
        pending = self.pending.setdefault(request.name, _Pending(clock))
        pending.requests[rank] = request
        if self._complete(pending):
            ready.append((request.name, self.pending.pop(request.name).requests))

    def _join(self, joining: List[int], ready: List[Tuple[str, Dict[int, Request]]]) -> Optional[int]:
        """Ranks that join this cycle: names they complete become ready (in the table's order, the
        same on every rank); once every rank has joined, the last of them (the highest of the
        last cycle's), and the join is over."""
        if not joining:
            return None
        self.joined.update(joining)
        for name, pending in list(self.pending.items()):
            if self._complete(pending):
                ready.append((name, self.pending.pop(name).requests))
        if len(self.joined) < self.size:
            return None
        self.joined.clear()
        return max(joining)

    def _expire(self, clock: float) -> List[Tuple[str, str]]:
        """Names that some ranks submitted and others have not, for longer than the timeout."""
        stale = []
        for name, pending in list(self.pending.items()):
            if clock - pending.first_seen <= self.stall_timeout:
                continue
            del self.pending[name]
            have = sorted(pending.requests)
            lacking = [r for r in range(self.size) if r not in pending.requests and r not in self.joined]
            stale.append(
                (
                    name,
                    (
                        f"rank {self.rank}: tensor {name!r} ({pending.requests[have[0]].describe()}) was submitted by "
                        f"ranks {have} but not by ranks {lacking} within {self.stall_timeout:g} s (RS_TIMEOUT); "
                        "every rank must submit every named collective"
                    ),
                )
            )
        return stale


def sum_in_place(comm: Communicator, array: np.ndarray, traced: bool = True) -> None:
    """In-place sum of `array` over every rank."""
    wire = wire_view(array, writable=True)
    comm._start(wire, wire, ReduceOp.SUM, 0, None, traced=traced).wait()


def exchange_bytes(comm: Communicator, payload: bytes, lengths: Sequence[int], traced: bool = True) -> List[bytes]:
    """Every rank's payload, given every rank's length: each rank fills its own slice of a zero
    buffer and the buffer is summed as bytes (exact: the other ranks add zeros)."""
    ends = np.cumsum(np.asarray(lengths, np.int64))
    buf = np.zeros(int(ends[-1]), np.uint8)
    start = int(ends[comm.rank]) - len(payload)
    buf[start : start + len(payload)] = np.frombuffer(payload, np.uint8)
    sum_in_place(comm, buf, traced)
    raw = buf.tobytes()
    return [raw[int(e - n) : int(e)] for e, n in zip(ends, lengths)]


def gather_bytes(comm: Communicator, payload: bytes) -> List[bytes]:
    """Every rank's payload, in rank order (two all-reduces; call on every rank in the same order)."""
    lengths = np.zeros(comm.world_size, np.int64)
    lengths[comm.rank] = len(payload)
    sum_in_place(comm, lengths)
    return exchange_bytes(comm, payload, lengths) if lengths.any() else [b""] * comm.world_size
