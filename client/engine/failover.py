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

For the last, a rank keeps each group's last results from each reducer. A rank that lacks a
chunk's result has the chunk among its unanswered ones on that reducer, at most its window per
group, plus what was moved there: the reducer answered at most that many of the group's rounds
after the one this rank lacks, so every rank that got it still keeps it. A result that came
back through shared memory stays in its slot, lent out until it is kept no longer (slots.py); a
large one that came as a frame is the message libzmq received (results.py). Any other is a view
of the collective's own buffer while the collective is in flight, which nobody else writes then;
only those still kept when the collective ends are copied out of it, before its caller gets the
buffer back. A large collective's earlier chunks are no longer kept by then, so most of its
result is never copied (bench/RESULTS.md, "Failover: what keeping results costs").
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Tuple, Union

import numpy as np

from reduction_server import protocol
from reduction_server.protocol import ITEMSIZE, MSG_FINAL, REJOIN_LEAD

from ..chunking import preference
from .collective import SENT, UNSENT, Collective
from .identity import Identity
from .ledger import Ledger
from .slots import Lease


@dataclass
class Kept:
    """A chunk's result as this rank received it, and what its FINAL header says of the chunk."""

    group: int
    seq: int
    chunk: int
    nchunks: int
    dtype: int
    op: int
    root: int
    offset: int
    count: int
    total: int
    #: a buffer of its own, of at least count x itemsize bytes (one is reused for a smaller chunk);
    #: its shared-memory slot (`lease`) or received message; while its collective is in flight, a
    #: view of the result in the collective's buffer; None once kept no longer
    data: Union[bytearray, memoryview, None]
    reducer: int = 0  # the reducer that answered it (or, once brought as a FINAL, the one it went to)
    lease: Optional[Lease] = None  # the slot it stays in, if any

    @property
    def nbytes(self) -> int:
        """The result's size in bytes (its buffer may be larger)."""
        return self.count * ITEMSIZE[self.dtype]

    def final_header(self, me: Identity) -> bytes:
        """The FINAL that brings this result to the chunk's new reducer."""
        return protocol.data_header(MSG_FINAL, dtype=self.dtype, op=self.op, rank=me.rank, world=me.world,
                                    job=me.job, generation=me.generation, seq=self.seq, chunk=self.chunk,
                                    nchunks=self.nchunks, offset=self.offset, count=self.count, total=self.total,
                                    nbytes=self.nbytes, aux=self.root, group=self.group)


_NEVER = float("inf")

#: where a result is besides its collective's buffer, if anywhere: the shared-memory slot it came
#: back in, lent out, or the memory of the message it came in
Held = Union[Lease, memoryview, None]

#: what the pump sends before new chunks: a chunk of a collective again (MOVED), or a kept result
Resend = Union[Tuple[Collective, int], Kept]


