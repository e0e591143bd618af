"""A round's result into the ranks' shared-memory slots, in process: the reducer's Rounds, Folder
and Delivery with real segments, hand-made peers and an outbox that records what is sent. The
last rank's fold writes the result into every slot that will be announced (and only those), an
average is divided once, and 16-bit floats need no pool buffer when every rank has a slot."""
from __future__ import annotations

import types
from typing import List

import numpy as np
import zmq

from reduction_server import protocol, shared_memory
from reduction_server.accumulator import AccumulatorPool
from reduction_server.protocol import DType, MsgType, ReduceOp
from reduction_server.reducer.clock import Clock
from reduction_server.reducer.membership import Peer
from reduction_server.reducer.rounds import Rounds

SLOT = 1


class Outbox:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, identity, frames) -> bool:
        self.sent.append((identity, frames))
        return True

    def error(self, identity, code, text, about=None) -> None:
        self.sent.append((identity, ("ERROR", code, text)))


def _job(world: int):
    members = types.SimpleNamespace(peers={}, rank_identity={}, lost={}, job=(1, 0))
    members.ranks_of = lambda h: (list(range(world)), None)
    members.seq_of = lambda rank, group: -1
    outbox = Outbox()
    rounds = Rounds(outbox, members, AccumulatorPool(1 << 30), Clock(), index=0, name="reducer 0",
                    max_chunk_bytes=1 << 26, max_rounds=100, round_timeout=100, deterministic=False)
    peers = []
    for rank in range(world):
        peer = Peer(identity=b"rank%d" % rank, rank=rank, world=world, job=1, generation=0, admitted=True)
        peer.segment = shared_memory.Segment.create(4, 1 << 20)
        members.peers[peer.identity], members.rank_identity[rank] = peer, peer.identity
        peers.append(peer)
    return rounds, members, outbox, peers


def _run(world: int, slots: List[bool], dtype: DType, op: ReduceOp, xs: List[np.ndarray], before_last=None):
    """Every rank contributes xs[rank] (through its slot or as a frame), in rank order; returns
    the job's parts and the pool buffers acquired."""
    rounds, members, outbox, peers = _job(world)
    acquired = []
    acquire = rounds.folder.pool.acquire
    rounds.folder.pool.acquire = lambda nbytes, **kw: acquired.append(nbytes) or acquire(nbytes, **kw)
    n = len(xs[0])
    for rank in range(world):
        if rank == world - 1 and before_last is not None:
            before_last(peers)
        h = protocol.unpack(protocol.data_header(
            MsgType.DATA, dtype=dtype, op=op, rank=rank, world=world, job=1, generation=0, seq=0, chunk=0, nchunks=1,
            offset=0, count=n, total=n, nbytes=n * dtype.itemsize))
        if slots[rank]:
            view = peers[rank].segment.slot(SLOT, xs[rank].nbytes)
            view[:] = xs[rank].view(np.uint8)
            rounds.contribute(peers[rank], h, view, None, SLOT)
        else:
            rounds.contribute(peers[rank], h, zmq.Frame(xs[rank].tobytes()), None, None)
    assert not rounds.rounds and rounds.folder.pool.in_use_bytes == 0
    return outbox, peers, acquired


def _answer(outbox: Outbox, peer: Peer, dtype: DType, n: int):
    """What `peer` was answered: ("slot", its slot's bytes) or ("frame", the frame's)."""
    (frames,) = [frames for identity, frames in outbox.sent if identity == peer.identity]
    h = protocol.unpack(frames[0])
    if h.type is MsgType.RESULT_SHM:
        assert h.aux == SLOT
        return "slot", np.frombuffer(bytes(peer.segment.slot(SLOT, n * dtype.itemsize)), dtype.storage)
    assert h.type is MsgType.RESULT
    return "frame", np.frombuffer(bytes(frames[1]), dtype.storage)


def test_a_16_bit_result_is_rounded_into_every_slot_and_no_pool_buffer_is_rounded_into():
    import ml_dtypes

    n = 3 * 16384 + 5  # blocks of 64 KiB of float32 accumulator, and a tail
    xs = [(np.arange(n) % 64 / 4 + rank).astype(ml_dtypes.bfloat16) for rank in range(3)]
    want = (np.sum([x.astype(np.float32) for x in xs], axis=0) / np.float32(3)).astype(ml_dtypes.bfloat16)
    outbox, peers, acquired = _run(3, [True] * 3, DType.BFLOAT16, ReduceOp.AVG, xs)
    assert acquired == [n * 4]  # the float32 accumulator only
    for peer in peers:
        how, got = _answer(outbox, peer, DType.BFLOAT16, n)
        assert how == "slot" and got.tobytes() == want.view(np.uint16).tobytes()
    # a rank over frames: the rounded result is made for its frame too, divided once
    outbox, peers, acquired = _run(3, [True, False, True], DType.BFLOAT16, ReduceOp.AVG, xs)
    assert acquired == [n * 4, n * 2]
    answers = [_answer(outbox, peer, DType.BFLOAT16, n) for peer in peers]
    assert [how for how, _ in answers] == ["slot", "frame", "slot"]
    assert all(got.tobytes() == want.view(np.uint16).tobytes() for _, got in answers)


def test_an_average_that_accumulates_in_itself_is_divided_once_for_slots_and_frames():
    n = 3 * 16384 + 5
    xs = [np.arange(n, dtype=np.int32) * (rank + 1) - 1000 for rank in range(3)]
    total = xs[0].astype(np.int64) + xs[1] + xs[2]
    want = (np.sign(total) * (np.abs(total) // 3)).astype(np.int32)  # C division: toward zero
    outbox, peers, acquired = _run(3, [True, False, True], DType.INT32, ReduceOp.AVG, xs)
    assert acquired == []  # rank 0's slot is the accumulator
    answers = [_answer(outbox, peer, DType.INT32, n) for peer in peers]
    assert [how for how, _ in answers] == ["slot", "frame", "slot"]
    for _, got in answers:
        np.testing.assert_array_equal(got, want)


def test_a_rank_whose_segment_was_replaced_gets_a_frame_and_neither_segment_is_written():
    n = 5000
    xs = [np.full(n, rank + 1.0, np.float32) for rank in range(3)]
    old = {}

    def reconnect(peers):  # rank 1 connected again after it contributed: a new segment
        old["segment"] = peers[1].segment
        peers[1].segment = shared_memory.Segment.create(4, 1 << 20)

    outbox, peers, _ = _run(3, [True] * 3, DType.FLOAT32, ReduceOp.SUM, xs, before_last=reconnect)
    answers = [_answer(outbox, peer, DType.FLOAT32, n) for peer in peers]
    assert [how for how, _ in answers] == ["slot", "frame", "slot"]
    assert all((got == 6.0).all() for _, got in answers)
    assert bytes(old["segment"].slot(SLOT, 4 * n)) == xs[1].tobytes()  # its contribution, as it left it
    assert bytes(peers[1].segment.slot(SLOT, 4 * n)) == bytes(4 * n)
