"""`reduction-server bench chunks`: what one chunk costs a worker and a reducer (issue 40). W local
workers all-reduce S MiB float32 over tcp loopback (RS_SHM=0, as between hosts) through R
reducers, the collective cut into chunks of each size given (RS_CHUNK_BYTES with
RS_PIPELINE_DEPTH=1, so that the plan's chunks are that size where S/R allows), beside a Gloo ring
of the same W and S in the same run, in turns. Per row:

- chunk_KiB, chunks: the plan's chunk size and its chunks per all-reduce (client/chunking.py);
- worker_cpu_s_per_GiB: the lead worker's CPU time (all its threads) per GiB it all-reduces;
  vs_gloo_cpu: that over a Gloo rank's per GiB (same W and S, same run);
- worker_us_per_chunk: the worker's CPU per all-reduce over its chunks, each sent and received
  (its byte costs included: the fit below takes them apart);
- reducer_cpu_s_per_GiB: the reducers' CPU (every process and thread) per GiB of incoming
  gradient (W x S); reducer_us_per_contribution: per all-reduce over chunks x W.

summary() fits a line through each (W, R, S)'s rows, CPU per all-reduce = a x chunks + b, and
says a (CPU per chunk) and b per GiB (the cost of the bytes alone) for the worker and, per
contribution, for the reducers: the constants issue 40 asks to cut and the sizing model takes
(reduction_server/tools/measured_costs.py).
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Sequence

import numpy as np
from tqdm import tqdm

from reduction_server.client.chunking import plan_chunks
from reduction_server.tools import reducer_load

from .loopback import measure as loopback_job

COLUMNS = [
    "W",
    "R",
    "mib",
    "chunk_KiB",
    "chunks",
    "ms",
    "worker_cpu_s_per_GiB",
    "vs_gloo_cpu",
    "worker_us_per_chunk",
    "reducer_cpu_s_per_GiB",
    "reducer_us_per_contribution",
]
GIB = float(1 << 30)


def run(
    worlds: Sequence[int] = (4,),
    reducers: Sequence[int] = (2, 8),
    sizes_mib: Sequence[float] = (16,),
    chunks_kib: Sequence[float] = (16, 64, 256, 1024, 4096),
    rounds: int = 1,
    iters: int = 0,
) -> List[Dict]:
    """One row per W x S x R x chunk size, each figure the median of `rounds` turns (Gloo's rank
    runs once in each turn too); `iters` all-reduces per job (0: more for small sizes)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    rows: List[Dict] = []
    jobs = [(w, s, r, k) for w in worlds for s in sizes_mib for r in reducers for k in chunks_kib]
    with tqdm(total=rounds * (len(jobs) + len(worlds) * len(sizes_mib)), desc="chunks", unit="job") as progress:
        for world in worlds:
            for mib in sizes_mib:
                n = iters or max(3, min(30, int(128 / mib)))
                gloo: List[float] = []
                loads: Dict[tuple, List[reducer_load.Load]] = {}
                for _ in range(rounds):
                    (point,) = loopback_job("gloo", world, 1, [mib], n)
                    gloo.append(point["cpu_s"] / (point["bytes"] / GIB))
                    progress.update()
                    for r in reducers:
                        for kib in chunks_kib:
                            env = {"RS_CHUNK_BYTES": str(int(kib * 1024)), "RS_PIPELINE_DEPTH": "1"}
                            load = reducer_load.run(world, mib, n, reducers=r, env=env)
                            loads.setdefault((r, kib), []).append(load)
                            progress.update()
                rows += [_row(world, mib, r, kib, runs, statistics.median(gloo)) for (r, kib), runs in loads.items()]
    return rows


def _row(world: int, mib: float, r: int, kib: float, runs: List[reducer_load.Load], gloo_s_per_gib: float) -> Dict:
    count = int(mib * (1 << 20)) // 4
    spans = plan_chunks(count, 4, r, int(kib * 1024), 1)
    chunks = len(spans)
    gib = count * 4 / GIB

    def median(values) -> float:
        return statistics.median(list(values))

    worker = median(load.worker_cpu_seconds / load.iters for load in runs)  # CPU-s per all-reduce
    reducers = median(load.cpu_seconds / load.iters for load in runs)
    return {
        "W": world,
        "R": r,
        "mib": mib,
        "rounds": len(runs),
        "chunk_KiB": spans[0][1] * 4 / 1024,
        "chunks": chunks,
        "ms": median(load.seconds / load.iters for load in runs) * 1e3,
        "worker_cpu_s_per_GiB": worker / gib,
        "vs_gloo_cpu": worker / gib / gloo_s_per_gib,
        "gloo_cpu_s_per_GiB": gloo_s_per_gib,
        "worker_us_per_chunk": worker / chunks * 1e6,
        "reducer_cpu_s_per_GiB": reducers / (world * gib),
        "reducer_us_per_contribution": reducers / (chunks * world) * 1e6,
        "worker_cpu_s": worker,
        "reducer_cpu_s": reducers,
    }


def summary(rows: Sequence[Dict]) -> List[str]:
    """Per (W, R, S): the least-squares line CPU per all-reduce = a x chunks + b, for the worker
    (a: per chunk) and the reducers (a: per contribution, chunks x W), b as CPU-s per GiB."""
    lines = []
    for key in sorted({(r["W"], r["R"], r["mib"]) for r in rows}):
        group = [r for r in rows if (r["W"], r["R"], r["mib"]) == key]
        if len({r["chunks"] for r in group}) < 2:
            continue  # one chunk count: no line to fit
        world, reducers, mib = key
        gib = mib / 1024
        chunks = np.array([r["chunks"] for r in group], float)
        worker = np.polyfit(chunks, [r["worker_cpu_s"] for r in group], 1)
        pool = np.polyfit(chunks * world, [r["reducer_cpu_s"] for r in group], 1)
        lines.append(
            f"W={world} R={reducers} {mib:g} MiB: worker {worker[0] * 1e6:.1f} us per chunk + "
            f"{worker[1] / gib:.2f} CPU-s per GiB (a Gloo rank: {group[0]['gloo_cpu_s_per_GiB']:.2f}); "
            f"reducers {pool[0] * 1e6:.1f} us per contribution + {pool[1] / (world * gib):.2f} CPU-s per GiB in"
        )
    return lines
