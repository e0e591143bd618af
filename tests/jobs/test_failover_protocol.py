"""A reducer's side of failover (docs/protocol.md, "Failover"), driven by hand-made peers against
a real reducer process. Rounds of chunks moved to it from a lost reducer (MOVED, FINAL): a FINAL
settles the round with the result it brings, every rank gets exactly that result whatever the
order of arrival, FINALs that differ fail the round, moved rounds are exempt from the
skipped-collective rule, and a settled round nobody else asks for goes away quietly at
RS_TIMEOUT. A reducer that comes back (PROGRESS, JOIN): once every member of a group has said
where it is, each hears the same boundary, past anything any of them had started."""

from __future__ import annotations

from typing import List

import numpy as np
import pytest

from helpers.cluster import reducers
from helpers.peers import JOB, Peer, data
from reduction_server.wire import protocol
from reduction_server.wire.protocol import REJOIN_LEAD, DType, ErrorCode, MsgType, ReduceOp

pytestmark = pytest.mark.timeout(60)

W = 3
COUNT = 20_000  # over the reducer's 64 KiB frame threshold: a FINAL frame is kept, not copied


def values(rank: int, count: int = COUNT) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(count).astype(np.float32)


def send(
    peer: Peer, rank: int, mtype: MsgType, payload: np.ndarray, seq: int = 1, op: ReduceOp = ReduceOp.SUM, aux: int = 0
) -> None:
    count = len(payload) if payload.size else COUNT
    nbytes = payload.nbytes
    peer.send(data(rank, W, seq=seq, count=count, op=op, aux=aux, mtype=mtype, nbytes=nbytes), payload.tobytes())


def result(peer: Peer) -> np.ndarray:
    reply = peer.recv()
    assert reply is not None, "no answer"
    header, payload = reply
    assert header.type is MsgType.RESULT, (header.type.name, payload[:200])
    return np.frombuffer(payload, np.float32)


@pytest.fixture(scope="module")
def group():
    with reducers(1, workers=W, extra_env={"RS_TIMEOUT": "1.5"}) as group:
        yield group


@pytest.fixture
def peers(group) -> List[Peer]:
    ps = [Peer(group.addresses[0]) for _ in range(W)]
    for rank, p in enumerate(ps):
        p.handshake(rank, W)
    yield ps
    for p in ps:
        p.close()


@pytest.mark.parametrize("final_first", [True, False], ids=["final-first", "final-last"])
def test_a_final_is_every_rank_s_result_whenever_it_arrives(peers, final_first: bool):
    final = values(99)  # not the sum of the contributions: the lost reducer's result is what counts
    if final_first:
        send(peers[0], 0, MsgType.FINAL, final)
        assert result(peers[0]).size == 0  # a bare RESULT: it holds the data
    send(peers[1], 1, MsgType.MOVED, values(1))
    if final_first:
        assert np.array_equal(result(peers[1]), final)  # answered at once, without waiting for rank 2
    else:
        peers[1].expect_silence(0.3)  # waits: nobody has brought the result, not everyone contributed
        send(peers[0], 0, MsgType.FINAL, final)
        assert result(peers[0]).size == 0
        assert np.array_equal(result(peers[1]), final)
    send(peers[2], 2, MsgType.MOVED, values(2))
    assert np.array_equal(result(peers[2]), final)
    for p in peers:
        p.expect_silence(0.2)  # each rank answered exactly once


def test_moved_contributions_alone_are_summed(peers):
    for rank in range(W):
        send(peers[rank], rank, MsgType.MOVED, values(rank), seq=2)
    want = values(0) + values(1) + values(2)
    for p in peers:
        assert np.allclose(result(p), want, rtol=1e-6, atol=1e-6)


def test_two_finals_that_differ_fail_the_round_on_every_rank(peers):
    send(peers[0], 0, MsgType.FINAL, values(10), seq=3)
    assert result(peers[0]).size == 0
    send(peers[1], 1, MsgType.FINAL, values(11), seq=3)
    peers[1].expect_error(ErrorCode.MISMATCH, "ranks 0 and 1 received different results")
    send(peers[2], 2, MsgType.MOVED, values(2), seq=3)
    peers[2].expect_error(ErrorCode.MISMATCH, "different results")


def test_a_chunk_sent_moved_by_one_rank_and_not_by_another_is_a_mismatch(peers):
    send(peers[0], 0, MsgType.MOVED, values(0), seq=4)
    send(peers[1], 1, MsgType.DATA, values(1), seq=4)
    for p in peers[:2]:
        p.expect_error(ErrorCode.MISMATCH, "disagree on which reducers are lost")


