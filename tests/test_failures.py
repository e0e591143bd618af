"""Failures with real processes (issue 5): a worker killed with SIGKILL in the middle of a
collective, a worker that closes its communicator mid-job, a reducer killed mid-collective and
restarted at the same address, a straggler slower than RS_TIMEOUT.

Reducers are real processes (tests/helpers/cluster.py); workers are real processes running
tests/scripts/failure_worker.py. Timeouts are small (RS_LIVENESS_TIMEOUT, RS_TIMEOUT) so that
every test is bounded in time; the latencies measured here are recorded in docs/reliability.md.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from reduction_server.config import settings

from helpers.cluster import SCRIPTS, TOKEN, Reducers, child_env, reducers, run_workers
from helpers.timing import DETECT, FAST, LIVENESS, QUIET, SILENT, SLACK
from helpers.probes import rss

pytestmark = pytest.mark.timeout(180)


def names_reducer(text: str, i: int, address: str) -> bool:
    """Whether `text` names reducer i at `address`, or one of its shards (shard s at port + s)."""
    host, port = address.rsplit(":", 1)
    return f"reducer {i} ({address})" in text or any(
        f"reducer {i} shard {s} ({host}:{int(port) + s})" in text for s in range(settings.MAX_SHARDS))


class Workers:
    """W worker processes running failure_worker.py; their stdout lines are read as JSON."""

    def __init__(self, world: int, group: Reducers, spec: dict, extra_env: Optional[Dict[str, str]] = None) -> None:
        self.procs: List[subprocess.Popen] = []
        self.errs = []
        self.lines: Dict[int, List[dict]] = {r: [] for r in range(world)}
        self.changed = threading.Condition()
        self.readers = []
        for rank in range(world):
            env = child_env({"RS_REDUCERS": group.spec, "RS_RANK": str(rank), "RS_WORLD_SIZE": str(world),
                             "RS_JOB_TOKEN": TOKEN, "RS_CONNECT_TIMEOUT": "30", **FAST, **(extra_env or {})})
            err = tempfile.TemporaryFile(mode="w+")
            self.errs.append(err)
            self.procs.append(subprocess.Popen(
                [sys.executable, str(SCRIPTS / "failure_worker.py"), json.dumps(spec)], env=env,
                stdout=subprocess.PIPE, stderr=err, text=True))
            reader = threading.Thread(target=self._read, args=(rank,), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _read(self, rank: int) -> None:
        for line in self.procs[rank].stdout:
            if line.strip():
                with self.changed:
                    self.lines[rank].append(json.loads(line))
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, key: str, ranks, timeout: float = 60) -> None:
        """Until every rank in `ranks` printed a line with `key`."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                pending = [r for r in ranks if not any(key in line for line in self.lines[r])]
                if not pending:
                    return
                for r in pending:
                    assert self.procs[r].poll() is None or self.readers[r].is_alive(), \
                        f"rank {r} exited ({self.procs[r].poll()}) before saying {key!r}: {self.stderr(r)}"
                assert time.monotonic() < deadline, f"ranks {pending} did not say {key!r}"
                self.changed.wait(0.2)

    def wait_until_still(self, ranks, quiet: float, timeout: float) -> None:
        """Until no rank in `ranks` has printed a line for `quiet` seconds (they all wait)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                seen = [len(self.lines[r]) for r in ranks]
                still_since = time.monotonic()
                while time.monotonic() - still_since < quiet:
                    self.changed.wait(quiet)
                    if [len(self.lines[r]) for r in ranks] != seen:
                        break
                else:
                    return
                assert time.monotonic() < deadline, f"ranks {list(ranks)} kept making progress"

    def stderr(self, rank: int) -> str:
        self.errs[rank].seek(0)
        return self.errs[rank].read()[-3000:]

    def finish(self, ranks, timeout: float = 60) -> Dict[int, dict]:
        """Each rank's last JSON line; it must exit 0."""
        results = {}
        deadline = time.monotonic() + timeout
        for r in ranks:
            code = self.procs[r].wait(timeout=max(1.0, deadline - time.monotonic()))
            self.readers[r].join(5)
            assert code == 0, f"rank {r} exited {code}:\n{self.stderr(r)}\n{self.lines[r]}"
            results[r] = self.lines[r][-1]
        return results

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for err in self.errs:
            err.close()


