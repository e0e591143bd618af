"""Prometheus metrics scraped from a live reducer process while a real job is connected to it.

The job (two ranks, threads of this process) runs collectives of known sizes and one that the
ranks disagree on, so every count the reducer reports can be checked exactly against what the
job did.
"""

import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

import reduction_server.client as rs
from helpers.cluster import ONE_PROCESS, TOKEN, child_env, reducers
from helpers.jobs import run_job, until
from helpers.metrics import Samples, scrape, value
from helpers.ports import free_port_range
from reduction_server.client.chunking import plan_chunks
from reduction_server.errors import CollectiveError

pytestmark = pytest.mark.timeout(120)

WORLD = 2
BUDGET = 256 << 20
# (dtype, element count) of each all-reduce the job runs: one chunk, several chunks, 16-bit floats
# (the larger one in chunks of 256 KiB, read by both ranks from a result slot), a last small one.
SENT = "reduction_server_sent_bytes_total"
CASES = [(np.float32, 1000), (np.float32, 300_000), (np.float16, 5000), (np.float16, 1 << 22), (np.int64, 7)]


def test_metrics_show_what_the_job_did():
    port = free_port_range(1)
    env = {"RS_METRICS_PORT": str(port), "RS_MAX_ACCUMULATOR_BYTES": str(BUDGET), **ONE_PROCESS}
    payload = sum(np.dtype(dtype).itemsize * count for dtype, count in CASES)
    barrier = np.dtype(np.int32).itemsize  # a barrier all-reduces one int32
    with reducers(1, workers=WORLD, token=TOKEN, extra_env=env) as group:
        before = scrape(port)
        assert value(before, "reduction_server_received_bytes_total") == 0
        assert value(before, "reduction_server_peers_connected") == 0
        scraped = threading.Event()

        def body(comm: rs.Communicator, rank: int) -> Samples:
            for dtype, count in CASES:
                comm.all_reduce(np.ones(count, dtype))
            # The ranks disagree on the size: the reducer fails that round on both.
            with pytest.raises(CollectiveError, match="disagree"):
                comm.all_reduce(np.ones(10 + 10 * rank, np.float32))
            comm.barrier()
            live = {}
            if rank == 0:  # both ranks connected, rank 1 holding back its next collective

                def settled() -> bool:  # the barrier's results count once both are out, maybe after rank 0 has its
                    live.update(scrape(port))
                    return value(live, SENT) == WORLD * (payload + barrier)

                until(settled, "the reducer to count both barrier results as sent", 10)
                scraped.set()
            assert scraped.wait(30)
            comm.barrier()
            return live

        live = run_job(WORLD, body, group=group, timeout=10, connect_timeout=10)[0]
        after = scrape(port)
        assert group.alive()

    rounds = sum(len(plan_chunks(count, np.dtype(dtype).itemsize, 1, 4 << 20)) for dtype, count in CASES) + 1
    mismatched = 10 * 4 + 20 * 4  # both ranks' payloads arrived; neither made a result
    assert value(live, "reduction_server_received_bytes_total") == WORLD * (payload + barrier) + mismatched
    assert value(live, SENT) == WORLD * (payload + barrier)
    # the ranks share the reducer's host: every chunk went both ways through shared memory
    assert value(live, "reduction_server_shared_memory_bytes_total") == 2 * WORLD * (payload + barrier) + mismatched
    assert value(live, "reduction_server_shared_results_total") == WORLD * len(plan_chunks(1 << 22, 2, 1, 4 << 20))
    assert value(live, "reduction_server_rounds_completed_total") == rounds
    assert value(live, "reduction_server_rounds_failed_total", code="MISMATCH") == 1
    assert value(live, "reduction_server_peers_connected") == WORLD
    assert value(live, "reduction_server_peers_admitted_total") == WORLD
    assert value(live, "reduction_server_accumulator_budget_bytes") == BUDGET
    # Every contribution folded is timed; the first of the failed round was folded before the
    # second disagreed with it.
    contributions = WORLD * rounds + 1
    assert value(live, "reduction_server_reduce_seconds_count") == contributions
    assert value(live, "reduction_server_round_latency_seconds_count") == rounds
    lags = [value(live, "reduction_server_arrival_lag_seconds_count", rank=str(r)) for r in range(WORLD)]
    assert sum(lags) == contributions and all(n >= rounds for n in lags), lags
    assert all(value(live, "reduction_server_arrival_lag_seconds_sum", rank=str(r)) >= 0 for r in range(WORLD))
    # Once the job has left: the second barrier counted, nobody connected, nothing in flight.
    assert value(after, "reduction_server_rounds_completed_total") == rounds + 1
    assert value(after, "reduction_server_sent_bytes_total") == WORLD * (payload + 2 * barrier)
    assert value(after, "reduction_server_peers_connected") == 0
    assert value(after, "reduction_server_rounds_in_flight") == 0
    assert value(after, "reduction_server_accumulator_bytes", state="held") == 0


def test_launcher_gives_reducer_i_metrics_port_base_plus_i():
    base = free_port_range(2)
    scrape_both = (
        "import urllib.request, reduction_server.client as rs\n"
        "comm = rs.Communicator.from_env()  # once it is admitted, both reducers are up\n"
        f"for port in ({base}, {base + 1}):\n"
        "    text = urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=10).read().decode()\n"
        "    print(port, [s for s in text.splitlines() if s.startswith('reduction_server_peers_adm')])\n"
        "comm.close()\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reduction_server",
            "run",
            "-np",
            "1",
            "--reducers",
            "2",
            "--metrics-port",
            str(base),
            "--",
            sys.executable,
            "-c",
            scrape_both,
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for index in range(2):
        assert f"{base + index} ['reduction_server_peers_admitted_total{{reducer=\"{index}\"}} 1.0']" in proc.stdout, (
            proc.stdout
        )


def test_a_metrics_port_in_use_is_a_clear_error():
    port = free_port_range(1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
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
                "0",
                "--metrics-port",
                str(port),
            ],
            cwd="/",
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port} (--metrics-port / RS_METRICS_PORT)" in proc.stderr
    assert "Traceback" not in proc.stderr
