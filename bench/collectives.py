"""`reduction-server bench collectives`: FSDP's sharding collectives, reduce_scatter_tensor and
all_gather_into_tensor, through the reducers beside Gloo's ring, same sizes, same run: on the
emulated network (bench/emulated_network.py: one namespace per host, every link shaped to the same rate,
R = W reducer hosts by default), and on this machine's loopback (through sockets, `RS_SHM=0`).

Through the reducers, reduce_scatter is one all-reduce per rank's piece, and all_gather one relay
per rank (docs/design.md): per rank, S out and S in for reduce_scatter, S/W out and S in for
all_gather, against (W-1)/W x S each way for the ring.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from tqdm import tqdm

from reduction_server.children import AWAY_FROM_SOURCE

from .emulated_network import EmulatedNetwork, cleanup_on_sigterm
from .netem import medians, plan_runs, run_gloo, run_reduction_server

COLUMNS = ["peer", "collective", "W", "R", "mbit", "mib", "ms", "ms_range", "algbw_GBps", "vs_gloo"]
_JOB = "reduction_server.bench.collectives_job"
_MARKER = '{"collective"'


def run(
    worlds: Sequence[int] = (4,),
    rates_mbit: Sequence[float] = (200,),
    sizes_mib: Sequence[float] = (4, 16),
    reducers: Optional[Sequence[int]] = None,
    iters: int = 3,
    rounds: int = 1,
) -> List[Dict]:
    """Rows for Gloo and this project for each W x (loopback, and each link rate) x size x
    collective; with rounds > 1 the peers take turns and each row gives the median."""
    args = ["--mib", ",".join(f"{s:g}" for s in sizes_mib), "--iters", str(iters)]
    rows: List[Dict] = []
    with cleanup_on_sigterm():
        jobs, _ = plan_runs(worlds, rates_mbit, reducers, rounds, 0.0, ())
        jobs = [(w, 0.0, r) for w in worlds for r in (reducers or [w])] + jobs  # 0.0: loopback
        for world, rate, r in tqdm(jobs, desc="collectives", unit="job"):
            runs: Dict[str, List[List[Dict]]] = {"gloo": [], "reduction-server": []}
            for _ in range(rounds):  # in turns: the peers meet the same quiet and busy moments
                if rate > 0:
                    with EmulatedNetwork(world + r, rate) as net:
                        runs["gloo"].append(run_gloo(net, world, _JOB, args, _MARKER))
                        runs["reduction-server"].append(run_reduction_server(net, world, r, _JOB, args, _MARKER))
                else:
                    runs["gloo"].append(_loopback("gloo", world, r, args))
                    runs["reduction-server"].append(_loopback("rs", world, r, args))
            rows += _rows(runs, world, r, rate, rounds)
    return rows


def _loopback(backend: str, world: int, reducers: int, args: List[str]) -> List[Dict]:
    """The job on this machine under `reduction-server run` (which starts the reducers, and sets
    RANK, WORLD_SIZE and MASTER_* for Gloo's ranks); rank 0's result lines."""
    command = [
        sys.executable,
        "-m",
        "reduction_server",
        "run",
        "-np",
        str(world),
        "--reducers",
        str(reducers),
        "--",
        sys.executable,
        "-m",
        _JOB,
        backend,
        *args,
    ]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=900, cwd=AWAY_FROM_SOURCE, env={**os.environ, "RS_SHM": "0"}
    )  # through sockets, as between hosts
    lines = [line[line.index("{") :] for line in proc.stdout.splitlines() if _MARKER in line]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{backend} W={world} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return [json.loads(line) for line in lines]


def _rows(runs: Dict[str, List[List[Dict]]], world: int, r: int, rate: float, rounds: int) -> List[Dict]:
    rows = []
    gloo_seconds = {}
    for peer, results in runs.items():
        for i, point in enumerate(results[0]):
            step = medians([result[i]["seconds"] for result in results])
            key = (point["collective"], point["mib"])
            if peer == "gloo":
                gloo_seconds[key] = step["seconds"]
            rows.append(
                {
                    "peer": peer,
                    "collective": point["collective"],
                    "W": world,
                    "R": "-" if peer == "gloo" else r,
                    "mbit": rate or "loopback",
                    "mib": point["mib"],
                    "rounds": rounds,
                    "ms": step["seconds"] * 1e3,
                    "ms_range": step["range"],
                    "algbw_GBps": point["mib"] * (1 << 20) / step["seconds"] / 1e9,
                    "vs_gloo": gloo_seconds[key] / step["seconds"],
                }
            )
    return rows
