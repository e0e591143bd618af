"""Reducer shards (`serve --shards N`, issue 18): one reducer address, N reducer processes on
consecutive ports, every worker's chunks spread over all of them; a shard that dies is started
again by its supervisor and used again by the workers, and a sharded job's results are the same
bits as an unsharded one's (deterministic mode)."""

from __future__ import annotations

import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import psutil
import pytest

import reduction_server.client as rs
from helpers.cluster import TOKEN, child_env, reducers, run_ranks
from helpers.jobs import until
from helpers.metrics import probe, scrape, value
from helpers.ports import free_port_range
from helpers.source_tree import ROOT
from helpers.training import FAST, Run
from reduction_server import CollectiveError, ConfigError
from reduction_server.client.chunking import plan_chunks
from reduction_server.client.engine.endpoints import Endpoint, check_shard_counts, expand
from reduction_server.config import settings
from reduction_server.errors import ListenError
from reduction_server.reducer import shards as shard_count

_STOPPED = re.compile(r"stopped reducer=(\d+) shard=(\d+) completed=(\d+)")
_BYTES_IN = re.compile(r"stopped reducer=0 shard=(\d+) .*?\bbytes_in=(\d+)")


def _shards(proc: subprocess.Popen) -> List[psutil.Process]:
    """The shard processes a supervisor runs, by shard number."""
    kids = psutil.Process(proc.pid).children()
    return sorted(kids, key=lambda p: int(p.cmdline()[p.cmdline().index("--shard") + 1]))


def _completed(logs: List[str]) -> dict:
    """(reducer, shard) -> rounds completed, from the shards' "stopped" lines (the last one of each)."""
    return {(int(r), int(s)): int(n) for log in logs for r, s, n in _STOPPED.findall(log)}


def test_the_plan_order_is_shard_by_shard_with_the_spares_last():
    ends, spare = expand(["a:10", "b:20", "c:30"], [2, 1, 3], spares=1)
    assert [(e.reducer, e.shard, e.address) for e in ends] == [
        (0, 0, "a:10"),
        (1, 0, "b:20"),
        (0, 1, "a:11"),
        (2, 0, "c:30"),
        (2, 1, "c:31"),
        (2, 2, "c:32"),
    ]
    assert spare == 3
    assert Endpoint(0, 1, "a:11", sharded=True).name() == "reducer 0 shard 1 (a:11)"
    assert expand(["[::1]:5"], [2], 0)[0][1].address == "[::1]:6"


def test_a_shard_that_names_another_shard_count_than_its_shard_0_is_refused_by_name():
    ends, _ = expand(["a:10", "b:20"], [2, 1], spares=0)
    check_shard_counts(ends, [2, 1, 2], [2, 1], rank=3)  # every shard agrees with its shard 0
    with pytest.raises(
        CollectiveError,
        match=r"rank 3: reducer 0 shard 1 \(a:11\) says its reducer runs 3 "
        r"shards, but its shard 0 said 2",
    ):
        check_shard_counts(ends, [2, 1, 3], [2, 1], rank=3)


