"""`reduction-server bench SUITE`: run a suite, print its table, save JSON and PNG plots."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List

from . import report

SUITES = ("kernels", "loopback", "netem", "ddp")


def main(suite: str, out: Path, quick: bool = False, rounds: int = 1) -> List[Path]:
    """Run `suite`; returns the files written. `rounds`: netem and ddp run the peers in turns
    that many times on one emulated network and report medians."""
    if rounds != 1 and suite not in ("netem", "ddp"):
        raise ValueError(f"--rounds is for the netem and ddp suites, not {suite}")
    command = " ".join(["reduction-server", "bench", suite, "--out", str(out)] + (["--quick"] if quick else [])
                       + ([f"--rounds {rounds}"] if rounds != 1 else []))
    if suite == "kernels":
        from . import kernels

        rows = kernels.run((0.0625,) if quick else (4, 64), quick=quick)
        print(report.table(rows, kernels.COLUMNS))
        largest = max(r["mib"] for r in rows)
        top = [r for r in rows if r["mib"] == largest]
        files = [report.save(rows, suite, out, command),
                 report.bars([f"{r['dtype']} {r['op']}" for r in top], [r["speedup"] for r in top],
                             xlabel="speed-up over NumPy (same run)", reference=1.0,
                             title=f"native kernels vs NumPy, {largest:g} MiB accumulator",
                             path=out / "kernels.png")]
    elif suite == "loopback":
        from . import loopback

        if quick:
            rows = loopback.run(worlds=(2,), reducers=(1,), sizes_mib=(0.25, 1), iters=3)
        else:
            rows = loopback.run()
        print(report.table(rows, loopback.COLUMNS))
        files = [report.save(rows, suite, out, command),
                 report.plot(rows, x="mib", y="algbw_GBps", series=("peer", "R"), panels="W",
                             title="loopback all-reduce algbw", path=out / "loopback.png")]
    elif suite == "netem":
        from . import netem

        if quick:
            rows = netem.run(worlds=(2,), rates_mbit=(400,), sizes_mib=(1,), iters=2, rounds=rounds)
        else:
            rows = netem.run(rounds=rounds)
        print(report.table(rows, netem.COLUMNS))
        files = [report.save(rows, suite, out, command),
                 report.plot(rows, x="mib", y="algbw_GBps", series=("peer", "R", "mbit"), panels="W",
                             title="emulated network all-reduce algbw", path=out / "netem.png")]
    elif suite == "ddp":
        from . import ddp

        if quick:
            rows = ddp.run(worlds=(2,), rates_mbit=(400,), width=32, batch=4, steps=2, warmup=1, rounds=rounds)
        else:
            rows = ddp.run(rounds=rounds)
        print(report.table(rows, ddp.COLUMNS))
        files = [report.save(rows, suite, out, command),
                 report.bars([f"{r['peer']} W={r['W']} R={r['R']} {r['mbit']:g} Mbit/s" for r in rows],
                             [r["steps_per_s"] for r in rows], xlabel="DDP training steps/s (same run)",
                             title=f"DDP, {rows[0]['params_M']:.3g}M parameters, batch {rows[0]['batch']} per rank",
                             path=out / "ddp.png")]
    else:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    for path in files:
        print(f"wrote {path}", file=sys.stderr)
    return files
