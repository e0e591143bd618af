"""A reducer told to stop (SIGTERM) drains (reducer/drain.py, docs/reliability.md "Draining"),
with real reducer processes and real workers: its workers move its chunks from the boundary it
names, it answers what it holds, says DRAINED and exits 0 by itself; nothing is resent and no
reducer is lost. /readyz says it drains meanwhile, and it admits no new worker. With
RS_FAILOVER=0 the collectives past the boundary fail, saying why. The SIGKILL cases are
test_failover.py's and test_failures.py's."""

from __future__ import annotations

import re
import signal
import threading

import numpy as np
import pytest

import reduction_server.client as rs
from helpers.cluster import TOKEN, reducers
from helpers.jobs import until
from helpers.metrics import probe, scrape, value
from helpers.ports import free_port_range
from helpers.timing import FAST
from helpers.workers import Workers
from reduction_server import CollectiveError

pytestmark = pytest.mark.timeout(90)

#: a drain's bound in these tests: it ends long before (its rounds are answered in milliseconds)
DRAIN_TIMEOUT = "20"


def _log(group, i: int) -> str:
    """What the group's i-th reducer has logged so far (its stderr is a file, opened anew here:
    its own offset stays where it writes)."""
    with open(f"/proc/self/fd/{group.logs[i].fileno()}") as log:
        return log.read()


def _drain_mid_job(group, workers: Workers, shards: int) -> None:
    """SIGTERM to reducer 1 mid-job while rank 1 is frozen: rank 0 waits in a collective whose
    rounds reducer 1 holds, so no rank has gone past what it has seen; rank 1 goes on once every
    shard of it has started draining."""
    workers.wait_for("done", [0, 1])
    workers.procs[1].send_signal(signal.SIGSTOP)
    try:
        workers.wait_until_still([0], quiet=0.5, timeout=20)
        group.procs[1].send_signal(signal.SIGTERM)
        started = re.compile(r"\bdraining reducer=1\b")
        until(lambda: len(started.findall(_log(group, 1))) == shards, "reducer 1 to start draining")
    finally:
        workers.procs[1].send_signal(signal.SIGCONT)


def test_a_reducer_told_to_stop_drains_and_every_collective_completes_without_a_resend():
    """W=2 all-reduce in a loop over R=2 reducers; reducer 1 gets SIGTERM mid-job
    (_drain_mid_job). Every collective completes, equal to NumPy's, reducer 1 exits
    0 by itself after DRAINED, and on every rank: one drain, no loss, no FINAL, no chunk sent
    past the boundary, while chunks of reducer 1 went to reducer 0 (MOVED) from the boundary on."""
    env = {**FAST, "RS_DRAIN_TIMEOUT": DRAIN_TIMEOUT}
    with reducers(2, extra_env=env) as group:
        with Workers(2, group, {"mode": "drain", "count": 1 << 18, "collectives": 30}) as workers:
            _drain_mid_job(group, workers, shards=1)
            results = workers.finish([0, 1])
            assert group.procs[1].wait(30) == 0, _log(group, 1)
        log = _log(group, 1)
        assert re.search(r"\bdrained reducer=1 open_rounds=0\b", log), log
        assert re.search(r"\bstopped reducer=1 .*\bdrain=drained\b", log), log
        assert group.procs[0].poll() is None
    for rank, res in results.items():
        assert (res["drains"], res["losses"], res["finals"], res["drain_moved"]) == (1, 0, 0, 0), (rank, res)
        assert res["lost"] == [1] and res["moved"] > 0, (rank, res)


