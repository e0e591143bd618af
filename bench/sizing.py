"""`reduction-server bench sizing`: the step-time model's all-reduce (reduction_server/tools/
pool_model.py, peer_model.py) against the emulated network (emulated_network.py, netem.py's
runners), point by point, the reduction server and Gloo's ring on the same hosts.

Each point is predicted before anything runs, from the measured constants (tools/
measured_costs.py) and the emulation's own facts: its links' rates and token buckets, the delay
it adds, and the cores all its hosts share. What those shared cores cost per GiB is measured
first by a calibration run off the grid (CALIBRATION: links so fast that the CPU binds), never
fitted to the grid: the validation is out of sample. A point with a round trip needs the kernel's
netem qdisc; where it is absent the point is reported as skipped.
"""

from __future__ import annotations

import itertools
import os
import random
import statistics
from typing import Dict, List, NamedTuple, Optional, Tuple

from tqdm import tqdm

from reduction_server.client.chunking import plan_chunks
from reduction_server.config.settings import tuning
from reduction_server.tools import peer_model, pool_model
from reduction_server.tools.network_model import Network
from reduction_server.tools.pool_model import Chunking

from .emulated_network import TBF_BURST_BYTES, EmulatedNetwork, cleanup_on_sigterm
from .netem import medians, run_gloo, run_reduction_server

COLUMNS = [
    "point",
    "load",
    "peer",
    "W",
    "R",
    "w_mbit",
    "r_mbit",
    "rtt_ms",
    "mib",
    "dtype",
    "predicted_ms",
    "measured_ms",
    "error",
    "binds",
]
_JOB = "reduction_server.bench.allreduce_job"
_MARKER = '{"bytes"'
ITEMSIZE = {"float32": 4, "float16": 2}
#: the calibration's two points: W, R, links far above what 2 cores move (so that the shared CPU
#: binds), and two sizes: 64 MiB in 512 KiB chunks, 4 MiB in 64 KiB chunks (the floor), so that a
#: GiB's cost and a chunk's come apart
CALIBRATION = (4, 4, 10_000.0)
CALIBRATION_MIB = (64.0, 4.0)
#: the grid's axes (issue 42): W 2..12, R 1..8, 100-1000 Mbit/s with reducers slower and faster
#: than workers, 1-64 MiB, RTT 0-10 ms, float32 and 16-bit
WORLDS = (2, 3, 4, 6, 8, 10, 12)
REDUCERS = (1, 2, 3, 4, 6, 8)
RATES = (100.0, 200.0, 400.0, 1000.0)
REDUCER_RATIOS = (0.5, 1.0, 2.0)
SIZES = (1.0, 4.0, 16.0, 64.0)
RTTS = (2.0, 5.0, 10.0)
#: a point's predicted all-reduce, either peer: long enough to measure, short enough to run
SHORTEST_S, LONGEST_S = 0.03, 4.0
SEED = 42
GRID_POINTS, DELAY_POINTS = 44, 8
#: timed all-reduces of a point: about TIMED_S seconds of them, within these bounds
TIMED_S, MIN_ITERS, MAX_ITERS = 2.0, 3, 20


class Point(NamedTuple):
    workers: int
    reducers: int
    worker_mbit: float
    reducer_mbit: float
    rtt_ms: float
    mib: float
    dtype: str


class Shared(NamedTuple):
    """The emulation's shared cores and what one worker's gradient costs them: through the pool
    per GiB and per chunk, through the ring per GiB."""

    cores: float
    pool_s_per_gib: float
    pool_s_per_chunk: float
    ring_s_per_gib: float


def network(point: Point, shared: Optional[Shared]) -> Network:
    """The model's view of a point's emulated network (both directions of a link alike; the
    delay crosses four links a round trip, each link's tbf has its burst)."""
    w, r = point.worker_mbit * 1e6 / 8, point.reducer_mbit * 1e6 / 8
    return Network(
        point.workers,
        point.reducers,
        w,
        w,
        r,
        r,
        point.rtt_ms / 1e3,
        burst_bytes=TBF_BURST_BYTES,
        shared_cores=shared.cores if shared else None,
        shared_pool_s_per_gib=shared.pool_s_per_gib if shared else 0.0,
        shared_pool_s_per_chunk=shared.pool_s_per_chunk if shared else 0.0,
        shared_ring_s_per_gib=shared.ring_s_per_gib if shared else 0.0,
    )


