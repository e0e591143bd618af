"""The collectives in flight on a worker, and every way one ends: all its chunks answered, an
error, a lost endpoint (a reducer's shard, endpoints.py), no progress for the backstop, or the
engine stopping."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from reduction_server.errors import CollectiveError
from reduction_server.wire.protocol import Header

from .collective import ANSWERED, SENT, Collective
from .identity import Identity


class Ledger:
    """Collectives started and not finished, and the chunks each endpoint has not answered."""

    def __init__(self, me: Identity, names: Sequence[str]) -> None:
        self.me = me
        self.names = names  # by endpoint, as messages name it: "reducer 1 (host:port)" (Endpoint.name)
        self.active: Dict[Tuple[int, int], Collective] = {}  # by (group, seq)
        # Started, with chunks still to send, in order, by group (each group's own window, below).
        self.sending: Dict[int, Deque[Collective]] = {}
        # Chunks sent and not answered, by group and endpoint: each group has its own window, so
        # that groups used in different orders by different ranks (send/recv pairs) never wait
        # on one another's window.
        self.inflight: Dict[int, List[int]] = {}
        self.next_seq: Dict[int, int] = {}  # by group: the seq of the next collective to start
        #: told of every chunk answered with its result, and where else the result is held, if
        #: anywhere (a kept.Held; kept.py keeps it), when set
        self.on_result: Optional[Callable[[Collective, int, int, Any], None]] = None
        #: told of every collective as it ends, completed or failed, before its caller may touch its
        #: buffers again (kept.py copies the results it keeps out of them), when set
        self.on_end: Optional[Callable[[Collective], None]] = None

    def start(self, coll: Collective) -> None:
        """Track a collective handed to the engine: active by seq, queued for sending, its progress clock started."""
        coll.last_progress = time.monotonic()
        self.active[coll.group, coll.seq] = coll
        self.next_seq[coll.group] = coll.seq + 1
        queue = self.sending.get(coll.group)
        if queue is None:
            queue = self.sending[coll.group] = deque()
        queue.append(coll)

    def pending_chunk(self, h: Header, e: int) -> Optional[Collective]:
        """The collective whose chunk, sent to endpoint e, h answers; None for a late answer (it
        already failed, or the chunk has moved since) or the answer to a FINAL."""
        coll = self.active.get((h.group, h.seq))
        if (
            coll is None
            or not self.me.owns(h)
            or h.chunk >= len(coll.chunks)
            or coll.state[h.chunk] != SENT
            or coll.chunks[h.chunk].reducer != e
        ):
            return None
        return coll

    def chunk_done(self, coll: Collective, k: int, e: int, error: Optional[str], held: Any = None) -> None:
        """Chunk k of coll was answered by endpoint e (error: why it failed); `held`: where else its
        result is, handed to on_result (given only with no error, and only when on_result is set)."""
        coll.state[k] = ANSWERED
        self.inflight[coll.group][e] -= 1
        coll.answered += 1
        coll.last_progress = time.monotonic()
        if coll.trace is not None:
            coll.trace.chunk_answered()
        if error is not None:
            coll.errors.append((k, f"chunk {k} on {self.names[e]}: {error}"))
        elif self.on_result is not None:
            self.on_result(coll, k, e, held)
        if coll.answered == len(coll.chunks):
            if not coll.errors:
                self._end(coll)  # while it is still active: should this raise, the engine's end fails it
            del self.active[coll.group, coll.seq]
            if coll.errors:
                # The lowest chunk's error, not the first to arrive: every rank reports the same one.
                more = f" (and {len(coll.errors) - 1} more chunk errors)" if len(coll.errors) > 1 else ""
                self.fail(coll, f"{min(coll.errors)[1]}{more}")
            else:
                if coll.trace is not None:
                    coll.trace.timeline.finish(coll.trace)
                coll.future.set_result(coll.result)

    def fail(self, coll: Collective, reason: str) -> None:
        """Fail coll's Future with a CollectiveError naming this rank, the collective and
        `reason`, and end its timeline record; nothing if it has already completed."""
        if not coll.future.done():
            try:
                self._end(coll)
            finally:  # its caller hears of it whatever happens
                if coll.trace is not None:
                    coll.trace.timeline.finish(coll.trace, reason)
                coll.future.set_exception(CollectiveError(f"rank {self.me.rank}: {coll.describe()} failed: {reason}"))

    def _end(self, coll: Collective) -> None:
        if self.on_end is not None:
            self.on_end(coll)

    def abandon(self, coll: Collective) -> None:
        """Stop tracking a collective: its window slots free up, late answers are dropped."""
        for k, s in enumerate(coll.state):
            if s == SENT:
                self.inflight[coll.group][coll.chunks[k].reducer] -= 1
            coll.state[k] = ANSWERED
        self.active.pop((coll.group, coll.seq), None)
        queue = self.sending.get(coll.group)
        if queue is not None and coll in queue:
            queue.remove(coll)

    def give_up(self, coll: Collective, reason: str) -> None:
        """Stop tracking coll (abandon) and fail it with `reason`."""
        self.abandon(coll)
        self.fail(coll, reason)

    def fail_sent_to(self, e: int, reason: str) -> None:
        """Fail every collective with a chunk waiting on endpoint e: its answers are unreadable."""
        for coll in list(self.active.values()):
            if coll.sent_to(e):
                self.give_up(coll, reason)

    def fail_pending_on(self, e: int, reason: str) -> None:
        """Fail every collective with a chunk on endpoint e not answered yet (sent or not): e is gone."""
        for coll in list(self.active.values()):
            if coll.pending_on(e):
                self.give_up(coll, reason)
        for counts in self.inflight.values():
            counts[e] = 0

    def window(self, group: int) -> List[int]:
        """Group's chunks in flight, by endpoint (made on its first collective)."""
        counts = self.inflight.get(group)
        if counts is None:
            counts = self.inflight[group] = [0] * len(self.names)
        return counts

    def expire(self, now: float, backstop: float, timeout: float) -> None:
        """Fail collectives past their own time limit, and those with chunks out and no progress
        for `backstop` seconds, naming the endpoints that did not answer."""
        for coll in list(self.active.values()):
            if now >= coll.deadline:
                self.give_up(
                    coll,
                    (
                        f"Timed out after {coll.time_limit:g} s (the timeout it was given): {coll.answered} of "
                        f"{len(coll.chunks)} chunks had completed; the ranks that did not join it in time are "
                        "named by the reducers' own RS_TIMEOUT"
                    ),
                )
                continue
            if now - coll.last_progress < backstop or SENT not in coll.state:
                continue  # nothing in flight: it waits for window slots held by earlier collectives
            waiting = sorted({c.reducer for c, s in zip(coll.chunks, coll.state) if s == SENT})
            self.give_up(
                coll,
                (
                    f"no answer for {backstop:g} s (RS_TIMEOUT={timeout:g} and a margin) from "
                    + ", ".join(self.names[e] for e in waiting)
                    + f"; {coll.answered} of {len(coll.chunks)} chunks had completed"
                ),
            )

    def fail_all(self, reason: str, queued: Sequence[Collective] = ()) -> None:
        """The engine stops: every collective in flight, and those still queued, fail with reason."""
        for coll in [*self.active.values(), *queued]:
            self.give_up(coll, reason)
