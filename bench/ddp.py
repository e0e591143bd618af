"""`reduction-server bench ddp`: DistributedDataParallel training throughput (steps/s) on the
emulated network (bench/emulated_network.py: one namespace per host, every link shaped to the same rate),
DDP over the reduction_server backend beside DDP over Gloo, same hosts, same run.

The job (bench/ddp_job.py) trains an MLP of 24 D^2 + 9 D parameters with a small batch, so that a
step is mostly the gradient all-reduce; both backends start from the same weights and data, and
their losses agree. R = W reducer hosts by default, so the reducers' links add up to the workers'.
`compressions` (`--compression int8,bf16`): this project trains once more per format with its
hook, and Gloo once more with torch's fp16_compress_hook for fp16 (torch's bf16 hook runs on NCCL
only); their losses differ from float32's by the format's rounding.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from tqdm import tqdm

from .emulated_network import cleanup_on_sigterm
from .netem import compressed_runs, labelled, medians, networks, plan_runs, run_gloo, run_reduction_server

COLUMNS = [
    "peer",
    "compression",
    "W",
    "R",
    "mbit",
    "reducer_mbit",
    "delay_ms",
    "params_M",
    "batch",
    "step_ms",
    "step_ms_range",
    "steps_per_s",
    "vs_gloo",
    "vs_float32",
    "first_loss",
    "loss",
]
_JOB = "reduction_server.bench.ddp_job"
#: the formats torch's own hooks send over Gloo (its bf16_compress_hook needs NCCL or XCCL)
_GLOO_HOOKS = ("none", "fp16")
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
    compressions: Sequence[str] = ("none",),
    reducer_rates_mbit: Optional[Sequence[float]] = None,
) -> List[Dict]:
    """Rows for Gloo and this project on each W x link rate (x R, default R = W; x the reducers'
    link rate, default the workers'), and for this project again under each of `variants`
    (settings, netem.parse_variant) and each of `compressions`; with rounds > 1 the peers take
    turns on the same network and each row gives the median step."""
    jobs, ours = plan_runs(worlds, rates_mbit, reducers, rounds, delay_ms, variants)
    formats = compressed_runs(compressions)
    args = ["--width", str(width), "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup)]
    gloo_runs = [(("gloo", name), [*args, "--hook", name]) for name in formats if name in _GLOO_HOOKS]
    our_runs = [(key, settings, [*args, "--hook", key[1]]) for key, settings in labelled(ours, formats)]
    rows: List[Dict] = []
    with cleanup_on_sigterm():
        for links in tqdm(networks(jobs, reducer_rates_mbit), desc="ddp", unit="job"):
            world, rate, r, reducer_rate = links
            runs: Dict[Tuple[str, str], List[Dict]] = {key: [] for key, *_ in (*gloo_runs, *our_runs)}
            with links.network(delay_ms) as net:
                for _ in range(rounds):  # in turns: the peers meet the same quiet and busy moments
                    for key, job_args in gloo_runs:
                        runs[key].append(_one(run_gloo(net, world, _JOB, job_args, _MARKER), f"gloo W={world}"))
                    for key, settings, job_args in our_runs:
                        runs[key].append(
                            _one(
                                run_reduction_server(net, world, r, _JOB, job_args, _MARKER, settings=settings),
                                f"{' '.join(key)} W={world}",
                            )
                        )
            g = medians([p["step_seconds"] for p in runs["gloo", "none"]])
            float32 = medians([p["step_seconds"] for p in runs[our_runs[0][0]]])
            for (peer, name), points in runs.items():
                is_gloo = peer == "gloo"
                step = medians([p["step_seconds"] for p in points])
                last = points[-1]  # the losses are the same in every round: same weights, same data
                rows.append(
                    {
                        "peer": peer,
                        "compression": name,
                        "W": world,
                        "R": "-" if is_gloo else r,
                        "mbit": rate,
                        "reducer_mbit": "-" if is_gloo else reducer_rate,
                        "delay_ms": delay_ms,
                        "params_M": last["params"] / 1e6,
                        "batch": batch,
                        "rounds": rounds,
                        "step_ms": step["seconds"] * 1e3,
                        "step_ms_range": step["range"],
                        "steps_per_s": 1 / step["seconds"],
                        "vs_gloo": g["seconds"] / step["seconds"],
                        "vs_float32": "-" if is_gloo else float32["seconds"] / step["seconds"],
                        "first_loss": last["first_loss"],
                        "loss": last["loss"],
                    }
                )
    return rows


def _one(points: List[Dict], what: str) -> Dict:
    if len(points) != 1:
        raise RuntimeError(f"{what}: rank 0 printed {len(points)} results instead of one")
    return points[0]
