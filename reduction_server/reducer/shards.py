"""Shards: one `reduction-server serve` that uses every core of its host.

A reducer process spends most of its CPU time in libzmq's one I/O thread (bench/RESULTS.md), so
it tops out near one core and a third however many its host has. `serve --shards N` runs N
reducer processes instead, shard s listening on port + s. Shard 0 (the address in RS_REDUCERS or
the cluster spec) says N in its WELCOME, and every worker connects to each shard and spreads its
chunks over all of them (client/engine/endpoints.py). Shards share nothing: each proves the job
token bound to its shard number, keeps its own rounds, holds 1/N of the accumulator budget and
serves its metrics to this process, which serves every shard's on the one metrics port
(shard_metrics.py).

This process supervises them: it starts them, says the reducer listens once all of them do, stops
them all on SIGTERM (passed on: each shard drains, drain.py) or SIGINT, and starts a shard that
died again at its port (workers treat it as a lost reducer and take it back once it is up:
reliability.md). The shards die with it, even when
it is killed with SIGKILL.
"""

from __future__ import annotations

import errno
import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

from ..children import AWAY_FROM_SOURCE, die_with_parent_hook
from ..config import settings
from ..errors import ConfigError, ListenError
from ..log import NOTICE, event, get_logger
from ..ports import port_holder

log = get_logger("reducer")

#: seconds a shard has to say it listens
READY_TIMEOUT_S = 60.0
#: a shard that dies is started again after this long, doubled for each time in a row it died
#: within STEADY_S of its start, up to MAX_BACKOFF_S; it is never given up (its peers fail over)
FIRST_BACKOFF_S, MAX_BACKOFF_S, STEADY_S = 0.2, 5.0, 10.0
_MAX_DOUBLINGS = 16  # past MAX_BACKOFF_S already; a float power of 2 overflows past 1023
_POLL_S = 0.1
_STOP_GRACE_S = 10.0
_PORT_TRIES = 5  # free runs of N ports tried when the port is 0 (another program may take one meanwhile)


def _cgroup_dirs(root: str, own: str) -> List[Tuple[str, str]]:
    """(directory, version) of every cgroup that may limit this process's CPU, from its own
    (as /proc/self/cgroup names it, under `root`) up to the root of the mount: v2's unified
    hierarchy, and v1's `cpu` controller. A directory that does not exist here (a container's
    view of a path outside it) is left out."""
    found: List[Tuple[str, str]] = []
    try:
        with open(own) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            mount, version = root, "v2"
        elif "cpu" in controllers.split(","):
            mount, version = os.path.join(root, "cpu"), "v1"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            directory = os.path.join(mount, *parts[:depth])
            if os.path.isdir(directory):
                found.append((directory, version))
    return found or [(root, "v2"), (os.path.join(root, "cpu"), "v1")]


