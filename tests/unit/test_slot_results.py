"""A round's result into the ranks' shared-memory slots, in process: the reducer's Rounds, Folder
and Delivery with real segments, hand-made peers and an outbox that records what is sent. The
last rank's fold writes the result into every slot that will be announced (and only those), an
average is divided once, and 16-bit floats need no pool buffer when every rank has a slot. Ranks
that read the reducer's result slots share one, written once, and it is written again only once
each of them has released it."""

from __future__ import annotations

import types
from typing import List, Optional, Sequence

import numpy as np
import pytest
import zmq

from reduction_server.reducer.accumulator import AccumulatorPool
from reduction_server.reducer.clock import Clock
from reduction_server.reducer.membership import Peer
from reduction_server.reducer.rounds import Rounds
from reduction_server.reducer.shared_results import SHARED_RESULT_BYTES, SharedResults
from reduction_server.wire import protocol, shared_memory
from reduction_server.wire.protocol import DType, MsgType, ReduceOp

SLOT = 1


class Outbox:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, identity, frames) -> bool:
        self.sent.append((identity, frames))
        return True

    def error(self, identity, code, text, about=None) -> None:
        self.sent.append((identity, ("ERROR", code, text)))


def _job(world: int, results: Optional[SharedResults] = None, readers: Sequence[int] = (), deterministic=False):
    """A reducer's Rounds for `world` ranks with a segment each; `readers` say they read `results`."""
    members = types.SimpleNamespace(peers={}, rank_identity={}, lost={}, job=(1, 0))
    members.ranks_of = lambda h: (list(range(world)), None)
    members.seq_of = lambda rank, group: -1
    outbox = Outbox()
    rounds = Rounds(
        outbox,
        members,
        AccumulatorPool(1 << 30),
        Clock(),
        index=0,
        name="reducer 0",
        max_chunk_bytes=1 << 26,
        max_rounds=100,
        round_timeout=100,
        deterministic=deterministic,
        results=results,
    )
    peers = []
    for rank in range(world):
        peer = Peer(identity=b"rank%d" % rank, rank=rank, world=world, job=1, generation=0, admitted=True)
        peer.segment = shared_memory.Segment.create(4, 1 << 20)
        if rank in readers:
            peer.segment.accept_results()
        members.peers[peer.identity], members.rank_identity[rank] = peer, peer.identity
        peers.append(peer)
    return rounds, members, outbox, peers


def _contribute(
    rounds: Rounds,
    peers: List[Peer],
    slots: List[bool],
    dtype: DType,
    op: ReduceOp,
    xs: List[np.ndarray],
    before_last=None,
    seq: int = 0,
    order: Optional[Sequence[int]] = None,
) -> None:
    """Every rank contributes xs[rank] to collective `seq` (through its slot or as a frame), in
    `order` (rank order by default)."""
    world, n = len(peers), len(xs[0])
    order = list(order or range(world))
    for rank in order:
        if rank == order[-1] and before_last is not None:
            before_last(peers)
        h = protocol.unpack(
            protocol.data_header(
                MsgType.DATA,
                dtype=dtype,
                op=op,
                rank=rank,
                world=world,
                job=1,
                generation=0,
                seq=seq,
                chunk=0,
                nchunks=1,
                offset=0,
                count=n,
                total=n,
                nbytes=n * dtype.itemsize,
            )
        )
        if slots[rank]:
            view = peers[rank].segment.slot(SLOT, xs[rank].nbytes)
            view[:] = xs[rank].view(np.uint8)
            rounds.contribute(peers[rank], h, view, None, SLOT)
        else:
            rounds.contribute(peers[rank], h, zmq.Frame(xs[rank].tobytes()), None, None)
    assert not rounds.rounds and rounds.folder.pool.in_use_bytes == 0


def _run(
    world: int,
    slots: List[bool],
    dtype: DType,
    op: ReduceOp,
    xs: List[np.ndarray],
    before_last=None,
    results: Optional[SharedResults] = None,
    readers: Sequence[int] = (),
):
    """Every rank contributes xs[rank] once; returns the job's parts and the pool buffers acquired."""
    rounds, members, outbox, peers = _job(world, results, readers)
    acquired = []
    acquire = rounds.folder.pool.acquire
    rounds.folder.pool.acquire = lambda nbytes, **kw: acquired.append(nbytes) or acquire(nbytes, **kw)
    _contribute(rounds, peers, slots, dtype, op, xs, before_last)
    return outbox, peers, acquired


