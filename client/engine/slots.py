"""Shared-memory slots between a worker and the reducers on its own host.

With RS_SHM on (the default), the AUTH to each endpoint (a reducer's shard, endpoints.py) whose
address is one of this host's offers a segment of payload slots
(reduction_server/wire/shared_memory.py), sent only once that reducer has proved the job token. A
reducer that maps it says so in its WELCOME; chunks of a reduction then go through a free slot
(DATA_SHM) and come back in it (RESULT_SHM), which saves the socket copies. A slot is free again
only once the reducer has answered its chunk, whatever became of the collective, so a late result
never overwrites a newer chunk; a chunk that finds no free slot, or a reducer without the segment,
travels as a frame. A new connection gets a new segment.

A reducer may also offer its result slots in its WELCOME (shared_memory.py, "shared results"):
they are mapped read-only, and the segment's header says so to the reducer, which may then write
a result once for several ranks and answer each with RESULT_SHARED. The chunk's own slot is free
again at once; the result slot is released, in this rank's segment header, once the result is
copied out and kept no longer.

A result that failover keeps (kept.py) can stay in the slot it came back in, lent out
instead of copied, until it is kept no longer: a segment has a window of slots for chunks in
flight and a window and one more to lend (the kept results of a group, and the one that pushes
the oldest out). A slot lent is never sent in, so the reducer has no reason to write it again.
A result slot is lent the same way (ResultLease): the reducer writes it again only once released.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from reduction_server.config.settings import MAX_WINDOW
from reduction_server.log import get_logger
from reduction_server.wire import shared_memory
from reduction_server.wire.protocol import Header, shared_result_slot

from .identity import Identity

log = get_logger("client")

#: the largest result slot a reducer may offer: mapped, not touched, so only address space
MAX_RESULT_SLOT_BYTES = 1 << 32


class Lease:
    """A result lent out where it lies: `view` is the result; end() says it is needed no longer."""

    view: memoryview

    def end(self) -> None:
        """The result is no longer needed: its slot may be written again."""
        raise NotImplementedError


@dataclass(eq=False)
class SlotLease(Lease):
    """One of this rank's slots lent out with the result in it: end() makes the slot free again,
    if its segment is still the endpoint's (after a new connection it is not)."""

    slots: "Slots"
    endpoint: int
    segment: shared_memory.Segment
    slot: int
    view: memoryview

    def end(self) -> None:
        """The result is no longer needed: its slot may take chunks again."""
        slots, e = self.slots, self.endpoint
        if slots.segments[e] is self.segment:
            slots.free[e].append(self.slot)
            slots.lent[e] -= 1


@dataclass(eq=False)
class ResultLease(Lease):
    """A reducer's result slot kept with the result in it: end() releases that use of it in
    `segment`, this rank's segment of the connection it came through (even once replaced)."""

    segment: shared_memory.Segment
    slot: int
    use: int
    view: memoryview

    def end(self) -> None:
        """The result is no longer needed: the reducer may write its slot again."""
        self.segment.release(self.slot, self.use)


