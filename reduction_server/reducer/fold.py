"""How the contributions to one round become its result, and the memory that takes.

The first contribution is loaded into an accumulator from the pool (float32 for the 16-bit
floats), or, for a dtype that accumulates in itself, becomes the accumulator: a shared-memory
slot, or a received frame of its own, summed into in place and sent back as the result. The
others are folded in by the native kernels (the GIL released); the last one also writes the
result (divided, rounded) into the ranks' shared-memory slots block by block, while each block is
in cache (Delivery.slot_copies says where). In deterministic mode they are
folded in rank order whatever their arrival order, early ones held until their turn (the last
fold, of the last rank, writes the result into the slots then). Every byte
kept is charged to the pool's budget and to a rank's (accumulator.py); the reducer's result slots
are bounded apart (shared_results.py).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import zmq

from .. import _native
from ..wire.formats import INT8_BLOCK
from ..wire.protocol import BATCHED_RECV_BYTES, OP_BROADCAST, DType, Header, ReduceOp
from .accumulator import AccumulatorPool
from .round import Round

Payload = Union[zmq.Frame, memoryview, None]
#: where the last fold also writes the result, by rank (Delivery.slot_copies), asked once the round
#: has its accumulator (in deterministic mode the last to arrive may be the first folded)
Copies = Optional[Callable[[], Dict[int, memoryview]]]
Result = Union[zmq.Frame, np.ndarray]  # a broadcast root's frame as it came, or the accumulator's memory
#: below this, a result goes out copied into a message libzmq owns, and its memory returns to the
#: pool at once: a copy costs less than a zero-copy send's tracking (an Event per frame, and a
#: wake-up of pyzmq's collector thread once libzmq frees it): 15-20 % of a reducer's CPU at 64-128
#: KiB chunks (bench/RESULTS.md, "Reducer CPU cost and sizing"). A peer's send queue (ZeroMQ's
#: SNDHWM, 1000 messages) bounds what such copies can hold for a peer that does not read.
COPIED_RESULT_BYTES = 256 << 10


class Folder:
    """Folds contributions into rounds' accumulators and finishes their results."""

    def __init__(self, pool: AccumulatorPool, deterministic: bool) -> None:
        self.pool = pool
        self.deterministic = deterministic

    def completes_in_place(self, rnd: Round) -> bool:
        """Whether folding its next contribution completes rnd, so that the last fold can write the
        result where it goes: an average divided, 16-bit floats rounded, as it is folded. In
        deterministic mode the last to arrive folds every contribution held back after it, in rank
        order (the first of them, when it is the first in rank order, becomes the accumulator), and
        the last of those folds writes it."""
        return (rnd.accumulator is not None or self.deterministic) and len(rnd.contributed) + 1 == len(rnd.ranks)

    def fold(self, rnd: Round, h: Header, payload: Payload, copies: Copies = None) -> None:
        """Fold h's payload (a frame, or a view of its shared-memory slot) into rnd; raises
        PoolExhausted past a budget, ValueError for a contribution without the payload it needs,
        SystemError where a kernel refuses. `copies`, when folding h completes rnd in place: asked
        before the last fold, where the result also goes, by rank."""
        if h.op == OP_BROADCAST:  # h agrees with the round's first contribution
            if h.rank == h.aux:
                if payload is None:
                    raise ValueError(f"broadcast root {h.rank} sent no payload")
                if not isinstance(payload, memoryview):  # a frame the reducer keeps, charged until sent
                    if len(payload) < BATCHED_RECV_BYTES:  # in a shared receive buffer: a copy pins less
                        payload = zmq.Frame(payload.bytes)
                    self.pool.hold(len(payload), h.rank)
                    rnd.owner, rnd.charged = h.rank, len(payload)
                rnd.adopted = payload  # the root's frame goes back out as it came: no copy
            return
        if payload is None:
            raise ValueError("a contribution without a payload")
        # A frame's view keeps the frame alive while it is held; a slot stays the worker's until
        # it is answered, so its view needs nothing more.
        in_slot = isinstance(payload, memoryview)
        data = payload if in_slot else payload.buffer
        if not self.deterministic:
            return self._fold_one(rnd, h, h.rank, data, payload, copies)
        if h.rank != rnd.next_rank:  # early: kept until the ranks before it are folded
            if len(data) < BATCHED_RECV_BYTES and not in_slot:
                # libzmq receives small messages into shared batch buffers: holding the frame would
                # pin a whole buffer while counting only the message, so keep a copy instead.
                data = payload.bytes
            # Charged like a frame even when it is a slot (worker memory): the per-rank budget
            # bounds what one rank can make the reducer keep, whichever way it came.
            self.pool.hold(len(data), h.rank)
        ready = rnd.in_rank_order(h.rank, data)
        for rank, held in ready[1:]:
            self.pool.unhold(len(held), rank)
        last = len(ready) - 1
        for i, (rank, held) in enumerate(ready):  # the first is this very contribution: adoptable
            self._fold_one(rnd, h, rank, held, payload if i == 0 else None, copies if i == last else None)

    def _fold_one(
        self,
        rnd: Round,
        h: Header,
        rank: int,
        data: Union[bytes, memoryview],
        payload: Payload = None,
        copies: Copies = None,
    ) -> None:
        """Fold rank's data in; `payload` (its frame or slot) may become the accumulator."""
        if rnd.compressed is not None:  # int8 blocks, decoded into float32 (never in a slot: no copies)
            if rnd.accumulator is not None:
                return _native.accumulate_int8(rnd.accumulator, data, h.block)
            nbytes = h.count * 4
            rnd.accumulator = self.pool.acquire(nbytes, rank=rank)
            rnd.owner, rnd.charged = rank, nbytes
            return _native.load_int8(rnd.accumulator, data, h.block)
        if rnd.accumulator is not None:
            targets = copies() if copies is not None else None
            if targets:  # each block of the sum is copied while in cache, not the whole sum again later
                outs = list({id(view): view for view in targets.values()}.values())  # ranks may share a result slot
                _native.accumulate_copies(rnd.accumulator, data, h.dtype, h.op, rnd.world, outs)
                # acc is now the result (divided) where the dtype accumulates in itself; 16-bit: the float32 sum
                rnd.copied = frozenset(targets)
                return None
            return _native.accumulate(rnd.accumulator, data, h.dtype, h.op)
        # The first contribution. When the dtype accumulates in itself its memory becomes the
        # accumulator, so nothing is copied in and the sum ends up in place: a shared-memory slot
        # (the rank leaves it alone until it is answered) or a received frame of its own (not
        # in a shared receive buffer), which then goes back out as the result.
        if payload is not None and rnd.dtype.accumulator is rnd.dtype:
            if isinstance(payload, memoryview):
                rnd.accumulator, rnd.in_slot, rnd.owner = np.frombuffer(data, np.uint8), True, rank
                return
            if len(data) >= BATCHED_RECV_BYTES:
                self.pool.hold(len(data), rank)  # memory kept on purpose, like a held frame
                rnd.accumulator, rnd.adopted = np.frombuffer(data, np.uint8), payload
                rnd.owner, rnd.charged = rank, len(data)
                return
        nbytes = h.count * rnd.dtype.accumulator.itemsize
        rnd.accumulator = self.pool.acquire(nbytes, rank=rank)
        rnd.owner, rnd.charged = rank, nbytes
        _native.load(rnd.accumulator, data, h.dtype)

    def result(self, rnd: Round) -> Tuple[Optional[Result], List[np.ndarray]]:
        """A complete round's result (avg divided once, 16-bit floats rounded once; None when it
        was rounded straight into every rank's slot), and the pool buffers it lives in; raises
        PoolExhausted when rounding needs a buffer the budget lacks."""
        h, buffers = rnd.first, []
        if rnd.op is ReduceOp.BROADCAST:
            return rnd.adopted, buffers
        acc = rnd.accumulator
        if not rnd.in_slot and rnd.adopted is None:  # pool memory
            buffers.append(acc)
        fmt = rnd.compressed
        if fmt is not None:  # the float32 sum, averaged, then encoded once in the format down
            if rnd.op is ReduceOp.AVG:
                _native.store(acc, acc, DType.FLOAT32, ReduceOp.AVG, rnd.world)
            if fmt.down == DType.FLOAT32:
                return acc, buffers
            out = self.pool.acquire(rnd.result_nbytes)
            buffers.append(out)
            if fmt.down == INT8_BLOCK:
                _native.store_int8(acc, out, h.block)
            else:
                _native.store(acc, out, fmt.down, ReduceOp.SUM, 1)
            return out, buffers
        if rnd.dtype.accumulator is not rnd.dtype:  # 16-bit floats: round once, here
            if rnd.copied.issuperset(rnd.ranks):  # rounded into every rank's slot as it was folded
                return None, buffers
            out = self.pool.acquire(h.count * rnd.dtype.itemsize)
            buffers.append(out)
            _native.store(acc, out, h.dtype, h.op, rnd.world)
            return out, buffers
        if rnd.op is ReduceOp.AVG and not rnd.copied:  # else divided as the last rank was folded
            _native.store(acc, acc, h.dtype, h.op, rnd.world)
        return acc, buffers

    @staticmethod
    def frame(rnd: Round, out: Result) -> zmq.Frame:
        """The result as a frame: a broadcast root's as it came; a slot copied, since libzmq sends
        later, when the slot's owner may be using it again; one under COPIED_RESULT_BYTES copied;
        else a pool buffer or an adopted frame's memory without a copy, tracked so that it counts
        until sent (sent() waits on its tracker)."""
        if isinstance(out, zmq.Frame):
            return out
        if rnd.in_slot or out.nbytes < COPIED_RESULT_BYTES:
            return zmq.Frame(out, copy=True)
        return zmq.Frame(out, copy=False, track=True)

    def sent(self, rnd: Round, buffers: List[np.ndarray], frame: Optional[zmq.Frame]) -> None:
        """rnd's result went out (from `buffers`, or an adopted frame, as `frame`): its memory
        returns to the pool now when `frame` is a copy, else once libzmq has released every copy."""
        rnd.accumulator = None
        held = 0
        if rnd.adopted is not None and rnd.charged:
            # An adopted frame's memory stays counted until libzmq has sent the result from it, as
            # a pool buffer's does; its rank no longer accounts for it.
            held, rnd.charged = rnd.charged, 0
            self.pool.discharge(rnd.owner, held)
        self._discharge(rnd)
        if buffers or held:
            self.pool.release(buffers, frame.tracker if frame is not None else None, held=held)

    def free(self, rnd: Round) -> None:
        """Give back everything rnd keeps (it failed, or its job was replaced)."""
        if rnd.accumulator is not None:
            if not rnd.in_slot and rnd.adopted is None:  # a slot or frame is not the pool's
                self.pool.release([rnd.accumulator])
            rnd.accumulator = None
        self._discharge(rnd)
        for rank, frame in rnd.held.items():
            self.pool.unhold(len(frame), rank)
        rnd.held.clear()
        rnd.slots.clear()
        rnd.adopted = None

    def _discharge(self, rnd: Round) -> None:
        """The rank charged for rnd's accumulator no longer accounts for it."""
        if rnd.charged:
            if rnd.adopted is not None:  # an adopted frame was held, not taken from the pool
                self.pool.unhold(rnd.charged, rnd.owner)
            else:
                self.pool.discharge(rnd.owner, rnd.charged)
            rnd.charged = 0