def test_auto_is_the_cores_this_process_may_use_and_bad_counts_are_named():
    assert shard_count.count("auto") == shard_count.count(None) == shard_count.usable_cores() >= 1
    assert shard_count.usable_cores() <= len(os.sched_getaffinity(0))
    assert shard_count.count("3") == 3
    for bad in ("0", "many", "257"):
        with pytest.raises(ConfigError, match="RS_SHARDS"):
            shard_count.count(bad)


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "frames"])
def test_chunks_spread_over_every_shard_of_every_reducer_and_sum_right(shm: str):
    """Two reducers of two shards: four endpoints, each of which completes a share of the rounds;
    each all-reduce is right on every rank. The chunks are sized by the two reducers, not the four
    endpoints: shards share their host's chunks, so more shards never cut smaller ones."""
    size = 3_000_000
    with reducers(2, extra_env={"RS_SHARDS": "2", "RS_SHM": shm}) as group:
        assert len(_shards(group.procs[0])) == len(_shards(group.procs[1])) == 2

        def make(rank: int) -> rs.Communicator:
            return rs.Communicator(
                group.addresses, rank, 3, job_token=TOKEN, shared_memory=shm == "1", connect_timeout=20, timeout=20
            )

        def body(comm: rs.Communicator, rank: int) -> tuple:
            base = (np.arange(size) % 1000).astype(np.float32)  # sums exact in float32
            sums = [comm.all_reduce(base * (rank + 1) * step) for step in range(4)]
            return comm.active_endpoints, all(np.array_equal(s, base * 6 * step) for step, s in enumerate(sums))

        assert run_ranks(3, make, body, limit=60) == [(4, True)] * 3
        logs = group.stop()
    done = _completed(logs)
    assert sorted(done) == [(0, 0), (0, 1), (1, 0), (1, 1)], logs

    def chunks(reducers: int) -> int:
        return len(
            plan_chunks(size, 4, reducers, settings.tuning("RS_CHUNK_BYTES"), settings.tuning("RS_PIPELINE_DEPTH"))
        )

    per_collective = chunks(2)
    assert per_collective < chunks(4)
    assert sum(done.values()) == 4 * per_collective, done
    # spread evenly: (seq + chunk) mod 4 over the endpoints
    assert set(done.values()) == {sum(done.values()) // 4}, done


def test_a_rank_that_connects_to_the_shards_is_no_loss_to_a_collective_waiting_for_it():
    """A worker's first connection, to shard 0, closes once the worker has connected to every
    shard: rank 0's collective, already waiting on every shard for rank 1, completes."""
    with reducers(1, extra_env={"RS_SHARDS": "2"}) as group:
        started = threading.Event()

        def make(rank: int) -> rs.Communicator:
            if rank == 1:
                assert started.wait(20)
                time.sleep(0.3)
            return rs.Communicator(group.addresses, rank, 2, job_token=TOKEN, connect_timeout=20, timeout=20)

        def body(comm: rs.Communicator, rank: int) -> list:
            handle = comm.all_reduce_async(np.full(200_000, rank + 1, np.int64))  # chunks on both shards
            started.set()
            return handle.wait(20).tolist()[::50_000]

        assert run_ranks(2, make, body, limit=60) == [[3] * 4] * 2


def test_a_sharded_reducer_serves_every_shards_metrics_on_its_one_metrics_port():
    """`serve --shards 2` with a metrics port: one scrape there gives both shards' series, each
    labelled with its shard (what each received is what its stop line says), and `shard_up` for
    each; a killed shard shows as down, then, started again, as up with a restart counted. The
    shards' own pages are on the loopback at ports of their own: nothing listens on port + 1."""
    port = free_port_range(2)
    with reducers(1, extra_env={"RS_SHARDS": "2", "RS_METRICS_PORT": str(port)}) as group:

        def make(rank: int) -> rs.Communicator:
            return rs.Communicator(group.addresses, rank, 2, job_token=TOKEN, connect_timeout=20, timeout=20)

        def body(comm: rs.Communicator, rank: int) -> bool:
            return all(
                np.array_equal(comm.all_reduce(np.ones(1_000_000, np.float32)), np.full(1_000_000, 2.0))
                for _ in range(3)
            )

        assert run_ranks(2, make, body, limit=60) == [True, True]
        samples = scrape(port)
        received = {s: value(samples, "reduction_server_received_bytes_total", shard=str(s)) for s in (0, 1)}
        assert all(value(samples, "reduction_server_shard_up", shard=str(s)) == 1 for s in (0, 1))
        assert all(samples[("process_cpu_seconds_total", (("shard", str(s)),))] > 0 for s in (0, 1))  # each its own
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port + 1), timeout=5).close()

        victim = _shards(group.procs[0])[1]
        victim.kill()
        victim.wait(10)
        assert value(scrape(port), "reduction_server_shard_up", shard="1") == 0  # restarted after a backoff
        deadline = time.monotonic() + 30
        while value(now := scrape(port), "reduction_server_shard_up", shard="1") == 0:
            assert time.monotonic() < deadline, "shard 1 was not started again"
            time.sleep(0.1)
        assert value(now, "reduction_server_shard_restarts_total", shard="1") == 1
        assert value(now, "reduction_server_shard_restarts_total", shard="0") == 0
        logs = group.stop()
    stopped = {int(s): int(n) for log in logs for s, n in _BYTES_IN.findall(log)}
    assert received[0] > 0 and received[1] > 0 and received[0] == stopped[0], (received, stopped)


