"""The README's main command: `reduction-server run` of the check script, as a user runs it."""

import re
import shutil
import subprocess
import sys

import pytest

from helpers.cluster import ROOT, child_env


def test_readme_local_job():
    command = shutil.which("reduction-server")
    if command is None:
        pytest.skip("the reduction-server console script is not installed (pip install .)")
    proc = subprocess.run(
        [
            command,
            "run",
            "-np",
            "4",
            "--reducers",
            "2",
            "--",
            sys.executable,
            "examples/allreduce_check.py",
            "--mib",
            "8",
            "--iters",
            "2",
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(4):
        assert f"[rank {rank}] rank {rank}: OK" in proc.stdout
    assert re.search(r"\[rank 0\] 4 workers, 2 reducers: 8 MiB float32 all-reduce in [\d.]+ ms", proc.stdout)
    assert "[rank 0] PASSED: every result of every rank was right" in proc.stdout
    assert "[reducer 1] reducer 1 listening on tcp://127.0.0.1:" in proc.stdout


def test_local_job_fails_when_a_worker_finds_a_wrong_result(tmp_path):
    """The launcher turns one rank's failure into the job's exit code."""
    script = tmp_path / "bad.py"
    script.write_text(
        "import sys, numpy as np, reduction_server.client as rs\n"
        "with rs.Communicator.from_env() as c:\n"
        "    y = c.all_reduce(np.ones(10, np.float32))\n"
        "    sys.exit(0 if c.rank == 0 else int(y[0]) + 1)\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reduction_server",
            "run",
            "-np",
            "2",
            "--reducers",
            "1",
            "--",
            sys.executable,
            str(script),
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr  # rank 1 saw 2.0 and exited 2 + 1
