"""Groups of some of a job's ranks (client/group.py) on real reducers: their own collectives
beside the job's, exact results, groups announced two ways, a member lost, hand-driven peers
that break the rules, a reducer restarted under a group, and a group closed with a collective in
flight."""

import re
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import reduction_server
from helpers.cluster import reducers
from helpers.jobs import connect, new_job, run_job, until
from helpers.peers import JOB, Peer, data
from reduction_server.client.buffers import wire_view
from reduction_server.client.engine.inbox import Inbox
from reduction_server.client.group import Group, group_id
from reduction_server.wire import protocol
from reduction_server.wire.protocol import ErrorCode, MsgType

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def group(transport_group):
    return transport_group


def test_a_group_runs_its_collectives_beside_the_jobs(group):
    """W=3, group {0, 2}: all-reduces of several chunks, a broadcast from the group's rank 1 (job
    rank 2), interleaved with the job's own all-reduces; rank 1 never touches the group."""

    def body(comm, rank):
        out = {"world": comm.all_reduce(np.array([rank + 1], np.int64)).tolist()}
        if rank != 1:
            sub = Group(comm, [2, 0], "evens")
            assert (sub.rank, sub.world_size) == ((0, 2) if rank == 0 else (1, 2))
            x = np.arange(200_000, dtype=np.float32) + rank
            out["sum"] = sub.all_reduce(x)
            y = np.full(7, float(rank))
            sub.broadcast(y, root=1)
            out["bcast"] = y.tolist()
        out["after"] = comm.all_reduce(np.array([10 * rank], np.int64)).tolist()
        return out

    results = run_job(3, body, group=group, chunk_bytes=65536)
    want = 2 * np.arange(200_000, dtype=np.float32) + 2
    for rank, out in enumerate(results):
        assert out["world"] == [6] and out["after"] == [30]
        if rank != 1:
            np.testing.assert_array_equal(out["sum"], want)
            assert out["bcast"] == [2.0] * 7


def test_a_group_without_rank_0_mixes_shared_memory_and_frames(group):
    """Group {1, 2} of W=3, rank 1 through shared-memory slots (on the shared-memory reducers) and
    rank 2 through frames: their contributions agree on every field, whichever way they came."""
    job = new_job()

    def body(comm, rank):
        if rank == 0:
            return None
        sub = Group(comm, [1, 2], "no zero")
        return sub.all_reduce(np.arange(300_000, dtype=np.float32) * rank)

    make = lambda rank: connect(group, rank, 3, job, shared_memory=rank == 1, chunk_bytes=65536)  # noqa: E731
    results = run_job(3, body, make=make)
    for got in results[1:]:
        np.testing.assert_array_equal(got, np.arange(300_000, dtype=np.float32) * 3)


def test_two_groups_over_the_same_ranks_keep_their_own_order(group):
    """Two groups of the same ranks are two groups (two names): the ranks may use them in different
    orders, as they may two torch subgroups."""

    def body(comm, rank):
        a, b = Group(comm, [0, 1], "a"), Group(comm, [0, 1], "b")
        first, second = (a, b) if rank == 0 else (b, a)
        h1 = first.all_reduce_async(np.array([1.0 if first is a else 100.0]))
        h2 = second.all_reduce_async(np.array([1.0 if second is a else 100.0]))
        return sorted([h1.wait()[0], h2.wait()[0]])

    assert run_job(2, body, group=group) == [[2.0, 200.0]] * 2
    assert group_id("a") != group_id("b") and group_id("a") != 0


def test_a_group_announced_two_ways_fails_on_every_member_naming_both(group):
    def body(comm, rank):
        sub = Group(comm, [0, 1] if rank == 0 else [0, 1, 2], "disputed")
        with pytest.raises(reduction_server.CollectiveError, match=r"announced group .* as ranks \[0, 1"):
            sub.all_reduce(np.ones(4, np.float32))
        return comm.all_reduce(np.array([1], np.int32)).tolist()  # the job goes on

    assert run_job(3, body, group=group) == [[3]] * 3


def test_a_lost_rank_fails_the_jobs_collectives_but_not_a_group_without_it(group):
    def body(comm, rank):
        comm.all_reduce(np.ones(1))  # every rank is admitted before rank 2 leaves
        if rank == 2:
            comm.close()  # BYE: lost on purpose
            return None
        time.sleep(0.5)
        sub = Group(comm, [0, 1], "survivors")
        got = sub.all_reduce(np.array([rank + 1.0])).tolist()
        with pytest.raises(reduction_server.CollectiveError, match="rank 2"):
            comm.all_reduce(np.ones(3))
        return got

    assert run_job(3, body, group=group)[:2] == [[3.0]] * 2


