"""Test harness: real reducer processes and real worker processes on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import psutil

from reduction_server.reducer import shards

from .ports import REDUCER_PORTS, free_port_range
from .source_tree import ROOT

SCRIPTS = ROOT / "tests" / "scripts"
#: the job token of the reducer groups and workers the helpers start, unless a test gives another;
#: one per test session, so that a reducer of another session on this host, which took a port one
#: of ours freed, cannot prove it (nor, the job id coming from it, pass for our job's reducer)
TOKEN = f"test-token-{os.getpid()}"
#: for a test of one reducer process itself (hand-driven peers on its one port, its own logs,
#: metrics or budgets): one shard whatever RS_SHARDS says (conftest.py)
ONE_PROCESS = {"RS_SHARDS": "1"}
_LISTENING = re.compile(r"listening on tcp://(\S+):(\d+)")
_START_TRIES = 3  # a reducer's start, each at a port probed again


def unreachable(url: str) -> Optional[str]:
    """None if `url` answers, else why not (for a skip that says why)."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10).close()
        return None
    except Exception as error:  # any failure means: no network for it
        return f"{url}: {error}"


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CLUSTER_SPEC", "TF_CONFIG") and not k.startswith("RS_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a process that a fatal signal kills prints every thread's stack
    env["RS_SHARDS"] = os.environ.get("RS_SHARDS", "1")  # conftest.py
    env.update(extra or {})
    return env


