"""Reducer failover on a worker: a lost reducer's chunks move to the reducers left, and the
collectives in flight complete there with the right result (docs/reliability.md).

A reducer keeps nothing between collectives, and a worker still holds the input of every chunk
it has not had answered, so when a reducer is lost each rank:
- moves the lost reducer's chunks of every collective in flight to the first reducer not lost in
  the chunk's preference order (chunking.preference): every rank computes the same one once it
  knows of the same losses, and a chunk on a reducer still up never moves;
- sends again (MOVED) what the lost reducer had not answered;
- sends the results it had already received from the lost reducer (FINAL), in place of its
  contribution: the reducer may have died after answering some ranks and not others, and a
  rank that has the result must still let the others get the same one.

For the last, a rank keeps each group's last results from each reducer (kept.py). A rank that
lacks a chunk's result has the chunk among its unanswered ones on that reducer, at most its window
per group, plus what was moved there: the reducer answered at most that many of the group's rounds
after the one this rank lacks, so every rank that got it still keeps it.

A reducer that runs shards fails over shard by shard: what is lost, kept and moved is an endpoint
(endpoints.py), and below an index is an endpoint's.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Container, Deque, Dict, List, Optional, Tuple, Union

from reduction_server.wire.protocol import REJOIN_LEAD

from ..chunking import preference
from .collective import SENT, UNSENT, Collective
from .identity import Identity
from .kept import Held, Kept, KeptResults
from .ledger import Ledger

_NEVER = float("inf")

#: what the pump sends before new chunks: a chunk of a collective again (MOVED), or a kept result
Resend = Union[Tuple[Collective, int], Kept]


class Failover:
    """The endpoints this rank has lost, where each chunk goes, the results it keeps (`results`,
    kept.py), what it must send again, and the lost endpoints that come back."""

    def __init__(self, me: Identity, num_endpoints: int, window: int, enabled: bool, spares: int = 0) -> None:
        self.me = me
        self.num_endpoints = num_endpoints
        self.active = num_endpoints - spares  # the chunk plan's endpoints; the spares' come after them
        self.spares = spares
        self.window = window
        # With one endpoint there is nowhere to move to: nothing is kept.
        self.enabled = enabled and num_endpoints > 1
        self.lost: Dict[int, str] = {}  # endpoint -> why it was lost (or that it is a spare not needed yet)
        for e in range(self.active, num_endpoints):
            self.lost[e] = f"reducer {e} is a spare (RS_SPARE_REDUCERS), used once a reducer is lost"
        self.losses = 0  # endpoints lost so far, one lost twice counted twice
        # A lost endpoint that came back: the groups this rank reported to it (PROGRESS: the next
        # seq it would start), and each group's seq from which it is used again (JOIN).
        self.rejoining: Dict[int, Dict[int, int]] = {}
        self.since: Dict[int, Dict[int, int]] = {}
        self.held_since: Optional[float] = None  # when the collective waiting for a JOIN began to
        # An endpoint that drains (DRAIN, reducer/drain.py): each group's seq from which it takes none.
        self.until: Dict[int, Dict[int, int]] = {}
        self.drains = 0  # endpoints that drained and left cleanly (DRAINED), never counted as losses
        self.drain_moved = 0  # chunks sent to a draining endpoint past its boundary, moved (not summed there)
        self.results = KeptResults(window, num_endpoints)
        self.resend: Deque[Resend] = deque()
        self.moved_chunks = 0  # chunks sent to a substitute as MOVED (the tests read these counts)
        self.finals = 0  # results brought to a substitute in place of a contribution (FINAL)
        self.joins = 0  # groups in which a lost endpoint is used again (JOIN)
        self.rejoined_chunks = 0  # chunks answered by an endpoint that came back

    @property
    def rerouting(self) -> bool:
        """Whether a new collective's chunks may need another endpoint than the plan's: one of
        the plan's endpoints is lost (spares alone never are a chunk's own)."""
        return bool(self.until) or any(e < self.active for e in self.lost)

    def usable(self, e: int, group: int, seq: int) -> bool:
        """Whether endpoint e takes chunks of collective seq of group: never lost, or back from
        that seq; one that drains, before its boundary (a group it did not name: none)."""
        until = self.until.get(e)
        if until is not None and seq >= until.get(group, 0):
            return False
        return e not in self.lost or seq >= self.since.get(e, {}).get(group, _NEVER)

    def survivors(self, without: int) -> List[int]:
        """The endpoints in use (not lost, back in some group, or back and awaiting the JOIN that
        says from when), leaving out `without`. One awaiting its JOIN counts: a rank that had
        read the JOIN first would count it, and the ranks must agree on what is lost."""
        return [
            e
            for e in range(self.num_endpoints)
            if e != without and (e not in self.lost or self.since.get(e) or e in self.rejoining)
        ]

    def route(self, seq: int, chunk: int, group: int) -> Optional[int]:
        """The endpoint chunk `chunk` of collective `seq` of `group` goes to: the first usable one
        in its preference order (None: none is)."""
        for e in preference(seq, chunk, self.active, self.spares):
            if self.usable(e, group, seq):
                return e
        return None

    def keep(self, coll: Collective, k: int, e: int, held: Held = None) -> None:
        """Chunk k of coll was answered by endpoint e: its result is kept (kept.py)."""
        if e in self.since:
            self.rejoined_chunks += 1
        # After the result a rank lacks, the endpoint answered at most: that rank's window, plus
        # what it resent there after each loss, plus this rank's own resends there (rounds that
        # a FINAL settled without the lacking rank).
        self.results.keep(coll, k, e, held, self.window * (1 + 2 * self.losses))

    # -- an endpoint lost ----------------------------------------------------------------------
    def move_off(self, e: int, reason: str, ledger: Ledger) -> List[Collective]:
        """Endpoint e is lost: every chunk on it moves to its substitute; what it had not
        answered, and the results it gave this rank, are queued to be sent there. Returns the
        collectives left with no endpoint for a chunk (the caller fails them)."""
        self.losses += 1
        stranded = self._leave(e, reason, ledger)
        self.resend.extend(self.results.take(e))
        return stranded

    def drain(self, e: int, boundaries: Dict[int, int], ledger: Ledger) -> List[Collective]:
        """Endpoint e drains (DRAIN): from each group's boundary on (a group it did not name: from
        its first collective), its chunks move to their substitutes, as after a loss; those sent
        there already are sent again (it answers them DRAINING, unsummed), and so are the
        results brought there. Every chunk before the boundary stays. Returns the collectives
        left with no endpoint for a chunk (the caller fails them)."""
        self.until[e] = boundaries
        before = len(self.resend)
        stranded = self._move(e, ledger, lambda coll: coll.seq >= boundaries.get(coll.group, 0))
        self.drain_moved += len(self.resend) - before
        self.resend.extend(self.results.brought_past(e, boundaries))
        return stranded

    def drained(self, e: int, reason: str, ledger: Ledger) -> List[Collective]:
        """Endpoint e drained (DRAINED): it answered every chunk before its boundaries, so no
        rank lacks a result of it: nothing kept of it is brought anywhere. It stays lost until
        it comes back (PROGRESS, JOIN), as a lost endpoint does."""
        self.drains += 1
        self.results.drop(e)
        return self._leave(e, reason, ledger)

    def _leave(self, e: int, reason: str, ledger: Ledger) -> List[Collective]:
        """Endpoint e is no longer in use: every chunk still on it moves (the stranded collectives)."""
        self.lost[e] = reason
        self.until.pop(e, None)
        self.since.pop(e, None)
        self.rejoining.pop(e, None)
        return self._move(e, ledger, lambda coll: True)

    def _move(self, e: int, ledger: Ledger, which: Callable[[Collective], bool]) -> List[Collective]:
        """The chunks on endpoint e of the collectives in flight that `which` picks go to their
        substitutes; those sent to e are queued to be sent again. Returns the collectives left
        with no endpoint for a chunk."""
        stranded = []
        for coll in ledger.active.values():
            if e not in coll.endpoints or not which(coll):
                continue
            inflight = ledger.window(coll.group)
            for k, chunk in enumerate(coll.chunks):
                if chunk.reducer != e:
                    continue
                if coll.state[k] == SENT:
                    inflight[e] -= 1
                    coll.state[k] = UNSENT
                    self.resend.append((coll, k))
                if not self._reroute(coll, k):
                    stranded.append(coll)
                    break
        return stranded

    def place(self, coll: Collective) -> bool:
        """A collective starting after a loss: its chunks on endpoints not usable go to their
        substitutes. False: some chunk has none (the caller fails it)."""
        return all(
            self.usable(chunk.reducer, coll.group, coll.seq) or self._reroute(coll, k)
            for k, chunk in enumerate(coll.chunks)
        )

    def _reroute(self, coll: Collective, k: int) -> bool:
        """Chunk k of coll to its first usable endpoint, marked moved unless that is its own."""
        e = self.route(coll.seq, k, coll.group)
        if e is None:
            return False
        coll.move(k, e, e != preference(coll.seq, k, self.active, self.spares)[0])
        return True

    def bring(self, item: Kept) -> Optional[int]:
        """Where a kept result goes now (its chunk's endpoint; None: nowhere), kept there from
        now on, since that endpoint may be lost in turn."""
        e = self.route(item.seq, item.chunk, item.group)
        if e is not None:
            self.results.brought_to(item, e)
        return e

    def close(self) -> None:
        """Keep and resend nothing any more (the engine stops, or no endpoint is left), so that no
        view holds a shared-memory segment mapped once its connection is closed."""
        self.resend.clear()
        self.results.close()

    def reset(self) -> None:
        """No endpoint is left: forget every loss, so that the endpoints, once back, are used as
        planned by every rank alike (each rank may have lost them in another order)."""
        self.lost.clear()
        self.until.clear()
        self.since.clear()
        self.rejoining.clear()
        self.close()
        self.held_since = None

    def still_owed(self, coll: Collective, k: int) -> bool:
        """Whether a queued resend of chunk k is still to be sent (its collective may have failed)."""
        return coll.state[k] == UNSENT and not coll.future.done()

    def reason(self) -> Optional[str]:
        """Every lost endpoint and why, for the error when none is left."""
        if not self.lost:
            return None
        return "; ".join(self.lost[e] for e in sorted(self.lost))

    # -- a lost endpoint that comes back -------------------------------------------------------
    def readmitted(self, e: int, next_seqs: Dict[int, int]) -> Optional[Dict[int, int]]:
        """Lost endpoint e admitted this rank again: what to report to it (PROGRESS: each
        group's next seq), or None when e was not lost (nothing to agree on)."""
        if e not in self.lost:
            return None
        self.rejoining[e] = dict(next_seqs)
        self.since.pop(e, None)
        return self.rejoining[e]

    def recruitable(self, down: Container[int]) -> List[int]:
        """The spares not in use nor asked to join yet, leaving out those `down` (a spare that is
        down reports when it is admitted again: readmitted). With no endpoint left in use but such
        a spare, a loss is moved off all the same: what is in flight fails (nowhere to move it),
        and the spare takes the chunks from the boundary its JOIN names."""
        return [
            e
            for e in range(self.active, self.num_endpoints)
            if e in self.lost and e not in self.rejoining and e not in self.since and e not in down
        ]

    def recruit(self, next_seqs: Dict[int, int], down: Container[int]) -> Dict[int, Dict[int, int]]:
        """An endpoint was lost: each spare that is up and not asked yet is asked to join
        (PROGRESS, as an endpoint that came back), with what to report to it, by spare."""
        asked = {}
        for e in self.recruitable(down):
            asked[e] = self.rejoining[e] = dict(next_seqs)
        return asked

    def joined(self, e: int, boundaries: Dict[int, int]) -> None:
        """Endpoint e's JOIN: from these seqs of these groups on, every rank uses it again."""
        if e in self.rejoining:
            self.since.setdefault(e, {}).update(boundaries)
            self.joins += len(boundaries)

    def waits(
        self,
        coll: Collective,
        now: float,
        timeout: float,
        report: Callable[[int, Dict[int, int]], None],
        name: Callable[[int], str],
    ) -> Union[bool, str]:
        """Whether coll waits to start (hold), telling the endpoints coming back where its group
        is (`report`, PROGRESS); once it has waited `timeout` seconds, why it fails instead."""
        held, reports = self.hold(coll)
        for e, progress in reports.items():
            report(e, progress)
        if not held:
            self.held_since = None
            return False
        if self.held_since is None:
            self.held_since = now
        if now - self.held_since < timeout:
            return True
        self.held_since = None
        waiting = [name(e) for e in self.rejoining if coll.group not in self.since.get(e, {})]
        return (
            f"it waited {timeout:g} s (RS_TIMEOUT) for {', '.join(waiting)}, which came back after it was "
            "lost, to name the collective from which every rank uses it again (some rank of the group did "
            "not rejoin it)"
        )

    def hold(self, coll: Collective) -> Tuple[bool, Dict[int, Dict[int, int]]]:
        """Whether coll must wait before it starts, since an endpoint coming back may take some of
        its chunks from a seq not known yet (JOIN); and the first reports of coll's group to
        make to such endpoints (PROGRESS), by endpoint."""
        held, reports = False, {}
        for e, reported in self.rejoining.items():
            if coll.group in self.since.get(e, {}):
                continue
            if coll.group not in reported:
                reported[coll.group] = coll.seq
                reports[e] = {coll.group: coll.seq}
            held = held or coll.seq >= reported[coll.group] + REJOIN_LEAD
        return held, reports