def last_field(log: str, event: str, field: str) -> Optional[int]:
    values = re.findall(rf"{event} .*?\b{field}=(\d+)", log)
    return int(values[-1]) if values else None


FRESH_JOB = json.dumps({"sequential": [
    {"dtype": "float32", "op": "sum", "count": 300_000, "seed": 1},
    {"dtype": "int64", "op": "max", "count": 70_001, "seed": 2},
    {"dtype": "bfloat16", "op": "avg", "count": 5000, "seed": 3},
], "broadcast": [1000]})


# -- 1. a worker killed with SIGKILL in the middle of a collective --------------------------------
def test_killed_worker_fails_the_survivors_naming_it_and_the_reducers_serve_a_fresh_job():
    env = {**FAST, "RS_TIMEOUT": "30"}  # far longer than detection: the loss, not a timeout, ends it
    with reducers(2, extra_env=env) as group:
        workers = Workers(3, group, {"mode": "loop", "count": 4 << 20, "ready_after": 3}, env)
        try:
            workers.wait_for("ready", range(3))
            before = [rss(p.pid) for p in group.procs]
            time.sleep(0.3)  # a 16 MiB all-reduce is always in progress: this is mid-collective
            killed_at = time.time()
            workers.procs[2].kill()
            results = workers.finish([0, 1])
        finally:
            workers.kill_all()
        for r in (0, 1):
            res = results[r]
            latency = res["error_at"] - killed_at
            print(f"rank {r}: error {latency:.3f} s after the kill: {res['error']}")
            assert "rank 2" in res["error"] and "was lost" in res["error"], res["error"]
            assert latency < DETECT, latency
            # the next collective fails too, at once, naming the lost rank
            assert "rank 2" in res["next"] and "was lost" in res["next"], res["next"]
            assert res["next_took"] < 2.0, res["next_took"]
            print(f"rank {r}: the next collective failed after {res['next_took']:.3f} s: {res['next']}")
        assert group.alive()
        # A fresh job (the restarted job's new generation) on the same reducers works.
        for res in run_workers(3, group, "allreduce_worker.py", [FRESH_JOB], extra_env={"RS_GENERATION": "1", **env},
                               timeout=120):
            assert not res["failures"], res
        after = [rss(p.pid) for p in group.procs]
        assert group.alive()
        logs = group.stop()
    # The failed collective's rounds were freed (none is open at the end) and the reducers did not
    # grow (they recycle pooled buffers). A result frame that libzmq had queued for the killed
    # worker is sometimes never released by libzmq; at most its window of chunks stays counted.
    chunk = (4 << 20) * 4 // 16  # the 16 MiB all-reduce is cut into 16 chunks of 1 MiB
    for index, log in enumerate(logs):
        assert "rank_lost" in log and "rank=2" in log, log[-2000:]
        assert last_field(log, "stopped", "open_rounds") == 0, log[-3000:]
        held = last_field(log, "stopped", "accumulator_bytes_in_use")
        print(f"reducer {index}: {held} accumulator bytes still held by libzmq at the end; RSS "
              f"{before[index] >> 20} MiB before the kill, {after[index] >> 20} MiB after the fresh job")
        assert held is not None and held <= 4 * chunk, log[-3000:]
        assert after[index] < before[index] + (64 << 20), (index, before, after)


# -- 1b. a clean disconnect: close() of one rank mid-job --------------------------------------------
def test_a_rank_that_closes_mid_job_fails_the_others_naming_it():
    env = {**FAST, "RS_TIMEOUT": "30"}
    with reducers(2, extra_env=env) as group:
        workers = Workers(3, group, {"mode": "close", "closer": 1, "before": 5}, env)
        try:
            results = workers.finish(range(3))
        finally:
            workers.kill_all()
        closed_at = results[1]["closed_at"]
        for r in (0, 2):
            res = results[r]
            assert res["error"] and "rank 1" in res["error"] and "BYE" in res["error"], res
            assert res["error_at"] - closed_at < DETECT, res["error_at"] - closed_at
            print(f"rank {r}: error {res['error_at'] - closed_at:.3f} s after the close: {res['error']}")
        assert group.alive()