def cli(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """`reduction-server ARGS` as a user runs it, with `env` added to a test's child environment."""
    return subprocess.run(
        [sys.executable, "-m", "reduction_server", *args],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Reducers:
    """R reducer processes on free loopback ports; stopped (and reaped) on exit. Their indexes
    start at `first_index` (a group that stands at the end of RS_REDUCERS). Each one's ports (one
    per shard) lie below the ephemeral range: a reducer restarted at its address must find them
    free, and a connection's local port, taken from that range, could hold one (seen once in CI)."""

    def __init__(self, count: int, workers: Optional[int], env: Dict[str, str], first_index: int = 0) -> None:
        self.procs: List[subprocess.Popen] = []
        self.logs: list = []
        self.stopped: Optional[List[str]] = None
        self.addresses: List[str] = []
        self.env = env
        self.first_index = first_index
        self.workers = workers
        ports = self.ports = shards.count(env.get("RS_SHARDS"))  # each reducer's: one per shard
        for index in range(first_index, first_index + count):
            for attempt in range(_START_TRIES):
                base = free_port_range(ports, REDUCER_PORTS, reuse=True)
                cmd = self._command("127.0.0.1", str(base), index)
                # Logs go to a file: a pipe read only at stop() would block a chatty reducer.
                log = tempfile.TemporaryFile(mode="w+")
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
                self.procs.append(proc)
                self.logs.append(log)
                match = _LISTENING.search(proc.stdout.readline())
                if match:
                    break
                why = _stopped(proc, log)
                self.procs.pop(), self.logs.pop()
                # A port free when probed may be taken before the reducer binds it (seen once in CI):
                # probe again, as `serve` itself does for a port of its own choosing.
                if "already in use" not in why or attempt == _START_TRIES - 1:
                    self.stop()
                    raise RuntimeError(f"reducer {index} did not start: {why}")
                warnings.warn(
                    f"reducer {index}: ports {base}-{base + ports - 1}, free when probed, were taken "
                    f"before it bound them, by {_holders(base, ports)}; probing again",
                    stacklevel=2,
                )
            self.addresses.append(f"{match.group(1)}:{match.group(2)}")

    def restart(self, i: int, env: Optional[Dict[str, str]] = None) -> None:
        """Start the group's i-th reducer again on its old port (the old process is dead), with
        the group's environment or `env`."""
        host, port = self.addresses[i].rsplit(":", 1)
        cmd = self._command(host, port, self.first_index + i)
        deadline = time.monotonic() + 20
        while True:
            proc = subprocess.Popen(
                cmd, env=self.env if env is None else env, stdout=subprocess.PIPE, stderr=self.logs[i], text=True
            )
            line = proc.stdout.readline()
            if "listening" in line:
                self.procs[i] = proc
                return
            proc.wait()
            assert time.monotonic() < deadline, (
                f"reducer {i} could not bind its port again: {line!r}; held: {_holders(int(port), self.ports)}"
            )
            time.sleep(0.2)  # the port may linger for a moment

    def signal(self, i: int, sig: int) -> None:
        """`sig` to the group's i-th reducer and to each of its shards where it runs several
        (RS_SHARDS), as a frozen (SIGSTOP) or lost (SIGKILL) host does to all of them at once; the
        supervisor first, so that it cannot start a shard again in between. SIGKILL reaps them."""
        proc = self.procs[i]
        try:
            shards = psutil.Process(proc.pid).children()
        except psutil.NoSuchProcess:
            shards = []
        proc.send_signal(sig)
        for shard in shards:
            with contextlib.suppress(psutil.NoSuchProcess):
                shard.send_signal(sig)
        if sig == signal.SIGKILL:
            proc.wait(5)
            psutil.wait_procs(shards, timeout=5)

    def _command(self, host: str, port: str, index: int) -> List[str]:
        """`serve` for reducer `index` of this group, at host:port."""
        cmd = [sys.executable, "-m", "reduction_server", "serve", "--host", host, "--port", port, "--index", str(index)]
        return cmd + (["--workers", str(self.workers)] if self.workers is not None else [])

    @property
    def spec(self) -> str:
        return ",".join(self.addresses)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self) -> List[str]:
        """Stop every reducer; returns their stderr (their logs). Safe to call again."""
        if self.stopped is not None:
            return self.stopped
        for proc in self.procs:
            if proc.poll() is None:  # at once: SIGTERM would drain, for up to RS_DRAIN_TIMEOUT
                proc.send_signal(signal.SIGINT)
        self.stopped = [_stopped(proc, log) for proc, log in zip(self.procs, self.logs)]
        return self.stopped


def _holders(base: int, count: int) -> List[str]:
    """Who has a TCP socket on ports base .. base+count-1: pid, command line and the socket's state."""
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and base <= conn.laddr.port < base + count:
            try:
                who = " ".join(psutil.Process(conn.pid).cmdline()) if conn.pid else "no process"
            except psutil.Error:
                who = "a process gone since"
            found.append(f"{conn.laddr.port} {conn.status} pid {conn.pid}: {who}")
    return found


def _stopped(proc: subprocess.Popen, log: Any) -> str:
    """The log of a reducer told to stop (or one that exited), once it has exited (killed after 10 s)."""
    try:
        proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    log.seek(0)
    text = log.read()
    log.close()
    return text


@contextmanager
def reducers(
    count: int,
    workers: Optional[int] = None,
    token: str = TOKEN,
    extra_env: Optional[Dict[str, str]] = None,
    first_index: int = 0,
) -> Iterator[Reducers]:
    group = Reducers(count, workers, child_env({"RS_JOB_TOKEN": token, **(extra_env or {})}), first_index)
    try:
        yield group
    finally:
        group.stop()


def run_workers(
    world: int,
    group: Reducers,
    script: str,
    args: List[str],
    token: str = TOKEN,
    extra_env: Optional[Dict[str, str]] = None,
    timeout: float = 240,
) -> List[dict]:
    """Run `script` as W rank processes; each prints one JSON line last. Returns them by rank."""
    procs = []
    for rank in range(world):
        env = child_env(
            {
                "RS_REDUCERS": group.spec,
                "RS_RANK": str(rank),
                "RS_WORLD_SIZE": str(world),
                "RS_JOB_TOKEN": token,
                "RS_CONNECT_TIMEOUT": "30",
                "RS_TIMEOUT": "60",
                **(extra_env or {}),
            }
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return collect(procs, timeout)


def once(results: Dict[Any, Any], key: Any, run: Callable[[], Any]) -> Any:
    """run()'s value for `key`, run at most once per session (a module's job whose results
    several tests read): a failure is kept too, and raised again for each test that asks."""
    if key not in results:
        try:
            results[key] = run()
        except Exception as exc:  # noqa: BLE001 - kept for the next test that reads this job
            results[key] = exc
    if isinstance(results[key], Exception):
        raise results[key]
    return results[key]


def collect(procs: List[subprocess.Popen], timeout: float) -> List[dict]:
    """Each rank process's last stdout line, parsed as JSON, by rank; a rank that fails is an
    AssertionError with its output; every process still running afterwards is killed."""
    results = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise AssertionError(f"rank {rank} exited {proc.returncode}:\n{err[-4000:]}\n{out}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def run_ranks(world: int, make: Callable[[int], Any], body: Callable[[Any, int], Any], limit: float = 20.0) -> list:
    """body(comm, rank) on every rank, each a thread of this process with comm = make(rank),
    closed afterwards (close() or destroy()). Returns the results by rank; re-raises the first
    rank's exception; fails if a rank is still running after `limit` seconds."""
    results: list = [None] * world
    errors: list = [None] * world

    def target(rank: int) -> None:
        comm = None
        try:
            comm = make(rank)
            results[rank] = body(comm, rank)
        except BaseException as exc:  # reported below, in the test's thread
            errors[rank] = exc
        finally:
            if comm is not None:
                (getattr(comm, "close", None) or comm.destroy)()  # NcclCommunicator has destroy()

    threads = [threading.Thread(target=target, args=(r,), daemon=True, name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + limit
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"{hung} did not finish within {limit} s"
    for exc in errors:
        if exc is not None:
            raise exc
    return results


def run_example(
    example: str,
    *args: str,
    cwd: Path,
    world: int = 2,
    reducer_count: int = 1,
    timeout: float = 180,
    env: Optional[Dict[str, str]] = None,
) -> str:
    """Run examples/<example> (or the script at an absolute path) under `reduction-server run`
    as the README shows, with `env` added to the environment; its stdout (a non-zero exit is an
    AssertionError carrying the output)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reduction_server",
            "run",
            "-np",
            str(world),
            "--reducers",
            str(reducer_count),
            "--",
            sys.executable,
            str(ROOT / "examples" / example),
            *args,
        ],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def torchrun(script: Union[str, Path], *args: str, options: Sequence[str] = ()) -> List[str]:
    """The command line of a standalone torchrun of 2 local ranks of `script` (a file of
    tests/scripts, or a path) with `args`; `options` go to torchrun itself."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        *options,
        str(SCRIPTS / script),
        *args,
    ]
