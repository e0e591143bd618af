"""A training job of W=4 worker processes (tests/scripts/failover_worker.py) whose rank 0's
progress a test follows step by step, to kill reducers (or shards) at chosen moments."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from typing import Dict, List, Optional, Set

from .cluster import SCRIPTS, TOKEN, Reducers, child_env

W = 4
STEPS = 200
#: liveness quick enough for a test: a silent reducer is lost after 2 s
FAST = {"RS_HEARTBEAT_INTERVAL": "0.5", "RS_LIVENESS_TIMEOUT": "2", "RS_TIMEOUT": "60"}


class Run:
    """W worker processes of failover_worker.py; rank 0's progress is followed line by line."""

    def __init__(self, group: Reducers, exact: bool, extra: Optional[Dict[str, str]] = None) -> None:
        self.step = -1
        self.out: Set[int] = set()  # the reducers rank 0 did not use in its last step
        self.progress = threading.Condition()
        self.outputs: Dict[int, List[str]] = {r: [] for r in range(W)}
        self.procs = []
        self.errs = []
        for rank in range(W):
            env = child_env(
                {
                    "RS_REDUCERS": group.spec,
                    "RS_RANK": str(rank),
                    "RS_WORLD_SIZE": str(W),
                    "RS_JOB_TOKEN": TOKEN,
                    "RS_CONNECT_TIMEOUT": "30",
                    **FAST,
                    **(extra or {}),
                }
            )
            err = tempfile.TemporaryFile(mode="w+")  # logs apart: a line of stdout must stay whole
            self.errs.append(err)
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(SCRIPTS / "failover_worker.py"), str(STEPS), "1" if exact else "0"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
            )
        self.readers = [threading.Thread(target=self._read, args=(r,), daemon=True) for r in range(W)]
        for t in self.readers:
            t.start()

    def _read(self, rank: int) -> None:
        for line in self.procs[rank].stdout:
            self.outputs[rank].append(line.rstrip("\n"))
            if rank == 0 and line.startswith("STEP "):
                with self.progress:
                    _, step, out = line.split()
                    self.step = int(step)
                    self.out = set() if out == "-" else {int(i) for i in out.split(",")}
                    self.progress.notify_all()

    def wait_for_step(self, step: int, timeout: float = 60) -> None:
        with self.progress:
            assert self.progress.wait_for(lambda: self.step >= step or self.procs[0].poll() is not None, timeout), (
                f"rank 0 did not reach step {step} in {timeout} s: {self.outputs[0][-5:]}"
            )

    def wait_until_used(self, reducers: Set[int], timeout: float = 60) -> None:
        """Wait until rank 0 uses each of `reducers` again (restarted ones, readmitted from a JOIN)."""
        with self.progress:
            used = self.progress.wait_for(lambda: not self.out & reducers or self.procs[0].poll() is not None, timeout)
            unused = sorted(self.out & reducers)
            assert used, f"rank 0 did not use reducers {unused} again in {timeout} s: {self.outputs[0][-5:]}"

    def finish(self, timeout: float = 120) -> List[dict]:
        results = []
        try:
            for rank, proc in enumerate(self.procs):
                proc.wait(timeout)
                self.readers[rank].join(10)
                lines = self.outputs[rank]
                self.errs[rank].seek(0)
                assert proc.returncode == 0 and lines and lines[-1].startswith("{"), (
                    f"rank {rank} failed ({proc.returncode}):\n"
                    + "\n".join(lines[-5:])
                    + self.errs[rank].read()[-3000:]
                )
                results.append(json.loads(lines[-1]))
        finally:
            for proc, err in zip(self.procs, self.errs):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                err.close()
        return results
