"""`reduction-server bench ddp`: DistributedDataParallel training throughput (steps/s) on the
emulated network (bench/netem.py: one namespace per host, every link shaped to the same rate),
DDP over the reduction_server backend beside DDP over Gloo, same hosts, same run.

The job (bench/ddp_job.py) trains an MLP of 24 D^2 + 9 D parameters with a small batch, so that a
step is mostly the gradient all-reduce; both backends start from the same weights and data, and
their losses agree. R = W reducer hosts by default, so the reducers' links add up to the workers'.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from tqdm import tqdm

from .netem import EmulatedNetwork, cleanup_on_sigterm, run_gloo, run_reduction_server

COLUMNS = ["peer", "W", "R", "mbit", "params_M", "batch", "step_ms", "steps_per_s", "vs_gloo", "first_loss", "loss"]
_JOB = "reduction_server.bench.ddp_job"
_MARKER = '{"step_seconds"'


def run(worlds: Sequence[int] = (4,), rates_mbit: Sequence[float] = (400,), width: int = 1024, batch: int = 16,
        steps: int = 5, warmup: int = 2, reducers: Optional[Sequence[int]] = None) -> List[Dict]:
    """Rows for Gloo and this project on each W x link rate (x R, default R = W)."""
    args = ["--width", str(width), "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup)]
    jobs = [(w, rate, r) for w in worlds for rate in rates_mbit for r in (reducers or [w])]
    rows: List[Dict] = []
    with cleanup_on_sigterm():
        for world, rate, r in tqdm(jobs, desc="ddp", unit="job"):
            with EmulatedNetwork(world + r, rate) as net:
                gloo = _one(run_gloo(net, world, _JOB, args, _MARKER), f"gloo W={world}")
                ours = _one(run_reduction_server(net, world, r, _JOB, args, _MARKER), f"reduction-server W={world}")
            for peer, point, r_column in (("gloo", gloo, "-"), ("reduction-server", ours, r)):
                rows.append({"peer": peer, "W": world, "R": r_column, "mbit": rate, "params_M": point["params"] / 1e6,
                             "batch": batch, "step_ms": point["step_seconds"] * 1e3,
                             "steps_per_s": 1 / point["step_seconds"],
                             "vs_gloo": gloo["step_seconds"] / point["step_seconds"], "first_loss": point["first_loss"],
                             "loss": point["loss"]})
    return rows


def _one(points: List[Dict], what: str) -> Dict:
    if len(points) != 1:
        raise RuntimeError(f"{what}: rank 0 printed {len(points)} results instead of one")
    return points[0]
