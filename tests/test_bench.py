"""Each benchmark suite runs on a small configuration and produces well-formed output (no test
asserts a time: the machine is shared and noisy)."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("pytest_benchmark", reason="the bench extra is not installed (pip install -e '.[bench]')")
pytest.importorskip("matplotlib", reason="the bench extra is not installed (pip install -e '.[bench]')")

from reduction_server.bench import kernels, loopback  # noqa: E402


def run_suite(suite, out):
    proc = subprocess.run([sys.executable, "-m", "reduction_server", "bench", suite, "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / f"{suite}.json").read_text())
    png = (out / f"{suite}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    assert doc["suite"] == suite and doc["command"].startswith(f"reduction-server bench {suite}")
    assert doc["machine"]["python"] and doc["date"]
    return proc.stdout, doc["rows"]


def test_kernels_suite(tmp_path):
    table, rows = run_suite("kernels", tmp_path)
    assert len(rows) == 10 * 5  # every dtype x op at the one quick size
    assert {(r["dtype"], r["op"]) for r in rows} >= {("float16", "sum"), ("bfloat16", "avg"), ("int8", "prod")}
    for row in rows:
        assert set(kernels.COLUMNS) <= set(row)
        assert row["native_ms"] > 0 and row["numpy_ms"] > 0
        assert row["speedup"] == pytest.approx(row["numpy_ms"] / row["native_ms"])
    assert table.splitlines()[0].split() == kernels.COLUMNS


def test_loopback_suite(tmp_path):
    table, rows = run_suite("loopback", tmp_path)
    ours = [r for r in rows if r["peer"] == "reduction-server"]
    assert [(r["W"], r["R"], r["mib"]) for r in ours] == [(2, 1, 0.25), (2, 1, 1)]
    for row in rows:
        assert row["algbw_GBps"] == pytest.approx(row["mib"] * (1 << 20) / (row["ms"] / 1e3) / 1e9)
        assert row["busbw_GBps(ring)"] == pytest.approx(row["algbw_GBps"] * 2 * (row["W"] - 1) / row["W"])
    if "gloo" in loopback.available_peers():  # the peer ran in the same run, and the ratio is to it
        gloo = {r["mib"]: r["algbw_GBps"] for r in rows if r["peer"] == "gloo"}
        assert set(gloo) == {0.25, 1}
        for row in ours:
            assert row["vs_gloo"] == pytest.approx(row["algbw_GBps"] / gloo[row["mib"]])


def test_unknown_suite_is_refused():
    proc = subprocess.run([sys.executable, "-m", "reduction_server", "bench", "nope"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
