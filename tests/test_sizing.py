"""`reduction-server size`: Google's sizing rule, and a real measurement of one reducer."""
import re
import subprocess
import sys

import pytest

from reduction_server.errors import ConfigError
from reduction_server.sizing import Measurement, explain, measure, reducers_needed


@pytest.mark.parametrize("workers,worker_gbps,reducer_gbps,expected", [
    (8, 100, 32, 25),   # Google's example: (8 worker VMs x 100 Gbps) / 32 Gbps = 25 reducer VMs
    (5, 100, 32, 16),   # and its other one: 5 x 100 Gbps matched by 16 x 32 Gbps (512 >= 500)
    (4, 32, 32, 4),
    (1, 10, 100, 1),
    (3, 10, 7, 5),
])
def test_reducers_needed(workers, worker_gbps, reducer_gbps, expected):
    assert reducers_needed(workers, worker_gbps, reducer_gbps) == expected


@pytest.mark.parametrize("args,match", [((0, 100, 32), "--workers"), ((8, 0, 32), "--worker-gbps"),
                                        ((8, 100, -1), "--reducer-gbps")])
def test_bad_arguments(args, match):
    with pytest.raises(ConfigError, match=match):
        reducers_needed(*args)


def test_explanation_names_the_binding_limit():
    nic = explain(8, 100, 32)
    assert nic[-1] == "Reducers needed: ceil(800 / 32) = 25 reducers."
    cpu = explain(8, 100, 32, Measurement(gbps=10.0, workers=2, mib=64, iters=5))
    assert "the CPU binds" in cpu[2] and "Run 4 reducer processes per reducer host" in cpu[2]
    assert cpu[-1] == "Reducers needed: ceil(800 / 10) = 80 reducer processes."
    fast = explain(8, 100, 32, Measurement(gbps=50.0, workers=2, mib=64, iters=5))
    assert "the NIC binds" in fast[2] and fast[-1].endswith("= 25 reducers.")


def test_cli_prints_the_arithmetic():
    out = subprocess.run([sys.executable, "-m", "reduction_server", "size", "--workers", "8", "--worker-gbps", "100",
                          "--reducer-gbps", "32"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "8 worker hosts x 100 Gbit/s = 800 Gbit/s" in out.stdout
    assert out.stdout.strip().endswith("= 25 reducers.")
    bad = subprocess.run([sys.executable, "-m", "reduction_server", "size", "--workers", "0", "--worker-gbps", "1",
                          "--reducer-gbps", "1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--workers must be at least 1" in bad.stderr and "Traceback" not in bad.stderr


def test_measure_runs_a_real_reducer():
    m = measure(workers=2, mib=2, iters=2, timeout=120)
    assert m.gbps > 0.05  # a real job moved real bytes; the figure itself is this machine's
    lines = explain(8, 100, 1e6, m)  # a NIC no CPU keeps up with: the CPU must bind
    assert "the CPU binds" in lines[2]
    assert re.search(r"summed \d+\.\d Gbit/s of incoming float32 gradient \(2 local workers, 2 MiB", lines[1])
