"""Soak: thousands of collectives of mixed sizes, dtypes and ops on real reducers and workers,
every result checked; then the reducers' and the workers' memory and open files must not have
grown since the warm-up. RS_SOAK_SECONDS (default 20) sets the length; set it higher (hours)
for a real soak.

Bounds, after a warm-up in which every size, dtype and op has been seen once: RSS may grow by at
most 32 MiB per reducer and 64 MiB per worker (allocator noise; a leak of one chunk per
collective would be gigabytes), and the number of open files may not grow at all (a reducer's go
back to their number after a first short job once the workers have left).

Also here, in process: a send that finds a peer gone keeps nothing of its caller alive, and what
a reducer keeps about peers that are not admitted (strike counts of malformed frames, HELLOs never
followed by AUTH) is dropped when they go away.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from typing import List

import numpy as np
import pytest
import zmq

import reduction_server.client as rs
from helpers.capture import CapturingSocket
from helpers.cluster import SCRIPTS, TOKEN, child_env, collect, reducers, run_ranks
from helpers.handshake import hello_payload
from helpers.probes import fd_targets, open_fds, rss, settled_fds
from reduction_server.reducer import FORGET_AFTER_S, MAX_STRIKES, Reducer
from reduction_server.reducer import admission as admission_module
from reduction_server.reducer.outbox import Outbox
from reduction_server.wire import protocol
from reduction_server.wire.protocol import MsgType

SOAK_SECONDS = float(os.environ.get("RS_SOAK_SECONDS", "20"))
WARMUP_SECONDS = min(6.0, SOAK_SECONDS / 3)
pytestmark = pytest.mark.timeout(120 + 2 * SOAK_SECONDS)

REDUCER_RSS_GROWTH = 32 << 20
WORKER_RSS_GROWTH = 64 << 20
WORLD = 3


def test_thousands_of_mixed_collectives_leave_memory_and_open_files_where_they_were():
    with reducers(2, workers=WORLD, extra_env={"RS_TIMEOUT": "60"}) as group:
        # A first short job: libzmq and pyzmq open some files on first use (I/O thread mailboxes,
        # the zero-copy tracker's thread), which stay open; after it the reducers are idle.
        run_ranks(
            WORLD,
            lambda r: rs.Communicator(group.addresses, r, WORLD, job_token=TOKEN),
            lambda comm, r: comm.all_reduce(np.ones(1 << 20, np.float32)),
        )
        idle = [settled_fds(p.pid, None) for p in group.procs]
        idle_targets = [fd_targets(p.pid) for p in group.procs]
        procs: List[subprocess.Popen] = []
        for rank in range(WORLD):
            env = child_env(
                {
                    "RS_REDUCERS": group.spec,
                    "RS_RANK": str(rank),
                    "RS_WORLD_SIZE": str(WORLD),
                    "RS_JOB_TOKEN": TOKEN,
                    "RS_CHUNK_BYTES": str(256 << 10),
                }
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(SCRIPTS / "soak_worker.py"), str(SOAK_SECONDS), str(WARMUP_SECONDS)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        first = procs[0].stdout.readline()  # rank 0 is warm: every size, dtype and op has been seen
        assert '"warm"' in first, first + (procs[0].stderr.read() if procs[0].poll() is not None else "")
        warm = [{"rss": rss(p.pid), "fds": open_fds(p.pid)} for p in group.procs]
        results = collect(procs, timeout=60 + 2 * SOAK_SECONDS)
        end = [{"rss": rss(p.pid), "fds": open_fds(p.pid)} for p in group.procs]
        # A worker's segment and connection go when the reducer has judged it gone: heartbeat
        # probes, each up to a second apart, and later on a loaded machine (seen: over 5 s).
        after_job = [settled_fds(p.pid, fds, limit=30.0) for p, fds in zip(group.procs, idle)]
        after_targets = [fd_targets(p.pid) for p in group.procs]
        assert group.alive()
        logs = group.stop()
    done = sum(r["done"] for r in results) // WORLD
    print(f"{done} collectives per rank in {results[0]['seconds']:.1f} s")
    for r, result in enumerate(results):
        assert result["failures"] == [], f"rank {r}: {result['failures']}"
        grown = result["end"]["rss"] - result["warm"]["rss"]
        print(
            f"worker {r}: RSS {result['warm']['rss'] >> 20} -> {result['end']['rss'] >> 20} MiB, "
            f"open files {result['warm']['fds']} -> {result['end']['fds']}"
        )
        assert grown < WORKER_RSS_GROWTH, f"worker {r} grew by {grown >> 20} MiB"
        assert result["end"]["fds"] <= result["warm"]["fds"], f"worker {r} opened files: {result}"
    assert done >= 1000 or SOAK_SECONDS < 20, f"only {done} collectives"
    for i, (before, after) in enumerate(zip(warm, end)):
        print(
            f"reducer {i}: RSS {before['rss'] >> 20} -> {after['rss'] >> 20} MiB; open files {idle[i]} idle, "
            f"{before['fds']} during the job, {after_job[i]} after it"
        )
        assert after["rss"] - before["rss"] < REDUCER_RSS_GROWTH, f"reducer {i} grew: {before} -> {after}"
        # the workers have gone: their connections are closed, and nothing else stays open
        assert after_job[i] == idle[i], (
            f"reducer {i}: {idle[i]} open files idle, {after_job[i]} after the job; "
            f"new: {sorted(set(after_targets[i]) - set(idle_targets[i]))}"
        )
    for log in logs:
        assert "internal error" not in log and "round_failed" not in log, log[-3000:]


def test_what_a_reducer_keeps_about_strangers_is_dropped_when_they_go(monkeypatch):
    sock = CapturingSocket()
    reducer = Reducer(sock, world_size=2, job_token="token")
    info = hello_payload()
    hello = protocol.text_header(MsgType.HELLO, info, rank=0, world=2, job=5)
    strangers = [b"s%d" % i for i in range(3000)]
    for identity in strangers:
        reducer.handle([zmq.Frame(identity), zmq.Frame(b"garbage")])
    for identity in strangers[:10]:  # these are dropped for good, and keep sending
        for _ in range(MAX_STRIKES):
            reducer.handle([zmq.Frame(identity), zmq.Frame(b"garbage")])
    greeters = [b"g%d" % i for i in range(500)]  # a HELLO, and never an AUTH
    for identity in greeters:
        reducer.handle([zmq.Frame(identity), zmq.Frame(hello), zmq.Frame(info)])
    assert len(reducer.strikes) == 3000 and len(reducer.peers) == 500
    # A send that finds the connection gone drops its strike count at once.
    sock.gone.update(strangers[10:20])
    for identity in strangers[10:20]:
        reducer.handle([zmq.Frame(identity), zmq.Frame(b"garbage")])
    assert len(reducer.strikes) == 2990
    reducer.members.check_unreachable()
    # Silent for FORGET_AFTER_S: forgotten, except the dropped peers that are still sending.
    later = reducer.now + FORGET_AFTER_S + 1
    reducer.now = later - 1
    for identity in strangers[:10]:
        reducer.handle([zmq.Frame(identity), zmq.Frame(b"garbage")])
    reducer.admission.forget_strangers(later)
    assert sorted(reducer.strikes) == sorted(strangers[:10]) and reducer.peers == {}
    # And the table is capped, whatever the rate of new identities.
    monkeypatch.setattr(admission_module, "MAX_STRIKE_ENTRIES", 100)
    for identity in strangers:
        reducer.handle([zmq.Frame(identity), zmq.Frame(b"garbage")])
    reducer.admission.forget_strangers(reducer.now)
    assert len(reducer.strikes) == 100


def test_a_send_to_a_peer_that_is_gone_keeps_nothing_of_its_caller_alive():
    """Seen in the soak: a PING to a worker that had just left failed (EHOSTUNREACH) and its peer,
    with the worker's mapped segment (an open file), stayed alive in a reference cycle through the
    failed send's traceback. An idle reducer allocates next to nothing, so no garbage collection
    would ever free it: it must go as the call returns."""

    class Held:  # stands for the peer in the caller's locals
        pass

    with zmq.Context() as context, context.socket(zmq.ROUTER) as sock:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        gone: List[bytes] = []
        outbox = Outbox(sock, 0, "reducer 0", gone.append)

        def caller(identity: bytes) -> weakref.ref:
            held = Held()
            assert not outbox.send(identity, [b"ping"])
            return weakref.ref(held)

        gc.disable()
        try:
            refs = [caller(b"first"), caller(b"first"), caller(b"second")]  # the first send to each is logged
        finally:
            gc.enable()
        assert gone == [b"first", b"first", b"second"]
        assert outbox.unsent == {b"first": 2, b"second": 1}
        assert [ref() is None for ref in refs] == [True, True, True]
