"""Reducer failover with real processes: W=4 workers train for STEPS steps on R=3 reducers while
reducers are SIGKILLed at random points (a property test over the kill point, seeded and
reproducible: RS_FAILOVER_SEED); every run must finish, every step's collectives must be right
(each worker checks them against a NumPy reference), and in deterministic mode the final weights
must be bitwise equal to an undisturbed run's. Killed reducers are restarted at their
address and must be used again, from a collective every rank agrees on, before they are killed
again; one run of each kind has reducers of 2 shards, as `serve` runs by default on a host of
several cores. RS_FAILOVER_RUNS sets how many runs of each kind (longer campaigns); the default
keeps CI to a few minutes."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

from helpers.cluster import ONE_PROCESS, TOKEN, reducers
from helpers.training import FAST, STEPS, Run

R = 3
RUNS = int(os.environ.get("RS_FAILOVER_RUNS", "2"))
SEED = int(os.environ.get("RS_FAILOVER_SEED", "20261124"))

pytestmark = pytest.mark.timeout(60 + 90 * RUNS)  # a run takes 40-150 s on a loaded 2-core host

#: a plan: (step of rank 0 after which to act, seconds to wait after it, "kill" or "restart", the reducers)
Plan = List[Tuple[int, float, str, Tuple[int, ...]]]
#: the plan's steps between a restart and the next kill (the run also waits until rank 0 uses the
#: restarted reducer again, however long that takes under load, and USED_STEPS more)
REJOIN_STEPS = 30
USED_STEPS = 3


def run(
    plan: Plan,
    exact: bool = True,
    sig: int = signal.SIGKILL,
    extra: Optional[Dict[str, str]] = None,
    shards: Optional[int] = None,
) -> Tuple[List[dict], float]:
    """One training run on fresh reducers (of `shards` shards each; None: RS_SHARDS), signalling
    (`sig`) and restarting reducers as `plan` says; the ranks' results and the run's wall time."""
    started = time.monotonic()
    env = {"RS_DETERMINISTIC": "1" if exact else "0", **FAST, **({"RS_SHARDS": str(shards)} if shards else {})}
    with reducers(R, extra_env=env) as group:
        job = Run(group, exact, extra)
        down = set()
        settled = 0  # nothing happens before this step: a restarted reducer's USED_STEPS
        try:
            for step, delay, action, which in plan:
                job.wait_for_step(max(step, settled))
                time.sleep(delay)  # anywhere inside the next step: sending, summing, or answering
                for i in which:
                    if action == "restart":
                        group.restart(i)
                        down.discard(i)
                    else:
                        group.signal(i, sig)
                        down.add(i)
                if action == "restart":  # used again from a JOIN, then a few steps on it before the next act
                    job.wait_until_used(set(which))
                    settled = job.step + USED_STEPS
            results = job.finish()
        finally:
            if sig == signal.SIGSTOP:
                for i in down:
                    group.signal(i, signal.SIGCONT)
        assert all(group.procs[i].poll() is None for i in range(R) if i not in down or sig != signal.SIGKILL)
    return results, time.monotonic() - started


def random_plan(rng: random.Random, together: bool) -> Plan:
    """Reducers killed at random steps, restarted, and killed again: one at a time (three kills,
    one of a reducer that came back), or two at once (twice, the same two back in between)."""

    def moment(low: int, high: int) -> Tuple[int, float]:
        return rng.randrange(low, high), rng.uniform(0, 0.03)

    if together:
        pair = tuple(sorted(rng.sample(range(R), 2)))
        first = moment(2, 40)
        back = moment(first[0] + 5, first[0] + 15)
        again = moment(back[0] + REJOIN_STEPS, STEPS - 2)
        return [(*first, "kill", pair), (*back, "restart", pair), (*again, "kill", pair)]
    a, b = rng.sample(range(R), 2)
    first = moment(2, 30)
    back = moment(first[0] + 5, first[0] + 20)
    again = moment(back[0] + REJOIN_STEPS, back[0] + REJOIN_STEPS + 40)
    other = moment(again[0] + 5, STEPS - 2)
    return [(*first, "kill", (a,)), (*back, "restart", (a,)), (*again, "kill", (a,)), (*other, "kill", (b,))]


def kills(plan: Plan) -> int:
    return sum(len(which) for _, _, action, which in plan if action == "kill")


def check(results: Sequence[dict], plan: Plan, reference: Optional[str]) -> None:
    """Every step right on every rank, the same weights everywhere (and the reference's), every
    reducer the plan hit known as lost, and a reducer that came back used again."""
    hit = sorted({i for _, _, action, which in plan if action == "kill" for i in which})
    restarted = any(action == "restart" for _, _, action, _ in plan)
    for res in results:
        assert res["mismatch_count"] == 0, res
        assert res["lost"] == hit, res
        assert len(res["lost_endpoints"]) == len(hit) * res["endpoints"] // R, res  # every shard of each
        assert res["moved"] > 0, res
        assert (res["rejoined_chunks"] > 0) == restarted, res
        if reference is not None:
            assert res["digest"] == reference, res
    assert len({res["digest"] for res in results}) == 1, results


@pytest.fixture(scope="module")
def undisturbed() -> str:
    results, took = run([])
    print(f"undisturbed run: {took:.1f} s")
    assert all(res["mismatch_count"] == 0 and res["lost"] == [] and res["moved"] == 0 for res in results), results
    assert len({res["digest"] for res in results}) == 1
    return results[0]["digest"]


@pytest.mark.parametrize("together", [False, True], ids=["one-at-a-time", "two-at-once"])
def test_reducers_killed_at_random_points_leave_every_step_right_and_the_weights_bitwise_equal(
    undisturbed: str, together: bool
):
    """RUNS runs of each kind: 3 kills per run one at a time (6 kill points by default), 4 per
    run two at once (8; with the other tests here, 21 in all); in each, a killed reducer is
    restarted, used again, and killed again."""
    rng = random.Random(SEED + together)
    for i in range(RUNS):
        plan = random_plan(rng, together)
        results, took = run(plan)
        print(
            f"run {i}: {plan}: {took:.1f} s, {kills(plan)} kills; per rank: chunks moved "
            f"{[res['moved'] for res in results]}, results brought (FINAL) {[res['finals'] for res in results]}, "
            f"chunks on a reducer that came back {[res['rejoined_chunks'] for res in results]}"
        )
        check(results, plan, undisturbed)


def test_sharded_reducers_killed_at_random_points_leave_every_step_right_and_the_weights_bitwise_equal(
    undisturbed: str,
):
    """Reducers of 2 shards, as `serve` runs on a host of 2 cores or more (RS_SHARDS=auto): a run
    of each kind, every shard of a killed reducer lost with it, and the same bits as unsharded."""
    for together in (False, True):
        plan = random_plan(random.Random(SEED + 11 + together), together)
        results, took = run(plan, shards=2)
        print(
            f"sharded: {plan}: {took:.1f} s; chunks on a reducer that came back "
            f"{[res['rejoined_chunks'] for res in results]}"
        )
        check(results, plan, undisturbed)


@pytest.mark.parametrize("depth", [None, "1"], ids=["default-depth", "result-slots"])
def test_failover_in_the_default_mode_keeps_every_step_right(depth: Optional[str]):
    """Arrival-order sums: checked to float32 rounding (int32 and broadcasts bitwise), and every
    rank ends with the same weights. At depth 1 the largest tensor's chunks (400 KB) are large
    enough for the reducers' result slots: the ranks read results there, keep them there for
    failover and bring them from there when a reducer is lost."""
    plan = random_plan(random.Random(SEED + 7), together=False)
    results, took = run(plan, exact=False, extra={"RS_PIPELINE_DEPTH": depth} if depth else None)
    print(f"kills {plan}: {took:.1f} s")
    check(results, plan, None)
    assert all((res["results_read"] > 0) == bool(depth) for res in results), results


def test_a_stopped_reducer_is_moved_off_after_the_liveness_timeout(undisturbed: str):
    """SIGSTOP: nothing closes; each rank's connection goes silent and libzmq closes it after
    RS_LIVENESS_TIMEOUT (2 s here), at a slightly different moment on each rank."""
    plan = [(60, 0.01, "kill", (1,))]
    results, took = run(plan, sig=signal.SIGSTOP)
    print(f"stopped reducer 1 at step 60: {took:.1f} s")
    check(results, plan, undisturbed)


def test_a_spare_reducer_takes_the_chunks_of_a_lost_one(undisturbed: str):
    """RS_SPARE_REDUCERS=1: reducers 0 and 1 carry the job, reducer 2 waits. Reducer 0 is killed;
    the spare joins from a collective every rank agrees on and sums from then on."""
    plan = [(50, 0.01, "kill", (0,))]
    results, took = run(plan, extra={"RS_SPARE_REDUCERS": "1"})
    print(f"spare: {took:.1f} s, its chunks per rank {[res['rejoined_chunks'] for res in results]}")
    for res in results:
        assert res["mismatch_count"] == 0 and res["digest"] == undisturbed, res
        assert res["lost"] == [0, 2], res  # the spare counts as lost until it joins
        assert res["joins"] == res["endpoints"] // R, res  # once, by each of its shards (RS_SHARDS)
        assert res["rejoined_chunks"] > 0, res


@pytest.mark.parametrize(
    "shared, n, kept_as",
    [(True, 1000, "slot"), (False, 1 << 14, "message"), (False, 1000, "copy")],
    ids=["kept-in-its-slot", "kept-as-its-message", "copied-when-it-ends"],
)
def test_a_rank_that_received_a_result_before_the_loss_brings_it_to_the_substitute(shared: bool, n: int, kept_as: str):
    """Reducer 0 answers a chunk and dies; the other rank (a hand-driven peer here) says it never
    got the answer and resends its contribution to the chunk's substitute, reducer 1: it gets the
    result rank 0 already has (brought as a FINAL), not a new sum of other inputs, even though
    rank 0's caller has since written over its result: rank 0 kept it in the shared-memory slot it
    came back in, as the message it came in (64 KiB or more), or copied it out of the collective's
    buffer when the collective ended. Then a chunk whose reducer is lost goes to the substitute
    from the start (MOVED)."""
    import numpy as np

    import reduction_server.client as rs
    from helpers.peers import Peer, data
    from reduction_server.wire.protocol import MsgType

    with reducers(2, extra_env={**FAST, **ONE_PROCESS}) as group:
        peers = [Peer(address) for address in group.addresses]
        for p in peers:
            p.handshake(1, 2)
        comm = rs.Communicator(
            group.addresses,
            0,
            2,
            job_token=TOKEN,
            timeout=20,
            connect_timeout=10,
            chunk_bytes=1 << 20,
            shared_memory=shared,
        )
        try:
            mine, theirs = np.full(n, 1.0, np.float32), np.full(n, 2.0, np.float32)
            # seq 0 and seq 2: one chunk each, on reducer 0; seq 1 on reducer 1. Seq 2's chunk
            # goes out in the slot seq 0's result came back in, were that slot free again.
            for seq in range(3):
                handle = comm.all_reduce_async(mine * (seq + 1))
                peers[seq % 2].send(data(1, 2, seq=seq, count=n), (theirs * (seq + 1)).tobytes())
                result = handle.wait(5)
                assert np.array_equal(result, (mine + theirs) * (seq + 1))
                result[:] = -7.0  # the caller's buffer again: what rank 0 brings is its own
                header, _ = peers[seq % 2].recv(5)  # rank 1's answer
                assert header.type is MsgType.RESULT and header.seq == seq
            assert comm._engine.chunks_shared == (6 if shared else 0)
            kept = comm._engine.failover.results.kept[0, 0]
            assert [item.seq for item in kept] == [0, 2]
            for item in kept:
                assert {
                    "slot": item.lease is not None,
                    "copy": isinstance(item.data, bytearray),
                    "message": item.lease is None and isinstance(item.data, memoryview),
                }[kept_as]
            group.signal(0, signal.SIGKILL)
            # Rank 1 "lost" its answer: it resends seq 0 (with other data) to reducer 1, moved.
            peers[1].send(data(1, 2, seq=0, count=n, mtype=MsgType.MOVED), np.zeros(n, np.float32).tobytes())
            header, payload = peers[1].recv(10)
            assert header.type is MsgType.RESULT and np.array_equal(np.frombuffer(payload, np.float32), mine + theirs)
            # seq 3 lives on reducer 1 anyway; seq 4's chunk (reducer 0's) is moved to reducer 1.
            for seq, mtype in ((3, MsgType.DATA), (4, MsgType.MOVED)):
                handle = comm.all_reduce_async(mine * seq)
                peers[1].send(data(1, 2, seq=seq, count=n, mtype=mtype), theirs.tobytes())
                assert np.array_equal(handle.wait(10), mine * seq + theirs)
                header, payload = peers[1].recv(5)
                assert header.type is MsgType.RESULT and header.seq == seq
            # seq 0 and seq 2 brought as FINALs; seq 2's settles a round nobody else asks for
            assert sorted(comm._engine.failover.lost) == [0] and comm._engine.failover.finals == 2
        finally:
            comm.close()
            for p in peers:
                p.close()


@pytest.mark.parametrize("ends", ["completes", "fails"])
def test_a_result_is_kept_as_a_view_in_flight_and_copied_when_its_collective_ends(ends: str):
    """A collective of ten chunks over two reducers, a window of two: while it is in flight the
    results kept are views of its buffer (no copy); when it ends, completed or failed by an error
    on its last chunk, the last two results of each reducer are copied out, before its caller gets
    the buffer back and writes over it; the earlier ones are kept no longer."""
    import numpy as np

    from reduction_server.client.chunking import Chunk
    from reduction_server.client.engine.collective import SENT, Collective
    from reduction_server.client.engine.failover import Failover
    from reduction_server.client.engine.identity import Identity
    from reduction_server.client.engine.ledger import Ledger
    from reduction_server.wire.protocol import DType, ReduceOp

    me = Identity(rank=0, world=2, job=1, generation=0)
    ledger = Ledger(me, ["reducer 0", "reducer 1"])
    failover = Failover(me, 2, window=2, enabled=True)
    ledger.on_result, ledger.on_end = failover.keep, failover.results.settle
    buf = np.arange(40, dtype=np.float32)
    before = buf.copy()
    view = memoryview(buf.view(np.uint8))
    chunks = [Chunk(4 * k, 4, k % 2) for k in range(10)]
    coll = Collective(0, DType.FLOAT32, ReduceOp.SUM, 0, view, view, 40, chunks, buf)
    ledger.start(coll)
    window = ledger.window(0)
    for k, chunk in enumerate(chunks):
        coll.state[k] = SENT
        window[chunk.reducer] += 1
    for k in range(9):
        ledger.chunk_done(coll, k, k % 2, None)
    assert all(isinstance(item.data, memoryview) for ring in failover.results.kept.values() for item in ring)
    ledger.chunk_done(coll, 9, 1, None if ends == "completes" else "the reducer said no")
    assert coll.future.done() and (coll.future.exception() is None) == (ends == "completes")
    buf[:] = -1.0  # the caller writes over its buffer
    expected = {0: [6, 8], 1: [7, 9] if ends == "completes" else [5, 7]}
    for r, chunk_ids in expected.items():
        ring = failover.results.kept[0, r]
        assert [item.chunk for item in ring] == chunk_ids
        for item in ring:
            assert isinstance(item.data, bytearray)
            kept = np.frombuffer(item.data, np.float32, item.count)
            assert np.array_equal(kept, before[item.offset : item.offset + item.count]), (r, item.chunk)


def test_a_pool_with_no_reducer_left_fails_naming_every_reducer(monkeypatch):
    import numpy as np

    import reduction_server.client as rs
    from helpers.jobs import connect, new_job, parallel
    from reduction_server import CollectiveError

    with reducers(2, extra_env=FAST) as group:
        job = new_job()
        comms = [None, None]
        monkeypatch.setenv("RS_LIVENESS_TIMEOUT", "1")
        monkeypatch.setenv("RS_HEARTBEAT_INTERVAL", "0.25")

        def open_rank(rank: int):
            comms[rank] = connect(group, rank, 2, job)

        assert all(kind == "ok" for kind, _ in parallel(lambda: open_rank(0), lambda: open_rank(1)))
        try:
            for proc in group.procs:
                proc.send_signal(signal.SIGKILL)
                proc.wait(5)
            started = time.monotonic()
            outcomes = parallel(*(lambda c=c: c.all_reduce(np.ones(1000, np.float32)) for c in comms), timeout=20)
            took = time.monotonic() - started
            for kind, error in outcomes:
                assert kind == "error" and isinstance(error, CollectiveError), (kind, error)
                text = str(error)
                assert "every reducer was lost" in text, text
                assert all(address in text for address in group.addresses), text
            assert took < 1.0 + 3, took  # within the liveness timeout (and a margin for this machine)
        finally:
            for c in comms:
                if isinstance(c, rs.Communicator):
                    c.close()


@contextlib.contextmanager
def _rank_0_beside_a_hand_driven_rank_1(monkeypatch, env: Optional[Dict[str, str]] = None):
    """Two reducers of one process each (`env` added to theirs); rank 0 a Communicator, rank 1 a
    hand-driven peer at each reducer (helpers/peers.py), both admitted: (group, peers, comm),
    closed at the end."""
    import reduction_server.client as rs
    from helpers.peers import Peer

    monkeypatch.setenv("RS_HEARTBEAT_INTERVAL", "0.25")
    with reducers(2, extra_env={**FAST, **ONE_PROCESS, **(env or {})}) as group:
        peers = [Peer(address) for address in group.addresses]
        for p in peers:
            p.handshake(1, 2)
        comm = rs.Communicator(group.addresses, 0, 2, job_token=TOKEN, timeout=20, connect_timeout=10)
        try:
            yield group, peers, comm
        finally:
            comm.close()
            for p in peers:
                p.close()


def test_a_reducer_that_comes_back_is_used_from_the_boundary_its_join_names(monkeypatch):
    """Rank 0 (a Communicator) lost reducer 1 and readmits it when it is restarted; rank 1 (a
    hand-driven peer) has not reached it yet. Rank 0 goes on REJOIN_LEAD collectives past its
    report, then waits; once rank 1 reports too, both hear one boundary, and from it reducer 1
    takes its own chunks again (as DATA, not moved)."""
    import numpy as np

    from helpers.peers import JOB, Peer, data
    from reduction_server import CollectiveError
    from reduction_server.wire import protocol
    from reduction_server.wire.protocol import REJOIN_LEAD, MsgType

    n = 64
    ones = np.ones(n, np.float32)
    with _rank_0_beside_a_hand_driven_rank_1(monkeypatch) as (group, peers, comm):
        seq = 0

        def step(reducer: int, mtype: MsgType, wait: bool = True):
            """Collective `seq` on rank 0, and rank 1's contribution to it at `reducer`."""
            nonlocal seq
            handle = comm.all_reduce_async(ones)
            peers[reducer].send(data(1, 2, seq=seq, count=n, mtype=mtype), ones.tobytes())
            seq += 1
            if wait:
                assert np.array_equal(handle.wait(10), 2 * ones)
                header, _ = peers[reducer].recv(5)
                assert header.type is MsgType.RESULT
            return handle

        for _ in range(4):
            step(seq % 2, MsgType.DATA)
        group.signal(1, signal.SIGKILL)
        peers[1].close()
        for _ in range(4):  # odd seqs belong to reducer 1: moved to reducer 0
            step(0, MsgType.MOVED if seq % 2 else MsgType.DATA)
        reported = seq
        group.restart(1)
        deadline = time.monotonic() + 10
        while 1 not in comm._engine.failover.rejoining:  # read without a lock: a test's glimpse
            assert time.monotonic() < deadline, "rank 0 did not readmit the restarted reducer"
            time.sleep(0.05)
        while seq < reported + REJOIN_LEAD:
            step(0, MsgType.MOVED if seq % 2 else MsgType.DATA)
        # Beyond its report plus REJOIN_LEAD, a collective waits for the JOIN, but not past its own timeout.
        late = comm.all_reduce_async(ones, timeout=1.0)
        with pytest.raises(CollectiveError, match="before it started"):
            late.wait(10)
        seq += 1  # its seq is spent, and no rank sent a chunk of it: no reducer has a round of it
        held = comm.all_reduce_async(ones)
        time.sleep(0.5)
        assert not held.done() and comm._engine.ledger.next_seq[0] == seq - 1  # not started: no chunk sent
        peers[1] = Peer(group.addresses[1])
        peers[1].handshake(1, 2)
        payload = protocol.seq_pairs_payload([(0, seq + 1)])
        peers[1].send(protocol.text_header(MsgType.PROGRESS, payload, rank=1, world=2, job=JOB), payload)
        header, joined = peers[1].recv(5)
        boundary = seq + 1 + REJOIN_LEAD  # the furthest report (rank 1's) plus the lead
        assert header.type is MsgType.JOIN and protocol.seq_pairs(joined) == {0: boundary}
        peers[0].send(data(1, 2, seq=seq, count=n, mtype=MsgType.MOVED if seq % 2 else MsgType.DATA), ones.tobytes())
        assert np.array_equal(held.wait(10), 2 * ones)
        peers[0].recv(5)
        seq += 1
        while seq < boundary:
            step(0, MsgType.MOVED if seq % 2 else MsgType.DATA)
        for _ in range(4):  # from the boundary on, reducer 1 has its own chunks again
            step(seq % 2, MsgType.DATA)
        failover = comm._engine.failover
        assert failover.joins == 1 and failover.rejoined_chunks == 2


def test_a_reducer_that_comes_back_summing_in_another_order_is_refused(monkeypatch):
    """In a deterministic job, what admits rank 0 at lost reducer 1's address sums in arrival
    order (started without --deterministic; or, on a loaded host, another job's reducer that took
    the freed port and holds the same token). Its sums of 3 or more ranks would differ from the
    rank-order ones in their last bits, on every rank alike: rank 0 refuses it, naming
    RS_DETERMINISTIC, and reducer 1's chunks stay with reducer 0. Once that process is gone and
    reducer 1 is restarted as it should be, rank 0 tries the address again and is readmitted (else
    it alone would never report to it, and no rank could use it again)."""
    import numpy as np

    from helpers.peers import data
    from reduction_server.wire.protocol import MsgType

    n = 64
    ones = np.ones(n, np.float32)
    with _rank_0_beside_a_hand_driven_rank_1(monkeypatch, {"RS_DETERMINISTIC": "1"}) as (group, peers, comm):

        def step(seq: int, reducer: int, mtype: MsgType) -> None:
            handle = comm.all_reduce_async(ones)
            peers[reducer].send(data(1, 2, seq=seq, count=n, mtype=mtype), ones.tobytes())
            assert np.array_equal(handle.wait(10), 2 * ones)
            assert peers[reducer].recv(5)[0].type is MsgType.RESULT

        step(0, 0, MsgType.DATA)
        step(1, 1, MsgType.DATA)
        group.signal(1, signal.SIGKILL)
        peers[1].close()
        step(2, 0, MsgType.DATA)
        step(3, 0, MsgType.MOVED)
        group.restart(1, env={**group.env, "RS_DETERMINISTIC": "0"})
        engine = comm._engine
        deadline = time.monotonic() + 10
        while "RS_DETERMINISTIC" not in engine.connections.down.get(1, ("", True))[0]:  # a test's glimpse
            assert time.monotonic() < deadline, f"rank 0 did not refuse it: {engine.connections.down.get(1)}"
            assert 1 not in engine.failover.rejoining, "rank 0 readmitted a reducer that sums in arrival order"
            time.sleep(0.05)
        reason = engine.connections.down[1][0]
        assert reason.startswith("reducer 1 (") and "in arrival order" in reason and "in rank order" in reason, reason
        assert 1 not in engine.failover.rejoining and 1 in engine.failover.lost
        for seq in range(4, 8):  # reducer 1's own chunks (odd seqs) still moved to reducer 0
            step(seq, 0, MsgType.MOVED if seq % 2 else MsgType.DATA)
        group.signal(1, signal.SIGKILL)
        group.restart(1)
        while 1 not in engine.failover.rejoining:  # readmitted: it reported where it is (PROGRESS)
            assert time.monotonic() < deadline + 10, f"rank 0 did not try it again: {engine.connections.down.get(1)}"
            time.sleep(0.05)
        assert 1 not in engine.connections.down


def test_a_reducer_lost_while_another_awaits_its_join_is_a_loss_like_any_other(monkeypatch):
    """Reducer 1 came back and awaits its JOIN (rank 1, hand-driven, has not reported) when
    reducer 0 is lost too. Rank 0 keeps both losses and waits for the agreement, as a rank that
    had read the JOIN first does; it used to forget every loss instead (no reducer left in use),
    and so sent its chunks as planned while its peers kept to the boundary. From the boundary on
    reducer 1 takes every chunk, reducer 0's moved."""
    import numpy as np

    from helpers.jobs import until
    from helpers.peers import JOB, Peer, data
    from reduction_server import CollectiveError
    from reduction_server.wire import protocol
    from reduction_server.wire.protocol import REJOIN_LEAD, MsgType

    n = 64
    ones = np.ones(n, np.float32)
    with _rank_0_beside_a_hand_driven_rank_1(monkeypatch) as (group, peers, comm):
        failover = comm._engine.failover  # read without a lock: a test's glimpse
        for seq in range(2):  # each collective is one chunk, on reducer seq % 2
            handle = comm.all_reduce_async(ones)
            peers[seq % 2].send(data(1, 2, seq=seq, count=n), ones.tobytes())
            assert np.array_equal(handle.wait(10), 2 * ones)
            peers[seq % 2].recv(5)
        group.signal(1, signal.SIGKILL)
        peers[1].close()
        until(lambda: 1 in failover.lost, "rank 0 to lose reducer 1")
        group.restart(1)
        until(lambda: 1 in failover.rejoining, "rank 0 to readmit reducer 1 and report to it")
        group.signal(0, signal.SIGKILL)
        peers[0].close()
        until(lambda: 0 in comm._engine.connections.down, "rank 0 to lose reducer 0")
        assert sorted(failover.lost) == [0, 1] and 1 in failover.rejoining, (failover.lost, failover.rejoining)
        peers[1] = Peer(group.addresses[1])
        peers[1].handshake(1, 2)
        payload = protocol.seq_pairs_payload([(0, 2)])
        peers[1].send(protocol.text_header(MsgType.PROGRESS, payload, rank=1, world=2, job=JOB), payload)
        header, joined = peers[1].recv(5)
        boundary = 2 + REJOIN_LEAD  # both reported 2
        assert header.type is MsgType.JOIN and protocol.seq_pairs(joined) == {0: boundary}
        until(lambda: failover.since.get(1), "rank 0 to hear the JOIN")
        for _ in range(2, boundary):  # no reducer takes these: they fail at once
            with pytest.raises(CollectiveError, match="no reducer is left"):
                comm.all_reduce_async(ones, timeout=5).wait(10)
        for seq in range(boundary, boundary + 2):
            handle = comm.all_reduce_async(ones)
            peers[1].send(
                data(1, 2, seq=seq, count=n, mtype=MsgType.MOVED if seq % 2 == 0 else MsgType.DATA), ones.tobytes()
            )
            assert np.array_equal(handle.wait(10), 2 * ones)
            peers[1].recv(5)


def _spare_job(group, kill: int, steps: int, limit: float) -> list:
    """W=2 ranks with the last reducer a spare: each all-reduces a few times, then reducer `kill`
    is SIGKILLed and each rank, once it has seen the loss, all-reduces `steps` times (within
    `limit` seconds); per rank, each step's result, or the error's text."""
    import numpy as np

    from helpers.jobs import run_job, until
    from reduction_server import CollectiveError

    dead = threading.Barrier(2, timeout=30)

    def body(comm, rank):
        for _ in range(3):
            assert np.array_equal(comm.all_reduce(np.ones(1000, np.float32)), np.full(1000, 2.0, np.float32))
        dead.wait()
        if rank == 0:
            group.signal(kill, signal.SIGKILL)
        until(lambda: kill in comm._engine.connections.down, f"rank {rank} to see reducer {kill} lost")
        dead.wait()
        started, outcomes = time.monotonic(), []
        for step in range(steps):
            if time.monotonic() - started > limit:
                break
            try:
                outcomes.append(comm.all_reduce(np.full(1000, step + rank, np.float32))[0])
            except CollectiveError as exc:
                outcomes.append(str(exc))
        return outcomes

    return run_job(2, body, group=group, limit=limit + 60, spares=1, failover=True, timeout=8)


def test_a_spare_that_dies_leaves_the_reducers_in_use_serving():
    """The spare itself is lost (and stays down): the two reducers in use carry on, and nothing
    waits for a JOIN from it; it was once asked to join again at each loss, and every collective
    from REJOIN_LEAD on waited RS_TIMEOUT for it and failed."""
    from reduction_server.wire.protocol import REJOIN_LEAD

    steps = 2 * REJOIN_LEAD + 10
    with reducers(3, extra_env=FAST) as group:
        outcomes = _spare_job(group, kill=2, steps=steps, limit=40)
    for rank in range(2):
        assert outcomes[rank] == [2.0 * step + 1 for step in range(steps)], outcomes[rank][:40]


def test_the_spare_of_a_single_reducer_takes_over_once_every_rank_agrees():
    """One reducer in use and a spare: the reducer is lost. What was in flight, and what starts
    before the boundary the spare's JOIN names, has nowhere to go and fails at once, naming the
    loss; from the boundary on the spare sums. (It was never asked to join: every collective
    waited for the lost reducer and failed.)"""
    from reduction_server.wire.protocol import REJOIN_LEAD

    steps = 3 * REJOIN_LEAD
    with reducers(2, extra_env=FAST) as group:
        outcomes = _spare_job(group, kill=0, steps=steps, limit=40)
    for rank in range(2):
        failed = [o for o in outcomes[rank] if isinstance(o, str)]
        assert failed and all("reducer 0" in text and "was lost" in text for text in failed), failed[:3]
        first = len(failed)
        assert outcomes[rank][:first] == failed, outcomes[rank]  # the failures come first, then no more
        assert first <= 2 * REJOIN_LEAD + 2, first
        assert outcomes[rank][first:] == [2.0 * step + 1 for step in range(first, len(outcomes[rank]))]
        assert len(outcomes[rank]) == steps
    assert len(outcomes[0]) - outcomes[0].count(None) == len(outcomes[1])


@pytest.mark.parametrize(
    "spares, failover, words", [(2, True, "leave at least one of the 2 reducers"), (1, False, "needs RS_FAILOVER=1")]
)
def test_spares_are_checked_before_anything_connects(spares: int, failover: bool, words: str):
    import reduction_server.client as rs
    from reduction_server.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        rs.Communicator(["127.0.0.1:1", "127.0.0.1:2"], 0, 1, spares=spares, failover=failover, job_token=TOKEN)
