"""`reduction-server bench failover`: what losing a reducer costs, on the emulated network
(bench/emulated_network.py: one namespace per host, every link shaped to the same rate).

Five runs of the same job (bench/failover_job.py: one all-reduce per step, rank 0 timing each),
in turns on one network: R reducers undisturbed; the same with RS_FAILOVER=0 (no results kept:
what keeping them costs); R-1 reducers from the start (the steady state after a loss, as fast as
it can be); R reducers with one SIGKILLed a moment into step K; and the same with SIGTERM, which
drains it (docs/reliability.md). Each row gives its median step; the failover and drain rows
also the step of the loss (or drain) and the median step after it, with the ratios that matter:
that step against an undisturbed step, and the steps after it against R-1 reducers from the
start.
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from tqdm import tqdm

from .emulated_network import EmulatedNetwork, cleanup_on_sigterm
from .netem import run_reduction_server

COLUMNS = ["run", "W", "R", "mbit", "mib", "step_ms", "loss_step_ms", "after_ms", "vs_undisturbed", "after_vs_fewer"]
_JOB = "reduction_server.bench.failover_job"
_MARKER = '{"step"'
_WARMUP = 2  # first steps left out of every median (connections and pools warming up)


def run(
    worlds: Sequence[int] = (4,),
    reducers: Optional[Sequence[int]] = None,
    rates_mbit: Sequence[float] = (400,),
    sizes_mib: Sequence[float] = (4,),
    steps: int = 30,
    rounds: int = 1,
) -> List[Dict]:
    """Rows for each W x R (default 3) x link rate x size: the four runs above, each the median
    over `rounds` turns. The reducer lost is the last one, a third of the way through."""
    for r in reducers or (3,):
        if r < 2:
            raise ValueError(f"failover needs at least 2 reducers, got R={r}")
    if steps < 3 * (_WARMUP + 2):
        raise ValueError(f"--steps must be at least {3 * (_WARMUP + 2)} (a warm-up, steps before and after the loss)")
    kill_at = steps // 3
    rows: List[Dict] = []
    with cleanup_on_sigterm():
        jobs = [
            (w, r, rate, mib) for w in worlds for r in (reducers or (3,)) for rate in rates_mbit for mib in sizes_mib
        ]
        for world, r, rate, mib in tqdm(jobs, desc="failover", unit="job"):
            args = ["--mib", f"{mib:g}", "--steps", str(steps)]
            runs: Dict[str, List[List[float]]] = {
                "undisturbed": [],
                "RS_FAILOVER=0": [],
                "fewer": [],
                "failover": [],
                "drain": [],
            }
            with EmulatedNetwork(world + r, rate) as net:
                for _ in range(rounds):  # in turns: the runs meet the same quiet and busy moments
                    runs["undisturbed"].append(_steps(run_reduction_server(net, world, r, _JOB, args, _MARKER)))
                    runs["RS_FAILOVER=0"].append(
                        _steps(run_reduction_server(net, world, r, _JOB, args, _MARKER, settings={"RS_FAILOVER": "0"}))
                    )
                    runs["fewer"].append(_steps(run_reduction_server(net, world, r - 1, _JOB, args, _MARKER)))
                    for label, signal in (("failover", "KILL"), ("drain", "TERM")):
                        stop = [*args, "--kill-at", str(kill_at), "--signal", signal]
                        runs[label].append(
                            _steps(run_reduction_server(net, world, r, _JOB, stop, _MARKER, victim=r - 1))
                        )
            rows += _rows(runs, world, r, rate, mib, kill_at)
    return rows


def _steps(lines: List[Dict]) -> List[float]:
    return [line["seconds"] for line in sorted(lines, key=lambda line: line["step"])]


def _median(runs: List[List[float]], steps: Tuple[int, int]) -> float:
    """The median over every round of the steps in [first, last)."""
    return statistics.median(s for run in runs for s in run[steps[0] : steps[1]])


def _rows(runs: Dict[str, List[List[float]]], world: int, r: int, rate: float, mib: float, kill_at: int) -> List[Dict]:
    whole = (_WARMUP, None)
    undisturbed = _median(runs["undisturbed"], whole)
    fewer = _median(runs["fewer"], whole)
    base = {"W": world, "mbit": rate, "mib": mib, "loss_step_ms": "-", "after_ms": "-", "after_vs_fewer": "-"}
    rows = []
    for label, reducers in (("undisturbed", r), ("RS_FAILOVER=0", r), ("fewer", r - 1)):
        step = _median(runs[label], whole)
        rows.append({**base, "run": label, "R": reducers, "step_ms": step * 1e3, "vs_undisturbed": step / undisturbed})
    for label, what in (("failover", "killed"), ("drain", "drained (SIGTERM)")):
        loss = statistics.median(run[kill_at] for run in runs[label])
        after = _median(runs[label], (kill_at + 1, None))
        before = _median(runs[label], (_WARMUP, kill_at))
        rows.append(
            {
                **base,
                "run": f"{label} (reducer {r - 1} {what} in step {kill_at})",
                "R": f"{r}->{r - 1}",
                "step_ms": before * 1e3,
                "loss_step_ms": loss * 1e3,
                "after_ms": after * 1e3,
                "vs_undisturbed": loss / undisturbed,
                "after_vs_fewer": after / fewer,
            }
        )
    return rows
