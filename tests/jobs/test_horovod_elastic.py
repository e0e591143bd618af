"""Elastic Horovod (hvd.elastic) under `reduction-server run --min-np 3 --max-np 4`: Horovod's
own elastic example, pytorch_mnist_elastic.py (only its import changed: fixtures/horovod/), on 4
workers; one is SIGKILLed mid-training and the other three go on from their last commit; then
the discovery script reports a fourth slot again, a new worker joins at the next commit and
takes the state from rank 0. The job ends with every rank holding the same model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import List

import psutil
import pytest

from helpers.cluster import SCRIPTS, child_env

pytest.importorskip("torch", reason="the elastic example needs torch")
pytest.importorskip("filelock", reason="the elastic example takes a FileLock")
pytestmark = pytest.mark.timeout(300)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "horovod"
EXAMPLE = FIXTURES / "examples" / "pytorch_mnist_elastic.py"


class Launcher:
    """`reduction-server run` in elastic mode; its output read line by line."""

    def __init__(self, tmp: Path) -> None:
        self.hosts = tmp / "hosts"
        self.hosts.write_text("localhost:4\n")
        discovery = tmp / "discover.sh"
        discovery.write_text(f"#!/bin/sh\ncat {self.hosts}\n")
        discovery.chmod(0o755)
        env = child_env(
            {
                "PYTHONPATH": str(FIXTURES / "stand_ins"),
                "HOME": str(tmp),
                "RS_LIVENESS_TIMEOUT": "2",
                "RS_HEARTBEAT_INTERVAL": "0.5",
            }
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "reduction_server",
                "run",
                "-np",
                "4",
                "--min-np",
                "3",
                "--max-np",
                "4",
                "--reducers",
                "2",
                "--host-discovery-script",
                str(discovery),
                "--",
                sys.executable,
                str(SCRIPTS / "horovod_elastic_check.py"),
                str(EXAMPLE),
                "--epochs",
                "60",
                "--data-dir",
                str(tmp),
            ],
            cwd=tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: List[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()

    def wait_for(self, pattern: str, after: int = 0, timeout: float = 120) -> int:
        """The index of the first line from `after` on that matches `pattern`."""
        regex = re.compile(pattern)

        def found():
            return next((i for i in range(after, len(self.lines)) if regex.search(self.lines[i])), None)

        with self.changed:
            assert self.changed.wait_for(lambda: found() is not None or self.proc.poll() is not None, timeout), (
                f"no line matching {pattern!r} in {timeout} s:\n" + "\n".join(self.lines[-40:])
            )
            index = found()
        assert index is not None, f"the job ended without {pattern!r}:\n" + "\n".join(self.lines[-60:])
        return index


def worker_pid(worker: int) -> int:
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "horovod_elastic_check.py" in " ".join(proc.info["cmdline"] or ()) and proc.environ().get(
                "RS_WORKER_ID"
            ) == str(worker):
                return proc.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no process of worker {worker}")


def test_the_elastic_example_loses_a_rank_goes_on_with_three_and_takes_a_fourth_back(tmp_path: Path):
    job = Launcher(tmp_path)
    try:
        first = job.wait_for(r"round 1 formed: 4 worker")
        job.wait_for(r"\[worker \d\] Train Epoch: 3 ", first)
        job.hosts.write_text("localhost:3\n")  # the slot goes with the worker: nobody replaces it yet
        os.kill(worker_pid(3), signal.SIGKILL)
        lost = job.wait_for(r"worker 3 was killed by signal 9 \(SIGKILL\); going on with 3 worker", first)
        shrunk = max(lost, job.wait_for(r"round 2 formed: 3 worker", first))  # formed as the launcher lets it go
        job.wait_for(r"\[worker \d\] Train Epoch: \d+ ", shrunk)  # training goes on with three
        job.hosts.write_text("localhost:4\n")
        started = job.wait_for(r"starting worker 4", shrunk)
        job.wait_for(r"round 3 formed: 4 worker", started)
        assert job.proc.wait(240) == 0, "\n".join(job.lines[-60:])
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()
    said = [line for line in job.lines if '"same_model"' in line]
    results = [json.loads(line[line.index("{") :]) for line in said]
    assert len(results) == 1, said
    assert results[0] == {"size": 4, "epoch": 60, "same_model": True, "digests": 4}, results
    assert any("Test set: Average loss" in line for line in job.lines)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--min-np", "3"], "1 <= --min-np <= -np <= --max-np (got 3, 2, 2)"),
        (["--max-np", "1"], "1 <= --min-np <= -np <= --max-np (got 1, 2, 1)"),
        (["--min-np", "1", "--max-restarts", "1"], "choose one"),
    ],
)
def test_elastic_bounds_are_checked_before_anything_starts(options, message):
    done = subprocess.run(
        [sys.executable, "-m", "reduction_server", "run", "-np", "2", *options, "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_keras_state_and_callbacks_survive_a_lost_worker(tmp_path: Path):
    """hvd.elastic.TensorFlowState synced from rank 0 and restored; then hvd.elastic.KerasState
    with Horovod's three Keras callbacks, 2 workers, --min-np 1:
    the first sync gives both rank 0's weights; worker 1 dies at the end of epoch 2; worker 0
    rolls back to its last commit and finishes the epochs alone."""
    pytest.importorskip("tensorflow", reason="the Keras elastic job needs tensorflow")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "reduction_server",
            "run",
            "-np",
            "2",
            "--min-np",
            "1",
            "--max-np",
            "2",
            "--reducers",
            "2",
            "--",
            sys.executable,
            str(SCRIPTS / "horovod_tf_elastic.py"),
            "6",
            "2",
        ],
        cwd=tmp_path,
        env=child_env({"RS_LIVENESS_TIMEOUT": "2", "RS_HEARTBEAT_INTERVAL": "0.5", "TF_CPP_MIN_LOG_LEVEL": "2"}),
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = done.stdout.splitlines() + done.stderr.splitlines()
    assert done.returncode == 0, "\n".join(lines[-60:])
    reports = [json.loads(line[line.index("{") :]) for line in lines if '"synced"' in line]
    first = [r for r in reports if r["epoch"] == 0 and r["size"] == 2]
    assert len(first) == 2 and first[0]["synced"] == first[1]["synced"], reports  # rank 0's weights everywhere
    assert any("worker 1 was killed by signal 9 (SIGKILL); going on with 1 worker" in line for line in lines), lines[
        -40:
    ]
    after = [r for r in reports if r["size"] == 1]
    assert after and after[0]["worker"] == "0" and 1 <= after[0]["epoch"] <= 3, reports  # from its last commit
    plain = [json.loads(line[line.index("{") :])["tensorflow_state"] for line in lines if '"tensorflow_state"' in line]
    assert plain == [[[0.0, 0.0, 0.0, 0], [0.0, 0.0, 0.0, 0]]] * 2, plain  # TensorFlowState: synced, then restored
    final = [json.loads(line[line.index("{") :]) for line in lines if '"final_size"' in line]
    assert final == [{"worker": "0", "final_size": 1, "epoch": 6, "same_model": True}], final