class Slots:
    """Per endpoint: the segment offered on its connection, its free slots, and which slot each
    unanswered chunk sent through it is in."""

    def __init__(self, me: Identity, offers: Sequence[bool], window: int, slot_bytes: int) -> None:
        self.me = me
        self.offers = list(offers)  # whether endpoint e may be offered a segment (it is on this host)
        self.window = window
        self.per_segment = min(2 * window + 1, MAX_WINDOW)  # a window in flight, the rest to lend (Lease)
        # as large as the largest chunk (RS_CHUNK_BYTES; a chunk is at least one 8-byte element)
        self.slot_bytes = max(8, min(slot_bytes, shared_memory.MAX_OFFERED_SLOT_BYTES))
        self.segments: List[Optional[shared_memory.Segment]] = [None] * len(offers)
        self.results: List[Optional[shared_memory.Segment]] = [None] * len(offers)  # their result slots, read-only
        self.free: List[List[int]] = [[] for _ in offers]  # empty until the reducer maps the segment
        self.lent: List[int] = [0] * len(offers)  # slots lent out (Lease), by endpoint
        self.slot_of: List[Dict[Tuple[int, int, int], int]] = [{} for _ in offers]  # (group, seq, chunk) -> slot
        self.chunks_shared = 0  # chunks that went through shared memory (both ways)
        self.results_read = 0  # of those, results read from a reducer's result slot

    def offer(self, e: int) -> Optional[dict]:
        """A new segment for endpoint e's connection, as its AUTH offers it; None: no offer."""
        self.drop(e)
        if not self.offers[e]:
            return None
        try:
            self.segments[e] = shared_memory.Segment.create(self.per_segment, self.slot_bytes)
        except OSError as exc:  # no memfd here: frames only
            log.debug("rank %d: no shared-memory segment for endpoint %d: %s", self.me.rank, e, exc)
            return None
        return self.segments[e].offer

    def welcomed(self, e: int, welcome: dict) -> None:
        """Endpoint e admitted this worker: its slots are usable if it mapped the segment."""
        if welcome.get("shared_memory") is True and self.segments[e] is not None:
            self.free[e] = list(range(self.segments[e].slots))
            self._map_results(e, welcome.get("shared_results"))
        else:
            self.drop(e)

    def _map_results(self, e: int, offer: object) -> None:
        """Map endpoint e's result slots, if it offered them, and say so in this rank's segment."""
        if offer is None:
            return
        try:
            self.results[e] = shared_memory.Segment.attach(
                offer, max_slots=shared_memory.MAX_RESULT_SLOTS, max_slot_bytes=MAX_RESULT_SLOT_BYTES, writable=False
            )
        except shared_memory.Unavailable as exc:
            log.debug("rank %d: endpoint %d's result slots not used: %s", self.me.rank, e, exc)
            return
        self.segments[e].accept_results()

    def drop(self, e: int) -> None:
        """Close endpoint e's segment, if any, and forget its free slots and the chunks sent through them."""
        if self.segments[e] is not None:
            self.segments[e].close()
            self.segments[e] = None
        self.results[e] = None  # a kept result stays readable through its own view
        self.free[e] = []
        self.lent[e] = 0
        self.slot_of[e] = {}

    def take(self, e: int, nbytes: int) -> Optional[int]:
        """A free slot of endpoint e that holds nbytes (not taken yet: see put), or None."""
        free = self.free[e]
        return free[-1] if free and nbytes <= self.slot_bytes else None

    def put(self, e: int, slot: int, group: int, seq: int, chunk: int) -> None:
        """Chunk `chunk` of collective `seq` of `group` went out in `slot` (the one take() gave)."""
        self.free[e].pop()
        self.slot_of[e][group, seq, chunk] = slot
        self.chunks_shared += 1

    def view(self, e: int, slot: int, nbytes: int) -> memoryview:
        """The first nbytes of endpoint e's shared-memory slot `slot`, writable."""
        return self.segments[e].slot(slot, nbytes)

    def copy_out(self, e: int, slot: int, dest: memoryview) -> None:
        """A result out of endpoint e's shared-memory slot `slot` into dest."""
        dest[:] = self.view(e, slot, len(dest))
        self.chunks_shared += 1

    def lease(self, e: int, slot: int, nbytes: int) -> Optional[Lease]:
        """Lend out free slot `slot` of endpoint e with the result of nbytes in it; None when every
        slot that can be lent is (a window stays for chunks in flight): failover keeps the result
        another way then."""
        segment = self.segments[e]
        if segment is None or self.lent[e] >= segment.slots - self.window or slot not in self.free[e]:
            return None
        self.free[e].remove(slot)
        self.lent[e] += 1
        return SlotLease(self, e, segment, slot, segment.slot(slot, nbytes))

    def read_result(self, e: int, aux: int, dest: memoryview, keep: bool) -> Optional[ResultLease]:
        """A RESULT_SHARED's result out of endpoint e's result slot (`aux` says which use of
        which) into dest; then the slot is released, or lent out (keep) until the lease ends.
        ValueError naming what is wrong when the slot cannot hold it (then it is released)."""
        slot, use = shared_result_slot(aux)
        results, mine = self.results[e], self.segments[e]
        if results is None or mine is None:
            raise ValueError("a result in a result slot, but this rank has not mapped them")
        try:
            view = results.slot(slot, len(dest))
        except ValueError:
            self.release_result(e, aux)
            raise
        dest[:] = view
        self.chunks_shared += 1
        self.results_read += 1
        if keep:
            return ResultLease(mine, slot, use, view)
        mine.release(slot, use)
        return None

    def release_result(self, e: int, aux: int) -> None:
        """A RESULT_SHARED from endpoint e that is not read (late, or misshapen): its slot released."""
        slot, use = shared_result_slot(aux)
        mine = self.segments[e]
        if mine is not None and slot < shared_memory.MAX_RESULT_SLOTS:
            mine.release(slot, use)

    def release(self, e: int, h: Header) -> Optional[int]:
        """The slot of the chunk endpoint e has answered with h, now free again; None if that
        chunk did not go through shared memory."""
        if h.nchunks == 0 or not self.me.owns(h):
            return None  # an answer about no chunk (an ERROR about a frame, not a key)
        slot = self.slot_of[e].pop((h.group, h.seq, h.chunk), None)
        if slot is not None:
            self.free[e].append(slot)
        return slot

    def close(self) -> None:
        """Drop every endpoint's segment."""
        for e in range(len(self.segments)):
            self.drop(e)
