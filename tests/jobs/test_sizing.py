"""`reduction-server size`: Google's sizing rule, and a real measurement of one reducer's CPU
cost, per core and per host."""

import re
import subprocess
import sys

import pytest

from reduction_server.errors import ConfigError
from reduction_server.tools.reducer_load import GBIT_PER_GIB
from reduction_server.tools.sizing import Measurement, explain, measure, reducers_needed


@pytest.mark.parametrize(
    "workers,worker_gbps,reducer_gbps,expected",
    [
        (8, 100, 32, 25),  # Google's example: (8 worker VMs x 100 Gbps) / 32 Gbps = 25 reducer VMs
        (5, 100, 32, 16),  # and its other one: 5 x 100 Gbps matched by 16 x 32 Gbps (512 >= 500)
        (4, 32, 32, 4),
        (1, 10, 100, 1),
        (3, 10, 7, 5),
    ],
)
def test_reducers_needed(workers, worker_gbps, reducer_gbps, expected):
    assert reducers_needed(workers, worker_gbps, reducer_gbps) == expected


@pytest.mark.parametrize(
    "args,match", [((0, 100, 32), "--workers"), ((8, 0, 32), "--worker-gbps"), ((8, 100, -1), "--reducer-gbps")]
)
def test_bad_arguments(args, match):
    with pytest.raises(ConfigError, match=match):
        reducers_needed(*args)


def _costing(per_core_gbps: float) -> Measurement:
    return Measurement(cpu_s_per_gib=GBIT_PER_GIB / per_core_gbps, gbps_in=5.0, workers=2, mib=64, iters=5)


def test_explanation_counts_hosts_and_names_the_binding_limit():
    nic = explain(8, 100, 32)
    assert nic[-1] == "Reducer hosts needed: ceil(800 / 32) = 25 (one `serve` each)."
    # 10 Gbit/s a core: a 2-core host sums 20 of its NIC's 32, a 16-core one fills it
    small = explain(8, 100, 32, _costing(10.0), cores=2)
    assert "one core sums 10.0 Gbit/s" in small[1] and "runs 2 shards" in small[2] and "= 20.0 Gbit/s" in small[2]
    assert "the CPU binds" in small[3] and "Hosts of 4 cores would fill the NIC" in small[3]
    assert small[-1] == "Reducer hosts needed: ceil(800 / 20) = 40 (one `serve` each)."
    big = explain(8, 100, 32, _costing(10.0), cores=16)
    assert "the NIC binds" in big[3] and big[-1] == "Reducer hosts needed: ceil(800 / 32) = 25 (one `serve` each)."
    with pytest.raises(ConfigError, match="--reducer-cores"):
        explain(8, 100, 32, _costing(10.0), cores=0)


def test_cli_prints_the_arithmetic():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "reduction_server",
            "size",
            "--workers",
            "8",
            "--worker-gbps",
            "100",
            "--reducer-gbps",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "8 worker hosts x 100 Gbit/s = 800 Gbit/s" in out.stdout
    assert out.stdout.strip().endswith("= 25 (one `serve` each).")
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "reduction_server",
            "size",
            "--workers",
            "0",
            "--worker-gbps",
            "1",
            "--reducer-gbps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--workers must be at least 1" in bad.stderr and "Traceback" not in bad.stderr


def test_measure_runs_a_real_reducer_and_reads_its_cpu_time():
    m = measure(workers=2, mib=8, iters=4, timeout=120)
    # a reducer receives, adds and sends each byte: it cannot cost nothing, nor a whole CPU-minute a GiB
    assert 0.02 < m.cpu_s_per_gib < 60 and m.gbps_in > 0.05, m
    lines = explain(8, 100, 1e6, m, cores=3)  # a NIC no CPU keeps up with: the CPU must bind
    assert "the CPU binds" in lines[3]
    assert re.search(
        r"a reducer spends \d+\.\d{3} CPU-seconds per GiB of incoming float32 gradient \(2 local workers, "
        r"8 MiB all-reduces, 4 steps",
        lines[1],
    )
    assert f"{3 * m.per_core_gbps:.1f} Gbit/s" in lines[2]
