"""One collective in flight on a worker: its buffers, its chunk plan, and each chunk's state."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from reduction_server.wire.formats import WireFormat, span
from reduction_server.wire.protocol import ITEMSIZE, DType, ReduceOp

from ..chunking import Chunk
from ..timeline import Trace

#: a chunk's state: not sent yet, sent and not answered, answered (or given up)
UNSENT, SENT, ANSWERED = 0, 1, 2


@dataclass
class Collective:
    """A collective handed to the engine; its Future completes with `result` or a CollectiveError."""

    seq: int
    dtype: DType
    op: ReduceOp
    root: int
    send: Optional[memoryview]  # None: this rank contributes no payload (broadcast, not root)
    recv: memoryview
    total: int
    # The plan (chunking.py): each chunk's bounds and endpoint, in the field Chunk calls `reducer` (a
    # substitute once moved).
    chunks: List[Chunk]
    result: Any
    future: Future = field(default_factory=Future)
    next: int = 0  # next chunk to send
    answered: int = 0
    state: bytearray = field(default=None)  # per chunk: UNSENT, SENT, ANSWERED
    moved: bytearray = field(default=None)  # per chunk: 1 once moved off a lost endpoint (failover.py)
    errors: List[Tuple[int, str]] = field(default_factory=list)  # (chunk, what went wrong)
    last_progress: float = 0.0
    blocked_since: Optional[float] = None  # waiting for a lost endpoint to come back
    trace: Optional[Trace] = None  # its timeline record, when RS_TIMELINE is set
    traced: bool = True  # False: kept off the timeline (Horovod's negotiation, every cycle)
    group: int = 0  # the group of ranks it runs in (0: all of them); seq counts within it
    time_limit: Optional[float] = None  # seconds it may take from its submission, its caller's timeout
    deadline: float = float("inf")  # monotonic time it fails unless done (from time_limit, as it is made)
    kept: List[Any] = field(default_factory=list)  # kept.Kept results that are views of recv, until it ends
    #: compressed (client/compression.py): send and recv hold its chunks in these formats, not `dtype`
    fmt: Optional[WireFormat] = None
    block: int = 0  # elements per int8 block (RS_INT8_BLOCK) when compressed

    def __post_init__(self) -> None:
        self.state = bytearray(len(self.chunks))
        self.moved = bytearray(len(self.chunks))
        if self.time_limit is not None:
            self.deadline = time.monotonic() + self.time_limit

    @property
    def code(self) -> int:
        """The headers' dtype byte: its element type, or its compressed format's code."""
        return self.dtype if self.fmt is None else self.fmt.code

    def send_span(self, offset: int, count: int) -> slice:
        """The bytes of send that hold elements offset..offset+count."""
        if self.fmt is None:
            return span(self.dtype, ITEMSIZE[self.dtype], 0, offset, count)
        return span(self.fmt.up, 0, self.block, offset, count)

    def recv_span(self, offset: int, count: int) -> slice:
        """The bytes of recv (the result) that hold elements offset..offset+count."""
        if self.fmt is None:
            return span(self.dtype, ITEMSIZE[self.dtype], 0, offset, count)
        return span(self.fmt.down, ITEMSIZE.get(self.fmt.down, 0), self.block, offset, count)

    @cached_property
    def endpoints(self) -> FrozenSet[int]:
        """The endpoints its chunks go to (asked only while an endpoint is down)."""
        return frozenset(chunk.reducer for chunk in self.chunks)

    @property
    def what(self) -> str:
        """ "broadcast", or "all_reduce" and its op."""
        return "broadcast" if self.op is ReduceOp.BROADCAST else f"all_reduce {self.op.name.lower()}"

    def describe(self) -> str:
        """The collective in words for error messages: its seq, what it is, its count and dtype."""
        group = f" of group {self.group:#x}" if self.group else ""
        wire = f", {self.fmt.name}" if self.fmt is not None else ""
        return f"collective seq={self.seq}{group} ({self.what} of {self.total} x {self.dtype.name.lower()}{wire})"

    def trace_facts(self) -> Tuple[str, Dict[str, Any]]:
        """Its name and arguments on the timeline (timeline.py)."""
        what = self.what
        return f"{what} #{self.seq}", {
            "seq": self.seq,
            "op": what,
            "dtype": self.dtype.name.lower(),
            "count": self.total,
            "bytes": len(self.send) if self.send is not None else self.total * self.dtype.itemsize,
            "chunks": len(self.chunks),
        }

    def move(self, k: int, endpoint: int, moved: bool) -> None:
        """Chunk k goes to `endpoint` from now on (failover.py); `moved`: not its own endpoint."""
        self.chunks[k] = self.chunks[k]._replace(reducer=endpoint)
        self.moved[k] = moved
        self.__dict__.pop("endpoints", None)  # the cached set of endpoints changed

    def pending_on(self, e: int) -> bool:
        """Whether a chunk of this collective on endpoint e is not answered yet (sent or not)."""
        return e in self.endpoints and any(s != ANSWERED and c.reducer == e for c, s in zip(self.chunks, self.state))

    def sent_to(self, e: int) -> bool:
        """Whether a chunk of this collective was sent to endpoint e and is not answered yet."""
        return e in self.endpoints and any(s == SENT and c.reducer == e for c, s in zip(self.chunks, self.state))
