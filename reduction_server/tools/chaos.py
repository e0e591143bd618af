"""`reduction-server chaos`: failure injection, to rehearse on your own hosts what a real cluster
does to a job (issue 17). Run it on the host of the process to hit:

    reduction-server chaos --target reducer:1 --between 10,60          # SIGKILL at a random moment
    reduction-server chaos --target rank:3 --signal stop --at 5 --for 8  # freeze a worker for 8 s

A target is found among this host's processes: a reducer by its index (`serve --index N`, or
RS_REDUCER_INDEX), a worker by its rank (RS_RANK in its environment, the top of the rank's process
tree); `--match NAME=VALUE` keeps only processes whose environment has it (one job of several on a
host: its RS_REDUCERS, say). It is signalled as a whole: its process group when it leads one (the
local launcher starts each process in a group of its own), else the process itself. `--signal stop`
sends SIGSTOP and, after `--for` seconds, SIGCONT (a frozen host or VM), past RS_LIVENESS_TIMEOUT a
lost peer.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import psutil

from ..errors import ConfigError

_SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}
_POLL_S = 0.2


@dataclass(frozen=True)
class Target:
    """What to hit: a reducer by index or a worker by rank."""

    role: str  # "reducer" or "rank"
    number: int

    @classmethod
    def parse(cls, text: str) -> "Target":
        """`reducer:N` or `rank:N`; ConfigError otherwise."""
        role, _, number = text.partition(":")
        if role not in ("reducer", "rank") or not number.isdigit():
            raise ConfigError(f"--target {text!r}: give reducer:INDEX or rank:RANK (e.g. reducer:0, rank:3)")
        return cls(role, int(number))

    def __str__(self) -> str:
        return f"{self.role} {self.number}"


def _reducer_index(proc: psutil.Process) -> Optional[int]:
    argv = proc.cmdline()
    if "serve" not in argv or not any("reduction_server" in a or "reduction-server" in a for a in argv):
        return None
    if "--index" in argv and argv.index("--index") + 1 < len(argv):
        return int(argv[argv.index("--index") + 1])
    index = proc.environ().get("RS_REDUCER_INDEX", "0").strip()
    return int(index) if index.isdigit() else 0


def _rank(proc: psutil.Process) -> Optional[int]:
    env = proc.environ()
    rank = env.get("RS_RANK", "").strip()
    if not rank.isdigit() or "RS_REDUCERS" not in env or _reducer_index(proc) is not None:
        return None
    return int(rank)


def find(target: Target, match: Optional[Tuple[str, str]] = None) -> List[psutil.Process]:
    """This host's processes that are `target` (the top of each matching process tree), and
    whose environment has `match` (NAME, VALUE) when given."""
    identify = _reducer_index if target.role == "reducer" else _rank
    found = []
    for proc in psutil.process_iter():
        try:
            if (
                proc.pid != os.getpid()
                and identify(proc) == target.number
                and (match is None or proc.environ().get(match[0]) == match[1])
            ):
                found.append(proc)
        except (psutil.Error, ValueError):  # gone, a zombie, not ours to read
            continue
    pids = {p.pid for p in found}
    return [p for p in found if _safe_ppid(p) not in pids]  # a rank's children carry its RS_RANK too


def _safe_ppid(proc: psutil.Process) -> Optional[int]:
    try:
        return proc.ppid()
    except psutil.Error:
        return None


def _send(proc: psutil.Process, signum: int) -> str:
    """Signal `proc`'s process group if it leads one, else `proc`; what was signalled, in words."""
    if os.getpgid(proc.pid) == proc.pid:
        os.killpg(proc.pid, signum)
        return f"process group {proc.pid}"
    os.kill(proc.pid, signum)
    return f"pid {proc.pid}"


def when(at: Optional[float], between: Optional[Tuple[float, ...]], rng: random.Random) -> float:
    """Seconds from now: `at`, or uniform in `between`, or now."""
    if between is not None:
        if len(between) != 2 or not 0 <= between[0] <= between[1]:
            raise ConfigError(
                f"--between {','.join(f'{b:g}' for b in between)}: give FIRST,LAST seconds, 0 <= FIRST <= LAST"
            )
        return rng.uniform(*between)
    if at is not None and at < 0:
        raise ConfigError(f"--at {at:g}: give seconds from now, 0 or more")
    return at or 0.0


def parse_match(text: Optional[str]) -> Optional[Tuple[str, str]]:
    """`NAME=VALUE` as (NAME, VALUE); ConfigError otherwise."""
    if text is None:
        return None
    name, equals, value = text.partition("=")
    if not name or not equals:
        raise ConfigError(f"--match {text!r}: give NAME=VALUE, an environment variable of the job's processes")
    return name, value


def inject(
    target: Target,
    signal_name: str = "kill",
    at: Optional[float] = None,
    between: Optional[Tuple[float, ...]] = None,
    hold: float = 0.0,
    wait: float = 60.0,
    seed: Optional[int] = None,
    match: Optional[Tuple[str, str]] = None,
) -> int:
    """Find `target` on this host (waiting up to `wait` s for it to appear), wait until the
    chosen moment, and signal it (`stop`: SIGCONT again after `hold` seconds). 0 when done; 1
    when the target is not found or is ambiguous."""
    if signal_name not in _SIGNALS:
        raise ConfigError(f"--signal {signal_name!r}: one of {', '.join(_SIGNALS)}")
    if hold < 0 or (hold and signal_name != "stop"):
        raise ConfigError("--for takes seconds, 0 or more, and only with --signal stop")
    delay = when(at, between, random.Random(seed))
    deadline = time.monotonic() + wait
    while not (found := find(target, match)) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    if len(found) != 1:
        _say(
            f"no {target} on this host"
            if not found
            else f"{len(found)} processes are {target} here (pids {[p.pid for p in found]}); pick the job with "
            "--match NAME=VALUE"
        )
        return 1
    time.sleep(delay)
    if not found[0].is_running():
        _say(f"{target} (pid {found[0].pid}) exited before the chosen moment ({delay:.1f} s)")
        return 1
    what = _send(found[0], _SIGNALS[signal_name])
    _say(f"{signal.Signals(_SIGNALS[signal_name]).name} {target} ({what}) after {delay:.1f} s")
    if signal_name == "stop":
        time.sleep(hold)
        _send(found[0], signal.SIGCONT)
        _say(f"SIGCONT {target} after {hold:g} s stopped")
    return 0


def _say(message: str) -> None:
    print(f"reduction-server chaos: {message}", file=sys.stderr, flush=True)
