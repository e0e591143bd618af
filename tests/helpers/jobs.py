"""Jobs of Communicators in threads of the test's process, against real reducers: made with the
test settings, run in parallel with a time limit, their results checked exactly."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import psutil

import reduction_server.client as rs

from . import cluster
from .cluster import TOKEN

CHUNK = 65536  # small chunks: a few thousand elements already make several chunks
#: what the in-process Communicators of a test job are made with, unless a test says otherwise
OPTIONS = {"job_token": TOKEN, "timeout": 5, "connect_timeout": 5}


def new_job() -> int:
    """A fresh job id: each test job is its own on the reducers it shares with other tests."""
    return secrets.randbits(63)


def connect(group: cluster.Reducers, rank: int, world: int, job: int, **options: Any) -> rs.Communicator:
    """Rank `rank` of job `job` over `group`, with OPTIONS and `options`."""
    return rs.Communicator(group.addresses, rank, world, job_id=job, **{**OPTIONS, **options})


def run_job(
    world: int,
    body: Callable[[Any, int], Any],
    *,
    make: Optional[Callable[[int], Any]] = None,
    group: Optional[cluster.Reducers] = None,
    limit: float = 20.0,
    **options: Any,
) -> list:
    """body(comm, rank) on every rank, each a thread with its own Communicator of a fresh job."""
    job = new_job()
    make = make or (lambda rank: connect(group, rank, world, job, **options))
    return cluster.run_ranks(world, make, body, limit)


def communicator(group, rank: int, world: int, **options) -> rs.Communicator:
    options.setdefault("job_token", TOKEN)
    options.setdefault("timeout", 10)
    options.setdefault("connect_timeout", 10)
    options.setdefault("chunk_bytes", CHUNK)
    return rs.Communicator(group.addresses, rank, world, **options)


def parallel(*calls: Callable[[], object], timeout: float = 30) -> List[Tuple[str, object]]:
    """Run each call in its own thread; [("ok", value) | ("error", exception)] in order."""
    results: List[Optional[Tuple[str, object]]] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = ("ok", calls[i]())
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[i] = ("error", exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"calls {hung} did not return within {timeout} s"
    return results  # type: ignore[return-value]


def ok(results):
    for i, (kind, value) in enumerate(results):
        assert kind == "ok", f"call {i} failed: {value!r}"
    return [value for _, value in results]


def check_sum_works(comms, count: int = 1000, seed: int = 0) -> None:
    """Every communicator all-reduces; the results equal NumPy's."""
    xs = [np.random.default_rng([seed, r]).integers(-1000, 1000, count).astype(np.int64) for r in range(len(comms))]
    out = ok(parallel(*[lambda c=c, x=x: c.all_reduce(x, "sum") for c, x in zip(comms, xs)]))
    for y in out:
        np.testing.assert_array_equal(y, np.sum(xs, axis=0))


def job_loop(
    comm: rs.Communicator,
    started: threading.Event,
    keep_going: threading.Event,
    min_iterations: int = 50,
    max_iterations: int = 5000,
) -> Tuple[int, List[str]]:
    """All-reduce (sum and max of int64) until rank 0 says stop; check every result exactly.
    The last element carries rank 0's 'continue' flag, so that all ranks agree on when to stop."""
    rank, world = comm.rank, comm.world_size
    failures: List[str] = []
    n = 0
    while True:
        count = [1, 7, 1000, 20_000, 3 * CHUNK // 8 + 5][n % 5]
        op = "max" if n % 3 == 2 else "sum"
        xs = [np.random.default_rng([n, r]).integers(-(10**6), 10**6, count) for r in range(world)]
        go = int(rank == 0 and n < max_iterations and (n < min_iterations or keep_going.is_set()))
        y = comm.all_reduce(np.append(xs[rank], go).astype(np.int64), op)
        expected = np.sum(xs, axis=0) if op == "sum" else np.max(xs, axis=0)
        if not np.array_equal(y[:-1], expected):
            failures.append(f"iteration {n} ({op} of {count}): wrong result")
        n += 1
        if n == 5:
            started.set()
        if y[-1] == 0:
            return n, failures


def until(condition: Callable[[], Any], what: str, limit: float = 20.0) -> None:
    """Wait until condition() holds, failing after `limit` seconds, naming `what` was awaited."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"waited {limit:g} s for {what}"
        time.sleep(0.01)


def wait_until_idle(group, index: int = 0, quiet: float = 0.5, limit: float = 20.0) -> None:
    """Wait until the reducer has stopped using CPU for `quiet` seconds (it drained its input)."""
    proc = psutil.Process(group.procs[index].pid)
    deadline = time.monotonic() + limit
    last = sum(proc.cpu_times()[:2])
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = sum(proc.cpu_times()[:2])
        if now - last < 0.02 * quiet:
            return
        last = now