def test_a_group_outside_the_rules_is_refused_by_name():
    """Hand-driven peers: a chunk of a group nobody announced, a chunk from a rank outside its
    group, a broadcast root outside it, and a malformed GROUP, each answered by name."""
    with reducers(1, workers=3) as reducer:
        peers = [Peer(reducer.addresses[0]) for _ in range(3)]
        for rank, peer in enumerate(peers):
            peer.handshake(rank, 3, job=JOB)
        unknown = protocol.unpack(data(0, world=3, seq=1))
        unknown.group = 77
        peers[0].send(unknown.pack(), b"\0" * 16)
        peers[0].expect_error(ErrorCode.MISMATCH, "a group none of its ranks announced")
        ranks = protocol.group_payload([0, 2])
        for rank in (0, 2):
            peers[rank].send(protocol.text_header(MsgType.GROUP, ranks, rank=rank, world=3, job=JOB, group=5), ranks)
        outsider = protocol.unpack(data(1, world=3, seq=2))
        outsider.group = 5
        peers[1].send(outsider.pack(), b"\0" * 16)
        peers[1].expect_error(ErrorCode.MISMATCH, "is not one of its ranks [0, 2]")
        for rank in (0, 2):  # the group's own round works
            h = protocol.unpack(data(rank, world=3, seq=3))
            h.group = 5
            peers[rank].send(h.pack(), np.full(4, rank + 1, np.float32).tobytes())
        for rank in (0, 2):
            header, payload = peers[rank].recv()
            assert header.type is MsgType.RESULT and header.group == 5
            assert np.frombuffer(payload, np.float32).tolist() == [4.0] * 4
        for rank, group_id_, members, words in (
            (1, 5, [0, 2], "which it is not one of"),
            (0, 0, [0, 1, 2], "never announced"),
        ):
            payload = protocol.group_payload(members)  # refused to its sender alone
            peers[rank].send(
                protocol.text_header(MsgType.GROUP, payload, rank=rank, world=3, job=JOB, group=group_id_), payload
            )
            peers[rank].expect_error(ErrorCode.MISMATCH, words)
        for rank in (0, 2):  # and the group still works, for its members only
            h = protocol.unpack(data(rank, world=3, seq=4))
            h.group = 5
            peers[rank].send(h.pack(), np.full(4, 10.0 * (rank + 1), np.float32).tobytes())
        for rank in (0, 2):
            header, payload = peers[rank].recv()
            assert header.type is MsgType.RESULT and (header.group, header.seq) == (5, 4)
            assert np.frombuffer(payload, np.float32).tolist() == [40.0] * 4
        peers[1].expect_silence(0.3)
        bad = b"\x02\0\0\0\x01\0\0\0"  # not ascending
        peers[0].send(protocol.text_header(MsgType.GROUP, bad, rank=0, world=3, job=JOB, group=6), bad)
        peers[0].expect_error(ErrorCode.MALFORMED, "ascending")
        for peer in peers:
            peer.close()
        assert reducer.alive()


def test_a_restarted_reducer_learns_the_groups_again():
    """The reducers keep groups per job in memory: a reducer restarted at its address hears every
    group again from each worker it admits again, before any of the group's chunks."""
    both = threading.Barrier(2)
    with reducers(1) as single:

        def body(comm, rank):
            sub = Group(comm, [0, 1], "kept")
            first = sub.all_reduce(np.array([rank + 1.0])).tolist()
            down = comm._engine.connections.down  # the engine's own view of reducer 0
            both.wait()
            if rank == 0:
                single.signal(0, signal.SIGKILL)
            until(lambda: 0 in down, "the engine to see reducer 0 gone")
            both.wait()
            if rank == 0:
                single.restart(0)
            until(lambda: 0 not in down, "the engine to be admitted again")
            return first, sub.all_reduce(np.array([10.0 * (rank + 1)])).tolist()

        results = run_job(2, body, group=single, limit=60)
    assert [r[0] for r in results] == [[3.0]] * 2
    assert [r[1] for r in results] == [[30.0]] * 2


def test_each_group_has_its_own_window_so_a_receive_first_ring_completes(group):
    """Each rank first posts a receive (a relay it is not the root of) in one pair's group, then
    its send in the other's, each of many chunks: were the groups to share a window, both ranks'
    windows would fill with receives waiting for sends behind them, until RS_TIMEOUT."""
    n = 1 << 21  # 8 MiB of float32: dozens of chunks per reducer, against a window of a few

    def body(comm, rank):
        other = 1 - rank
        inbound, outbound = Group(comm, [0, 1], f"{other}>{rank}"), Group(comm, [0, 1], f"{rank}>{other}")
        received = np.zeros(n, np.float32)
        first = inbound.broadcast_async(received, root=other)
        second = outbound.broadcast_async(np.full(n, rank + 1.0, np.float32), root=rank)
        first.wait(), second.wait()
        return float(received.min()), float(received.max())

    assert run_job(2, body, group=group, chunk_bytes=65536) == [(2.0, 2.0), (1.0, 1.0)]


