"""`reduction-server chaos` against real jobs under the local launcher: it finds the reducer or
worker it is told to hit among this host's processes, signals it at the chosen moment, and the
job sees exactly that failure."""

import subprocess
import sys
import time
import uuid

import pytest

from helpers.cluster import SCRIPTS, child_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups: Linux")


#: every process of this module's jobs has it, so that chaos hits them and not another job on the host
MARK = f"RS_TEST_CHAOS={uuid.uuid4().hex}"


def start_job(steps: int, pause: float, **env: str) -> subprocess.Popen:
    name, value = MARK.split("=")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reduction_server",
            "run",
            "-np",
            "2",
            "--reducers",
            "2",
            "--",
            sys.executable,
            str(SCRIPTS / "steady_worker.py"),
            str(steps),
            str(pause),
        ],
        env=child_env({name: value, **env}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def chaos(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reduction_server", "chaos", "--match", MARK, *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_killed_reducer_is_named_by_the_job():
    job = start_job(400, 0.05)
    try:
        hit = chaos("--target", "reducer:1", "--between", "0.5,1", "--seed", "3")
        out, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert hit.returncode == 0, hit.stderr
    assert "reduction-server chaos: SIGKILL reducer 1 (process group " in hit.stderr, hit.stderr
    assert job.returncode != 0 and "DONE" not in out
    assert "reducer 1" in out + err and "killed by signal 9" in err, (out[-2000:], err[-2000:])


def test_a_worker_frozen_shorter_than_the_liveness_timeout_is_waited_for():
    job = start_job(40, 0.05, RS_LIVENESS_TIMEOUT="10")
    try:
        began = time.monotonic()
        hit = chaos("--target", "rank:1", "--signal", "stop", "--at", "0.5", "--for", "2")
        out, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert hit.returncode == 0, hit.stderr
    assert "SIGSTOP rank 1 (process group " in hit.stderr and "SIGCONT rank 1 after 2 s stopped" in hit.stderr
    assert job.returncode == 0, err[-2000:]
    assert "[rank 0] DONE" in out and time.monotonic() - began >= 2


def test_a_target_that_is_not_there_is_named():
    missing = chaos("--target", "reducer:7", "--wait", "0.5")
    assert missing.returncode == 1 and "no reducer 7 on this host" in missing.stderr, missing.stderr
    bad = chaos("--target", "worker:1")
    assert bad.returncode == 2 and "give reducer:INDEX or rank:RANK" in bad.stderr, bad.stderr
