"""`reduction-server bench ddp`: DistributedDataParallel training throughput (steps/s) on the
emulated network (bench/emulated_network.py: one namespace per host, every link shaped to the same rate),
DDP over the reduction_server backend beside DDP over Gloo, same hosts, same run.

The job (bench/ddp_job.py) trains an MLP of 24 D^2 + 9 D parameters with a small batch, so that a
step is mostly the gradient all-reduce; both backends start from the same weights and data, and
their losses agree. R = W reducer hosts by default, so the reducers' links add up to the workers'.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from tqdm import tqdm

from .emulated_network import EmulatedNetwork, cleanup_on_sigterm
from .netem import medians, plan_runs, run_gloo, run_reduction_server

COLUMNS = [
    "peer",
    "W",
    "R",
    "mbit",
    "delay_ms",
    "params_M",
    "batch",
    "step_ms",
    "step_ms_range",
    "steps_per_s",
    "vs_gloo",
    "first_loss",
    "loss",
]
_JOB = "reduction_server.bench.ddp_job"
_MARKER = '{"step_seconds"'


def run(
    worlds: Sequence[int] = (4,),
    rates_mbit: Sequence[float] = (400,),
    width: int = 1024,
    batch: int = 16,
    steps: int = 5,
    warmup: int = 2,
    reducers: Optional[Sequence[int]] = None,
    rounds: int = 1,
    delay_ms: float = 0.0,
    variants: Sequence[Dict[str, str]] = (),
) -> List[Dict]:
    """Rows for Gloo and this project on each W x link rate (x R, default R = W), and for this
    project again under each of `variants` (settings, netem.parse_variant); with rounds > 1 the
    peers take turns on the same network and each row gives the median step."""
    jobs, ours = plan_runs(worlds, rates_mbit, reducers, rounds, delay_ms, variants)
    args = ["--width", str(width), "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup)]
    rows: List[Dict] = []
    with cleanup_on_sigterm():
        for world, rate, r in tqdm(jobs, desc="ddp", unit="job"):
            runs: Dict[str, List[Dict]] = {"gloo": [], **{label: [] for label, _ in ours}}
            with EmulatedNetwork(world + r, rate, delay_ms) as net:
                for _ in range(rounds):  # in turns: the peers meet the same quiet and busy moments
                    runs["gloo"].append(_one(run_gloo(net, world, _JOB, args, _MARKER), f"gloo W={world}"))
                    for label, settings in ours:
                        runs[label].append(
                            _one(
                                run_reduction_server(net, world, r, _JOB, args, _MARKER, settings=settings),
                                f"{label} W={world}",
                            )
                        )
            g = medians([p["step_seconds"] for p in runs["gloo"]])
            for peer, points in runs.items():
                step = medians([p["step_seconds"] for p in points])
                last = points[-1]  # the losses are the same in every round: same weights, same data
                rows.append(
                    {
                        "peer": peer,
                        "W": world,
                        "R": "-" if peer == "gloo" else r,
                        "mbit": rate,
                        "delay_ms": delay_ms,
                        "params_M": last["params"] / 1e6,
                        "batch": batch,
                        "rounds": rounds,
                        "step_ms": step["seconds"] * 1e3,
                        "step_ms_range": step["range"],
                        "steps_per_s": 1 / step["seconds"],
                        "vs_gloo": g["seconds"] / step["seconds"],
                        "first_loss": last["first_loss"],
                        "loss": last["loss"],
                    }
                )
    return rows


def _one(points: List[Dict], what: str) -> Dict:
    if len(points) != 1:
        raise RuntimeError(f"{what}: rank 0 printed {len(points)} results instead of one")
    return points[0]
