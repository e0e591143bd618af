"""`reduction-server run`, end to end: real launcher, reducer and worker processes.

Every launcher runs as `python -m reduction_server run ...` under a subprocess timeout, so a
broken launcher fails a test instead of hanging it. The worker command is
tests/scripts/launcher_worker.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List

import psutil
import pytest

from helpers.ports import free_port_range
from helpers.source_tree import ROOT
from reduction_server.config.settings import ONE_HOST_PIPELINE_DEPTH
from reduction_server.reducer import shards as shard_count

WORKER = [sys.executable, str(ROOT / "tests" / "scripts" / "launcher_worker.py")]
TIMEOUT_S = 60  # for any one launcher run; a hang fails the test
PREFIXED = re.compile(r"^\[(rank|reducer) \d+\] ")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and PDEATHSIG: Linux")


def launcher_argv(*args: str) -> List[str]:
    return [sys.executable, "-m", "reduction_server", "run", *args]


def launcher_env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RS_JOB_TOKEN", "CLUSTER_SPEC", "TF_CONFIG")}
    env.update(extra)
    return env


def run_launcher(*args: str, timeout: float = TIMEOUT_S, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        launcher_argv(*args), env=launcher_env(**env), capture_output=True, text=True, timeout=timeout
    )


def lines_of(stdout: str, prefix: str) -> List[str]:
    """The payloads of the output lines that start with `prefix`, e.g. "[rank 0] ENV "."""
    return [line[len(prefix) :] for line in stdout.splitlines() if line.startswith(prefix)]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a zombie has already died
    except psutil.NoSuchProcess:
        return False


def survivors(pids: List[int], within: float = 5.0) -> List[int]:
    """The pids still alive after `within` seconds (killing takes a moment to land)."""
    deadline = time.monotonic() + within
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


class Records:
    """The processes a `hold` job recorded in a directory; whatever survives a test is killed."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def load(self) -> List[dict]:
        return [json.loads(path.read_text()) for path in sorted(self.directory.glob("rank*.json"))]

    def wait_for(self, count: int, launcher: subprocess.Popen) -> List[dict]:
        deadline = time.monotonic() + 30
        while len(records := self.load()) < count:
            assert launcher.poll() is None, f"launcher exited early: {launcher.communicate()}"
            assert time.monotonic() < deadline, "the workers never recorded themselves"
            time.sleep(0.05)
        return records

    def workers(self) -> List[int]:
        return [record["pid"] for record in self.load()]

    def reducers(self) -> List[int]:
        return sorted({pid for record in self.load() for pid in record["reducers"]})

    def everyone(self) -> List[int]:
        pids = self.workers() + self.reducers()
        return pids + [pid for record in self.load() for pid in record["grandchildren"]]

    def kill_survivors(self) -> None:
        for pid in self.everyone():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def records(tmp_path: Path) -> Iterator[Records]:
    recorded = Records(tmp_path)
    yield recorded
    recorded.kill_survivors()


