"""How results reach the ranks: a complete round's into each rank's shared-memory slot, into one
result slot that several ranks read (shared_results.py), or as one frame for all; and a settled
moved round's (finals.py) to each rank as it asks. Counts the bytes sent (the metrics and the
stop line read them)."""

from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

import zmq

from ..log import event, get_logger
from ..wire import protocol
from ..wire.protocol import OP_BROADCAST, Header, MsgType
from ..wire.shared_memory import Segment
from .fold import Folder, Result
from .membership import Membership
from .outbox import Outbox
from .round import Round
from .shared_results import SharedResults

log = get_logger("reducer")


class Delivery:
    """Sends results to the ranks of a round."""

    def __init__(
        self, outbox: Outbox, members: Membership, folder: Folder, index: int, shared: Optional[SharedResults] = None
    ) -> None:
        self.outbox = outbox
        self.shared = shared  # the result slots, where ranks on this host may read results
        self.members = members
        self.folder = folder
        self.index = index
        self.bytes_out = 0
        self.bytes_shared_out = 0
        self.results_shared = 0  # RESULT_SHARED sent

    def result(self, rnd: Round, out: Optional[Result]) -> Optional[zmq.Frame]:
        """The result to every rank: into its shared-memory slot (already there for rnd.copied;
        `out` is None when every rank's is), or as a frame (made once, the first time a rank
        needs it, and returned)."""
        h, members = rnd.first, self.members
        nbytes = rnd.result_nbytes
        header = protocol.pack_as(h, MsgType.RESULT, self.index, nbytes)
        frame = None
        # The owner of an accumulator slot may reuse it as soon as it is answered: it goes last,
        # after every copy out of its slot.
        order = rnd.ranks if not rnd.in_slot else [*(r for r in rnd.ranks if r != rnd.owner), rnd.owner]
        root = h.aux if h.op == OP_BROADCAST else -1  # a broadcast's root holds the data: its answer is bare
        for rank in order:
            identity = members.rank_identity.get(rank)
            if identity is None:
                event(
                    log,
                    logging.INFO if rank in members.lost else logging.ERROR,
                    "result_undeliverable",
                    reducer=self.index,
                    rank=rank,
                    key=h.describe(),
                    reason="rank is no longer connected",
                )
                continue
            live = self._live_slot(rnd, rank)
            if live is not None and rank in rnd.readers:  # the fold wrote it into the result slot
                aux = self.shared.aux(rnd.result_slot)
                if self.outbox.send(
                    identity, [protocol.pack_as(h, MsgType.RESULT_SHARED, self.index, nbytes, aux=aux)]
                ):
                    self.shared.hand(rnd.result_slot, rank, live[0])  # told: it releases it now
                    self.bytes_out += nbytes
                    self.bytes_shared_out += nbytes
                    self.results_shared += 1
                continue
            if live is not None:
                segment, slot = live
                # The owner's slot holds the sum already; the copied ones got it as the last rank was folded.
                if not (rnd.in_slot and rank == rnd.owner) and rank not in rnd.copied:
                    segment.slot(slot, nbytes)[:] = out  # the slot is the rank's until this answer
                if self.outbox.send(identity, [protocol.pack_as(h, MsgType.RESULT_SHM, self.index, nbytes, aux=slot)]):
                    self.bytes_out += nbytes
                    self.bytes_shared_out += nbytes
                continue
            if rank == root:
                self.outbox.send(identity, [protocol.pack_as(h, MsgType.RESULT, self.index, 0)])
                continue
            if frame is None:
                frame = self.folder.frame(rnd, out)
            if self.outbox.send(identity, [header, frame]):
                self.bytes_out += len(frame)
        return frame

    def slot_copies(self, rnd: Round, last: Header, slot: Optional[Tuple[Segment, int]]) -> Dict[int, memoryview]:
        """Where the result goes for the ranks that answer through shared memory, by rank, when
        `last` (whose own slot, if any, is `slot`) completes rnd: what the fold of `last` can
        write as it sums (Folder.fold), in place of a copy of the result into each slot once it
        is summed. Ranks that read result slots share one when two or more would (rnd.readers)."""
        if slot is None and not rnd.slots:  # no rank answered through a slot (tcp): the common case
            return {}
        nbytes = rnd.result_nbytes
        targets, readers = {}, {}
        for rank in rnd.ranks:
            live = self._live_slot(rnd, rank, slot if rank == last.rank else None)
            if live is not None and not (rnd.in_slot and rank == rnd.owner):  # the owner's slot is the accumulator
                targets[rank] = live[0].slot(live[1], nbytes)
                if live[0].accepts_results():
                    readers[rank] = live[0]
        taken = self.shared.take(nbytes, readers) if self.shared is not None else None
        if taken is not None:
            rnd.result_slot, view, rnd.readers = taken
            for rank in rnd.readers:
                targets[rank] = view
        return targets

    def _live_slot(
        self, rnd: Round, rank: int, slot: Optional[Tuple[Segment, int]] = None
    ) -> Optional[Tuple[Segment, int]]:
        """rank's slot for rnd's result (`slot`, or the one it contributed through), if it is on
        the segment of the rank's connection now: else its result goes as a frame."""
        segment, index = slot or rnd.slots.get(rank, (None, 0))
        peer = self.members.peers.get(self.members.rank_identity.get(rank))
        if segment is None or peer is None or segment is not peer.segment:
            return None
        return segment, index

    def settled(self, rnd: Round, h: Header) -> None:
        """Answer h's sender from a settled moved round: its result, or a bare RESULT to a
        FINAL's sender (it has the data) and to a broadcast's root."""
        identity = self.members.rank_identity.get(h.rank)
        if identity is None:
            return
        if h.type is MsgType.FINAL or (h.op == OP_BROADCAST and h.rank == h.aux):
            self.outbox.send(identity, [protocol.pack_as(h, MsgType.RESULT, self.index, 0)])
            return
        nbytes = len(rnd.final)
        if self.outbox.send(identity, [protocol.pack_as(h, MsgType.RESULT, self.index, nbytes), rnd.final]):
            self.bytes_out += nbytes