def _answer(outbox: Outbox, peer: Peer, dtype: DType, n: int, results: Optional[SharedResults] = None):
    """What `peer` was answered last: ("slot", its slot's bytes), ("frame", the frame's) or
    (the RESULT_SHARED's aux, the result slot's bytes)."""
    frames = [frames for identity, frames in outbox.sent if identity == peer.identity][-1]
    h = protocol.unpack(frames[0])
    if h.type is MsgType.RESULT_SHARED:
        slot, _ = protocol.shared_result_slot(h.aux)
        return h.aux, np.frombuffer(bytes(results.segment.slot(slot, n * dtype.itemsize)), dtype.storage)
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


# -- result slots that several ranks read (shared_results.py) ------------------------------------
N_SHARED = SHARED_RESULT_BYTES // 4 + 5  # float32 elements: just large enough for a result slot


def test_ranks_that_read_result_slots_share_one_written_once():
    """The accumulator's owner finds the sum in its own slot; every other reader is told the same
    result slot, and its own slot still holds its contribution (nothing wrote it)."""
    xs = [np.arange(N_SHARED, dtype=np.float32) * (rank + 1) for rank in range(4)]
    results = SharedResults(1 << 20, slots=4)
    outbox, peers, acquired = _run(4, [True] * 4, DType.FLOAT32, ReduceOp.SUM, xs, results=results, readers=range(4))
    answers = [_answer(outbox, peer, DType.FLOAT32, N_SHARED, results) for peer in peers]
    assert answers[0][0] == "slot" and acquired == []  # rank 0's slot is the accumulator
    assert {how for how, _ in answers[1:]} == {protocol.shared_result_aux(0, 1)}
    for _, got in answers:
        np.testing.assert_array_equal(got, np.arange(N_SHARED, dtype=np.float32) * 10)
    for rank in (1, 2, 3):
        assert bytes(peers[rank].segment.slot(SLOT, 4 * N_SHARED)) == xs[rank].tobytes()
    assert results.held() == 1


def test_a_16_bit_result_is_rounded_once_into_the_result_slot_that_every_rank_reads():
    import ml_dtypes

    n = SHARED_RESULT_BYTES // 2 + 3
    xs = [(np.arange(n) % 64 / 4 + rank).astype(ml_dtypes.bfloat16) for rank in range(3)]
    want = (np.sum([x.astype(np.float32) for x in xs], axis=0) / np.float32(3)).astype(ml_dtypes.bfloat16)
    results = SharedResults(1 << 20, slots=4)
    outbox, peers, acquired = _run(3, [True] * 3, DType.BFLOAT16, ReduceOp.AVG, xs, results=results, readers=range(3))
    assert acquired == [n * 4]  # the float32 accumulator only
    for peer in peers:
        how, got = _answer(outbox, peer, DType.BFLOAT16, n, results)
        assert how == protocol.shared_result_aux(0, 1) and got.tobytes() == want.view(np.uint16).tobytes()


@pytest.mark.parametrize("readers, n", [((2,), N_SHARED), ((0, 1, 2), 1000)], ids=["one-reader", "small"])
def test_one_reader_or_a_small_result_gets_it_in_its_own_slot(readers, n):
    xs = [np.full(n, rank + 1.0, np.float32) for rank in range(3)]
    results = SharedResults(1 << 20, slots=4)
    outbox, peers, _ = _run(3, [True] * 3, DType.FLOAT32, ReduceOp.SUM, xs, results=results, readers=readers)
    for peer in peers:
        how, got = _answer(outbox, peer, DType.FLOAT32, n)
        assert how == "slot" and (got == 6.0).all()
    assert results.held() == 0


