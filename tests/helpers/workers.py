"""Worker processes running tests/scripts/failure_worker.py, for the failure tests
(test_failures.py): W real processes against a reducer group, their stdout lines read as JSON.
A context manager: `with Workers(...) as workers:` kills every one still running on exit,
whatever the test did."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

from .cluster import SCRIPTS, TOKEN, Reducers, child_env
from .timing import FAST


class Workers:
    """W worker processes running failure_worker.py; their stdout lines are read as JSON."""

    def __init__(self, world: int, group: Reducers, spec: dict, extra_env: Optional[Dict[str, str]] = None) -> None:
        self.procs: List[subprocess.Popen] = []
        self.errs = []
        self.lines: Dict[int, List[dict]] = {r: [] for r in range(world)}
        self.changed = threading.Condition()
        self.readers = []
        try:
            for rank in range(world):
                env = child_env(
                    {
                        "RS_REDUCERS": group.spec,
                        "RS_RANK": str(rank),
                        "RS_WORLD_SIZE": str(world),
                        "RS_JOB_TOKEN": TOKEN,
                        "RS_CONNECT_TIMEOUT": "30",
                        **FAST,
                        **(extra_env or {}),
                    }
                )
                err = tempfile.TemporaryFile(mode="w+")
                self.errs.append(err)
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(SCRIPTS / "failure_worker.py"), json.dumps(spec)],
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                    )
                )
                reader = threading.Thread(target=self._read, args=(rank,), daemon=True)
                reader.start()
                self.readers.append(reader)
        except BaseException:  # those started already do not outlive a start that failed halfway
            self.kill_all()
            raise

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill_all()

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
                    assert self.procs[r].poll() is None or self.readers[r].is_alive(), (
                        f"rank {r} exited ({self.procs[r].poll()}) before saying {key!r}: {self.stderr(r)}"
                    )
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
        """Kill every worker still running and wait for it; close the stderr files (once is
        enough: a second call finds nothing left to do)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for err in self.errs:
            err.close()