# -- 2. a reducer killed mid-collective, then restarted at the same address -------------------------
def test_killed_reducer_fails_every_worker_naming_it_and_a_restarted_one_is_used_again(tmp_path: Path):
    """Killed in the middle of a collective: every rank's collective fails at once, naming it.

    To land the kill inside a collective on every rank (not between two, where a collective waits
    for the reducer to come back: the next test), the reducer is first stopped (SIGSTOP) until no
    rank makes progress, then killed. With RS_FAILOVER=0: with failover (the default) the
    collectives move to the other reducer and complete instead (test_failover.py)."""
    env = {**FAST, "RS_TIMEOUT": "30", "RS_FAILOVER": "0"}
    go = tmp_path / "go"
    with reducers(2, extra_env=env) as group:
        workers = Workers(3, group, {"mode": "restart", "count": 4 << 20, "go": str(go), "after": 5,
                                     "progress": True}, env)
        try:
            workers.wait_for("ready", range(3))
            group.signal(1, signal.SIGSTOP)
            workers.wait_until_still(range(3), quiet=1.0, timeout=QUIET / 2)
            killed_at = time.time()
            group.signal(1, signal.SIGKILL)
            workers.wait_for("waiting", range(3), timeout=30)
            errors = {r: workers.lines[r][-1]["error"] for r in range(3)}
            group.restart(1)
            go.touch()
            results = workers.finish(range(3))
        finally:
            workers.kill_all()
        for r in range(3):
            res = results[r]
            latency = res["error_at"] - killed_at
            print(f"rank {r}: error {latency:.3f} s after the kill: {res['error']}")
            assert res["error"] == errors[r]
            assert names_reducer(res["error"], 1, group.addresses[1]), res["error"]
            assert "was lost" in res["error"] and "did not come back" not in res["error"], res["error"]
            assert latency < DETECT, latency
            assert res["after"] == 5  # the same processes used the restarted reducer
        assert group.alive()


@pytest.mark.parametrize("comes_back", [True, False], ids=["restarted", "gone"])
def test_a_collective_started_while_a_reducer_is_away_waits_for_it_at_most_the_liveness_timeout(
        tmp_path: Path, comes_back: bool):
    """Killed between collectives (a training step's compute phase): the next collective waits
    for the reducer; restarted in time, it is used and nothing fails; otherwise the collective
    fails after RS_LIVENESS_TIMEOUT, naming it (RS_FAILOVER=0, as above)."""
    liveness = QUIET if comes_back else LIVENESS
    env = {**FAST, "RS_LIVENESS_TIMEOUT": str(liveness), "RS_TIMEOUT": "30", "RS_FAILOVER": "0"}
    go = tmp_path / "go"
    with reducers(2, extra_env=env) as group:
        workers = Workers(3, group, {"mode": "between", "count": 1 << 20, "go": str(go)}, env)
        try:
            workers.wait_for("ready", range(3))
            group.signal(1, signal.SIGKILL)
            time.sleep(0.5)  # every worker has seen its connection close before it starts the collective
            go.touch()
            if comes_back:
                time.sleep(1.0)  # the collectives are waiting by now
                group.restart(1)
            results = workers.finish(range(3))
            logs = [workers.stderr(r) for r in range(3)]
        finally:
            workers.kill_all()
        for r in range(3):
            res = results[r]
            print(f"rank {r}: took {res['took']:.3f} s: {res['error']}")
            # The worker logs it as structured events naming the rank and the reducer.
            named = rf"rank={r} reducer=1 address={re.escape(group.addresses[1])}"
            assert re.search(rf"^\S+ \S+ WARNING reduction_server\.client reducer_lost {named} reason=.*"
                             r"reconnecting=True$", logs[r], re.M), logs[r]
            assert bool(re.search(rf"WARNING reduction_server\.client reducer_readmitted {named}$", logs[r], re.M)) \
                == comes_back, logs[r]
            if comes_back:
                assert res["error"] is None
                assert res["took"] >= 0.9  # it waited for the restart
            else:
                assert names_reducer(res["error"], 1, group.addresses[1]), res["error"]
                assert f"did not come back within {liveness:g} s" in res["error"], res["error"]
                assert liveness - 0.1 <= res["took"] < liveness + SLACK, res["took"]
        if comes_back:
            assert group.alive()


