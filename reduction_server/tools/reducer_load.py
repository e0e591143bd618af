"""Reducers under a synthetic load, and what they spend: R x `reduction-server serve --shards N`
on loopback, W local worker processes all-reducing float32 over tcp (RS_SHM=0: the chunks come
through sockets, as between hosts), the CPU time each thread of the reducers' processes spent over
the timed all-reduces (Linux's /proc), and the lead worker's own. `reduction-server size
--measure`, `reduction-server bench reducer` and `bench chunks` are built on it.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..children import AWAY_FROM_SOURCE, die_with_parent_hook

GIB = 1 << 30
GBIT_PER_GIB = GIB * 8 / 1e9
_TOKEN = "reducer-load"
_LISTENING = re.compile(r"listening on tcp://(\S+):(\d+)")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

Thread = Tuple[int, int]  # (pid, tid)


@dataclass
class Load:
    """A load's timed all-reduces: their wall time, each reducer thread's CPU time over them, and
    the lead worker's (rank 0, all its threads)."""

    world: int
    mib: float
    iters: int
    seconds: float
    threads: Dict[Thread, float]  # CPU seconds
    names: Dict[Thread, str]  # as the kernel has them (libzmq's I/O threads: ZMQbg/IO/N)
    worker_cpu_seconds: float = 0.0

    @property
    def incoming_gib(self) -> float:
        """Gradient the reducer received: W x size x iterations."""
        return self.world * self.mib * (1 << 20) * self.iters / GIB

    @property
    def cpu_seconds(self) -> float:
        return sum(self.threads.values())

    @property
    def cpu_s_per_gib(self) -> float:
        return self.cpu_seconds / self.incoming_gib

    @property
    def worker_cpu_s_per_gib(self) -> float:
        """The lead worker's CPU time per GiB it all-reduces (size x iterations): what a worker pays
        the network besides its own work, send, receive, copy."""
        return self.worker_cpu_seconds / (self.mib * self.iters / 1024)

    @property
    def gbit_s_in(self) -> float:
        """Incoming gradient per second (a lower bound: the workers share this machine's cores)."""
        return self.incoming_gib * GBIT_PER_GIB / self.seconds

    def busiest(self) -> Tuple[str, float]:
        """The busiest thread's name and its share of the reducer's CPU time."""
        top = max(self.threads, key=self.threads.__getitem__)
        return self.names.get(top, str(top[1])), self.threads[top] / self.cpu_seconds

    def busy_threads(self) -> int:
        """Threads that did at least 1 % of the work."""
        return sum(1 for t in self.threads.values() if t > 0.01 * self.cpu_seconds)