class Failover:
    """The reducers this rank has lost, where each chunk goes, the results it keeps, what it
    must send again, and the lost reducers that come back."""

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
        self.kept: Dict[Tuple[int, int], Deque[Kept]] = {}  # (group, reducer) -> its last results here
        # (group, reducer) -> results brought there as FINAL: kept for the generation, since a rank
        # that lacks one is not bounded by any window there (a substitute lost in turn needs them again)
        self.brought: Dict[Tuple[int, int], List[Kept]] = {}
        self.spare: List[bytearray] = []  # buffers of results no longer kept
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
        """The reducers in use (not lost, or back in some group), leaving out `without`."""
        return [r for r in range(self.num_reducers) if r != without and (r not in self.lost or self.since.get(r))]

    def route(self, seq: int, chunk: int, group: int) -> Optional[int]:
        """The reducer chunk `chunk` of collective `seq` of `group` goes to: the first usable one
        in its preference order (None: none is)."""
        for r in preference(seq, chunk, self.active, self.spares):
            if self.usable(r, group, seq):
                return r
        return None

    # -- results kept ------------------------------------------------------------------------
    def keep(self, coll: Collective, k: int, r: int, held: Held = None) -> None:
        """Chunk k of coll was answered by reducer r: keep its result where it is `held`, or as a
        view of coll's buffer until coll ends."""
        if r in self.since:
            self.rejoined_chunks += 1
        offset, count, _ = coll.chunks[k]
        size = ITEMSIZE[coll.dtype]
        lease = held if isinstance(held, Lease) else None
        data = lease.view if lease is not None else held
        if data is None:
            data = coll.recv[offset * size:(offset + count) * size]
        item = Kept(coll.group, coll.seq, k, len(coll.chunks), coll.dtype, coll.op, coll.root, offset, count,
                    coll.total, data, r, lease)
        if held is None:
            coll.kept.append(item)
        ring = self.kept.get((item.group, item.reducer))
        if ring is None:
            ring = self.kept[item.group, item.reducer] = deque()
        ring.append(item)
        # After the result a rank lacks, the reducer answered at most: that rank's window, plus
        # what it resent there after each loss, plus this rank's own resends there (rounds that
        # a FINAL settled without the lacking rank).
        while len(ring) > self.window * (1 + 2 * self.losses):
            self._discard(ring.popleft())

    def settle(self, coll: Collective) -> None:
        """coll ends, completed or failed, and its caller gets its buffer back: the results of
        it still kept (or queued as FINALs) are copied out of it now."""
        for item in coll.kept:
            if isinstance(item.data, memoryview):
                self._copy(item)
        coll.kept.clear()

    def _own(self, item: Kept) -> None:
        """A result kept in a shared-memory slot gets a buffer of its own: it is brought to another
        reducer and kept for the generation, and a slot's view would keep its whole segment mapped."""
        if item.lease is not None:
            self._copy(item)
            item.lease.end()
            item.lease = None

    def _copy(self, item: Kept) -> None:
        """item's result into a buffer of its own, which it keeps from now on."""
        data = self._buffer(item.nbytes)
        # NumPy copies without the GIL: the training thread runs on meanwhile.
        np.copyto(np.frombuffer(data, np.uint8, item.nbytes), np.frombuffer(item.data, np.uint8, item.nbytes))
        item.data = data

    def _discard(self, item: Kept) -> None:
        """item is kept no longer: its slot is free again, its own buffer spare (as many as a
        collective's end may copy with one group in use, a window per reducer), a view let go."""
        if item.lease is not None:
            item.lease.end()
            item.lease = None
        elif isinstance(item.data, bytearray):
            self.spare.append(item.data)
            del self.spare[:-self.window * self.num_reducers]
        item.data = None

    def _buffer(self, nbytes: int) -> bytearray:
        for i, data in enumerate(self.spare):
            if len(data) >= nbytes:
                return self.spare.pop(i)
        return bytearray(nbytes)

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
        for store in (self.kept, self.brought):
            for key in [key for key in store if key[1] == r]:
                for item in store.pop(key):
                    self._own(item)
                    self.resend.append(item)
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
            item.reducer = r
            self.brought.setdefault((item.group, r), []).append(item)
        return r

    def forget_group(self, group: int) -> None:
        """A closed group's results are kept no longer."""
        self._forget(lambda key: key[0] == group)

    def _forget(self, which: Callable[[Tuple[int, int]], bool]) -> None:
        """Keep no longer the results of the (group, reducer) keys `which` picks."""
        for store in (self.kept, self.brought):
            for key in [key for key in store if which(key)]:
                for item in store.pop(key):
                    self._discard(item)

    def close(self) -> None:
        """Keep and resend nothing any more (the engine stops, or no reducer is left), so that no
        view holds a shared-memory segment mapped once its connection is closed."""
        self.resend.clear()
        self._forget(lambda key: True)

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

    def recruit(self, next_seqs: Dict[int, int]) -> Dict[int, Dict[int, int]]:
        """A reducer was lost: each spare not asked yet is asked to join (PROGRESS, as a reducer
        that came back), with what to report to it, by spare."""
        asked = {}
        for r in range(self.active, self.num_reducers):
            if r in self.lost and r not in self.rejoining and r not in self.since:
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