@pytest.fixture
def launcher() -> Iterator[List[subprocess.Popen]]:
    """Background launchers; any still running at the end is killed."""
    started: List[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def start_launcher(started: List[subprocess.Popen], *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        launcher_argv(*args), env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    started.append(proc)
    return proc


def hold(directory: Path, *options: str) -> List[str]:
    return ["--", *WORKER, "hold", "--dir", str(directory), *options]


def test_every_rank_gets_the_job_variables_and_the_reducers_listen() -> None:
    result = run_launcher(
        "-np",
        "3",
        "--reducers",
        "2",
        "--",
        *WORKER,
        "env",
        CLUSTER_SPEC='{"cluster": {}}',
        TF_CONFIG="{}",
        RS_TEST_PASSTHROUGH="yes",
    )
    assert result.returncode == 0, result

    envs = {rank: json.loads(lines_of(result.stdout, f"[rank {rank}] ENV ")[0]) for rank in range(3)}
    addresses = envs[0]["RS_REDUCERS"].split(",")
    ports = [int(address.rsplit(":", 1)[1]) for address in addresses]
    assert len(set(ports)) == 2 and all(address.startswith("127.0.0.1:") for address in addresses)
    token = envs[0]["RS_JOB_TOKEN"]
    assert re.fullmatch(r"[0-9a-f]{32}", token)
    for rank, env in envs.items():
        assert env["RS_RANK"] == env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["RS_WORLD_SIZE"] == env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["RS_REDUCERS"] == envs[0]["RS_REDUCERS"] and env["RS_JOB_TOKEN"] == token
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == envs[0]["MASTER_PORT"]
        assert int(env["MASTER_PORT"]) not in ports
        assert env["PYTHONUNBUFFERED"] == "1" and env["RS_TEST_PASSTHROUGH"] == "yes"
        assert env["RS_PIPELINE_DEPTH"] == str(ONE_HOST_PIPELINE_DEPTH)  # one host: CPU, not links, limits
        assert env["CLUSTER_SPEC"] is None and env["TF_CONFIG"] is None and env["RS_REDUCER_INDEX"] is None
        assert sorted(lines_of(result.stdout, f"[rank {rank}] CONNECTED ")) == sorted(addresses)

    reducers = [json.loads(line) for line in lines_of(result.stdout, "[rank 0] REDUCER ")]
    assert [r["index"] for r in reducers] == [r["RS_REDUCER_INDEX"] for r in reducers] == ["0", "1"]
    assert [int(r["port"]) for r in reducers] == ports
    for reducer in reducers:
        assert reducer["host"] == "127.0.0.1" and reducer["workers"] == reducer["RS_WORLD_SIZE"] == "3"
        assert reducer["RS_JOB_TOKEN"] == token and reducer["RS_REDUCERS"] == envs[0]["RS_REDUCERS"]
        assert reducer["CLUSTER_SPEC"] is None and reducer["TF_CONFIG"] is None and reducer["RANK"] is None

    assert "started 3 worker(s) and 2 reducer(s)" in result.stderr
    assert envs[0]["RS_REDUCERS"] in result.stderr


def test_a_job_token_and_a_pipeline_depth_from_the_caller_are_kept() -> None:
    result = run_launcher("-np", "2", "--", *WORKER, "env", RS_JOB_TOKEN="feedface" * 4, RS_PIPELINE_DEPTH="24")
    assert result.returncode == 0, result
    envs = [json.loads(line) for rank in range(2) for line in lines_of(result.stdout, f"[rank {rank}] ENV ")]
    assert [(env["RS_JOB_TOKEN"], env["RS_PIPELINE_DEPTH"]) for env in envs] == [("feedface" * 4, "24")] * 2


def test_output_lines_carry_their_rank() -> None:
    result = run_launcher("-np", "3", "--", *WORKER, "output", "--lines", "300")
    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    assert all(PREFIXED.match(line) for line in lines), [line for line in lines if not PREFIXED.match(line)]
    for rank in range(3):
        mine = lines_of(result.stdout, f"[rank {rank}] ")
        # Whole lines only: a line mixed from two writers would not match.
        assert [line for line in mine if line.startswith("out ")] == [
            f"out {rank} {i} " + "x" * 100 for i in range(300)
        ]
        assert [line for line in mine if line.startswith("err ")] == [
            f"err {rank} {i} " + "y" * 100 for i in range(300)
        ]
        assert f"junk \ufffd\ufffd {rank}" in mine
        assert mine[-1] == f"partial {rank}"  # the last line had no newline
        assert len(mine) == 602


def test_success_stops_the_reducers_and_the_grandchildren(records: Records) -> None:
    result = run_launcher("-np", "2", "--reducers", "2", *hold(records.directory, "--grandchild", "--sleep", "0"))
    assert result.returncode == 0, result
    assert len(records.workers()) == 2 and len(records.reducers()) == 2
    assert survivors(records.everyone()) == []


def test_a_failing_worker_stops_the_job_promptly(records: Records) -> None:
    began = time.monotonic()
    result = run_launcher(
        "-np", "3", "--reducers", "2", *hold(records.directory, "--grandchild", "--rank", "1", "--code", "3")
    )
    elapsed = time.monotonic() - began
    assert result.returncode == 3, result
    assert elapsed < 30, f"took {elapsed:.1f}s; the other ranks sleep 120s"
    assert "rank 1 exited with code 3" in result.stderr
    assert len(records.workers()) == 3 and len(records.reducers()) == 2
    assert survivors(records.everyone()) == []


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_worker_killed_by_a_signal_gives_128_plus_the_signal(records: Records, signum: int) -> None:
    result = run_launcher("-np", "2", *hold(records.directory, "--rank", "0", "--signal", str(int(signum))))
    assert result.returncode == 128 + signum, result
    assert f"rank 0 was killed by signal {int(signum)}" in result.stderr
    assert survivors(records.everyone()) == []


def test_a_reducer_that_dies_early_fails_the_job(records: Records) -> None:
    result = run_launcher("-np", "2", "--reducers", "2", *hold(records.directory, "--kill-reducer"))
    assert result.returncode != 0, result
    assert re.search(r"reducer 0 \(127\.0\.0\.1:\d+\) was killed by signal 9", result.stderr), result.stderr
    assert survivors(records.everyone()) == []


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_stops_everything(
    records: Records, launcher: List[subprocess.Popen], signum: int, code: int
) -> None:
    proc = start_launcher(launcher, "-np", "2", "--reducers", "2", *hold(records.directory, "--grandchild"))
    records.wait_for(2, proc)
    assert len(records.reducers()) == 2
    os.kill(proc.pid, signum)
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == code, stderr
    assert f"received {signal.Signals(signum).name}" in stderr
    assert survivors(records.everyone()) == []


def test_children_die_with_a_sigkilled_launcher(records: Records, launcher: List[subprocess.Popen]) -> None:
    # Direct children only: PDEATHSIG does not pass on to grandchildren (a documented limit).
    proc = start_launcher(launcher, "-np", "2", "--reducers", "2", *hold(records.directory))
    records.wait_for(2, proc)
    children = records.workers() + records.reducers()
    assert len(children) == 4 and all(alive(pid) for pid in children)
    proc.kill()
    proc.communicate(timeout=TIMEOUT_S)
    assert survivors(children, within=10) == []


def test_port_base_is_honoured() -> None:
    base = free_port_range(2)
    result = run_launcher("-np", "2", "--reducers", "2", "--port-base", str(base), "--", *WORKER, "env")
    assert result.returncode == 0, result
    expected = [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]
    for rank in range(2):
        env = json.loads(lines_of(result.stdout, f"[rank {rank}] ENV ")[0])
        assert env["RS_REDUCERS"] == ",".join(expected)
        assert int(env["MASTER_PORT"]) not in (base, base + 1)
        assert sorted(lines_of(result.stdout, f"[rank {rank}] CONNECTED ")) == expected


@pytest.mark.parametrize(
    "args, message",
    [
        (["-np", "0", "--", "true"], "-np must be at least 1"),
        (["-np", "1", "--reducers", "0", "--", "true"], "--reducers must be at least 1"),
        (["-np", "1", "--port-base", "0", "--", "true"], "--port-base 0"),
        (["-np", "1", "--port-base", "70000", "--", "true"], "--port-base 70000"),
        (["-np", "1", "--reducers", "2", "--port-base", "65535", "--", "true"], "65535-65536, outside 1-65535"),
        (["-np", "1"], "no command given"),
        (["-np", "1", "--"], "no command given"),
        (["-np", "1", "--max-restarts", "-1", "--", "true"], "--max-restarts must be at least 0 (got -1)"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args: List[str], message: str) -> None:
    result = run_launcher(*args)
    assert result.returncode == 2, result
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""  # nothing was started


def test_a_command_that_cannot_start_gives_127() -> None:
    result = run_launcher("-np", "2", "--", str(ROOT / "no-such-command"))
    assert result.returncode == 127, result
    assert "cannot start rank 0" in result.stderr and "Traceback" not in result.stderr


def test_max_restarts_starts_the_worker_group_again_on_the_same_reducers(tmp_path) -> None:
    """Rank 1 is SIGKILLed at step 5 of 10: the launcher stops rank 0 and starts both again on
    the same reducers with the next generation; they resume from rank 0's checkpoint and end with
    what an undisturbed run ends with (10 steps of 1 + 2 on every element)."""
    worker = [sys.executable, str(ROOT / "tests" / "scripts" / "restart_worker.py"), str(tmp_path), "10", "5"]
    result = run_launcher("-np", "2", "--reducers", "2", "--max-restarts", "1", "--", *worker, RS_GENERATION="7")
    assert result.returncode == 0, result
    # Whichever the launcher sees first: rank 1's death, or rank 0 failing on the lost rank.
    assert re.search(
        r"rank (1 was killed by signal 9 \(SIGKILL\)|0 exited with code 1); stopping the other workers", result.stderr
    ), result.stderr
    assert "restarting the 2 worker(s) (restart 1 of 1)" in result.stderr, result.stderr
    reports = [json.loads(line) for rank in (0, 1) for line in lines_of(result.stdout, f"[rank {rank}] RESULT ")]
    assert [(r["rank"], r["attempt"], r["generation"]) for r in reports] == [(0, 1, 8), (1, 1, 8)], reports
    assert {r["resumed_from"] for r in reports} == {5}, reports  # rank 0 never finished step 5 without rank 1
    assert all(r["state"] == [30.0] * 4 for r in reports), reports
    # Each start of the group is a run of its own (RS_RUN_ID), the same on its ranks.
    runs = {tuple(line.split()) for rank in (0, 1) for line in lines_of(result.stdout, f"[rank {rank}] RUN ")}
    assert {attempt for attempt, _ in runs} == {"0", "1"} and len({run for _, run in runs}) == 2, runs
    # Without restarts left, the same failure ends the job with the worker's status.
    again = run_launcher("-np", "2", "--max-restarts", "0", "--", *worker)
    assert again.returncode in (128 + signal.SIGKILL, 1) and "stopping the job" in again.stderr, again
    assert "restarting" not in again.stderr


def test_auto_shards_split_the_launchers_cores_among_its_reducers() -> None:
    """`run --shards auto` on two cores (the launcher's affinity, inherited): two reducers take
    one shard each, not one per core each; one reducer takes both. Each sharded reducer chooses
    its own run of ports, and the workers, told where, all-reduce right through every shard."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2 or shard_count.usable_cores() < 2:
        pytest.skip("needs two cores this process may use")
    cases = json.dumps({"sequential": [{"dtype": "float32", "op": "sum", "count": 300_001, "seed": 1}]})
    worker = [sys.executable, str(ROOT / "tests" / "scripts" / "allreduce_worker.py"), cases]
    for reducers, shards in ((2, 1), (1, 2)):
        result = subprocess.run(
            launcher_argv("-np", "2", "--reducers", str(reducers), "--shards", "auto", "--", *worker),
            env=launcher_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
        )
        assert result.returncode == 0, result
        starts = [line for line in result.stdout.splitlines() if " listening on tcp://" in line]
        assert len(starts) == reducers, result.stdout
        for line in starts:
            assert (f"shards={shards} " in line) if shards > 1 else ("shards=" not in line), line
        done = [json.loads(line) for rank in range(2) for line in lines_of(result.stdout, f"[rank {rank}] ")[-1:]]
        assert [(d["done"], d["failures"]) for d in done] == [(1, [])] * 2, result.stdout


def test_port_base_with_sharded_reducers_is_refused_before_anything_starts() -> None:
    result = run_launcher("-np", "1", "--shards", "2", "--port-base", "23000", "--", *WORKER, "env")
    assert result.returncode == 2 and "--port-base with --shards 2" in result.stderr, result
