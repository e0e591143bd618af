"""How many reducers a job needs: `reduction-server size`.

Each reducer receives its share of every worker's gradient and sends the sum back, so the
reducer pool's total bandwidth must match the workers' (DESIGN.md section 1):
R >= W x B_worker / B_reducer (Google's example: 8 workers at 100 Gbit/s and reducers at
32 Gbit/s need 25). A reducer's usable bandwidth is the smaller of its NIC and of what one
reducer process can sum, which `--measure` finds out on this host.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import List, Optional

from .errors import ConfigError

# One rank of the measuring job: all-reduce a float32 buffer, print the mean time per step.
_WORKER = textwrap.dedent("""
    import sys, time, numpy as np
    import reduction_server.client as rs
    mib, iters = float(sys.argv[1]), int(sys.argv[2])
    with rs.Communicator.from_env() as comm:
        x = np.ones(int(mib * (1 << 20)) // 4, np.float32)
        comm.all_reduce(x, out=x)  # warm-up: connections, buffers
        comm.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x, out=x)
        print(f"seconds_per_step={(time.perf_counter() - start) / iters}", flush=True)
""")


@dataclass
class Measurement:
    gbps: float  # incoming gradient one reducer process summed, Gbit/s
    workers: int
    mib: float
    iters: int


def reducers_needed(workers: int, worker_gbps: float, reducer_gbps: float) -> int:
    """ceil(W x B_worker / B_reducer), the reducer count whose bandwidth matches the workers'."""
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    if not all(value > 0 and math.isfinite(value) for value in (worker_gbps, reducer_gbps)):
        raise ConfigError(f"bandwidths must be positive, finite Gbit/s, got --worker-gbps {worker_gbps:g} "
                          f"--reducer-gbps {reducer_gbps:g}")
    # The epsilon keeps 512/32 at 16 instead of a float rounding it to 17.
    return max(1, math.ceil(workers * worker_gbps / reducer_gbps - 1e-9))


def explain(workers: int, worker_gbps: float, reducer_gbps: float,
            measured: Optional[Measurement] = None) -> List[str]:
    """The sizing, worked through in sentences; the last line gives the count."""
    total = workers * worker_gbps
    lines = [f"Gradient traffic into the reducer pool: {workers} worker hosts x {worker_gbps:g} Gbit/s "
             f"= {total:g} Gbit/s (each reducer receives its share and sends the sum back as much)."]
    per_reducer = reducer_gbps
    if measured is None:
        lines.append(f"Per reducer: {reducer_gbps:g} Gbit/s, its NIC (add --measure to check that one "
                     "reducer process can sum that fast on this kind of host).")
    else:
        lines.append(
            f"Measured here: one reducer process summed {measured.gbps:.1f} Gbit/s of incoming float32 "
            f"gradient ({measured.workers} local workers, {measured.mib:g} MiB all-reduces, {measured.iters} "
            "steps; the workers shared this machine's CPUs, so it is a lower bound).")
        per_reducer = min(reducer_gbps, measured.gbps)
        if measured.gbps < reducer_gbps:
            per_instance = math.ceil(reducer_gbps / measured.gbps - 1e-9)
            lines.append(
                f"Per reducer: min(NIC {reducer_gbps:g}, CPU {measured.gbps:.1f}) = {measured.gbps:.1f} Gbit/s: "
                f"the CPU binds. Run {per_instance} reducer processes per reducer host (one per core) to fill "
                "its NIC, or count reducer processes as below.")
        else:
            lines.append(f"Per reducer: min(NIC {reducer_gbps:g}, CPU {measured.gbps:.1f}) = {reducer_gbps:g} "
                         "Gbit/s: the NIC binds.")
    count = reducers_needed(workers, worker_gbps, per_reducer)
    unit = "reducer processes" if measured is not None and measured.gbps < reducer_gbps else "reducers"
    lines.append(f"Reducers needed: ceil({total:g} / {per_reducer:.4g}) = {count} {unit}.")
    return lines


def measure(workers: int = 2, mib: float = 64, iters: int = 5, timeout: float = 300) -> Measurement:
    """Time one reducer process with `workers` local worker processes all-reducing float32."""
    if workers < 1 or mib <= 0 or iters < 1:
        raise ConfigError(f"--measure needs workers >= 1, a positive size and iters >= 1 "
                          f"(got {workers}, {mib}, {iters})")
    command = [sys.executable, "-m", "reduction_server", "run", "-np", str(workers), "--reducers", "1", "--",
               sys.executable, "-c", _WORKER, str(mib), str(iters)]
    # RS_SHM=0: reducers serve workers on other hosts, so their chunks must come through the
    # sockets here too; shared memory would spare the reducer the very work being measured.
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd="/",
                          env={**os.environ, "RS_SHM": "0"})
    steps = [float(v) for v in re.findall(r"\] seconds_per_step=([0-9.eE+-]+)", proc.stdout)]
    if proc.returncode != 0 or len(steps) != workers:
        raise RuntimeError(f"the measuring job failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    seconds = max(steps)  # the step ends when the slowest rank has its result
    incoming_bits = workers * mib * (1 << 20) * 8
    return Measurement(incoming_bits / seconds / 1e9, workers, mib, iters)
