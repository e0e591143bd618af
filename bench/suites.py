"""`reduction-server bench SUITE`: run a suite, print its table, save JSON and PNG plots."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from reduction_server.config.settings import TUNING

from . import report

SUITES = ("kernels", "loopback", "netem", "ddp", "collectives", "reducer", "chunks", "failover", "sizing", "numerics")

#: what each suite's configuration can be swept over: run()'s keyword -> the command-line option
SWEEPS = {
    "worlds": "--workers",
    "reducers": "--reducers",
    "rates_mbit": "--rate-mbit",
    "sizes_mib": "--mib",
    "delay_ms": "--delay-ms",
    "rounds": "--rounds",
    "variants": "--variant",
    "shards": "--shards",
    "chunks_kib": "--chunk-kib",
    "compressions": "--compression",
    "reducer_rates_mbit": "--reducer-rate-mbit",
    "part": "--part",
}
_ACCEPTS = {
    "kernels": {"sizes_mib"},
    "loopback": {"worlds", "reducers", "sizes_mib", "rounds"},
    "netem": {
        "worlds",
        "reducers",
        "rates_mbit",
        "reducer_rates_mbit",
        "sizes_mib",
        "delay_ms",
        "rounds",
        "variants",
        "compressions",
    },
    "ddp": {"worlds", "reducers", "rates_mbit", "reducer_rates_mbit", "delay_ms", "rounds", "variants", "compressions"},
    "collectives": {"worlds", "reducers", "rates_mbit", "sizes_mib", "rounds"},
    "reducer": {"worlds", "sizes_mib", "shards", "compressions", "variants"},
    "chunks": {"worlds", "reducers", "sizes_mib", "chunks_kib", "rounds"},
    "failover": {"worlds", "reducers", "rates_mbit", "sizes_mib", "rounds"},
    "sizing": {"rounds", "part"},
    "numerics": set(),
}


def _configure(suite: str, base: Dict[str, Any], sweep: Dict[str, Any]) -> Dict[str, Any]:
    """The suite's (quick or full) configuration with the options given on the command line."""
    for key in sweep:
        if key not in _ACCEPTS[suite]:
            takers = [name for name in SUITES if key in _ACCEPTS[name]]
            names = f"{takers[0]} suite" if len(takers) == 1 else f"{', '.join(takers[:-1])} and {takers[-1]} suites"
            raise ValueError(f"{SWEEPS[key]} is for the {names}, not {suite}")
    return {**base, **sweep}


def _command(suite: str, out: Path, quick: bool, sweep: Dict[str, Any]) -> str:
    """The command line that reproduces this run, for the JSON file, with the settings of this
    project that its processes inherit from the environment (settings.TUNING) in front."""
    inherited = [f"{name}={os.environ[name]}" for name in TUNING if os.environ.get(name, "").strip()]
    words = [*inherited, "reduction-server", "bench", suite, "--out", str(out)] + (["--quick"] if quick else [])
    for key, value in ((key, sweep[key]) for key in SWEEPS if key in sweep):  # one order, whatever the caller's
        if key == "variants":  # each its own --variant NAME=VALUE,...
            words += [word for v in value for word in (SWEEPS[key], ",".join(f"{k}={x}" for k, x in v.items()))]
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        text = ",".join(v if isinstance(v, str) else f"{v:g}" for v in values)
        words += [SWEEPS[key], text]
    return shlex.join(words)


