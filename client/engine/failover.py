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
    """The reducers this rank has lost, where each chunk goes, the results it keeps (`results`,
    kept.py), what it must send again, and the lost reducers that come back."""

    def __init__(self, me: Identity, num_reducers: int, window: int, enabled: bool, spares: int = 0) -> None:
        self.me = me
        self.num_reducers = num_reducers
        self.active = num_reducers - spares  # the chunk plan's reducers; the spares come after them
        self.spares = spares
        self.window = window
        # With one reducer there is nowhere to move to: nothing is kept.
        self.enabled = enabled and num_reducers > 1
        self.lost: Dict[int, str] = {}  # reducer -> why it was lost (or that it is a spare not needed yet)
        for r in range(self.active, num_reducers):
            self.lost[r] = f"reducer {r} is a spare (RS_SPARE_REDUCERS), used once a reducer is lost"
        self.losses = 0  # reducers lost so far, one lost twice counted twice
        # A lost reducer that came back: the groups this rank reported to it (PROGRESS: the next
        # seq it would start), and each group's seq from which it is used again (JOIN).
        self.rejoining: Dict[int, Dict[int, int]] = {}
        self.since: Dict[int, Dict[int, int]] = {}
        self.held_since: Optional[float] = None  # when the collective waiting for a JOIN began to
        self.results = KeptResults(window, num_reducers)
        self.resend: Deque[Resend] = deque()
        self.moved_chunks = 0  # chunks sent to a substitute as MOVED (the tests read these counts)
        self.finals = 0  # results brought to a substitute in place of a contribution (FINAL)
        self.joins = 0  # groups in which a lost reducer is used again (JOIN)
        self.rejoined_chunks = 0  # chunks answered by a reducer that came back

    @property
    def rerouting(self) -> bool:
        """Whether a new collective's chunks may need another reducer than the plan's: one of
        the plan's reducers is lost (spares alone never are a chunk's own)."""
        return any(r < self.active for r in self.lost)

    def usable(self, r: int, group: int, seq: int) -> bool:
        """Whether reducer r takes chunks of collective seq of group: never lost, or back from that seq."""
        return r not in self.lost or seq >= self.since.get(r, {}).get(group, _NEVER)

    def survivors(self, without: int) -> List[int]:
        """The reducers in use (not lost, back in some group, or back and awaiting the JOIN that
        says from when), leaving out `without`. One awaiting its JOIN counts: a rank that had
        read the JOIN first would count it, and the ranks must agree on what is lost."""
        return [r for r in range(self.num_reducers)
                if r != without and (r not in self.lost or self.since.get(r) or r in self.rejoining)]

    def route(self, seq: int, chunk: int, group: int) -> Optional[int]:
        """The reducer chunk `chunk` of collective `seq` of `group` goes to: the first usable one
        in its preference order (None: none is)."""
        for r in preference(seq, chunk, self.active, self.spares):
            if self.usable(r, group, seq):
                return r
        return None

    def keep(self, coll: Collective, k: int, r: int, held: Held = None) -> None:
        """Chunk k of coll was answered by reducer r: its result is kept (kept.py)."""
        if r in self.since:
            self.rejoined_chunks += 1
        # After the result a rank lacks, the reducer answered at most: that rank's window, plus
        # what it resent there after each loss, plus this rank's own resends there (rounds that
        # a FINAL settled without the lacking rank).
        self.results.keep(coll, k, r, held, self.window * (1 + 2 * self.losses))

    # -- a reducer lost ------------------------------------------------------------------------
    def move_off(self, r: int, reason: str, ledger: Ledger) -> List[Collective]:
        """Reducer r is lost: every chunk on it moves to its substitute; what it had not
        answered, and the results it gave this rank, are queued to be sent there. Returns the
        collectives left with no reducer for a chunk (the caller fails them)."""
        self.lost[r] = reason
        self.losses += 1
        self.since.pop(r, None)
        self.rejoining.pop(r, None)
        stranded = []
        for coll in ledger.active.values():
            if r not in coll.reducers:
                continue
            inflight = ledger.window(coll.group)
            for k, chunk in enumerate(coll.chunks):
                if chunk.reducer != r:
                    continue
                if coll.state[k] == SENT:
                    inflight[r] -= 1
                    coll.state[k] = UNSENT
                    self.resend.append((coll, k))
                if not self._reroute(coll, k):
                    stranded.append(coll)
                    break
        self.resend.extend(self.results.take(r))
        return stranded

    def place(self, coll: Collective) -> bool:
        """A collective starting after a loss: its chunks on reducers not usable go to their
        substitutes. False: some chunk has none (the caller fails it)."""
        return all(self.usable(chunk.reducer, coll.group, coll.seq) or self._reroute(coll, k)
                   for k, chunk in enumerate(coll.chunks))

    def _reroute(self, coll: Collective, k: int) -> bool:
        """Chunk k of coll to its first usable reducer, marked moved unless that is its own."""
        r = self.route(coll.seq, k, coll.group)
        if r is None:
            return False
        coll.move(k, r, r != preference(coll.seq, k, self.active, self.spares)[0])
        return True

    def bring(self, item: Kept) -> Optional[int]:
        """Where a kept result goes now (its chunk's reducer; None: nowhere), kept there from
        now on, since that reducer may be lost in turn."""
        r = self.route(item.seq, item.chunk, item.group)
        if r is not None:
            self.results.brought_to(item, r)
        return r

    def close(self) -> None:
        """Keep and resend nothing any more (the engine stops, or no reducer is left), so that no
        view holds a shared-memory segment mapped once its connection is closed."""
        self.resend.clear()
        self.results.close()

    def reset(self) -> None:
        """No reducer is left: forget every loss, so that the reducers, once back, are used as
        planned by every rank alike (each rank may have lost them in another order)."""
        self.lost.clear()
        self.since.clear()
        self.rejoining.clear()
        self.close()
        self.held_since = None

    def still_owed(self, coll: Collective, k: int) -> bool:
        """Whether a queued resend of chunk k is still to be sent (its collective may have failed)."""
        return coll.state[k] == UNSENT and not coll.future.done()

    def reason(self) -> Optional[str]:
        """Every lost reducer and why, for the error when none is left."""
        if not self.lost:
            return None
        return "; ".join(self.lost[r] for r in sorted(self.lost))

    # -- a lost reducer that comes back --------------------------------------------------------
    def readmitted(self, r: int, next_seqs: Dict[int, int]) -> Optional[Dict[int, int]]:
        """Lost reducer r admitted this rank again: what to report to it (PROGRESS: each
        group's next seq), or None when r was not lost (nothing to agree on)."""
        if r not in self.lost:
            return None
        self.rejoining[r] = dict(next_seqs)
        self.since.pop(r, None)
        return self.rejoining[r]

    def recruitable(self, down: Container[int]) -> List[int]:
        """The spares not in use nor asked to join yet, leaving out those `down` (a spare that is
        down reports when it is admitted again: readmitted). With no reducer left in use but such
        a spare, a loss is moved off all the same: what is in flight fails (nowhere to move it),
        and the spare takes the chunks from the boundary its JOIN names."""
        return [r for r in range(self.active, self.num_reducers)
                if r in self.lost and r not in self.rejoining and r not in self.since and r not in down]

    def recruit(self, next_seqs: Dict[int, int], down: Container[int]) -> Dict[int, Dict[int, int]]:
        """A reducer was lost: each spare that is up and not asked yet is asked to join
        (PROGRESS, as a reducer that came back), with what to report to it, by spare."""
        asked = {}
        for r in self.recruitable(down):
            asked[r] = self.rejoining[r] = dict(next_seqs)
        return asked

    def joined(self, r: int, boundaries: Dict[int, int]) -> None:
        """r's JOIN: from these seqs of these groups on, every rank uses it again."""
        if r in self.rejoining:
            self.since.setdefault(r, {}).update(boundaries)
            self.joins += len(boundaries)

    def waits(self, coll: Collective, now: float, timeout: float, report: Callable[[int, Dict[int, int]], None],
              name: Callable[[int], str]) -> Union[bool, str]:
        """Whether coll waits to start (hold), telling the reducers coming back where its group
        is (`report`, PROGRESS); once it has waited `timeout` seconds, why it fails instead."""
        held, reports = self.hold(coll)
        for r, progress in reports.items():
            report(r, progress)
        if not held:
            self.held_since = None
            return False
        if self.held_since is None:
            self.held_since = now
        if now - self.held_since < timeout:
            return True
        self.held_since = None
        waiting = [name(r) for r in self.rejoining if coll.group not in self.since.get(r, {})]
        return (f"it waited {timeout:g} s (RS_TIMEOUT) for {', '.join(waiting)}, which came back after it was "
                "lost, to name the collective from which every rank uses it again (some rank of the group did "
                "not rejoin it)")

    def hold(self, coll: Collective) -> Tuple[bool, Dict[int, Dict[int, int]]]:
        """Whether coll must wait before it starts, since a reducer coming back may take some of
        its chunks from a seq not known yet (JOIN); and the first reports of coll's group to
        make to such reducers (PROGRESS), by reducer."""
        held, reports = False, {}
        for r, reported in self.rejoining.items():
            if coll.group in self.since.get(r, {}):
                continue
            if coll.group not in reported:
                reported[coll.group] = coll.seq
                reports[r] = {coll.group: coll.seq}
            held = held or coll.seq >= reported[coll.group] + REJOIN_LEAD
        return held, reports