def _family(pid: int) -> List[int]:
    """`pid` and its children (a sharded reducer's supervisor and its shards)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue  # it exited meanwhile
    return [pid, *kids]


def thread_clocks(pids: List[int]) -> Tuple[Dict[Thread, float], Dict[Thread, str]]:
    """CPU seconds (user + system) of every thread of these processes so far, and their names."""
    clocks: Dict[Thread, float] = {}
    names: Dict[Thread, str] = {}
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            task = f"/proc/{pid}/task/{tid}"
            try:
                clocks[pid, tid] = _cpu_seconds(task)
                with open(f"{task}/comm") as f:
                    names[pid, tid] = f.read().strip()
            except OSError:
                clocks.pop((pid, tid), None)  # it exited meanwhile
    return clocks, names


def process_cpu_seconds() -> float:
    """This process's CPU time so far, user and system, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_seconds(task: str) -> float:
    """A thread's time on a CPU: schedstat's nanoseconds where the kernel keeps them, else stat's
    user + system ticks, whose 10 ms steps make a short load read as no work at all."""
    try:
        with open(f"{task}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except FileNotFoundError:
        with open(f"{task}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK


def _serve(index: int, world: int, shards: int, env: Dict[str, str], hook) -> subprocess.Popen:
    """Reducer `index` on a free loopback port, which it says on its first line."""
    command = [sys.executable, "-m", "reduction_server", "serve", "--host", "127.0.0.1", "--port", "0"]
    command += ["--index", str(index), "--workers", str(world), "--shards", str(shards)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=AWAY_FROM_SOURCE, preexec_fn=hook)


def _stop(reducer: subprocess.Popen) -> None:
    reducer.terminate()  # a sharded reducer's supervisor stops its shards
    try:
        reducer.wait(timeout=30)
    except subprocess.TimeoutExpired:
        reducer.kill()
        reducer.wait()


def run(
    world: int,
    mib: float,
    iters: int,
    shards: int = 1,
    timeout: float = 300,
    compression: str = "none",
    reducers: int = 1,
    env: Optional[Dict[str, str]] = None,
) -> Load:
    """Start `reducers` reducers of `shards` shards each and W workers, time `iters` all-reduces of
    `mib` MiB float32 after a warm-up, and stop them all (they die with this process).
    `compression`: the workers' `compression=` (the gradient a GiB counts stays float32's); `env`:
    settings for every process (RS_CHUNK_BYTES, ...). RuntimeError if any of them fails or the
    whole takes longer than `timeout` seconds."""
    if world < 1 or mib <= 0 or iters < 1 or shards < 1 or reducers < 1:
        raise ValueError(
            f"a load needs workers >= 1, a positive size, iters >= 1, shards >= 1 and reducers >= 1 "
            f"(got {world}, {mib}, {iters}, {shards}, {reducers})"
        )
    env = {**os.environ, **(env or {}), "RS_SHM": "0", "RS_JOB_TOKEN": _TOKEN}
    hook = die_with_parent_hook()
    # From the root directory: `-m` puts the working directory first on sys.path (a checkout's tree).
    pool = [_serve(index, world, shards, env, hook) for index in range(reducers)]
    workers: List[subprocess.Popen] = []
    # A process that stops answering is killed after `timeout`: the reads below then end.
    watchdog = threading.Timer(timeout, lambda: [p.kill() for p in [*pool, *workers] if p.poll() is None])
    watchdog.start()
    try:
        addresses = []
        for reducer in pool:
            match = _LISTENING.search(reducer.stdout.readline())
            if not match:
                raise RuntimeError("a reducer did not start")
            addresses.append(f"{match.group(1)}:{match.group(2)}")
        address = ",".join(addresses)
        for rank in range(world):
            workers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "reduction_server.bench.reducer_job", f"{mib:g}", str(iters), compression],
                    cwd=AWAY_FROM_SOURCE,
                    env=dict(env, RS_REDUCERS=address, RS_RANK=str(rank), RS_WORLD_SIZE=str(world)),
                    stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    text=True,
                    preexec_fn=hook,
                )
            )
        lead = workers[0]
        if lead.stdout.readline().strip() != "READY":
            raise RuntimeError("the workers did not get ready")
        family = [pid for reducer in pool for pid in _family(reducer.pid)]
        before, _ = thread_clocks(family)
        lead.stdin.write("go\n")
        lead.stdin.flush()
        done = lead.stdout.readline()
        after, names = thread_clocks(family)
        if not done.startswith("DONE "):
            raise RuntimeError(f"the workers failed: {done!r}")
        lead.stdin.write("end\n")
        lead.stdin.flush()
        for w in workers:
            if w.wait(timeout=timeout) != 0:
                raise RuntimeError(f"a worker exited with {w.returncode}")
    finally:
        watchdog.cancel()
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for reducer in pool:
            _stop(reducer)
    spent = {t: after[t] - before.get(t, 0.0) for t in after}
    timed = json.loads(done[5:])
    load = Load(world, mib, iters, timed["seconds"], spent, names, timed["cpu_s"])
    if load.cpu_seconds <= 0:  # only with stat's ticks
        raise RuntimeError(f"W={world}, {mib:g} MiB x {iters}: too little work to measure; raise the size or iters")
    return load