def test_a_drain_says_so_on_readyz_admits_no_new_worker_and_ends_at_its_timeout():
    """One reducer with a metrics port holds a round that cannot complete (rank 0 of 2
    contributed; rank 1 never comes). On SIGTERM /readyz is 503 `draining` (/healthz still
    200), a new worker is refused naming the drain, and at RS_DRAIN_TIMEOUT the reducer exits 0
    by itself, saying its drain timed out with the round still open."""
    metrics = free_port_range(1)
    env = {**FAST, "RS_DRAIN_TIMEOUT": "2", "RS_METRICS_PORT": str(metrics)}
    with reducers(1, extra_env=env) as group:
        assert probe(metrics, "/readyz") == (200, "ok\n")
        comm = rs.Communicator(group.addresses, 0, 2, job_token=TOKEN, connect_timeout=10)
        outcome = {}

        def rank_zero() -> None:
            try:
                comm.all_reduce(np.ones(1 << 16, np.float32))
                outcome["error"] = None
            except CollectiveError as exc:
                outcome["error"] = str(exc)

        waiter = threading.Thread(target=rank_zero, daemon=True)
        waiter.start()
        try:
            held = "reduction_server_rounds_in_flight"
            until(lambda: value(scrape(metrics), held) > 0, "rank 0's rounds on the reducer")
            group.procs[0].send_signal(signal.SIGTERM)
            until(lambda: probe(metrics, "/readyz") == (503, "not ready: draining\n"), "readyz to say draining")
            assert probe(metrics, "/healthz")[0] == 200
            with pytest.raises(CollectiveError, match=r"it drains \(it was told to stop\) and admits no worker"):
                rs.Communicator(group.addresses, 1, 2, job_token=TOKEN, connect_timeout=5)
            assert group.procs[0].wait(30) == 0
            waiter.join(30)
        finally:
            comm.close()
        log = _log(group, 0)
        assert re.search(r"\bdrain_timed_out reducer=0 open_rounds=[1-9]", log), log
        assert re.search(r"\bstopped reducer=0 .*\bdrain=drain_timed_out\b", log), log
    assert outcome["error"] and "reducer 0" in outcome["error"], outcome


def test_with_failover_off_a_drain_fails_the_collectives_past_its_boundary_saying_why():
    """RS_FAILOVER=0: the workers cannot move a draining reducer's chunks. The collectives
    before its boundary complete; the first one past it fails on every rank naming the drain and
    RS_FAILOVER=0, and the reducer exits 0 by itself once it has answered what it holds."""
    env = {**FAST, "RS_DRAIN_TIMEOUT": DRAIN_TIMEOUT}
    with reducers(2, extra_env=env) as group:
        spec = {"mode": "loop", "count": 1 << 18, "ready_after": 3}
        with Workers(2, group, spec, extra_env={"RS_FAILOVER": "0"}) as workers:
            workers.wait_for("ready", [0, 1])
            group.procs[1].send_signal(signal.SIGTERM)
            results = workers.finish([0, 1])
            assert group.procs[1].wait(30) == 0, _log(group, 1)
        assert re.search(r"\bstopped reducer=1 .*\bdrain=drained\b", _log(group, 1))
    for rank, res in results.items():
        assert "reducer 1" in res["error"] and "drain" in res["error"], (rank, res)
        assert "RS_FAILOVER=0" in res["error"], (rank, res)
        assert res["iterations"] >= 3, (rank, res)


def test_shards_of_a_reducer_told_to_stop_drain_each():
    """`serve --shards 2`: SIGTERM to the supervisor reaches both shards, which drain (one
    reducer of two, its two endpoints), every collective completes on the other reducer, and
    nothing is resent."""
    env = {**FAST, "RS_DRAIN_TIMEOUT": DRAIN_TIMEOUT, "RS_SHARDS": "2"}
    with reducers(2, extra_env=env) as group:
        with Workers(2, group, {"mode": "drain", "count": 1 << 18, "collectives": 30}) as workers:
            _drain_mid_job(group, workers, shards=2)
            results = workers.finish([0, 1])
            assert group.procs[1].wait(30) == 0
        log = _log(group, 1)
        assert len(re.findall(r"\bstopped reducer=1 shard=\d .*\bdrain=drained\b", log)) == 2, log
    for rank, res in results.items():
        assert (res["drains"], res["losses"], res["finals"], res["drain_moved"]) == (2, 0, 0, 0), (rank, res)
