"""`reduction-server bench kernels`: run the pytest-benchmark suite (test_kernels.py) and report
our kernels beside NumPy, per dtype x op x size, as time and speed-up."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence

import pytest
from tqdm import tqdm

SUITE = Path(__file__).with_name("test_kernels.py")
COLUMNS = ["dtype", "op", "mib", "native_ms", "numpy_ms", "speedup", "native_GBps"]


class _Progress:
    """A progress bar over the suite's benchmarks (pytest plugin)."""

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.bar = tqdm(total=len(session.items), desc="kernels", unit="bench")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.bar.update(1)

    def pytest_sessionfinish(self) -> None:
        self.bar.close()


def run(sizes_mib: Sequence[float] = (4, 64), quick: bool = False) -> List[Dict]:
    """Rows: one per dtype x op x size, best (min) time of each implementation."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "kernels.json"
        args = [
            str(SUITE),
            "-p",
            "no:terminal",
            "-p",
            "no:cacheprovider",
            "-c",
            os.devnull,
            "--rootdir",
            tmp,
            "--benchmark-quiet",
            f"--benchmark-json={report}",
            "--benchmark-disable-gc",
        ]
        if quick:  # a smoke run: one round each, tiny operands
            args += ["--benchmark-min-rounds=1", "--benchmark-max-time=0.001", "--benchmark-warmup=off"]
        else:
            args += ["--benchmark-min-rounds=10", "--benchmark-max-time=0.5", "--benchmark-warmup=on"]
        previous = os.environ.get("RS_BENCH_KERNEL_MIB")
        os.environ["RS_BENCH_KERNEL_MIB"] = ",".join(f"{s:g}" for s in sizes_mib)  # read by the suite
        try:
            code = pytest.main(args, plugins=[_Progress()])
        finally:
            if previous is None:
                del os.environ["RS_BENCH_KERNEL_MIB"]
            else:
                os.environ["RS_BENCH_KERNEL_MIB"] = previous
        if code != 0:
            raise RuntimeError(f"the kernel benchmark suite failed (pytest exit {code})")
        data = json.loads(report.read_text())
    best: Dict[tuple, Dict[str, float]] = {}
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        key = (info["dtype"], info["op"], info["mib"], info["nbytes"])
        best.setdefault(key, {})[info["impl"]] = bench["stats"]["min"]
    rows = []
    for (dtype, op, mib, nbytes), t in sorted(best.items()):
        rows.append(
            {
                "dtype": dtype,
                "op": op,
                "mib": mib,
                "native_ms": t["native"] * 1e3,
                "numpy_ms": t["numpy"] * 1e3,
                "speedup": t["numpy"] / t["native"],
                "native_GBps": nbytes / t["native"] / 1e9,
            }
        )
    return rows