def test_a_moved_round_is_not_taken_for_a_skipped_collective(peers):
    """Rank 0 contributed to seq 11 before it resent seq 10 (moved): the reducer must not fail
    seq 10 as skipped by rank 0 (a plain round would be, at the next tick)."""
    for rank in range(W):
        send(peers[rank], rank, MsgType.DATA, values(rank), seq=11)
    send(peers[1], 1, MsgType.MOVED, values(1), seq=10)
    for p in peers:
        result(p)  # seq 11 completes
    peers[1].expect_silence(0.6)  # several ticks: seq 10 still waits for ranks 0 and 2
    send(peers[0], 0, MsgType.MOVED, values(0), seq=10)
    send(peers[2], 2, MsgType.MOVED, values(2), seq=10)
    for p in (peers[1], peers[0], peers[2]):
        assert result(p).size == COUNT


def test_a_settled_round_nobody_else_asks_for_goes_away_quietly(peers):
    """Every rank but one had the result: nobody else will ever ask. At RS_TIMEOUT (1.5 s here)
    the round is forgotten without an error to anyone; the key is then free."""
    send(peers[0], 0, MsgType.FINAL, values(20), seq=5)
    assert result(peers[0]).size == 0
    peers[0].expect_silence(2.5)
    send(peers[1], 1, MsgType.MOVED, values(1), seq=5)  # a new round of the same key: it waits
    peers[1].expect_silence(0.3)
    peers[1].expect_error(ErrorCode.STALE, "timed out", timeout=3)


def test_a_moved_broadcast_settled_by_a_final(peers):
    root_data = values(7, 1000)
    send(peers[2], 2, MsgType.FINAL, root_data, seq=6, op=ReduceOp.BROADCAST, aux=1)
    assert result(peers[2]).size == 0
    peers[0].send(data(0, W, seq=6, count=1000, op=ReduceOp.BROADCAST, aux=1, mtype=MsgType.MOVED, nbytes=0))
    assert np.array_equal(result(peers[0]), root_data)
    send(peers[1], 1, MsgType.MOVED, root_data, seq=6, op=ReduceOp.BROADCAST, aux=1)
    assert result(peers[1]).size == 0  # the root holds the data


def test_a_final_with_the_wrong_size_is_refused(peers):
    peers[0].send(data(0, W, seq=8, count=COUNT, mtype=MsgType.FINAL, nbytes=COUNT * 4), values(0, 10).tobytes())
    peers[0].expect_error(ErrorCode.BAD_PAYLOAD)


def test_float16_final_passes_through_unrounded(peers):
    final = np.arange(100, dtype=np.float16) / 7
    peers[0].send(data(0, W, seq=9, count=100, dtype=DType.FLOAT16, mtype=MsgType.FINAL), final.tobytes())
    assert peers[0].recv()[0].nbytes == 0
    for rank in (1, 2):
        peers[rank].send(
            data(rank, W, seq=9, count=100, dtype=DType.FLOAT16, mtype=MsgType.MOVED),
            np.ones(100, np.float16).tobytes(),
        )
        header, payload = peers[rank].recv()
        assert header.type is MsgType.RESULT and payload == final.tobytes()


def progress(peer: Peer, rank: int, pairs: dict) -> None:
    payload = protocol.seq_pairs_payload(pairs.items())
    peer.send(protocol.text_header(MsgType.PROGRESS, payload, rank=rank, world=W, job=JOB), payload)


def join(peer: Peer) -> dict:
    reply = peer.recv()
    assert reply is not None and reply[0].type is MsgType.JOIN, reply
    return protocol.seq_pairs(reply[1])


def test_every_member_hears_one_boundary_past_what_any_had_started(peers):
    progress(peers[0], 0, {0: 40})
    progress(peers[1], 1, {0: 44})
    for p in peers[:2]:
        p.expect_silence(0.3)  # rank 2 has not said where it is
    progress(peers[2], 2, {0: 41})
    for p in peers:
        assert join(p) == {0: 44 + REJOIN_LEAD}
    progress(peers[1], 1, {0: 50})  # reconnected: it hears the boundary already chosen
    assert join(peers[1]) == {0: 44 + REJOIN_LEAD}
    peers[0].expect_silence(0.2)


def test_a_group_s_boundary_waits_for_its_members_only(peers):
    ranks = protocol.group_payload([0, 2])
    group = 0x1234
    for rank in (0, 2):
        peers[rank].send(protocol.text_header(MsgType.GROUP, ranks, rank=rank, world=W, job=JOB, group=group), ranks)
    progress(peers[0], 0, {group: 3})
    progress(peers[2], 2, {group: 7})
    for rank in (0, 2):
        assert join(peers[rank]) == {group: 7 + REJOIN_LEAD}
    peers[1].expect_silence(0.2)
    progress(peers[1], 1, {group: 1})
    peers[1].expect_error(ErrorCode.MISMATCH, "not a member")


def test_a_malformed_progress_is_refused(peers):
    peers[0].send(protocol.text_header(MsgType.PROGRESS, b"x" * 10, rank=0, world=W, job=JOB), b"x" * 10)
    peers[0].expect_error(ErrorCode.MALFORMED, "(group, seq)")
