"""The rounds of a reducer: the state of each key (one chunk of one collective), and every
transition between its states, in one place, as BytePS keeps a server's per-key state.

    OPEN --every rank contributed--> (result sent to every rank) --> forgotten
    OPEN --a disagreement, a lost rank, a budget, RS_TIMEOUT--> FAILED --every rank answered--> forgotten

A round opens with its key's first contribution. Each contribution is folded into the
accumulator as it arrives (deterministic mode: in rank order, holding early ones); once all W
ranks have contributed, the result goes back to every rank and the accumulator returns to the
pool once libzmq has released it. A FAILED round has given up its memory and answers each rank
once with the same ERROR, including ranks that contribute after it failed; it is forgotten once
every rank has been answered or is lost, or after RETAIN_FAILED_S + 2 x RS_TIMEOUT. Rounds reach
the workers only through the Outbox.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from ..log import event, get_logger
from ..wire.protocol import ACCUMULATOR_ITEMSIZE, MOVED_TYPES, ErrorCode, Header, MsgType, format_name
from .accumulator import AccumulatorPool, PoolExhausted
from .clock import Clock
from .delivery import Delivery
from .finals import Finals
from .fold import Folder, Payload
from .membership import Membership, Peer
from .outbox import Outbox, clip
from .round import Round, format_ranks
from .shared_results import SharedResults

if TYPE_CHECKING:
    from .metrics import ReducerMetrics

log = get_logger("reducer")

# Failed rounds are kept (without their memory) so that ranks that contribute late get the same
# error as the others; at most this many, each for at most RETAIN_FAILED_S + 2 x RS_TIMEOUT.
MAX_FAILED_ROUNDS = 65536
RETAIN_FAILED_S = 60.0


class Rounds:
    """Every open or failed round of the job served, by key."""

    def __init__(
        self,
        outbox: Outbox,
        members: Membership,
        pool: AccumulatorPool,
        clock: Clock,
        *,
        index: int,
        name: str,
        max_chunk_bytes: int,
        max_rounds: int,
        round_timeout: float,
        deterministic: bool,
        results: Optional[SharedResults] = None,
    ) -> None:
        self.outbox = outbox
        self.members = members
        self.clock = clock
        self.folder = Folder(pool, deterministic)
        self.index = index
        self.name = name
        self.max_chunk_bytes = max_chunk_bytes
        self.max_rounds = max_rounds
        self.round_timeout = round_timeout
        self.rounds: Dict[tuple, Round] = {}
        self.failed_kept = 0  # rounds in self.rounds that failed (kept to answer late contributions)
        self.metrics: Optional["ReducerMetrics"] = None  # timings, when metrics are served
        # Plain counters for the stop summary and the metrics (metrics.py reads them at scrape time).
        self.completed = 0
        self.failed = 0
        self.failed_codes: Dict[str, int] = {}
        self.delivery = Delivery(outbox, members, self.folder, index, results)
        self.finals = Finals(self.delivery, self.folder, pool)

    @property
    def bytes_out(self) -> int:
        """Payload bytes of results sent (frames and shared-memory slots)."""
        return self.delivery.bytes_out

    @property
    def bytes_shared_out(self) -> int:
        """Of bytes_out, those written into shared-memory slots."""
        return self.delivery.bytes_shared_out

    @property
    def open_count(self) -> int:
        """Rounds still waiting for contributions."""
        return len(self.rounds) - self.failed_kept

    # -- OPEN: contributions ---------------------------------------------------------------
    def contribute(
        self, peer: Peer, h: Header, payload: Payload, bad_payload: Optional[str] = None, slot: Optional[int] = None
    ) -> None:
        """An admitted peer's contribution h to its key (its rank, job and generation checked)."""
        if h.count * ACCUMULATOR_ITEMSIZE[h.dtype] > self.max_chunk_bytes:
            return self._fail_contribution(
                h,
                ErrorCode.TOO_LARGE,
                (
                    f"rank {h.rank} sent a chunk of {h.count} x {format_name(h.dtype)}, over this reducer's "
                    f"limit of {self.max_chunk_bytes} bytes per chunk"
                ),
            )
        if bad_payload is not None:
            return self._fail_contribution(h, ErrorCode.BAD_PAYLOAD, bad_payload)
        if h.key not in self.rounds and len(self.rounds) >= self.max_rounds:
            in_flight = self.open_count
            if in_flight >= self.max_rounds:
                return self._fail_contribution(
                    h,
                    ErrorCode.TOO_LARGE,
                    (
                        f"rank {h.rank} started {h.describe()} while {in_flight} chunks of collectives were in "
                        f"flight on this reducer, its cap (RS_MAX_ROUNDS={self.max_rounds}); ranks that issue "
                        "collectives in the same order stay within their window (RS_WINDOW) of each other"
                    ),
                )
        rnd, problem = self._round_for(h)
        if rnd is None:  # not one of the group's ranks: it alone hears why, the group's round goes on
            return self.outbox.error(peer.identity, ErrorCode.MISMATCH, f"{self.name}: {problem}", about=h)
        if h.type not in MOVED_TYPES and h.seq > peer.max_seq.get(h.group, -1):
            peer.max_seq[h.group] = h.seq  # a moved chunk is resent out of order: it says nothing of skips
        if rnd.error is not None:
            return self._answer_failed(rnd, h.rank, h)
        if problem is not None:
            return self.fail(rnd, ErrorCode.MISMATCH, problem, extra=h)
        if rnd.final is not None or h.type is MsgType.FINAL:  # a moved round a rank brought the result of
            failure = self.finals.contribute(rnd, h, payload)
            if failure is not None:
                return self.fail(rnd, *failure, extra=h)
            return self._forget(h.key) if rnd.complete else None
        lost = self.members.lost
        if lost:
            gone = [rank for rank in lost if rank not in rnd.contributed and rank in rnd.ranks]
            if gone:
                return self.fail(
                    rnd,
                    ErrorCode.LOST,
                    f"{rnd.first.describe()} cannot complete: " + "; ".join(lost[rank] for rank in sorted(gone)[:8]),
                    extra=h,
                )
        reason = rnd.disagreement(h)
        if reason is not None:
            code = ErrorCode.DUPLICATE if h.rank in rnd.contributed else ErrorCode.MISMATCH
            return self.fail(rnd, code, reason, extra=h)
        arrived = time.monotonic() if self.metrics is not None else 0.0
        copies = None
        if self.folder.completes_in_place(rnd):  # into the slots it goes to as it is summed
            own = (peer.segment, slot) if slot is not None else None
            copies = functools.partial(self.delivery.slot_copies, rnd, h, own)
        try:
            self.folder.fold(rnd, h, payload, copies)
        except PoolExhausted as exc:
            return self.fail(rnd, ErrorCode.TOO_LARGE, str(exc), extra=h)
        except ValueError as exc:
            return self.fail(rnd, ErrorCode.BAD_PAYLOAD, f"rank {h.rank}: {exc}", extra=h)
        except SystemError as exc:  # a kernel refused: the round may be half folded, so no rank may wait on it
            return self.fail(rnd, ErrorCode.INTERNAL, f"folding rank {h.rank}'s contribution failed: {exc}", extra=h)
        rnd.contributed[h.rank] = h
        if slot is not None:  # its result goes back into the same slot of the same segment
            rnd.slots[h.rank] = (peer.segment, slot)
        if self.metrics is not None:
            self.metrics.contributed(h.rank, rnd.started, arrived)
        if rnd.complete:
            self._finish(rnd)

    # -- OPEN -> result sent -> forgotten -----------------------------------------------------
    def _finish(self, rnd: Round) -> None:
        h = rnd.first
        try:
            out, buffers = self.folder.result(rnd)
        except PoolExhausted as exc:  # every rank hears it, and the accumulator is freed
            return self.fail(rnd, ErrorCode.TOO_LARGE, f"{h.describe()} cannot be sent: {exc}")
        frame = self.delivery.result(rnd, out)
        if self.metrics is not None:
            self.metrics.finished(rnd.started)
        self._forget(h.key)
        self.folder.sent(rnd, buffers, frame)
        self.completed += 1

    # -- OPEN -> FAILED -> forgotten ----------------------------------------------------------
    def _fail_contribution(self, h: Header, code: ErrorCode, reason: str) -> None:
        """A contribution that cannot be used fails its whole round, so no rank waits for it
        (h.rank is its sender's: the core checked it)."""
        rnd, problem = self._round_for(h)
        if rnd is None:  # not one of the group's ranks: no round of the group is touched
            identity = self.members.rank_identity.get(h.rank)
            if identity is not None:
                self.outbox.error(identity, ErrorCode.MISMATCH, f"{self.name}: {problem}", about=h)
            return None
        if rnd.error is not None:
            return self._answer_failed(rnd, h.rank, h)
        self.fail(rnd, code, reason, extra=h)

    def _round_for(self, h: Header) -> Tuple[Optional[Round], Optional[str]]:
        """The round of h's key (a new one, with h as its first contribution, if there is none),
        and why h cannot contribute to it (its group's verdict: membership.ranks_of); no round
        when h's sender is not one of the group's ranks (or the group is unknown)."""
        ranks, problem = self.members.ranks_of(h)
        if problem is not None and h.rank not in ranks:
            return None, problem
        rnd = self.rounds.get(h.key)
        if rnd is None:
            rnd = self.rounds[h.key] = Round(first=h, ranks=ranks, started=self.clock.now, moved=h.type in MOVED_TYPES)
        return rnd, problem

    def fail(self, rnd: Round, code: ErrorCode, reason: str, extra: Optional[Header] = None) -> None:
        """rnd fails: its memory goes back, and every rank that contributed (and `extra`'s
        sender) hears why; ranks that contribute later hear the same."""
        reason = clip(reason)
        if rnd.error is None and self.rounds.get(rnd.first.key) is rnd:
            self.failed_kept += 1
        rnd.error = f"{self.name}: {reason}"
        rnd.code = code
        rnd.failed_at = self.clock.now
        self.failed += 1
        self.failed_codes[code.name] = self.failed_codes.get(code.name, 0) + 1
        event(
            log,
            logging.WARNING,
            "round_failed",
            reducer=self.index,
            key=rnd.first.describe(),
            code=code.name,
            reason=reason,
        )
        self.folder.free(rnd)
        self.finals.release(rnd)
        for rank, h in list(rnd.contributed.items()):
            self._answer_failed(rnd, rank, h)
        if extra is not None:
            self._answer_failed(rnd, extra.rank, extra)

    def _answer_failed(self, rnd: Round, rank: int, about: Header) -> None:
        identity = self.members.rank_identity.get(rank)
        if identity is not None:
            self.outbox.error(identity, rnd.code, rnd.error, about=about)
        if rank not in rnd.answered and rank in rnd.ranks:
            rnd.answered.append(rank)
        self._maybe_forget(rnd)

    def _maybe_forget(self, rnd: Round) -> None:
        """A failed round is forgotten once every rank has been answered (or is lost)."""
        answered = len(rnd.answered)
        lost = self.members.lost
        if answered < rnd.world and lost:
            answered += sum(1 for rank in lost if rank not in rnd.answered and rank in rnd.ranks)
        if answered >= rnd.world:
            self._forget(rnd.first.key)

    def rank_lost(self, rank: int, text: str) -> Dict[str, int]:
        """Fail every open round `rank` has not contributed to; what it did, for the log line."""
        failed = 0
        for rnd in list(self.rounds.values()):
            if rnd.error is None and rnd.final is None and rank not in rnd.contributed and rank in rnd.ranks:
                self.fail(rnd, ErrorCode.LOST, f"{rnd.first.describe()} cannot complete: {text}")
                failed += 1
            elif rnd.error is not None:
                self._maybe_forget(rnd)
        return {
            "failed_rounds": failed,
            "open_rounds": self.open_count,
            "accumulator_bytes_in_use": self.folder.pool.in_use_bytes,
        }

    def check_skipped(self) -> None:
        """A rank sends its collectives in seq order, so a rank that already contributed to a
        later seq here will never contribute to an open round of an earlier one (the collective
        failed on its side, e.g. while a reducer was down): that round fails now, not at RS_TIMEOUT."""
        for rnd in list(self.rounds.values()):
            if rnd.error is not None or rnd.moved or (rnd.first.job, rnd.first.generation) != self.members.job:
                continue
            skipped = [rank for rank in rnd.missing if self.members.seq_of(rank, rnd.first.group) > rnd.first.seq]
            if skipped:
                self.fail(
                    rnd,
                    ErrorCode.LOST,
                    (
                        f"{rnd.first.describe()} cannot complete: ranks {format_ranks(skipped)} went on to later "
                        f"collectives without contributing (it failed on their side); ranks "
                        f"{format_ranks(rnd.contributed)} contributed"
                    ),
                )

    def expire(self, now: float) -> None:
        """Fail rounds that waited longer than the timeout for their last contributions. The
        failed round is kept (without its memory) so that a rank that contributes late gets the
        same message as the others; it is forgotten once every rank has been answered."""
        retain = RETAIN_FAILED_S + 2 * self.round_timeout
        failed = 0
        for key, rnd in list(self.rounds.items()):
            if rnd.error is None and rnd.final is not None:
                if now - rnd.started >= self.round_timeout:  # every rank that asked has its answer
                    self._forget(key)
            elif rnd.error is None:
                if now - rnd.started >= self.round_timeout:
                    self.fail(
                        rnd,
                        ErrorCode.STALE,
                        (
                            f"{rnd.first.describe()} timed out after {self.round_timeout:g} s: ranks "
                            f"{format_ranks(rnd.contributed)} contributed, ranks {format_ranks(rnd.missing)} did not"
                        ),
                    )
                    failed += 1
            elif now - rnd.failed_at >= retain:
                self._forget(key)
            else:
                failed += 1
        if failed > MAX_FAILED_ROUNDS:  # bounded: the oldest failed rounds go first
            for key in [k for k, r in self.rounds.items() if r.error is not None][: failed - MAX_FAILED_ROUNDS]:
                self._forget(key)

    def drop_all(self) -> int:
        """Forget every round, giving its memory back (a new job replaces the old one); how many."""
        dropped = len(self.rounds)
        for rnd in self.rounds.values():
            self.folder.free(rnd)
            self.finals.release(rnd)
        self.rounds.clear()
        self.failed_kept = 0
        return dropped

    def _forget(self, key: tuple) -> None:
        rnd = self.rounds.pop(key, None)
        if rnd is not None and rnd.error is not None:
            self.failed_kept -= 1
        elif rnd is not None and rnd.final is not None:
            self.finals.release(rnd)
            self.completed += 1
