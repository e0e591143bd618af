"""`reduction-server size --simulate`: the predicted all-reduce and step time of a job for each
reducer count R, beside a ring on the same network; the R within 5 % of the best, the R of
bandwidth parity, and the limit that binds (pool_model.py, peer_model.py, step_model.py)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from ..errors import ConfigError
from . import peer_model, pool_model
from .gradient_formats import Format
from .measured_costs import MEASURED, Costs
from .network_model import GBIT, MAX_REDUCERS, Network
from .pool_model import Chunking, Planner
from .reducer_load import GBIT_PER_GIB
from .sizing import reducers_needed
from .step_model import StepShape, step_time

#: "within 5 % of the best"
NEAR_BEST = 1.05
#: a reducer host's cores unless given: Google's reducer machine, n1-highcpu-16
REDUCER_CORES = 16


def parse_reducers(text: str) -> List[int]:
    """`8`, `1-32` or `1,2,4,8` -> the reducer counts, each in 1..MAX_REDUCERS."""
    words = [word.strip() for word in text.split(",")]
    counts: List[int] = []
    for word in words:
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", word)
        if not match:
            raise ConfigError(f"--reducers {text!r}: expected a count, a range like 1-32, or a list like 1,2,4")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if not 1 <= low <= high <= MAX_REDUCERS:
            raise ConfigError(f"--reducers {text!r}: each count must be in 1..{MAX_REDUCERS}, the range ascending")
        counts += range(low, high + 1)
    return sorted(set(counts))


@dataclass(frozen=True)
class Job:
    """What is simulated: the network (with its R replaced for each row), the gradient, its
    format and chunking, the step."""

    network: Network
    elements: int
    fmt: Format
    chunking: Chunking
    step: StepShape


@dataclass(frozen=True)
class Row:
    """One reducer count's prediction: the gradient's all-reduce (its buckets back to back, no
    compute) and the step, through the pool and through the peers; `bucket`: the largest bucket's
    all-reduce through the pool, whose limits say which binds."""

    reducers: int
    bucket: pool_model.Timing
    allreduce_s: float
    ring_s: float
    tree_s: float
    step_s: float
    ring_step_s: float

    @property
    def speedup(self) -> float:
        return self.ring_step_s / self.step_s if self.step_s else 1.0


def simulate(job: Job, reducers: Sequence[int], planner: Planner, costs: Costs = MEASURED) -> List[Row]:
    """One row per reducer count."""
    itemsize = job.fmt.itemsize
    base = job.network
    comm_only = dataclasses.replace(job.step, compute_s=0.0, optimizer_s=0.0)
    largest = max(size for size, _ in job.step.buckets())

    def peer(model: Callable[[Network, float], pool_model.Timing]) -> Callable[[float], pool_model.Timing]:
        return lambda size: model(base, size / 4 * itemsize)  # float32 bytes -> bytes on the wire

    ring = step_time(comm_only, peer(peer_model.ring), pipelined=False)
    tree = step_time(comm_only, peer(peer_model.tree), pipelined=False)
    ring_step = step_time(job.step, peer(peer_model.ring), pipelined=False)
    rows = []
    for r in reducers:
        net = dataclasses.replace(base, reducers=r)

        def bucket(size: float, net: Network = net) -> pool_model.Timing:
            return pool_model.allreduce(net, max(1, int(size // 4)), itemsize, planner, job.chunking, costs)

        rows.append(
            Row(
                r,
                bucket(largest),
                step_time(comm_only, bucket, pipelined=True),
                ring,
                tree,
                step_time(job.step, bucket, pipelined=True),
                ring_step,
            )
        )
    return rows


def smallest_near_best(rows: Sequence[Row]) -> Row:
    """The row of fewest reducers whose step is within 5 % of the best row's."""
    best = min(row.step_s for row in rows)
    return min((row for row in rows if row.step_s <= best * NEAR_BEST), key=lambda row: row.reducers)


def parity(job: Job, costs: Costs = MEASURED) -> int:
    """Google's rule, R >= W x B_worker / B_reducer, with a reducer host's rate the smaller of its
    NIC and what its cores sum at the measured CPU per GiB."""
    net = job.network
    per_core = GBIT_PER_GIB / costs.reducer_cpu_s_per_gib
    reducer_gbps = min(net.reducer_down / GBIT, net.reducer_parallelism * per_core)
    return reducers_needed(net.workers, min(net.worker_up, net.worker_down) / GBIT, reducer_gbps)


