"""`reduction-server run --min-np A --max-np B [--host-discovery-script S]`: the launcher's side
of an elastic job, as horovodrun's elastic mode.

Workers get an id for their life (RS_WORKER_ID) and the launcher's rendezvous (RS_RENDEZVOUS,
rendezvous.py), where Horovod's init() learns their rank, the world size and the generation. A
worker that fails leaves the rendezvous and the others go on without it (their collectives fail,
they roll back to their last commit and initialize again), as long as at least A are left. With
a discovery script (run every DISCOVERY_S; each line `host:slots`, or `host` for one slot) the
launcher starts workers up to min(B, slots): the others take them in at their next commit. The
local launcher runs every worker on this machine, so only this machine's names count as slots.
The reducers are told no fixed world size: each round of the job has its own.
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set

from .rendezvous import Rendezvous

#: seconds between two runs of the host discovery script
DISCOVERY_S = 1.0
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass
class Elastic:
    """An elastic job's bounds, discovery script and rendezvous, and what it has said."""

    min_np: int
    max_np: int
    say: Callable[[str], None]  # the launcher's voice
    discovery: Optional[str] = None
    rendezvous: Optional[Rendezvous] = None
    next_discovery: float = 0.0
    said: Set[str] = field(default_factory=set)  # each warning once

    def start(self, token: str, host: str) -> None:
        """Serve the rendezvous on the reducers' connect host."""
        self.rendezvous = Rendezvous(token, host, on_round=self._formed).start()

    def _formed(self, number: int, workers: List[int]) -> None:
        self.say(f"round {number} formed: {len(workers)} worker(s), ranks 0-{len(workers) - 1} for workers {workers}")

    def close(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.close()

    def worker_env(self, env: Dict[str, str], worker: int) -> Dict[str, str]:
        """A worker's environment: its id and the rendezvous (it is a member from now on)."""
        self.rendezvous.add(worker)
        return dict(env, RS_RENDEZVOUS=self.rendezvous.address, RS_WORKER_ID=str(worker))

    def lose(self, worker: int) -> None:
        """A worker failed: the next round goes on without it."""
        self.rendezvous.remove(worker)

    def wanted(self, live: int) -> int:
        """How many workers to start now: up to min(max_np, the discovered slots)."""
        if self.discovery is None or time.monotonic() < self.next_discovery:
            return 0
        self.next_discovery = time.monotonic() + DISCOVERY_S
        slots = self._slots()
        if slots is None:
            return 0
        if slots < live:
            self._say_once(
                "fewer",
                f"the discovery script reports {slots} slot(s) for {live} running workers; "
                "the local launcher does not stop workers for it",
            )
        return max(0, min(self.max_np, slots) - live)

    def _slots(self) -> Optional[int]:
        try:
            done = subprocess.run([self.discovery], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._say_once("run", f"cannot run the host discovery script {self.discovery}: {exc}")
            return None
        if done.returncode != 0:
            self._say_once(
                "exit",
                f"the host discovery script {self.discovery} exited {done.returncode}: {done.stderr.strip()[-300:]}",
            )
            return None
        slots = 0
        local = _LOCAL_NAMES | {socket.gethostname()}
        for line in done.stdout.split():
            host, _, count = line.partition(":")
            if host not in local:
                self._say_once(
                    f"host {host}",
                    f"host {host} from the discovery script is not this machine: "
                    "the local launcher runs workers here only",
                )
                continue
            try:
                slots += int(count) if count else 1
            except ValueError:
                self._say_once(f"line {line}", f"the discovery script printed {line!r}: expected host[:slots]")
        return slots

    def _say_once(self, key: str, message: str) -> None:
        if key not in self.said:
            self.said.add(key)
            self.say(message)
