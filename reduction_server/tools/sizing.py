"""How many reducer hosts a job needs: `reduction-server size`.

Each reducer receives its share of every worker's gradient and sends the sum back, so the
reducer pool's total bandwidth must match the workers' (docs/design.md, "The algorithm"):
R >= W x B_worker / B_reducer (Google's example: 8 workers at 100 Gbit/s and reducers at
32 Gbit/s need 25). A reducer host's usable bandwidth is the smaller of its NIC and of what its
cores can sum: `--measure` finds the CPU cost of a GiB on this host (reducer_load.py), hence what
one core sums, and a reducer host runs one shard per core (`serve --shards auto`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from ..errors import ConfigError
from .reducer_load import GBIT_PER_GIB


@dataclass
class Measurement:
    cpu_s_per_gib: float  # the reducer's CPU seconds (all its threads) per GiB of incoming gradient
    gbps_in: float  # incoming gradient it summed, Gbit/s (its cores shared with the workers: a lower bound)
    workers: int
    mib: float
    iters: int

    @property
    def per_core_gbps(self) -> float:
        """Incoming Gbit/s one fully busy core sums at this cost."""
        return GBIT_PER_GIB / self.cpu_s_per_gib


def reducers_needed(workers: int, worker_gbps: float, reducer_gbps: float) -> int:
    """ceil(W x B_worker / B_reducer), the reducer count whose bandwidth matches the workers'."""
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    if not all(value > 0 and math.isfinite(value) for value in (worker_gbps, reducer_gbps)):
        raise ConfigError(
            f"bandwidths must be positive, finite Gbit/s, got --worker-gbps {worker_gbps:g} "
            f"--reducer-gbps {reducer_gbps:g}"
        )
    # The epsilon keeps 512/32 at 16 instead of a float rounding it to 17.
    return max(1, math.ceil(workers * worker_gbps / reducer_gbps - 1e-9))


def explain(
    workers: int,
    worker_gbps: float,
    reducer_gbps: float,
    measured: Optional[Measurement] = None,
    cores: Optional[int] = None,
) -> List[str]:
    """The sizing, worked through in sentences; the last line gives the count of reducer hosts.
    `cores`: each reducer host's cores (with a measurement)."""
    total = workers * worker_gbps
    lines = [
        f"Gradient traffic into the reducer pool: {workers} worker hosts x {worker_gbps:g} Gbit/s "
        f"= {total:g} Gbit/s (each reducer receives its share and sends the sum back as much)."
    ]
    per_host = reducer_gbps
    if measured is None:
        lines.append(
            f"Per reducer host: {reducer_gbps:g} Gbit/s, its NIC (add --measure to check that its cores "
            "can sum that fast)."
        )
    else:
        if cores is None or cores < 1:
            raise ConfigError(f"--reducer-cores must be at least 1, got {cores}")
        cpu = cores * measured.per_core_gbps
        lines.append(
            f"Measured here: a reducer spends {measured.cpu_s_per_gib:.3f} CPU-seconds per GiB of incoming float32 "
            f"gradient ({measured.workers} local workers, {measured.mib:g} MiB all-reduces, {measured.iters} steps, "
            f"over tcp; it summed {measured.gbps_in:.1f} Gbit/s sharing this machine's cores with them): one core "
            f"sums {measured.per_core_gbps:.1f} Gbit/s."
        )
        lines.append(
            f"A reducer host of {cores} cores runs {cores} shards (serve --shards auto) and sums "
            f"{cores} x {measured.per_core_gbps:.1f} = {cpu:.1f} Gbit/s."
        )
        per_host = min(reducer_gbps, cpu)
        binds = "the CPU binds" if cpu < reducer_gbps else "the NIC binds"
        lines.append(
            f"Per reducer host: min(NIC {reducer_gbps:g}, CPU {cpu:.1f}) = {per_host:.4g} Gbit/s: {binds}."
            + (
                f" Hosts of {math.ceil(cores * reducer_gbps / cpu - 1e-9)} cores would fill the NIC."
                if cpu < reducer_gbps
                else ""
            )
        )
    count = reducers_needed(workers, worker_gbps, per_host)
    lines.append(f"Reducer hosts needed: ceil({total:g} / {per_host:.4g}) = {count} (one `serve` each).")
    return lines


def measure(workers: int = 2, mib: float = 64, iters: int = 5, timeout: float = 300) -> Measurement:
    """One reducer process (one shard) with `workers` local worker processes all-reducing float32
    over tcp: its CPU time per GiB of incoming gradient."""
    from . import reducer_load

    if workers < 1 or mib <= 0 or iters < 1:
        raise ConfigError(
            f"--measure needs workers >= 1, a positive size and iters >= 1 (got {workers}, {mib}, {iters})"
        )
    load = reducer_load.run(workers, mib, iters, shards=1, timeout=timeout)
    return Measurement(load.cpu_s_per_gib, load.gbit_s_in, workers, mib, iters)