def test_a_broadcast_root_gets_no_copy_of_its_own_data():
    """A relay sends the root's chunks to the other ranks only (the root's answer is bare), in
    place and out of place: the reducer's bytes out are (W - 1) x S, and every rank, the root
    included, ends with the root's data."""
    n = 1 << 18  # 1 MiB of float32
    with reducers(1) as single:

        def body(comm, rank):
            x = np.full(n, float(rank), np.float32)
            comm.broadcast(x, root=2)
            out = np.zeros(n, np.float32)  # out of place, as Horovod's broadcast
            src = np.full(n, 7.0 + rank, np.float32)
            comm._start(
                wire_view(src) if rank == 1 else None,
                wire_view(out, writable=True),
                protocol.ReduceOp.BROADCAST,
                1,
                out,
            ).wait()
            return float(x.min()), float(x.max()), float(out.min()), float(out.max())

        assert run_job(3, body, group=single) == [(2.0, 2.0, 8.0, 8.0)] * 3
        log = single.stop()[0]
    sent = [int(v) for v in re.findall(r"stopped .*?\bbytes_out=(\d+)", log)]  # a line per shard
    assert sent and sum(sent) == 2 * 2 * 4 * n, log[-2000:]


def test_a_group_closed_with_a_collective_in_flight_keeps_its_results_until_it_ends(group):
    """Rank 0 closes its group while its all-reduce still waits for rank 1: failover may still
    need that collective's results, so they are kept until it ends, and then let go (a group
    made and closed in a loop would otherwise leave each one's last window behind)."""
    closed, contributed = threading.Event(), threading.Event()

    def body(comm, rank):
        sub = Group(comm, [0, 1], "closed early")
        kept = comm._engine.failover.results.kept
        # a snapshot taken in one step: the engine thread adds and pops keys meanwhile
        mine = lambda: [key for key, ring in list(kept.items()) if key[0] == sub.group_id and ring]  # noqa: E731
        x = np.arange(100_000, dtype=np.float32) + rank
        if rank == 0:
            handle = sub.all_reduce_async(x)
            sub.close()
            time.sleep(0.3)  # the engine has seen the close: it keeps the results all the same
            closed.set()
            assert contributed.wait(10)
            got = handle.wait(10)
            until(lambda: not mine(), "rank 0's results of the closed group to be let go", 5)
            with pytest.raises(reduction_server.CollectiveError, match="closed"):
                sub.all_reduce(x)
        else:
            assert closed.wait(10)
            got = sub.all_reduce(x)
            assert mine(), "rank 1 keeps the results of its open group"
            contributed.set()
        return got

    want = 2 * np.arange(100_000, dtype=np.float32) + 1
    for got in run_job(2, body, group=group, chunk_bytes=65536):
        np.testing.assert_array_equal(got, want)


def test_a_closed_groups_results_go_when_nothing_of_it_is_in_flight_and_not_if_it_is_made_again():
    inbox = Inbox(0)
    try:
        inbox.remove_group(7)
        inbox.add_group(7, (0, 1))  # made again before the engine saw the close: the same key, kept on
        assert inbox.idle_closed_groups([]) == []
        inbox.remove_group(8)
        assert inbox.idle_closed_groups([SimpleNamespace(group=8)]) == []  # one of its collectives in flight
        inbox.queue.append(SimpleNamespace(group=8))
        assert inbox.idle_closed_groups([SimpleNamespace(group=9)]) == []  # one queued
        inbox.queue.clear()
        assert inbox.idle_closed_groups([SimpleNamespace(group=9)]) == [8]
        assert inbox.closed_groups == []
    finally:
        inbox.close()


def test_two_groups_made_under_one_name_fail_the_collective_that_would_share_a_seq(group):
    """Two Group objects of one name count their collectives apart, so both have a seq 0: the
    second, started while the first is in flight, fails by name, and the first completes (its
    answers could not have been told apart: the first once waited for ever)."""

    def body(comm, rank):
        first, second = Group(comm, [0, 1], "twice"), Group(comm, [0, 1], "twice")
        if rank == 1:
            time.sleep(1.0)  # rank 0 starts both before rank 1 joins the first
            return first.all_reduce(np.ones(4, np.float32)).tolist()
        pending = first.all_reduce_async(np.ones(4, np.float32))
        with pytest.raises(reduction_server.CollectiveError, match="another collective with its group and seq"):
            second.all_reduce_async(np.ones(4, np.float32)).wait(10)
        return pending.wait(10).tolist()

    assert run_job(2, body, group=group) == [[2.0] * 4] * 2