def chunking() -> Chunking:
    """The chunk settings the emulated hosts run with (this environment's TUNING)."""
    return Chunking(tuning("RS_CHUNK_BYTES"), tuning("RS_PIPELINE_DEPTH"), tuning("RS_WINDOW"))


def predict(point: Point, shared: Optional[Shared]) -> Tuple[pool_model.Timing, pool_model.Timing]:
    """The pool's and the ring's predicted all-reduce of the point."""
    net = network(point, shared)
    itemsize = ITEMSIZE[point.dtype]
    nbytes = int(point.mib * (1 << 20))
    pool = pool_model.allreduce(net, nbytes // itemsize, itemsize, plan_chunks, chunking())
    return pool, peer_model.ring(net, nbytes)


def grid(count: int = GRID_POINTS, delayed: int = DELAY_POINTS) -> List[Point]:
    """`count` points without a delay and `delayed` with one, drawn (seeded) from every
    combination of the axes whose hosts fit and whose predicted times lie in SHORTEST_S..LONGEST_S."""
    candidates = [
        Point(w, r, rate, rate * ratio, 0.0, mib, dtype)
        for w, r, rate, ratio, mib, dtype in itertools.product(WORLDS, REDUCERS, RATES, REDUCER_RATIOS, SIZES, ITEMSIZE)
        if 100 <= rate * ratio <= 1000 and r <= w and _measurable(Point(w, r, rate, rate * ratio, 0.0, mib, dtype))
    ]
    draw = random.Random(SEED)
    points = draw.sample(candidates, count)
    with_delay = [p._replace(rtt_ms=draw.choice(RTTS)) for p in draw.sample(candidates, delayed)]
    return sorted(points) + sorted(p for p in with_delay if _measurable(p))


def _measurable(point: Point) -> bool:
    pool, ring = predict(point, None)
    return all(SHORTEST_S <= t.seconds <= LONGEST_S for t in (pool, ring))


#: --quick: four points of the grid's kinds (reducers slower, faster, fewer; 16-bit)
QUICK = [
    Point(2, 2, 400.0, 400.0, 0.0, 4.0, "float32"),
    Point(4, 2, 200.0, 400.0, 0.0, 16.0, "float16"),
    Point(4, 1, 400.0, 200.0, 0.0, 4.0, "float32"),
    Point(3, 3, 1000.0, 1000.0, 0.0, 16.0, "float32"),
]


def shared_cores() -> float:
    """The cores every emulated host shares: this process's."""
    return float(len(os.sched_getaffinity(0)))


def calibrate(rounds: int = 1) -> Shared:
    """What one worker's gradient costs the shared cores where the CPU binds (CALIBRATION's
    links, off the grid): seconds x cores / W = GiB x per GiB + chunks x per chunk, at the two
    sizes, solved for both; the ring's per GiB from the larger."""
    w, r, mbit = CALIBRATION
    cores = shared_cores()
    equations = []
    for mib in CALIBRATION_MIB:
        point = Point(w, r, mbit, mbit, 0.0, mib, "float32")
        pool, ring = _measure(point, rounds, iters=5)
        chunks = len(plan_chunks(int(mib * (1 << 20)) // 4, 4, r, chunking().chunk_bytes, chunking().depth))
        equations.append((mib / 1024, chunks, pool * cores / w, ring * cores / w))
    (g1, n1, t1, ring1), (g2, n2, t2, _) = equations
    per_chunk = max(0.0, (t2 * g1 - t1 * g2) / (n2 * g1 - n1 * g2))
    per_gib = (t1 - n1 * per_chunk) / g1
    return Shared(cores, per_gib, per_chunk, ring1 / (2 * (w - 1) / w * g1))


def _measure(point: Point, rounds: int, iters: int) -> Tuple[float, float]:
    """The point's measured seconds per all-reduce (median of the rounds): pool, ring."""
    args = ["--mib", f"{point.mib:g}", "--iters", str(iters), "--dtype", point.dtype]
    hosts = point.workers + point.reducers
    rates = [point.worker_mbit] * point.workers + [point.reducer_mbit] * point.reducers
    pool: List[float] = []
    ring: List[float] = []
    with EmulatedNetwork(hosts, point.worker_mbit, point.rtt_ms / 4, rates) as net:
        for _ in range(rounds):
            ring.append(run_gloo(net, point.workers, _JOB, args, _MARKER)[0]["seconds"])
            pool.append(run_reduction_server(net, point.workers, point.reducers, _JOB, args, _MARKER)[0]["seconds"])
    return medians(pool)["seconds"], medians(ring)["seconds"]


def _netem_available() -> bool:
    try:
        with EmulatedNetwork(1, 100.0, 1.0):
            return True
    except OSError:
        return False


def part_of(points: List[Point], part: str) -> List[Tuple[int, Point]]:
    """The K-th of N near-equal parts of `points` ("K/N"), each with its index in the whole: a
    grid run in several calls (a lent machine's calls are bounded) whose rows merge by index."""
    k, sep, n = part.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n) <= len(points)):
        raise ValueError(f"--part {part!r}: expected K/N with 1 <= K <= N <= {len(points)} (the grid's points)")
    k, n = int(k), int(n)
    first, last = (k - 1) * len(points) // n, k * len(points) // n
    return list(enumerate(points))[first:last]


def run(
    points: Optional[List[Point]] = None, rounds: int = 1, quick: bool = False, part: Optional[str] = None
) -> List[Dict]:
    """Calibrate, predict every point, then run them: two rows a point (pool, Gloo), each with
    its prediction, measurement and error (predicted / measured - 1). `part` ("K/N"): only the
    K-th of N parts of the points, calibrated on its own, each row keeping its point's index."""
    points = points or (QUICK if quick else grid())
    chosen = part_of(points, part) if part else list(enumerate(points))
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    rows: List[Dict] = []
    with cleanup_on_sigterm():
        shared = calibrate(rounds)
        print(
            f"calibration (W={CALIBRATION[0]} R={CALIBRATION[1]} {CALIBRATION[2]:g} Mbit/s, "
            f"{'/'.join(f'{m:g}' for m in CALIBRATION_MIB)} MiB, {shared.cores:g} shared cores): per worker, pool "
            f"{shared.pool_s_per_gib:.3g} CPU-s a GiB + {shared.pool_s_per_chunk * 1e6:.0f} us a chunk, ring "
            f"{shared.ring_s_per_gib:.3g} CPU-s a GiB",
            flush=True,
        )
        predictions = [(i, point, *predict(point, shared)) for i, point in chosen]  # all before any run
        delay = any(point.rtt_ms for _, point in chosen) and _netem_available()
        for i, point, pool, ring in tqdm(predictions, desc="sizing", unit="point"):
            base = {
                "point": i,
                "W": point.workers,
                "R": point.reducers,
                "w_mbit": point.worker_mbit,
                "r_mbit": point.reducer_mbit,
                "rtt_ms": point.rtt_ms,
                "mib": point.mib,
                "dtype": point.dtype,
                "calibration": shared._asdict(),
            }
            if point.rtt_ms and not delay:
                rows += [{**base, "peer": peer, "binds": "skipped: no netem qdisc"} for peer in ("pool", "gloo")]
                continue
            iters = max(MIN_ITERS, min(MAX_ITERS, round(TIMED_S / max(pool.seconds, ring.seconds))))
            measured = _measure(point, rounds, iters)
            base["load"] = os.getloadavg()[0]  # the last minute's: other jobs on the shared cores, the noise
            for peer, timing, seconds in (("pool", pool, measured[0]), ("gloo", ring, measured[1])):
                rows.append(
                    {
                        **base,
                        "peer": peer,
                        "predicted_ms": timing.seconds * 1e3,
                        "measured_ms": seconds * 1e3,
                        "error": timing.seconds / seconds - 1,
                        "binds": timing.binds,
                    }
                )
    return rows


def summary(rows: List[Dict]) -> List[str]:
    """Median and worst absolute error per peer, over the points that ran."""
    lines = []
    for peer in ("pool", "gloo"):
        errors = [abs(row["error"]) for row in rows if row["peer"] == peer and "error" in row]
        if errors:
            lines.append(
                f"{peer}: {len(errors)} points, median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}"
            )
    return lines
