"""Moved rounds that a FINAL settles: the result of a chunk whose reducer was lost, brought by a
rank that had received it before the loss (docs/reliability.md, "Reducer failover").

When a reducer dies after sending a chunk's result to some ranks and not to others, the ranks
that have it send it to the chunk's substitute (FINAL) in place of their contribution, and the
others send their contribution (MOVED). The first FINAL becomes the round's result: it goes at
once to every rank that contributed, a FINAL's sender gets a bare RESULT (it holds the data), and
every later contribution is answered as it arrives. Every FINAL of a key must carry the same
bytes (they are one reducer's one result); two that differ fail the round. A settled round is
forgotten once every rank has arrived, or quietly at RS_TIMEOUT: everyone who asked has been
answered, and ranks that already had the result may never ask.
"""

from __future__ import annotations

import time
from typing import Optional, Tuple

from ..wire.protocol import BATCHED_RECV_BYTES, ErrorCode, Header, MsgType
from .accumulator import AccumulatorPool, PoolExhausted
from .delivery import Delivery
from .fold import Folder, Payload
from .round import Round


class Finals:
    """Settles moved rounds with the result a rank brought, and answers their ranks."""

    def __init__(self, delivery: Delivery, folder: Folder, pool: AccumulatorPool) -> None:
        self.delivery = delivery
        self.folder = folder
        self.pool = pool

    def contribute(self, rnd: Round, h: Header, payload: Payload) -> Optional[Tuple[ErrorCode, str]]:
        """h (a FINAL, or any contribution once rnd is settled) joins rnd and is answered; the
        failure of the round it causes, if any (the caller fails the round)."""
        reason = rnd.disagreement(h)
        if reason is not None:
            return (ErrorCode.DUPLICATE if h.rank in rnd.contributed else ErrorCode.MISMATCH), reason
        if h.type is MsgType.FINAL:
            if rnd.final is None:
                try:
                    self._settle(rnd, h, payload)
                except PoolExhausted as exc:
                    return ErrorCode.TOO_LARGE, str(exc)
                except ValueError as exc:
                    return ErrorCode.BAD_PAYLOAD, f"rank {h.rank}: {exc}"
            elif not self._same(rnd, payload):
                return ErrorCode.MISMATCH, (
                    f"ranks {rnd.final_owner} and {h.rank} received different results for "
                    f"{h.describe()} from the reducer that was lost"
                )
        rnd.contributed[h.rank] = h
        self.delivery.settled(rnd, h)
        return None

    def _settle(self, rnd: Round, h: Header, payload: Payload) -> None:
        """h is rnd's first FINAL: its payload is the result. What was folded so far is dropped,
        and every rank that contributed already gets the result."""
        if payload is None or isinstance(payload, memoryview):
            raise ValueError("a FINAL carries the result as a frame")
        data = payload if len(payload) >= BATCHED_RECV_BYTES else payload.bytes  # see protocol.BATCHED_RECV_BYTES
        self.folder.free(rnd)  # first: its memory makes room under the budgets
        self.pool.hold(len(data), h.rank)
        rnd.final, rnd.final_owner = data, h.rank
        rnd.started = time.monotonic()  # RS_TIMEOUT counts from here: late ranks are still answered
        for contribution in rnd.contributed.values():
            self.delivery.settled(rnd, contribution)

    @staticmethod
    def _same(rnd: Round, payload: Payload) -> bool:
        """Whether a later FINAL carries the bytes of the first."""
        if payload is None or isinstance(payload, memoryview):
            return False
        first = rnd.final if isinstance(rnd.final, bytes) else rnd.final.buffer
        return payload.buffer == first

    def release(self, rnd: Round) -> None:
        """rnd is forgotten: its result's memory no longer counts."""
        if rnd.final is not None:
            self.pool.unhold(len(rnd.final), rnd.final_owner)
            rnd.final = None
