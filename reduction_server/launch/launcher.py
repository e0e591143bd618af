"""`reduction-server run`: a local job of R reducer processes and W worker processes.

The launcher gives every worker the variables the client (RS_*) and torch.distributed-style
code (RANK, WORLD_SIZE, MASTER_ADDR, ...) expect, prefixes each output line with its rank, and
makes sure the job ends as a whole: the first failing worker, a reducer that dies early, or a
signal to the launcher stops every process, grandchildren included.

With --max-restarts N, as torchrun's elastic agent does, a failing worker instead stops the
other workers and starts the whole group again, up to N times, with TORCHELASTIC_RESTART_COUNT
one higher: the workers add it to RS_GENERATION, so the same reducers serve the new group as the
next generation, and the script knows which attempt it is (so it resumes from its checkpoint).
Each start of the worker group gets a fresh RS_RUN_ID (unless the caller set one): a reducer
tells its ranks from late ones of the group before by it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence

from ..children import (
    AWAY_FROM_SOURCE,
    POLL_S,
    Child,
    close_all,
    copy_output,
    describe,
    die_with_parent_hook,
    exit_code,
    peek_exit,
    signal_name,
    stop_all,
    wait_briefly,
)
from ..config import settings
from .elastic import Elastic
from .local_layout import Layout, busy_port, check_arguments, job_environment, plan_layout, worker_environment

_PREFIX = "reduction-server run:"
_GRACE_S = 5.0  # between SIGTERM and SIGKILL when stopping children
_READER_JOIN_S = 2.0  # how long to wait for the last output after the children are gone
_READY_S = 60.0  # how long a reducer may take to listen (imports, bind) before the job gives up
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_RESTART = -1  # _outcome(): a worker failed, and the group may start again


@dataclass
class _Job:
    layout: Layout
    np: int
    command: List[str]
    metrics_port: Optional[int] = None  # reducer i serves metrics on metrics_port + i
    max_restarts: int = 0
    elastic: Optional[Elastic] = None  # --min-np/--max-np: workers come and go (elastic.py)
    shards: str = "1"  # each reducer's --shards: a count, or `auto` (its share of this host's cores)
    restarts: int = 0  # how many times the worker group has been started again
    env: Dict[str, str] = field(default_factory=dict)  # what every child sees (job_environment)
    workers: List[Child] = field(default_factory=list)
    reducers: List[Child] = field(default_factory=list)
    worker_readers: List[threading.Thread] = field(default_factory=list)  # copying each worker's output
    reducer_readers: List[threading.Thread] = field(default_factory=list)
    output_lock: threading.Lock = field(default_factory=threading.Lock)
    signum: Optional[int] = None  # the first stop signal the launcher received

    def on_signal(self, signum: int, frame: object) -> None:
        # Only record it: the watch loop acts on it, so a signal never interrupts a half-done step.
        if self.signum is None:
            self.signum = signum

    def run(self) -> int:
        """Start every process and wait until the job's exit code is decided."""
        try:
            failure = self._spawn_all()
        finally:
            # After the last fork, not before: preexec_fn is only safe while no other thread runs.
            self.worker_readers = self._start_readers(self.workers)
            self.reducer_readers = self._start_readers(self.reducers)
        if failure is not None:
            return failure
        _say(
            f"started {self.np} worker(s) and {len(self.reducers)} reducer(s) at "
            f"{','.join(self.layout.reducer_addresses())}; "
            f"MASTER_ADDR={self.layout.connect_host} MASTER_PORT={self.layout.master_port}"
        )
        while True:
            code = self._outcome()
            if code is None:
                time.sleep(POLL_S)
            elif code == _RESTART:
                failure = self._restart_workers()
                if failure is not None:
                    return failure
            else:
                return code

    def stop(self) -> None:
        """Stop and reap every child, then let the readers copy the rest of their output."""
        stop_all(self.workers + self.reducers, _GRACE_S)
        _join(self.worker_readers + self.reducer_readers)
        if self.elastic is not None:
            self.elastic.close()

    def _spawn_all(self) -> Optional[int]:
        env = self.env = job_environment(self.layout, self.np)
        die_with_parent = die_with_parent_hook()
        # Reducers first, and workers only once every reducer listens: a port that another process
        # holds fails the job here, before any worker could reach a stranger there.
        ready: List[int] = []
        try:
            for index, port in enumerate(self.layout.reducer_ports):
                ready_r, ready_w = os.pipe()
                ready.append(ready_r)
                argv = [
                    sys.executable,
                    "-m",
                    "reduction_server",
                    "serve",
                    "--host",
                    self.layout.bind_host,
                    "--port",
                    str(port),
                    "--index",
                    str(index),
                    "--ready-fd",
                    str(ready_w),
                ]
                # One process each unless asked: the workers share this host's cores, and --reducers
                # sets how many. `auto` counts a reducer's share of them: the R reducers split them.
                argv += ["--shards", self.shards]
                if self.elastic is None:  # an elastic job's rounds each have a world size of their own
                    argv += ["--workers", str(self.np)]
                # Each reducer its own port: an inherited RS_METRICS_PORT would make the second one fail.
                argv += ["--metrics-port", str(self.metrics_port + index if self.metrics_port else 0)]
                child_env = dict(
                    env, RS_REDUCER_INDEX=str(index), RS_LOCAL_REDUCERS=str(len(self.layout.reducer_ports))
                )
                if self.elastic is not None:
                    child_env.pop("RS_WORLD_SIZE")
                # From the root directory: `-m` puts the working directory first on sys.path, and in a
                # source checkout that is the uncompiled tree, not the installed package.
                try:
                    failure = self._spawn(
                        self.reducers,
                        f"reducer {index}",
                        argv,
                        child_env,
                        die_with_parent,
                        cwd=AWAY_FROM_SOURCE,
                        pass_fds=(ready_w,),
                    )
                finally:
                    os.close(ready_w)
                if failure is not None:
                    return failure
            failure = self._await_reducers(ready)
        finally:
            close_all(ready)
        if failure is not None or self.signum is not None:
            return failure if failure is not None else self._outcome()
        env["RS_REDUCERS"] = ",".join(self.layout.reducer_addresses())  # sharded ones chose their ports
        return self._spawn_workers(die_with_parent)

    def _spawn_workers(self, die_with_parent: Optional[Callable[[], None]]) -> Optional[int]:
        # Each start of the group is a run of its own (unless the caller named one): a reducer
        # never takes one of its ranks for a late rank of the group before (discovery.run_id).
        # Workers an elastic job adds later (self.env) join this run.
        self.env["RS_RUN_ID"] = settings.read("RS_RUN_ID") or secrets.token_hex(8)
        # As torchrun's agent does; the workers add it to RS_GENERATION (discovery.py), so the
        # reducers drop the previous group's rounds.
        env = dict(self.env, TORCHELASTIC_RESTART_COUNT=str(self.restarts))
        if self.elastic is not None:
            self.elastic.start(env["RS_JOB_TOKEN"], self.layout.connect_host)
        for rank in range(self.np):
            failure = self._spawn_worker(env, rank, die_with_parent)
            if failure is not None:
                return failure
        return None

    def _spawn_worker(
        self, env: Dict[str, str], rank: int, die_with_parent: Optional[Callable[[], None]]
    ) -> Optional[int]:
        """Worker `rank` (in an elastic job, worker id `rank`: its rank comes from the rendezvous)."""
        env = worker_environment(env, self.layout, rank, self.np)
        if self.elastic is not None:
            return self._spawn(
                self.workers, f"worker {rank}", self.command, self.elastic.worker_env(env, rank), die_with_parent
            )
        return self._spawn(self.workers, f"rank {rank}", self.command, env, die_with_parent)

    def _restart_workers(self) -> Optional[int]:
        """Stop what is left of the worker group and start it again (the reducers keep running)."""
        stop_all(self.workers, _GRACE_S)
        _join(self.worker_readers)
        self.workers.clear()
        self.restarts += 1
        _say(f"restarting the {self.np} worker(s) (restart {self.restarts} of {self.max_restarts})")
        failure = self._spawn_workers(die_with_parent_hook())
        self.worker_readers = self._start_readers(self.workers)
        return failure

    def _await_reducers(self, ready: List[int]) -> Optional[int]:
        """Wait until every reducer says, on its `ready` pipe, that it listens at its planned port
        (any, when it was to choose one: then the layout takes it); the job's exit code if one
        cannot. A stop signal ends the wait (the caller acts on it)."""
        deadline = time.monotonic() + _READY_S
        for i, (child, port, address, fd) in enumerate(
            zip(self.reducers, self.layout.reducer_ports, self.layout.reducer_addresses(), ready)
        ):
            said = b""
            while not said.endswith(b"\n"):
                if self.signum is not None:
                    return None
                if time.monotonic() >= deadline:
                    _say(f"{child.label} did not listen at {address} within {_READY_S:g} s; stopping the job")
                    return 1
                if not select.select([fd], [], [], POLL_S)[0]:
                    continue
                chunk = os.read(fd, 64)
                if not chunk:  # it exited, or closed the pipe, before listening: its output says why
                    status = wait_briefly(child.proc)
                    _say(
                        f"{child.label} exited before it listened at {address}"
                        + (f" ({describe(status)})" if status is not None else "")
                        + "; stopping the job"
                    )
                    return exit_code(status) if status else 1
                said += chunk
            if port == 0 and said.strip().isdigit():
                self.layout.reducer_ports[i] = int(said)
            elif said.strip() != str(port).encode():
                _say(
                    f"{child.label} listens at port {said.strip().decode(errors='replace')}, not {port}; "
                    "stopping the job"
                )
                return 1
        return None

    @staticmethod
    def _spawn(
        children: List[Child],
        label: str,
        argv: List[str],
        env: Dict[str, str],
        die_with_parent: Optional[Callable[[], None]],
        cwd: Optional[str] = None,
        pass_fds: Sequence[int] = (),
    ) -> Optional[int]:
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,  # W processes must not fight over the terminal
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: one killpg reaches its descendants
                preexec_fn=die_with_parent,
                pass_fds=pass_fds,
            )
        except OSError as exc:
            _say(f"cannot start {label} ({' '.join(argv)}): {exc}")
            return 127 if isinstance(exc, FileNotFoundError) else 126  # the shell's codes
        children.append(Child(label, proc))
        return None

    def _start_readers(self, children: List[Child]) -> List[threading.Thread]:
        """One started thread per child, copying its output."""
        readers = []
        for child in children:
            reader = threading.Thread(
                target=copy_output,
                args=(child.proc.stdout, f"[{child.label}] ", self.output_lock),
                name=f"output of {child.label}",
                daemon=True,
            )
            reader.start()
            readers.append(reader)
        return readers

    def _outcome(self) -> Optional[int]:
        """The job's exit code once it is decided (_RESTART: a worker failed and the group may
        start again), else None; says why when it is a failure."""
        if self.signum is not None:
            _say(f"received {signal_name(self.signum)}; stopping the job")
            return 128 + self.signum
        if self.elastic is not None:
            return self._elastic_outcome()
        running = 0
        for child in self.workers:  # in rank order, so simultaneous failures report the lowest rank
            status = peek_exit(child.proc)
            if status is None:
                running += 1
            elif status != 0:
                if self.restarts < self.max_restarts:
                    _say(f"{child.label} {describe(status)}; stopping the other workers")
                    return _RESTART
                _say(f"{child.label} {describe(status)}; stopping the job")
                return exit_code(status)
        if running == 0:
            return 0
        return self._reducers_outcome()

    def _elastic_outcome(self) -> Optional[int]:
        """An elastic job goes on while --min-np workers run; it ends when none does (0 if one
        finished well). New slots from the discovery script get new workers until one finishes."""
        running, finished, failed = [], 0, None
        for worker, child in enumerate(self.workers):
            status = peek_exit(child.proc)
            if status is None:
                running.append(worker)
            elif status == 0:
                finished += 1
                if worker in self.elastic.rendezvous.members:  # done: a round no longer waits for it
                    self.elastic.lose(worker)
            elif worker in self.elastic.rendezvous.members:  # newly failed
                self.elastic.lose(worker)
                failed = (child, status)
        if failed is not None and len(running) + finished < self.elastic.min_np:
            _say(
                f"{failed[0].label} {describe(failed[1])}; {len(running)} worker(s) left, fewer than --min-np "
                f"{self.elastic.min_np}: stopping the job"
            )
            return exit_code(failed[1])
        if failed is not None:
            _say(f"{failed[0].label} {describe(failed[1])}; going on with {len(running)} worker(s)")
        if not running:
            return 0 if finished else 1
        # A worker that finished well means the job is ending: a newcomer would start it over.
        for _ in range(0 if finished else self.elastic.wanted(len(running))):
            worker = len(self.workers)
            _say(f"starting worker {worker}: the discovery script reports a free slot")
            failure = self._spawn_worker(self.env, worker, die_with_parent_hook())
            if failure is not None:
                return failure
            self.worker_readers += self._start_readers(self.workers[-1:])
        return self._reducers_outcome()

    def _reducers_outcome(self) -> Optional[int]:
        """1 (or its code) when a reducer exited while workers still run, else None."""
        for child, address in zip(self.reducers, self.layout.reducer_addresses()):
            status = peek_exit(child.proc)
            if status is not None:  # even a clean exit: the workers still need it
                _say(f"{child.label} ({address}) {describe(status)} while workers were running; stopping the job")
                return exit_code(status) or 1
        return None