def _quota_of(directory: str, version: str) -> Optional[float]:
    """One cgroup's CPU quota in cores (v2's cpu.max; v1's cfs quota over its period), None when unlimited."""
    try:
        if version == "v2":
            with open(os.path.join(directory, "cpu.max")) as f:
                quota, period = (f.read().split() + ["100000"])[:2]
        else:
            with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        return None if quota in ("max", "-1") else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _cgroup_quota(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> Optional[float]:
    """The CPU quota, in cores, of this process's cgroup or the tightest of its ancestors' (a
    container's --cpus, a pod's CPU limit, a systemd slice's CPUQuota), None when unlimited."""
    quotas = [q for q in (_quota_of(d, v) for d, v in _cgroup_dirs(root, own)) if q is not None]
    return min(quotas) if quotas else None


def usable_cores(share: int = 1) -> int:
    """The CPUs this process may run on: its affinity, cut to its cgroup's CPU quota, divided
    among the `share` reducers a launcher started on this host (RS_LOCAL_REDUCERS); at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota()
    cores = cores if quota is None else min(cores, max(1, math.ceil(quota)))
    return max(1, cores // share)


def count(value: Union[str, int, None], name: str = "RS_SHARDS", share: int = 1) -> int:
    """How many shards `value` asks for: `auto` (or None) is usable_cores(share); else an integer
    in 1..MAX_SHARDS. A ConfigError names `name` otherwise."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return min(usable_cores(share), settings.MAX_SHARDS)
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is neither `auto` nor a number of shards") from None
    if not 1 <= n <= settings.MAX_SHARDS:
        raise ConfigError(f"{name}={value!r} must be `auto` or 1..{settings.MAX_SHARDS}")
    return n


def free_run(host: str, n: int) -> int:
    """A port p such that p .. p+n-1 are free on `host` now (the shards bind them next)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(_PORT_TRIES):
        with socket.socket(family) as probe:
            try:
                probe.bind((host, 0))
            except OSError as exc:
                raise ListenError.binding(host, 0, exc.errno, exc.strerror or str(exc)) from None
            base = probe.getsockname()[1]
        if base + n - 1 > 65535:
            continue
        try:
            check_free(host, base, n)
            return base
        except ListenError:
            continue
    raise ListenError(f"cannot find {n} consecutive free ports on {host} for --shards {n}; give --port")


def port_in_use(host: str, port: int, shard: int = 0) -> ListenError:
    """The ListenError of a port another process listens on: where, who (port_holder) and what to do."""
    where = f"tcp://{f'[{host}]' if ':' in host else host}:{port}"
    if shard:
        where += f", shard {shard}'s port (--port + {shard})"
    holder = port_holder(port)
    return ListenError(
        f"cannot listen on {where}: the port is already in use "
        f"({f'by {holder}' if holder else 'another reducer or program listens there'}); "
        "stop it, or choose another port (--port; 0 picks a free one)"
    )


def check_free(host: str, base: int, n: int) -> None:
    """A ListenError in one reducer's words (process.py) naming the first of the ports base ..
    base+n-1 that cannot be bound on `host` now: said once, before any shard starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in range(base, base + n):
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq binds: TIME_WAIT is free
            try:
                probe.bind((host, port))
            except OSError as exc:
                if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                    return  # not an address (libzmq also binds an interface's name): the shards say
                if exc.errno == errno.EADDRINUSE:
                    raise port_in_use(host, port, port - base) from None
                raise ListenError.binding(host, port, exc.errno, exc.strerror or str(exc), port - base) from None


@dataclass
class Shard:
    """One shard process and when to start it again after it died."""

    number: int
    port: int
    proc: Optional[subprocess.Popen] = None
    started: float = 0.0
    restart_at: Optional[float] = None
    restarts: int = field(default=0)
    failures: int = 0  # deaths in a row, each within STEADY_S of its start (the backoff doubles with them)
    metrics_port: Optional[int] = None  # its metrics page on the loopback, for shard_metrics.py
    ready: Optional[int] = None  # while it starts: the read end of the pipe it says it listens on
    ready_by: float = 0.0  # when it must have said so


class Supervisor:
    """The shards of one reducer: started, watched, started again, stopped."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        index: int,
        shards: int,
        workers: Optional[int],
        deterministic: bool,
        metrics_port: int,
    ) -> None:
        if port and port + shards - 1 > 65535:
            raise ConfigError(f"--port {port} with --shards {shards}: the shards' ports would pass 65535")
        self.host, self.index, self.count = host, index, shards
        self.workers, self.deterministic, self.metrics_port = workers, deterministic, metrics_port
        self.fixed_port = bool(port)
        self.base = port
        self.shards: List[Shard] = []
        self.started = False  # every shard has listened once (start returned)
        self.hook = die_with_parent_hook()
        # A reducer does no linear algebra: without this, NumPy's OpenBLAS starts a thread per core
        # in every shard, and each spins for a while at start (bench/RESULTS.md, "Shards").
        self.env = {"OPENBLAS_NUM_THREADS": "1", **os.environ}

    def _command(self, shard: Shard, ready: int) -> List[str]:
        cmd = [
            sys.executable,
            "-m",
            "reduction_server",
            "serve",
            "--host",
            self.host,
            "--port",
            str(shard.port),
            "--index",
            str(self.index),
            "--shards",
            str(self.count),
            "--shard",
            str(shard.number),
            "--ready-fd",
            str(ready),
        ]
        if self.workers is not None:
            cmd += ["--workers", str(self.workers)]
        if self.deterministic:
            cmd.append("--deterministic")
        # Nonzero: the shard serves its metrics on a loopback port it names when ready; 0: none
        # (not RS_METRICS_PORT from the environment, which the supervisor has read already).
        return cmd + ["--metrics-port", str(self.metrics_port or 0)]

    def _where(self, shard: Shard) -> str:
        return f"shard {shard.number} of reducer {self.index} (port {shard.port})"

    def _launch(self, shard: Shard) -> Optional[str]:
        """Start `shard`'s process, which says on a pipe when it listens (_settle); why it could
        not be started, or None."""
        shard.metrics_port = None  # until this process names its own: the old one's may be anyone's now
        ready_r, ready_w = os.pipe()
        try:
            shard.proc = subprocess.Popen(
                self._command(shard, ready_w),
                pass_fds=(ready_w,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=self.env,
                preexec_fn=self.hook,
                cwd=AWAY_FROM_SOURCE,
            )
        except OSError as exc:  # fork or exec failed (no memory, too many processes)
            os.close(ready_r)
            shard.proc = None
            return f"{self._where(shard)} could not be started: {exc}"
        finally:
            os.close(ready_w)
        shard.ready, shard.ready_by = ready_r, time.monotonic() + READY_TIMEOUT_S
        return None

    def _settle(self, shard: Shard, wait: float) -> Tuple[bool, Optional[str]]:
        """Whether `shard`, launched, has ended starting (waiting up to `wait` s for it), and why it
        failed: it exited, or it did not listen within READY_TIMEOUT_S (it is killed then)."""
        readable, _, _ = select.select([shard.ready], [], [], max(0.0, wait))
        if not readable and time.monotonic() < shard.ready_by:
            return False, None
        said = os.read(shard.ready, 64).decode(errors="replace").strip() if readable else ""
        os.close(shard.ready)
        shard.ready, shard.started = None, time.monotonic()  # one that cannot start dies "at once" (the backoff)
        port, _, metrics = said.partition(" ")
        if port == str(shard.port):
            shard.metrics_port = int(metrics) if metrics.isdigit() else None
            return True, None
        if readable:  # it closed the pipe without a word: it exited
            return (
                True,
                f"{self._where(shard)} exited with status {shard.proc.wait()} before it listened "
                "(its message is above)",
            )
        shard.proc.kill()
        shard.proc.wait()
        return True, f"{self._where(shard)} did not listen within {READY_TIMEOUT_S:g} s"

    def start(self) -> int:
        """Start every shard, all at once; the first one's port once all listen. A ListenError says
        which could not."""
        if self.fixed_port:
            check_free(self.host, self.base, self.count)
        for _ in range(1 if self.fixed_port else _PORT_TRIES):
            base = self.base or free_run(self.host, self.count)
            self.shards = [Shard(s, base + s) for s in range(self.count)]
            failed, bad = None, None
            for shard in self.shards:
                failed, bad = self._launch(shard), shard
                if failed:
                    break
            for shard in self.shards if not failed else []:
                _, failed = self._settle(shard, shard.ready_by - time.monotonic())
                bad = shard
                if failed:
                    break
            if not failed:
                self.base, self.started = base, True
                return base
            self.stop()
            if bad.proc is None or bad.proc.returncode != 1:  # 1: it could not listen (cli.py)
                break  # not a port another program took meanwhile: other ports would not help
        raise ListenError(f"reducer {self.index} could not start its {self.count} shards: {failed}")

    def not_listening(self) -> Optional[str]:
        """Why this reducer does not serve its workers now, or None when every shard listens (its
        readiness, READY_PATH in metrics.py): read from the metrics server's thread."""
        if not self.started:
            return f"its {self.count} shards are starting"
        down = [s for s in list(self.shards) if s.ready is not None or s.proc is None or s.proc.poll() is not None]
        if not down:
            return None
        return "not listening (restarting): " + ", ".join(f"shard {s.number} (port {s.port})" for s in down)

    def watch(self, should_stop) -> None:
        """Until should_stop(): start a shard that died again at its port, backing off when it
        keeps dying. A shard that is starting holds up nothing: the others are watched meanwhile."""
        while not should_stop():
            now = time.monotonic()
            for shard in self.shards:
                if shard.ready is not None:  # starting again
                    ended, failed = self._settle(shard, 0)
                    if ended:  # one that failed is dead now: the next turn backs off and starts it again
                        event(
                            log,
                            NOTICE,
                            "shard_restarted" if not failed else "shard_restart_failed",
                            reducer=self.index,
                            shard=shard.number,
                            port=shard.port,
                            restarts=shard.restarts,
                            **({"reason": failed} if failed else {}),
                        )
                elif shard.restart_at is None and (shard.proc is None or shard.proc.poll() is not None):
                    shard.failures = shard.failures + 1 if now - shard.started < STEADY_S else 0
                    backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2.0 ** min(shard.failures, _MAX_DOUBLINGS))
                    shard.restart_at, shard.metrics_port = now + backoff, None
                    event(
                        log,
                        NOTICE,
                        "shard_died",
                        reducer=self.index,
                        shard=shard.number,
                        port=shard.port,
                        status=shard.proc.returncode if shard.proc is not None else "not started",
                        restart_in_s=f"{backoff:g}",
                    )
                elif shard.restart_at is not None and now >= shard.restart_at and not should_stop():
                    shard.restart_at = None
                    shard.restarts += 1
                    failed = self._launch(shard)
                    if failed:
                        event(
                            log,
                            NOTICE,
                            "shard_restart_failed",
                            reducer=self.index,
                            shard=shard.number,
                            port=shard.port,
                            restarts=shard.restarts,
                            reason=failed,
                        )
            time.sleep(_POLL_S)

    def stop(self, signum: int = signal.SIGTERM, drain_timeout: float = 0.0) -> None:
        """`signum` to every shard (SIGTERM: each drains for up to `drain_timeout` seconds,
        drain.py), then SIGKILL those still there after a grace period beyond that."""
        for shard in self.shards:
            if shard.ready is not None:
                os.close(shard.ready)
                shard.ready = None
        running = [s.proc for s in self.shards if s.proc is not None and s.proc.poll() is None]
        for proc in running:
            proc.send_signal(signum)
        deadline = time.monotonic() + _STOP_GRACE_S + (drain_timeout if signum == signal.SIGTERM else 0.0)
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