def test_a_reducer_of_one_shard_beside_a_sharded_one():
    """Shard counts may differ between reducers: the plan takes every endpoint there is."""
    with (
        reducers(1, extra_env={"RS_SHARDS": "3"}) as sharded,
        reducers(1, extra_env={"RS_SHARDS": "1"}, first_index=1) as single,
    ):
        addresses = sharded.addresses + single.addresses

        def make(rank: int) -> rs.Communicator:
            return rs.Communicator(addresses, rank, 2, job_token=TOKEN, connect_timeout=20, timeout=20)

        def body(comm: rs.Communicator, rank: int) -> tuple:
            return comm.active_endpoints, comm.all_reduce(np.full(1_000_000, rank + 1, np.int64)).tolist()[::250_000]

        assert run_ranks(2, make, body, limit=60) == [(4, [3] * 4)] * 2


def test_a_killed_shard_is_restarted_and_the_job_ends_bitwise_as_unsharded():
    """W=4 processes train 200 steps on 2 reducers of 2 shards (deterministic); shard 1 of
    reducer 0 is SIGKILLed at step 20 and shard 0 of reducer 1 (its listed address) at step 110.
    Each supervisor starts its shard again; the workers fail over, take the shard back and use it
    (chunks on it after it rejoined); every step is right, and the final weights are the same
    bits as those of an undisturbed run on one unsharded reducer."""
    exact = {"RS_DETERMINISTIC": "1", **FAST}
    with reducers(1, extra_env={**exact, "RS_SHARDS": "1"}) as plain:
        reference = Run(plain, exact=True).finish()
    # INFO: each shard's `started` line (its configuration, heap=kept) is logged at INFO
    with reducers(2, extra_env={**exact, "RS_SHARDS": "2", "RS_LOG_LEVEL": "INFO"}) as group:
        job = Run(group, exact=True)
        for step, reducer, shard in ((20, 0, 1), (110, 1, 0)):
            job.wait_for_step(step)
            victim = _shards(group.procs[reducer])[shard]
            victim.kill()
            victim.wait(5)
        results = job.finish()
        for proc in group.procs:
            deadline = time.monotonic() + 10
            while len(_shards(proc)) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(_shards(proc)) == 2, "a supervisor did not start its shard again"
        logs = group.stop()
    assert all(log.count("shard_restarted") == 1 for log in logs), logs
    if platform.libc_ver()[0] == "glibc":  # each shard, the restarted one too, keeps its heap (heap.py)
        assert all(log.count("heap=kept") == 3 for log in logs), logs
    for res in results:
        assert res["mismatch_count"] == 0, res
        assert res["lost"] == [0, 1], res  # reducers
        assert res["lost_endpoints"] == [1, 2], res  # r0s0 0, r1s0 1, r0s1 2, r1s1 3
        assert res["rejoined_chunks"] > 0, res
        assert res["digest"] == reference[0]["digest"], res