def run_job(
    np: int,
    reducers: int,
    command: Sequence[str],
    port_base: Optional[int] = None,
    host: str = "127.0.0.1",
    metrics_port: Optional[int] = None,
    max_restarts: int = 0,
    min_np: Optional[int] = None,
    max_np: Optional[int] = None,
    discovery: Optional[str] = None,
    shards: str = "1",
) -> int:
    """Run `reducers` reducer processes (each of `shards` shard processes: a count, or `auto`, its
    share of the cores) and `np` copies of `command` on this machine; a failing
    worker starts the worker group again up to `max_restarts` times. With `min_np`/`max_np` the
    job is elastic (elastic.py): it goes on without failed workers while `min_np` run,
    and starts new ones up to `max_np` as the `discovery` script reports slots.

    Returns 0 when every worker exits 0; the first failing worker's exit code (128+signal when
    it was killed) once no restart is left; 128+signal when the launcher is stopped by
    SIGINT/SIGTERM/SIGHUP; 1 or the reducer's code when a reducer exits while workers run; 2 for
    bad arguments.
    """
    if max_restarts < 0:
        return _usage_error(f"--max-restarts must be at least 0 (got {max_restarts})")
    elastic = None
    if min_np is not None or max_np is not None or discovery is not None:
        low, high = min_np or 1, max_np or np
        if not 1 <= low <= np <= high:
            return _usage_error(f"an elastic job needs 1 <= --min-np <= -np <= --max-np (got {low}, {np}, {high})")
        if max_restarts:
            return _usage_error(
                "--max-restarts restarts the whole group; an elastic job (--min-np/--max-np) "
                "goes on without the failed worker: choose one"
            )
        elastic = Elastic(low, high, _say, discovery)
    problem = check_arguments(np, reducers, command, port_base, metrics_port, shards)
    if problem is not None:
        return _usage_error(problem)
    try:
        layout = plan_layout(host, reducers, port_base, metrics_port, sharded=shards != "1")
        busy = busy_port(layout, metrics_port)
    except OSError as exc:
        return _usage_error(f"cannot use --host {host!r}: {exc}")
    if busy is not None:  # before any process starts: nothing to stop, and the owner named
        _say(busy)
        return 1
    job = _Job(layout, np, list(command), metrics_port, max_restarts, elastic, shards)
    started = time.monotonic()
    with _signals_recorded_by(job):
        try:
            code = job.run()
        finally:
            job.stop()
    if code == 0:  # a failure has said why already
        restarts = f" after {job.restarts} restart(s)" if job.restarts else ""
        _say(f"job done: every worker exited 0{restarts}, in {time.monotonic() - started:.1f} s")
    return code


def _join(readers: List[threading.Thread]) -> None:
    """Let the readers copy the last output of children that are gone."""
    deadline = time.monotonic() + _READER_JOIN_S
    for reader in readers:
        # Bounded: a process that escaped its group could hold a pipe open forever.
        reader.join(max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def _signals_recorded_by(job: _Job) -> Iterator[None]:
    """Route the stop signals to `job` for the duration; only the main thread may do that."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, job.on_signal) for signum in _STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _usage_error(message: str) -> int:
    _say(message)
    return 2


def _say(message: str) -> None:
    print(f"{_PREFIX} {message}", file=sys.stderr, flush=True)