def main(
    suite: str, out: Path, quick: bool = False, rounds: int = 1, sweep: Optional[Dict[str, Any]] = None
) -> List[Path]:
    """Run `suite`; returns the files written. `rounds`: the suites that take it (SWEEPS) run
    the peers in turns that many times and report medians. `sweep`: run()'s keywords
    (SWEEPS) that replace the suite's configuration; a suite refuses one it does not take."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    sweep = {**(sweep or {}), **({"rounds": rounds} if rounds != 1 else {})}
    command = _command(suite, out, quick, sweep)
    if suite == "kernels":
        from . import kernels

        config = _configure(suite, {"sizes_mib": (0.0625,) if quick else (4, 64)}, sweep)
        rows = kernels.run(config["sizes_mib"], quick=quick)
        print(report.table(rows, kernels.COLUMNS))
        largest = max(r["mib"] for r in rows)
        top = [r for r in rows if r["mib"] == largest]
        files = [
            report.save(rows, suite, out, command),
            report.bars(
                [f"{r['dtype']} {r['op']}" for r in top],
                [r["speedup"] for r in top],
                xlabel="speed-up over NumPy (same run)",
                reference=1.0,
                title=f"native kernels vs NumPy, {largest:g} MiB accumulator",
                path=out / "kernels.png",
            ),
        ]
    elif suite == "loopback":
        from . import loopback

        rows = loopback.run(
            **_configure(
                suite, {"worlds": (2,), "reducers": (1,), "sizes_mib": (0.25, 1), "iters": 3} if quick else {}, sweep
            )
        )
        print(report.table(rows, loopback.COLUMNS))
        files = [
            report.save(rows, suite, out, command),
            report.plot(
                rows,
                x="mib",
                y="algbw_GBps",
                series=("peer", "R"),
                panels="W",
                title="loopback all-reduce algbw",
                path=out / "loopback.png",
            ),
        ]
    elif suite == "netem":
        from . import netem

        rows = netem.run(
            **_configure(
                suite, {"worlds": (2,), "rates_mbit": (400,), "sizes_mib": (1,), "iters": 2} if quick else {}, sweep
            )
        )
        print(report.table(rows, netem.COLUMNS))
        files = [
            report.save(rows, suite, out, command),
            report.plot(
                rows,
                x="mib",
                y="algbw_GBps",
                series=("peer", "compression", "R", "mbit"),
                panels="W",
                title="emulated network all-reduce algbw (of the float32 buffer)",
                path=out / "netem.png",
            ),
        ]
    elif suite == "ddp":
        from . import ddp

        rows = ddp.run(
            **_configure(
                suite,
                {"worlds": (2,), "rates_mbit": (400,), "width": 32, "batch": 4, "steps": 2, "warmup": 1}
                if quick
                else {},
                sweep,
            )
        )
        print(report.table(rows, ddp.COLUMNS))
        files = [
            report.save(rows, suite, out, command),
            report.bars(
                [f"{r['peer']} W={r['W']} R={r['R']} {r['mbit']:g} Mbit/s" for r in rows],
                [r["steps_per_s"] for r in rows],
                xlabel="DDP training steps/s (same run)",
                title=f"DDP, {rows[0]['params_M']:.3g}M parameters, batch {rows[0]['batch']} per rank",
                path=out / "ddp.png",
            ),
        ]
    elif suite == "collectives":
        from . import collectives

        rows = collectives.run(
            **_configure(
                suite, {"worlds": (2,), "rates_mbit": (400,), "sizes_mib": (1,), "iters": 2} if quick else {}, sweep
            )
        )
        print(report.table(rows, collectives.COLUMNS))
        files = [
            report.save(rows, suite, out, command),
            report.bars(
                [f"{r['collective']} {r['peer']} W={r['W']} {r['mib']:g} MiB" for r in rows],
                [r["vs_gloo"] for r in rows],
                xlabel="speed vs Gloo (same run)",
                reference=1.0,
                title="reduce_scatter_tensor and all_gather_into_tensor",
                path=out / "collectives.png",
            ),
        ]
    elif suite == "reducer":
        from . import reducer

        rows = reducer.run(
            **_configure(
                suite,
                {"worlds": (2,), "sizes_mib": (16,), "shards": (1, 2), "iters": 8, "limit_gib": 0.25} if quick else {},
                sweep,
            )
        )
        print(report.table(rows, reducer.COLUMNS))
        files = [
            report.save(rows, suite, out, command),
            report.bars(
                [
                    f"W={r['W']} {r['mib']:g} MiB {r['shards']} shards {r['compression']} {r['variant']}".rstrip(" -")
                    for r in rows
                ],
                [r["vs_limit"] for r in rows],
                xlabel="reducer CPU per GiB / copy limit (same run)",
                reference=1.0,
                title="one reducer over tcp: CPU per GiB of incoming gradient",
                path=out / "reducer.png",
            ),
        ]
    elif suite == "chunks":
        from . import chunk_cost

        rows = chunk_cost.run(
            **_configure(
                suite,
                {"worlds": (2,), "reducers": (1,), "sizes_mib": (1,), "chunks_kib": (64, 256), "iters": 3}
                if quick
                else {},
                sweep,
            )
        )
        print(report.table(rows, chunk_cost.COLUMNS))
        print("\n".join(chunk_cost.summary(rows)))
        files = [
            report.save(rows, suite, out, command),
            report.plot(
                rows,
                x="chunk_KiB",
                y="worker_cpu_s_per_GiB",
                series=("R",),
                panels="W",
                title="a worker's CPU per GiB all-reduced against its chunk size",
                path=out / "chunks.png",
            ),
        ]
    elif suite == "failover":
        from . import failover

        rows = failover.run(
            **_configure(
                suite,
                {"worlds": (2,), "reducers": (2,), "rates_mbit": (400,), "sizes_mib": (1,), "steps": 12}
                if quick
                else {},
                sweep,
            )
        )
        print(report.table(rows, failover.COLUMNS))
        files = [
            report.save(rows, suite, out, command),
            report.bars(
                [row["run"] for row in rows],
                [row["vs_undisturbed"] for row in rows],
                xlabel="step time / undisturbed step (same run; failover: the step of the loss)",
                reference=1.0,
                title="losing a reducer on the emulated network",
                path=out / "failover.png",
            ),
        ]
    elif suite == "sizing":
        from . import sizing

        rows = sizing.run(quick=quick, **_configure(suite, {}, sweep))
        print(report.table(rows, sizing.COLUMNS))
        print("\n".join(sizing.summary(rows)))
        measured = [row for row in rows if "error" in row]
        files = [
            report.save(rows, suite, out, command),
            report.scatter(
                measured,
                x="measured_ms",
                y="predicted_ms",
                series="peer",
                title="step-time model: predicted vs measured all-reduce",
                path=out / "sizing.png",
            ),
        ]
    elif suite == "numerics":
        from . import numerics

        quick_config = {"tasks": ("charlm",), "variants": ("float32", "int8-ef"), "world": 2, "reducers": 1}
        rows = numerics.run(**_configure(suite, {**quick_config, "steps": 6, "every": 3} if quick else {}, sweep))
        print(report.table(rows, numerics.COLUMNS))
        print("\n".join(numerics.summary(rows)))
        files = [
            report.save(rows, suite, out, command),
            report.plot(
                numerics.points(rows),
                x="step",
                y="val_loss",
                series=("variant",),
                panels="task",
                title="held-out loss by gradient format",
                path=out / "numerics.png",
                logx=False,
            ),
        ]
    for path in files:
        print(f"wrote {path}", file=sys.stderr)
    return files