def test_sigterm_stops_every_shard_and_sigkill_of_the_supervisor_takes_them_along():
    env = child_env({"RS_JOB_TOKEN": TOKEN})
    serve = [sys.executable, "-m", "reduction_server", "serve", "--host", "127.0.0.1", "--port", "0", "--shards", "3"]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = subprocess.Popen(serve, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = proc.stdout.readline()
        base = int(re.search(r"ports (\d+)-(\d+)", line).group(1))
        kids = _shards(proc)
        assert [int(k.cmdline()[k.cmdline().index("--port") + 1]) for k in kids] == [base, base + 1, base + 2]
        proc.send_signal(sig)
        assert proc.wait(15) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        gone, alive = psutil.wait_procs(kids, timeout=10)
        assert not alive, f"shards outlived their supervisor ({sig!r})"


@pytest.mark.parametrize("given, expected", [(None, "1"), ("3", "3")])
def test_shards_start_no_blas_threads_unless_asked(given, expected):
    """A reducer does no linear algebra: its shards run NumPy's OpenBLAS on one thread (not a
    spinning thread per core in each of them), unless the environment says otherwise."""
    env = child_env({"RS_JOB_TOKEN": TOKEN})
    env.pop("OPENBLAS_NUM_THREADS", None)
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    proc = subprocess.Popen(
        [sys.executable, "-m", "reduction_server", "serve", "--host", "127.0.0.1", "--port", "0", "--shards", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert "listening" in proc.stdout.readline()
        assert [kid.environ().get("OPENBLAS_NUM_THREADS") for kid in _shards(proc)] == [expected, expected]
    finally:
        proc.terminate()
        proc.wait(15)


def test_a_shard_that_hangs_while_starting_again_holds_up_nothing(monkeypatch):
    """While one shard's new process has not said it listens, the supervisor still watches the
    others: a shard killed meanwhile is started again at once."""
    monkeypatch.setenv("RS_JOB_TOKEN", TOKEN)
    supervisor = shard_count.Supervisor(
        host="127.0.0.1", port=0, index=0, shards=2, workers=None, deterministic=False, metrics_port=0
    )
    stop = threading.Event()
    watcher = threading.Thread(target=supervisor.watch, args=(stop.is_set,), daemon=True)
    try:
        supervisor.start()
        command = supervisor._command
        monkeypatch.setattr(
            supervisor,
            "_command",  # shard 1's next process never says it listens
            lambda shard, ready: ["sleep", "60"] if shard.number == 1 else command(shard, ready),
        )
        watcher.start()
        zero, one = supervisor.shards
        first = zero.proc.pid
        one.proc.kill()
        until(lambda: one.ready is not None, "shard 1 to be started again")
        zero.proc.kill()
        until(
            lambda: zero.proc.pid != first and zero.ready is None and zero.proc.poll() is None,
            "shard 0 to be started again while shard 1 was starting",
        )
        assert one.ready is not None and zero.restarts == one.restarts == 1
        with socket.create_connection(("127.0.0.1", zero.port), timeout=5):
            pass  # shard 0 listens again
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join(5)
        supervisor.stop()
    assert all(shard.proc.poll() is not None for shard in supervisor.shards)


def test_a_shard_that_keeps_dying_is_started_again_after_the_longest_backoff_however_often():
    """A shard that dies within STEADY_S of every start (another program holds its port) is
    never given up: after a thousand deaths in a row the supervisor still waits MAX_BACKOFF_S,
    where the doubling once overflowed a float and stopped every shard."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    supervisor = shard_count.Supervisor(
        host="127.0.0.1", port=0, index=0, shards=1, workers=None, deterministic=False, metrics_port=0
    )
    shard = shard_count.Shard(0, 0, proc=dead, started=time.monotonic(), failures=1023)
    supervisor.shards = [shard]
    turns = iter([False, True])
    before = time.monotonic()
    supervisor.watch(lambda: next(turns))
    assert shard.failures == 1024
    assert before + shard_count.MAX_BACKOFF_S <= shard.restart_at <= time.monotonic() + shard_count.MAX_BACKOFF_S


def test_a_taken_shard_port_is_named_and_nothing_is_left_running():
    port = free_port_range(2)  # not next to an ephemeral port, which another connection may hold
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))  # shard 1 would need the taken one
        taken.listen()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "reduction_server",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--shards",
                "2",
            ],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1
    # Checked before any shard starts: one line, as an unsharded reducer says it, naming who holds
    # the port (this test's process), and no shard's log.
    [line] = proc.stderr.splitlines()
    assert line.startswith(
        f"reduction-server serve: cannot listen on tcp://127.0.0.1:{port + 1}, shard 1's port "
        f"(--port + 1): the port is already in use (by pid {os.getpid()} ("
    ), line
    assert line.endswith("); stop it, or choose another port (--port; 0 picks a free one)"), line
    assert proc.stdout == ""
    with socket.socket() as probe:  # nothing listens at shard 0's port
        probe.bind(("127.0.0.1", port))


def test_the_port_check_leaves_what_is_not_an_address_to_libzmq():
    """libzmq binds an interface's name (`--host lo`); the check, which cannot, says nothing then."""
    base = free_port_range(2)
    shard_count.check_free("lo", base, 2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        with pytest.raises(ListenError, match=f"127.0.0.1:{base + 1}, shard 1's port"):
            shard_count.check_free("127.0.0.1", base, 2)


def test_a_shard_port_taken_after_the_check_stops_every_shard_and_is_named(monkeypatch):
    """Another program may take a port between the supervisor's check and the shard's bind: the
    shard says why and exits, and the supervisor stops the others and names it."""
    monkeypatch.setenv("RS_JOB_TOKEN", TOKEN)
    monkeypatch.setattr(shard_count, "check_free", lambda host, base, n: None)  # the race, made certain
    port = free_port_range(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        supervisor = shard_count.Supervisor(
            host="127.0.0.1", port=port, index=0, shards=2, workers=None, deterministic=False, metrics_port=0
        )
        try:
            with pytest.raises(ListenError) as failed:
                supervisor.start()
        finally:
            supervisor.stop()
    assert str(failed.value) == (
        f"reducer 0 could not start its 2 shards: shard 1 of reducer 0 (port {port + 1}) "
        "exited with status 1 before it listened (its message is above)"
    )
    assert all(shard.proc is None or shard.proc.poll() is not None for shard in supervisor.shards)
    with socket.socket() as probe:  # shard 0 was stopped: its port is free again
        probe.bind(("127.0.0.1", port))


def test_a_taken_metrics_port_stops_a_sharded_reducer_before_any_shard_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        metrics = taken.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "reduction_server",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--shards",
                "2",
                "--metrics-port",
                str(metrics),
            ],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2, proc.stderr
    assert f"cannot serve metrics on 127.0.0.1:{metrics}" in proc.stderr, proc.stderr
    assert "shard=" not in proc.stderr, proc.stderr  # a shard that started would have logged it (stderr is shared)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--shards", "0"], "--shards='0' must be `auto` or 1..256"),
        (["--shards", "lots"], "--shards='lots' is neither `auto` nor"),
        (["--port", "65535", "--shards", "2"], "would pass 65535"),
    ],
)
def test_bad_shard_arguments_are_named(args: List[str], words: str):
    proc = subprocess.run(
        [sys.executable, "-m", "reduction_server", "serve", "--host", "127.0.0.1", *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and words in proc.stderr, proc.stderr


def _start_line(env: dict, cores: Optional[List[int]] = None) -> str:
    """The start line of `serve --host 127.0.0.1 --port 0` with `env`, run on `cores` (its
    affinity, as `taskset` sets it; None: this process's), stopped once it has said it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "reduction_server", "serve", "--host", "127.0.0.1", "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=None if cores is None else (lambda: os.sched_setaffinity(0, cores)),
    )
    try:
        return proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(15)


def _says_shards(line: str, count: int) -> bool:
    """Whether a start line says `count` shards (one shard says none)."""
    return (f"shards={count} " in line) if count > 1 else ("shards=" not in line)


def test_serve_runs_one_shard_per_core_by_default():
    env = child_env({"RS_JOB_TOKEN": TOKEN})
    del env["RS_SHARDS"]
    line = _start_line(env)
    assert _says_shards(line, shard_count.usable_cores()), line


def test_serve_from_a_source_checkouts_root_starts_its_shards_from_the_installed_package():
    """From the clone's root, where the README has users run commands, `python -m` in a shard
    would import the uncompiled tree (no _native) instead of the installed package."""
    env = child_env({"RS_JOB_TOKEN": TOKEN})
    command = [
        str(Path(sys.executable).parent / "reduction-server"),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--shards",
        "2",
    ]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "shards=2 " in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        assert [shard.status() != psutil.STATUS_ZOMBIE for shard in _shards(proc)] == [True, True]
    finally:
        proc.terminate()
        proc.wait(15)


def test_a_process_on_a_shard_port_that_is_not_that_shard_is_refused_by_name():
    """A worker told (by shard 0's WELCOME) that reducer 0 has two shards finds, at port + 1, a
    one-shard reducer of the same job: it proves the token, but not as shard 1, and is refused."""
    with reducers(1, extra_env={"RS_SHARDS": "2"}) as group:
        host, port = group.addresses[0].rsplit(":", 1)
        shard1 = _shards(group.procs[0])[1]
        shard1.kill()
        shard1.wait(5)
        group.procs[0].send_signal(signal.SIGSTOP)  # its supervisor must not start shard 1 again
        try:
            stranger = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "reduction_server",
                    "serve",
                    "--host",
                    host,
                    "--port",
                    str(int(port) + 1),
                    "--index",
                    "0",
                    "--shards",
                    "1",
                ],
                env=child_env({"RS_JOB_TOKEN": TOKEN}),
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            try:
                assert "listening" in stranger.stdout.readline()
                with pytest.raises(
                    CollectiveError,
                    match=r"reducer 0 shard 1 \(.*\) says it is shard 0 of its "
                    r"reducer, but its port makes it shard 1: RS_REDUCERS "
                    r"must list each reducer's own port",
                ):
                    rs.Communicator(group.addresses, 0, 1, job_token=TOKEN, connect_timeout=10)
            finally:
                stranger.kill()
                stranger.wait()
        finally:
            group.procs[0].send_signal(signal.SIGCONT)


def test_readyz_says_whether_every_shard_listens_and_healthz_that_the_reducer_is_alive():
    """`serve --shards 2` with a metrics port: /readyz is 200 once it says it listens; while
    shard 1 cannot listen (killed, its port taken by another program) it is 503 naming the
    shard, and 200 again once the supervisor has started it again; once told to stop (its shards
    frozen, so that stopping lasts) it is 503 `stopping`. /healthz is 200 all along, and
    /metrics is still the metrics page."""
    metrics = free_port_range(1)
    with reducers(1, extra_env={"RS_SHARDS": "2", "RS_METRICS_PORT": str(metrics)}) as group:
        assert probe(metrics, "/readyz") == (200, "ok\n")
        assert probe(metrics, "/healthz") == (200, "ok\n")
        assert "reduction_server_shard_up" in probe(metrics, "/metrics")[1]
        victim = _shards(group.procs[0])[1]
        port = int(victim.cmdline()[victim.cmdline().index("--port") + 1])
        victim.kill()
        victim.wait(10)
        with socket.socket() as squatter:  # before the supervisor's first try again (0.4 s)
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            status, body = probe(metrics, "/readyz")
            assert status == 503 and f"shard 1 (port {port})" in body, body
            until(lambda: "shard_restart_failed" in open(f"/proc/{group.procs[0].pid}/fd/2").read(), "a failed try")
            assert probe(metrics, "/readyz")[0] == 503 and probe(metrics, "/healthz")[0] == 200
        until(lambda: probe(metrics, "/readyz")[0] == 200, "shard 1 listening again", limit=30)
        kids = _shards(group.procs[0])
        for kid in kids:
            kid.suspend()
        group.procs[0].terminate()
        try:
            until(lambda: probe(metrics, "/readyz") == (503, "not ready: stopping\n"), "stopping", limit=10)
            assert probe(metrics, "/healthz")[0] == 200
        finally:
            for kid in kids:
                kid.resume()
        assert group.procs[0].wait(15) == 0


@pytest.mark.parametrize(
    "cpus, local_reducers, expected",
    [(1, "1", 1), (2, "1", 2), (2, "2", 1)],
    ids=["one-core", "two-cores", "two-cores-two-reducers"],
)
def test_auto_counts_the_cores_of_its_affinity_shared_with_the_launchers_other_reducers(
    cpus: int, local_reducers: str, expected: int
):
    """`serve --shards auto` under `taskset` (the affinity it inherits), on a host of any size:
    one shard per core it may run on, divided among RS_LOCAL_REDUCERS reducers."""
    cores = sorted(os.sched_getaffinity(0))[:cpus]
    if len(cores) < cpus or shard_count.usable_cores() < cpus:
        pytest.skip(f"needs {cpus} cores this process may use")
    env = child_env({"RS_JOB_TOKEN": TOKEN, "RS_SHARDS": "auto", "RS_LOCAL_REDUCERS": local_reducers})
    line = _start_line(env, cores)
    assert _says_shards(line, expected), line


def test_the_cgroup_quota_is_the_tightest_of_its_cgroup_and_its_ancestors(tmp_path: Path):
    """cgroup v2: a quota set on an ancestor (a systemd slice, a pod) binds a child cgroup with
    none of its own; v1: the `cpu` controller's quota, at the mount's root when the process's own
    path is not visible there (a container's view); no quota anywhere: None."""
    own = tmp_path / "self-cgroup"
    (tmp_path / "pod" / "container").mkdir(parents=True)
    (tmp_path / "pod" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "pod" / "container" / "cpu.max").write_text("max 100000\n")
    own.write_text("0::/pod/container\n")
    assert shard_count._cgroup_quota(str(tmp_path), str(own)) == 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    own.write_text("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/\n")
    assert shard_count._cgroup_quota(str(v1), str(own)) == 2.0
    own.write_text("0::/\n")
    assert shard_count._cgroup_quota(str(tmp_path / "pod" / "container"), str(own)) is None
