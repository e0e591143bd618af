"""Reducer memory and work bounds per rank and per job: RS_MAX_PEER_BYTES (the reducer memory one
rank may account for) and RS_MAX_ROUNDS (chunks of collectives in flight). A rank over either
gets an ERROR naming it and the cap; every other rank of the round gets the same error, the
reducer stays up, and the other ranks' own budgets and later collectives are untouched.

Real reducer processes; the ranks are hand-driven DEALER peers (test_reducer_errors.Peer), so
that a test can run one rank ahead of the others, which a Communicator never does."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from helpers.cluster import ONE_PROCESS, child_env, reducers
from helpers.jobs import check_sum_works, communicator, until
from helpers.metrics import scrape, value
from helpers.peers import Peer, data
from helpers.ports import free_port_range
from reduction_server.wire.protocol import DType, ErrorCode, MsgType, ReduceOp

pytestmark = pytest.mark.timeout(90)

BUDGET = 1 << 20
COUNT = 1 << 16  # float32 elements: 256 KiB chunks, 4 fill the budget


def payload(value: float, count: int = COUNT) -> bytes:
    return np.full(count, value, np.float32).tobytes()


def expect_result(peer: Peer, seq: int, value: float, count: int = COUNT) -> None:
    reply = peer.recv()
    assert reply is not None, f"no result for seq {seq}"
    header, body = reply
    assert header.type is MsgType.RESULT and header.seq == seq, (header, body[:200])
    np.testing.assert_array_equal(np.frombuffer(body, np.float32), np.full(count, value, np.float32))


def peers(group, world: int, job: int):
    ranks = [Peer(group.addresses[0]) for _ in range(world)]
    for rank, peer in enumerate(ranks):
        peer.handshake(rank, world, job=job)
    return ranks


def test_a_rank_over_its_memory_budget_is_refused_and_the_others_keep_theirs():
    with reducers(1, workers=2, extra_env={"RS_MAX_PEER_BYTES": str(BUDGET)}) as group:
        a, b = peers(group, 2, job=0xB0D6)
        for seq in range(1, 5):  # rank 0 runs 4 chunks ahead: 1 MiB of accumulators, its whole budget
            a.send(data(0, job=0xB0D6, seq=seq, count=COUNT), payload(1))
        a.expect_silence(0.3)
        a.send(data(0, job=0xB0D6, seq=5, count=COUNT), payload(1))
        _, text = a.expect_error(
            ErrorCode.TOO_LARGE, "rank 0 would hold", f"per-rank budget of {BUDGET} bytes", "RS_MAX_PEER_BYTES"
        )
        for seq in range(1, 5):  # the rounds it held complete
            b.send(data(1, job=0xB0D6, seq=seq, count=COUNT), payload(2))
            for peer in (a, b):
                expect_result(peer, seq, 3)
        b.send(data(1, job=0xB0D6, seq=5, count=COUNT), payload(2))
        _, same = b.expect_error(ErrorCode.TOO_LARGE)
        assert same == text  # every rank of the failed round hears the same
        # Rank 1 has its own budget: it may now run 4 chunks ahead, and rank 0 has its budget back.
        for seq in range(6, 10):
            b.send(data(1, job=0xB0D6, seq=seq, count=COUNT), payload(2))
        b.expect_silence(0.3)
        for seq in range(6, 10):
            a.send(data(0, job=0xB0D6, seq=seq, count=COUNT), payload(1))
            for peer in (a, b):
                expect_result(peer, seq, 3)
        assert group.alive()
        for peer in (a, b):
            peer.close()
        # A job of real communicators (window 4, 64 KiB chunks: 512 KiB per rank at most) is served.
        comms = [communicator(group, r, 2) for r in range(2)]
        check_sum_works(comms, count=200_000)
        for comm in comms:
            comm.close()


def test_held_contributions_count_against_their_senders_budget_in_deterministic_mode():
    env = {"RS_MAX_PEER_BYTES": str(BUDGET), "RS_DETERMINISTIC": "1"}
    with reducers(1, workers=3, extra_env=env) as group:
        ranks = peers(group, 3, job=0xDE7)
        for seq in range(1, 5):  # rank 2 first: its contributions wait for ranks 0 and 1
            ranks[2].send(data(2, 3, job=0xDE7, seq=seq, count=COUNT), payload(4))
        ranks[2].expect_silence(0.3)
        ranks[2].send(data(2, 3, job=0xDE7, seq=5, count=COUNT), payload(4))
        ranks[2].expect_error(ErrorCode.TOO_LARGE, "rank 2 would hold", "RS_MAX_PEER_BYTES", "held")
        for seq in range(1, 5):
            for rank in (0, 1):
                ranks[rank].send(data(rank, 3, job=0xDE7, seq=seq, count=COUNT), payload(rank + 1))
            for peer in ranks:
                expect_result(peer, seq, 1 + 2 + 4)
        for rank in (0, 1):
            ranks[rank].send(data(rank, 3, job=0xDE7, seq=5, count=COUNT), payload(1))
            ranks[rank].expect_error(ErrorCode.TOO_LARGE, "rank 2 would hold")
        # its budget is free again once the held contributions were folded
        for rank in (2, 1, 0):
            ranks[rank].send(data(rank, 3, job=0xDE7, seq=6, count=COUNT), payload(rank + 1))
        for peer in ranks:
            expect_result(peer, 6, 6)
        assert group.alive()
        for peer in ranks:
            peer.close()


def test_collectives_in_flight_are_capped_per_job():
    cap = 8
    with reducers(1, workers=2, extra_env={"RS_MAX_ROUNDS": str(cap)}) as group:
        a, b = peers(group, 2, job=0xCA9)
        for seq in range(1, cap + 1):
            a.send(data(0, job=0xCA9, seq=seq), payload(1, 4))
        a.expect_silence(0.3)
        a.send(data(0, job=0xCA9, seq=cap + 1), payload(1, 4))
        a.expect_error(
            ErrorCode.TOO_LARGE,
            "rank 0 started collective seq=9",
            f"{cap} chunks of collectives",
            f"RS_MAX_ROUNDS={cap}",
        )
        for seq in range(1, cap + 1):
            b.send(data(1, job=0xCA9, seq=seq), payload(2, 4))
            for peer in (a, b):
                expect_result(peer, seq, 3, 4)
        b.send(data(1, job=0xCA9, seq=cap + 1), payload(2, 4))
        b.expect_error(ErrorCode.TOO_LARGE, f"RS_MAX_ROUNDS={cap}")
        for peer, rank in ((a, 0), (b, 1)):
            peer.send(data(rank, job=0xCA9, seq=cap + 2), payload(rank + 1, 4))
        for peer in (a, b):
            expect_result(peer, cap + 2, 3, 4)
        assert group.alive()
        for peer in (a, b):
            peer.close()
        # Communicators whose window equals the cap never reach it: ranks stay within a window.
        comms = [communicator(group, r, 2, window=cap) for r in range(2)]
        for seed in range(3):
            check_sum_works(comms, count=300_000, seed=seed)  # 38 chunks each
        for comm in comms:
            comm.close()


@pytest.mark.parametrize("variable", ["RS_MAX_ROUNDS", "RS_MAX_PEER_BYTES"])
def test_the_caps_are_validated(variable):
    serve = [sys.executable, "-m", "reduction_server", "serve", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.run(serve, env=child_env({variable: "0"}), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and f"{variable}='0' must be at least" in proc.stderr, proc.stderr


def test_a_16_bit_result_that_does_not_fit_fails_every_rank_at_once():
    """A float16 round's float32 accumulator fits the reducer's memory but its rounded result
    does not: every rank gets TOO_LARGE at once (not a timeout), and the memory comes back."""
    count = 4096  # 16 KiB float32 accumulator, 8 KiB float16 result; 20 KiB of memory holds one, not both
    with reducers(1, workers=2, extra_env={"RS_MAX_ACCUMULATOR_BYTES": str(20 << 10), **ONE_PROCESS}) as group:
        a, b = peers(group, 2, job=0xF16)
        half = np.ones(count, np.float16).tobytes()
        for rank, peer in enumerate((a, b)):
            peer.send(data(rank, job=0xF16, seq=1, count=count, dtype=DType.FLOAT16), half)
        texts = [
            peer.expect_error(ErrorCode.TOO_LARGE, "cannot be sent", "RS_MAX_ACCUMULATOR_BYTES")[1] for peer in (a, b)
        ]
        assert texts[0] == texts[1]
        # float32 rounds need no second buffer: the freed accumulator serves them.
        for rank, peer in enumerate((a, b)):
            peer.send(data(rank, job=0xF16, seq=2, count=count), np.ones(count, np.float32).tobytes())
        for peer in (a, b):
            header, body = peer.recv()
            assert header.type is MsgType.RESULT, body[:200]
            np.testing.assert_array_equal(np.frombuffer(body, np.float32), np.full(count, 2, np.float32))
        assert group.alive()


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_received_frame_becomes_the_accumulator_and_is_counted_until_its_round_ends(deterministic):
    """A contribution of a dtype that accumulates in itself, large enough to have a receive
    buffer of its own, is summed into in place and sent back as the result: nothing is taken
    from the pool, and its bytes count against the budgets (as held) until the round is
    answered or fails. In deterministic mode that is rank 0's, whenever it arrives (a rank
    ahead of it is held meanwhile). 16-bit floats and small frames still go through pool
    accumulators."""
    port = free_port_range(1)
    held = lambda: value(scrape(port), "reduction_server_accumulator_bytes", state="held")  # noqa: E731
    pool = lambda: [value(scrape(port), "reduction_server_accumulator_bytes", state=s) for s in ("in_use", "free")]  # noqa: E731

    def released() -> bool:
        """The result was sent from the adopted frame, so it stops counting once libzmq is done
        with it: the reducer notices within a turn of its loop."""
        deadline = time.monotonic() + 5
        while (held(), pool()) != (0, [0, 0]):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    env = {"RS_METRICS_PORT": str(port), "RS_DETERMINISTIC": str(int(deterministic)), **ONE_PROCESS}
    with reducers(1, workers=2, extra_env=env) as group:
        a, b = peers(group, 2, job=0xAD0)
        for seq, op, expected, order in (
            (1, ReduceOp.SUM, 3, "ab"),
            (2, ReduceOp.AVG, 1.5, "ab"),
            (3, ReduceOp.MAX, 2, "ab"),
            (4, ReduceOp.SUM, 3, "ba"),
        ):
            for i, name in enumerate(order):
                rank = "ab".index(name)
                (a, b)[rank].send(data(rank, job=0xAD0, seq=seq, count=COUNT, op=op), payload(rank + 1))
                if i == 0:
                    a.expect_silence(0.3)
                    assert held() == COUNT * 4 and pool() == [0, 0]
            for peer in (a, b):
                expect_result(peer, seq, expected)
            assert released(), (held(), pool())
        # A round that fails gives the adopted frame back too.
        a.send(data(0, job=0xAD0, seq=5, count=COUNT), payload(1))
        a.expect_silence(0.3)
        b.send(data(1, job=0xAD0, seq=5, count=COUNT // 2), payload(2, COUNT // 2))
        for peer in (a, b):
            peer.expect_error(ErrorCode.MISMATCH, "disagree")
        assert held() == 0 and pool() == [0, 0]
        # float16 accumulates in float32, and a small frame may share libzmq's receive buffer:
        # both are loaded into pool memory, which stays pooled for reuse.
        for seq, dtype, count in ((6, DType.FLOAT16, COUNT), (7, DType.FLOAT32, 1000)):
            ones = np.ones(count, np.float16 if dtype is DType.FLOAT16 else np.float32).tobytes()
            a.send(data(0, job=0xAD0, seq=seq, count=count, dtype=dtype), ones)
            a.expect_silence(0.3)
            assert held() == 0 and pool()[0] == count * 4
            b.send(data(1, job=0xAD0, seq=seq, count=count, dtype=dtype), ones)
            for peer in (a, b):
                header, body = peer.recv()
                assert header.type is MsgType.RESULT and header.seq == seq, body[:200]
                assert np.all(np.frombuffer(body, np.float16 if dtype is DType.FLOAT16 else np.float32) == 2)
        assert group.alive()


@pytest.mark.parametrize("small", [True, False], ids=["copied", "tracked"])
def test_a_small_result_leaves_the_pool_as_it_is_sent_and_a_large_one_once_libzmq_has_sent_it(small):
    """A result under COPIED_RESULT_BYTES goes out as a copy that libzmq owns, and its memory is
    back in the pool at once: a rank that does not read its results pins none of the budget, and
    the others' rounds go on. A larger one is sent from the accumulator itself, which counts until
    libzmq has sent it: that rank's unread results fill the budget, and a round is refused
    (TOO_LARGE) long before the last."""
    from reduction_server.reducer.fold import COPIED_RESULT_BYTES

    count = COPIED_RESULT_BYTES // 4 // (4 if small else 1)  # float32: 64 KiB, or 256 KiB
    port = free_port_range(1)
    # 16 MiB of results for the rank that does not read: more than its kernel buffers take (4 MiB)
    # and the budget (1 MiB) together
    rounds = (16 << 20) // (count * 4)
    env = {"RS_METRICS_PORT": str(port), "RS_MAX_ACCUMULATOR_BYTES": str(BUDGET), **ONE_PROCESS}
    with reducers(1, workers=2, extra_env=env) as group:
        a = Peer(group.addresses[0])
        sleeper = Peer(group.addresses[0], RCVHWM=1, RCVBUF=4096)
        for rank, peer in enumerate((a, sleeper)):
            peer.handshake(rank, 2, job=0x5EE)
        refused = None
        for seq in range(1, rounds + 1):
            a.send(data(0, job=0x5EE, seq=seq, count=count), payload(1, count))
            sleeper.send(data(1, job=0x5EE, seq=seq, count=count), payload(2, count))
            header, body = a.recv()
            if header.type is MsgType.ERROR:
                refused = seq, body.decode()
                break
            assert header.type is MsgType.RESULT and header.seq == seq, (header, body[:200])
            assert np.all(np.frombuffer(body, np.float32) == 3)

        def memory() -> list:
            live = scrape(port)
            return [value(live, "reduction_server_accumulator_bytes", state=s) for s in ("in_use", "held")]

        if small:
            assert refused is None, refused
            # the reducer sends the last result before it returns its memory: a scrape may come between
            until(lambda: memory() == [0, 0], "the copied results' memory back in the pool", limit=5)
        else:
            assert refused is not None and refused[0] < rounds, (rounds, memory())
            assert "RS_MAX_ACCUMULATOR_BYTES" in refused[1], refused
        assert group.alive()
        for peer in (a, sleeper):
            peer.close()