def test_a_reducer_that_is_silent_is_declared_lost_after_the_liveness_timeout():
    """SIGSTOP: the connection stays open, only the heartbeats stop."""
    env = {**SILENT, "RS_TIMEOUT": "30"}
    with reducers(1, extra_env=env) as group:
        workers = Workers(2, group, {"mode": "loop", "count": 1 << 18, "ready_after": 3}, env)
        try:
            workers.wait_for("ready", range(2))
            stopped_at = time.time()
            group.signal(0, signal.SIGSTOP)
            results = workers.finish([0, 1])
        finally:
            group.signal(0, signal.SIGCONT)
            workers.kill_all()
        for r in range(2):
            res = results[r]
            latency = res["error_at"] - stopped_at
            print(f"rank {r}: error {latency:.3f} s after SIGSTOP: {res['error']}")
            assert "reducer 0" in res["error"] and "RS_LIVENESS_TIMEOUT" in res["error"], res["error"]
            assert LIVENESS - 0.5 < latency < LIVENESS + SLACK, latency
            assert "reducer 0" in res["next"], res["next"]


# -- 3. a straggler slower than RS_TIMEOUT -------------------------------------------------------
def test_a_straggler_fails_the_collective_with_the_same_message_on_every_rank():
    timeout = 2.0
    env = {**FAST, "RS_TIMEOUT": str(timeout)}
    with reducers(2, extra_env=env) as group:
        workers = Workers(3, group, {"mode": "straggler", "slow": 2, "delay": timeout + 2.5, "count": 100_000}, env)
        try:
            results = workers.finish(range(3))
        finally:
            workers.kill_all()
        texts = set()
        for r in range(3):
            res = results[r]
            error = res["error"]
            assert error, res
            print(f"rank {r}: took {res['took']:.2f} s: {error}")
            assert error.startswith(f"rank {r}: ")
            texts.add(error[len(f"rank {r}: "):])
            assert "timed out after 2 s" in error and "ranks [0, 1] contributed, ranks [2] did not" in error, error
            assert res["next"] == [3.0] * 4  # the next collective works
        assert len(texts) == 1, texts  # the same message on every rank (after the rank prefix)
        for r in (0, 1):
            assert timeout - 0.5 < results[r]["took"] < timeout + SLACK, results[r]["took"]
        assert results[2]["took"] < 1.0  # the straggler hears it as soon as it contributes
        assert group.alive()


def test_a_silent_worker_is_declared_lost_after_the_liveness_timeout():
    """SIGSTOP: its connection stays open, only its heartbeats stop."""
    env = {**SILENT, "RS_TIMEOUT": "30"}
    with reducers(2, extra_env=env) as group:
        workers = Workers(3, group, {"mode": "loop", "count": 1 << 18, "ready_after": 3}, env)
        try:
            workers.wait_for("ready", range(3))
            stopped_at = time.time()
            workers.procs[2].send_signal(signal.SIGSTOP)
            results = workers.finish([0, 1])
        finally:
            workers.kill_all()
        for r in (0, 1):
            res = results[r]
            latency = res["error_at"] - stopped_at
            print(f"rank {r}: error {latency:.3f} s after SIGSTOP: {res['error']}")
            assert "rank 2" in res["error"] and "RS_LIVENESS_TIMEOUT" in res["error"], res["error"]
            assert LIVENESS - 0.5 < latency < LIVENESS + SLACK, latency
            assert "rank 2" in res["next"], res["next"]
        assert group.alive()
