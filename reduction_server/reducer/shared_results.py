"""The reducer's result slots: a segment of its own that the ranks on its host map read-only, so
that a round's result is written once for all of them instead of into each rank's slot
(shared_memory.py, "shared results"; RESULT_SHARED).

A slot is handed to the ranks of one round and written again only once each of them has
released that use of it in its own segment's header, whatever became of its connection: a rank
keeps a result there while failover keeps it (client/engine/kept.py). A rank that connects
again holds nothing any more (its worker let go of every result of the old connection before its
HELLO), so its holds end when it is admitted again. A rank that never comes back (its process
died) pins its slots; a new job renews the segment if any slot is pinned, so a long-lived
reducer does not run out. With no slot free, results go into each rank's slot.

Memory: the slots written, at most RESULT_SLOTS chunks, is not charged to the accumulator
budget (RS_MAX_ACCUMULATOR_BYTES); slots are reused most recently released first, so only as
many are touched as are held at once.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, List, Optional, Tuple

from ..wire import shared_memory
from ..wire.protocol import MAX_RESULT_USE, shared_result_aux
from ..wire.shared_memory import Segment

#: below this a result goes into each rank's slot: the copies cost less than a slot's bookkeeping
SHARED_RESULT_BYTES = 256 << 10
#: result slots per reducer (shard): each rank keeps a window of results per group in them, besides
#: those in flight; memory is touched only in slots used, most recently released first
RESULT_SLOTS = 64


class SharedResults:
    """The result slots of one reducer process, and who holds each slot in use."""

    def __init__(self, slot_bytes: int, slots: int = RESULT_SLOTS) -> None:
        self.slot_bytes = slot_bytes
        self.slots = min(slots, shared_memory.MAX_RESULT_SLOTS)
        self.segment: Optional[Segment] = None
        self._uses: List[int] = []
        self._holders: Dict[int, List[Tuple[int, Segment]]] = {}  # slot in use -> (rank, its segment)
        self._free: List[int] = []
        self.renew()

    def renew(self) -> None:
        """A new segment when any slot is held (or none exists): a new job's ranks need no
        release from the old one's. The old one stays mapped where a rank still reads it."""
        if self.segment is not None:
            if not self.held():
                return
            self.segment.close()
        try:
            self.segment = Segment.create(self.slots, self.slot_bytes)
        except OSError:  # no memfd here: every result goes into each rank's slot
            self.segment = None
        self._uses = [0] * self.slots
        self._holders = {}
        self._free = list(range(self.slots - 1, -1, -1))

    @property
    def offer(self) -> Optional[dict]:
        """What a WELCOME tells a rank that shares this host, for it to map the slots."""
        return None if self.segment is None else self.segment.offer

    def take(self, nbytes: int, readers: Dict[int, Segment]) -> Optional[Tuple[int, memoryview, FrozenSet[int]]]:
        """A free result slot for a result of nbytes that the ranks `readers` (by their segments)
        would read: the slot, a view of its first nbytes and the ranks that may read it (hand
        each as it is told). None when the result is too small or too large, no slot is free, or
        fewer than two ranks may read it: a rank whose segment says the slot's next use released
        already (its numbers came round again) may not, since its release would not be its own."""
        if self.segment is None or not SHARED_RESULT_BYTES <= nbytes <= self.slot_bytes or len(readers) < 2:
            return None
        self._reclaim()
        if not self._free:
            return None
        slot = self._free[-1]
        use = self._uses[slot] % MAX_RESULT_USE + 1
        ranks = frozenset(rank for rank, segment in readers.items() if segment.released(slot) != use)
        if len(ranks) < 2:
            return None
        self._free.pop()
        self._uses[slot] = use
        self._holders[slot] = []
        return slot, self.segment.slot(slot, nbytes), ranks

    def aux(self, slot: int) -> int:
        """What a RESULT_SHARED for the current use of `slot` says (protocol.shared_result_aux)."""
        return shared_result_aux(slot, self._uses[slot])

    def hand(self, slot: int, rank: int, segment: Segment) -> None:
        """`rank` was told of the current use of `slot` through `segment`: it holds it until it
        releases it there."""
        self._holders[slot].append((rank, segment))

    def forget(self, rank: int) -> None:
        """`rank` connected again: it holds nothing of its old connection any more."""
        for holders in self._holders.values():
            holders[:] = [held for held in holders if held[0] != rank]

    def held(self) -> int:
        """Slots in use: not yet released by every rank they were handed to."""
        self._reclaim()
        return len(self._holders)

    def _reclaim(self) -> None:
        """Free each slot in use that every rank it was handed to has released."""
        uses = self._uses
        done = [
            slot
            for slot, holders in self._holders.items()
            if all(segment.released(slot) == uses[slot] for _, segment in holders)
        ]
        for slot in done:
            del self._holders[slot]
            self._free.append(slot)

    def close(self) -> None:
        """Drop the segment's descriptor (ranks that mapped it keep their mapping)."""
        if self.segment is not None:
            self.segment.close()