def test_a_result_slot_is_written_again_only_once_every_reader_released_that_use():
    """One result slot: while any of the ranks it was handed to has not released it, results go
    into each rank's own slot; a release of an older use counts for nothing."""
    results = SharedResults(1 << 20, slots=1)
    rounds, _, outbox, peers = _job(3, results, readers=range(3))
    xs = [np.full(N_SHARED, rank + 1.0, np.float32) for rank in range(3)]

    def collective(seq):
        _contribute(rounds, peers, [True] * 3, DType.FLOAT32, ReduceOp.SUM, [x * (seq + 1) for x in xs], seq=seq)
        answers = [_answer(outbox, peer, DType.FLOAT32, N_SHARED, results) for peer in peers]
        assert all((got == 6.0 * (seq + 1)).all() for _, got in answers)
        return [how for how, _ in answers]

    first = collective(0)
    assert first == ["slot", protocol.shared_result_aux(0, 1), protocol.shared_result_aux(0, 1)]
    assert collective(1) == ["slot"] * 3  # held by ranks 1 and 2
    peers[1].segment.release(0, 1)
    peers[2].segment.release(0, 7)  # not the use it was handed
    assert collective(2) == ["slot"] * 3
    peers[2].segment.release(0, 1)
    assert collective(3) == ["slot", protocol.shared_result_aux(0, 2), protocol.shared_result_aux(0, 2)]


def test_a_rank_that_is_not_told_of_its_result_slot_does_not_hold_it():
    """A RESULT_SHARED that cannot be queued (the rank's connection is gone) pins nothing."""
    results = SharedResults(1 << 20, slots=4)
    rounds, _, outbox, peers = _job(3, results, readers=range(3))
    send = outbox.send
    outbox.send = lambda identity, frames: identity != peers[2].identity and send(identity, frames)
    xs = [np.full(N_SHARED, rank + 1.0, np.float32) for rank in range(3)]
    _contribute(rounds, peers, [True] * 3, DType.FLOAT32, ReduceOp.SUM, xs)
    how, got = _answer(outbox, peers[1], DType.FLOAT32, N_SHARED, results)
    assert how == protocol.shared_result_aux(0, 1) and (got == 6.0).all()
    assert results.held() == 1
    peers[1].segment.release(0, 1)
    assert results.held() == 0


@pytest.mark.parametrize("order", [[0, 3, 2, 1], [3, 2, 1, 0]], ids=["owner-first", "owner-last"])
def test_deterministic_mode_writes_the_rank_order_sum_into_the_result_slot_as_the_last_rank_is_folded(order):
    """Ranks 3 and 2 are held until 1 comes (and 0, when it comes last), whose arrival folds the
    rest in rank order; the fold of 3 writes the sum, bitwise the rank-order one, into the result
    slot, and rank 0's slot, the accumulator, holds it too."""
    n = N_SHARED
    big = np.float32(1 << 24)
    xs = [np.full(n, v, np.float32) for v in (big, 1.0, -big, 1.0)]  # rank order: (((2^24 + 1) - 2^24) + 1) = 1
    results = SharedResults(1 << 20, slots=4)
    rounds, _, outbox, peers = _job(4, results, readers=range(4), deterministic=True)
    _contribute(rounds, peers, [True] * 4, DType.FLOAT32, ReduceOp.SUM, xs, order=order)
    answers = [_answer(outbox, peer, DType.FLOAT32, n, results) for peer in peers]
    assert [how for how, _ in answers] == ["slot"] + [protocol.shared_result_aux(0, 1)] * 3
    for _, got in answers:
        assert (got == 1.0).all()
    assert bytes(peers[2].segment.slot(SLOT, 4 * n)) == xs[2].tobytes()  # held, folded, never written


def test_a_kernel_that_refuses_the_last_fold_fails_the_round_on_every_rank(monkeypatch):
    """No rank waits on a round whose last fold stopped part way: every one hears INTERNAL."""
    from reduction_server.reducer import fold

    def refuse(*args):
        raise SystemError("reduction kernel rejected its arguments")

    monkeypatch.setattr(fold._native, "accumulate_copies", refuse)
    rounds, _, outbox, peers = _job(3, deterministic=True)
    xs = [np.full(5000, rank + 1.0, np.float32) for rank in range(3)]
    _contribute(rounds, peers, [True] * 3, DType.FLOAT32, ReduceOp.SUM, xs, order=[1, 2, 0])  # and nothing left
    errors = {identity: frames for identity, frames in outbox.sent if frames[0] == "ERROR"}
    assert sorted(errors) == sorted(peer.identity for peer in peers)
    assert all(code == protocol.ErrorCode.INTERNAL and "kernel rejected" in text for _, code, text in errors.values())