def as_json(job: Job, rows: Sequence[Row], costs: Costs = MEASURED) -> Dict:
    """The rows and the summary, for scripts: per R `allreduce_s`, `ring_s`, `tree_s`, `step_s`,
    `ring_step_s`, `speedup`, `binds`, and each limit's seconds for the largest bucket."""
    near = smallest_near_best(rows)
    return {
        "workers": job.network.workers,
        "gradient_bytes": round(job.elements * job.fmt.itemsize),
        "format": job.fmt.name,
        "chunks": {"chunk_bytes": job.chunking.chunk_bytes, "depth": job.chunking.depth, "window": job.chunking.window},
        "reducers_within_5pct": near.reducers,
        "reducers_for_parity": parity(job, costs),
        "rows": [
            {
                "reducers": row.reducers,
                "allreduce_s": row.allreduce_s,
                "ring_s": row.ring_s,
                "tree_s": row.tree_s,
                "step_s": row.step_s,
                "ring_step_s": row.ring_step_s,
                "speedup": row.speedup,
                "binds": row.bucket.binds,
                "bucket_limits_s": row.bucket.limits,
                "bucket_lag_s": row.bucket.lag_s,
            }
            for row in rows
        ],
    }


def explain(job: Job, rows: Sequence[Row], costs: Costs = MEASURED) -> List[str]:
    """The prediction as a table and its summary in sentences."""
    gib = job.elements * job.fmt.itemsize / (1 << 30)
    net = job.network
    lines = [
        f"{net.workers} workers, gradient {job.elements * 4 / (1 << 20):.6g} MiB as float32, "
        f"{gib * 1024:.6g} MiB on the wire ({job.fmt.meaning}), in buckets of {job.step.bucket_bytes / (1 << 20):g} "
        f"MiB; ring all-reduce {rows[0].ring_s * 1e3:.4g} ms, tree {rows[0].tree_s * 1e3:.4g} ms; step compute "
        f"{job.step.compute_s * 1e3:g} ms.",
        f"{'R':>5} {'all-reduce ms':>14} {'step ms':>10} {'ring step ms':>13} {'speed-up':>9}  binds",
    ]
    for row in rows:
        lines.append(
            f"{row.reducers:>5} {row.allreduce_s * 1e3:>14.4g} {row.step_s * 1e3:>10.4g} "
            f"{row.ring_step_s * 1e3:>13.4g} {row.speedup:>8.3g}x  {row.bucket.binds}"
        )
    near = smallest_near_best(rows)
    best = min(rows, key=lambda row: row.step_s)
    lines.append(
        f"Best: R={best.reducers}, {best.step_s * 1e3:.4g} ms a step ({best.speedup:.3g}x the ring); the fewest "
        f"within 5 %: R={near.reducers} ({near.step_s * 1e3:.4g} ms, {near.bucket.binds} binds)."
    )
    lines.append(
        f"Bandwidth parity (R >= W x B_worker / B_reducer, a host's rate its NIC or its cores' sum, the smaller): "
        f"R={parity(job, costs)}."
    )
    return lines


def seconds(rows: Sequence[Row], peer: str) -> List[float]:
    """Per R, the step's seconds through the pool (`pool`) or a ring (`ring`)."""
    return [row.step_s if peer == "pool" else row.ring_step_s for row in rows]


def make_job(
    *,
    workers: int,
    worker_gbps: float,
    reducer_gbps: float,
    rtt_ms: float,
    elements: int,
    fmt: Format,
    chunking: Chunking,
    compute_ms: float,
    optimizer_ms: float,
    bucket_mib: float,
    reducer_cores: Optional[int],
) -> Job:
    """The job of `size --simulate`'s options: symmetric links, a `serve --shards auto` per
    reducer host (one shard per core; REDUCER_CORES when its cores are not given)."""
    for name, value in (("--worker-gbps", worker_gbps), ("--reducer-gbps", reducer_gbps)):
        if not value > 0 or value == float("inf"):
            raise ConfigError(f"{name} must be a positive, finite rate in Gbit/s, got {value:g}")
    if not rtt_ms >= 0 or rtt_ms == float("inf"):
        raise ConfigError(f"--rtt-ms must be 0 or more, got {rtt_ms:g}")
    if elements < 1:
        raise ConfigError("the gradient must have at least one element (--mib or --model)")
    cores = reducer_cores or REDUCER_CORES
    net = Network.symmetric(workers, 1, worker_gbps, reducer_gbps, rtt_ms, shards=cores, reducer_cores=cores)
    step = StepShape(compute_ms / 1e3, elements * 4.0, bucket_mib * (1 << 20), optimizer_s=optimizer_ms / 1e3)
    return Job(net, elements, fmt, chunking, step)
