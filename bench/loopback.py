"""`reduction-server bench loopback`: all-reduce on one machine, this project beside
torch.distributed's Gloo ring and Open MPI (where mpirun and mpi4py are installed), same sizes,
same run. algbw = bytes / time; busbw is nccl-tests' ring formula algbw x 2(W-1)/W, shown for
comparison only (it overstates a reduction server's link use).

This project runs twice: as a local job runs it, with chunks in shared-memory slots (its
reducers share the workers' host), and with RS_SHM=0, through tcp loopback sockets as chunks
travel between hosts."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
from typing import Dict, List, Sequence, Tuple

from tqdm import tqdm

from reduction_server.children import AWAY_FROM_SOURCE

from .netem import medians

COLUMNS = ["peer", "W", "R", "mib", "ms", "ms_range", "algbw_GBps", "busbw_GBps(ring)", "vs_gloo", "vs_gloo_range"]
_JOB = [sys.executable, "-m", "reduction_server.bench.allreduce_job"]


def available_peers() -> List[str]:
    peers = []
    if importlib.util.find_spec("torch") is not None:
        peers.append("gloo")
    if shutil.which("mpirun") and importlib.util.find_spec("mpi4py") is not None:
        peers.append("mpi")
    return peers


#: this project's two transports on one host: peer name -> (row label, extra environment)
TRANSPORTS = {"rs": ("reduction-server", {}), "rs-tcp": ("reduction-server (tcp)", {"RS_SHM": "0"})}


def _command(peer: str, world: int, reducers: int, sizes: str, iters: int) -> List[str]:
    job = [*_JOB, "rs" if peer in TRANSPORTS else peer, "--mib", sizes, "--iters", str(iters)]
    if peer == "mpi":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(world), *job]
    # Gloo ranks are started by our launcher too: it sets RANK, WORLD_SIZE and MASTER_*; the
    # reducer it also starts stays idle for them.
    return [sys.executable, "-m", "reduction_server", "run", "-np", str(world), "--reducers", str(reducers), "--", *job]


def measure(peer: str, world: int, reducers: int, sizes_mib: Sequence[float], iters: int) -> List[Dict]:
    """One run of the job: bytes and seconds per all-reduce of each size."""
    sizes = ",".join(f"{s:g}" for s in sizes_mib)
    extra = TRANSPORTS.get(peer, (peer, {}))[1]
    proc = subprocess.run(
        _command(peer, world, reducers, sizes, iters),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=AWAY_FROM_SOURCE,
        env={**os.environ, **extra},
    )
    points = [json.loads(line[line.index("{") :]) for line in proc.stdout.splitlines() if '{"bytes"' in line]
    if proc.returncode != 0 or len(points) != len(sizes_mib):
        raise RuntimeError(
            f"{peer} W={world} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return points


def run(
    worlds: Sequence[int] = (2, 4),
    reducers: Sequence[int] = (1, 2),
    sizes_mib: Sequence[float] = (1, 4, 16, 64, 256),
    peers: Sequence[str] = (),
    iters: int = 0,
    rounds: int = 1,
) -> List[Dict]:
    """Rows for every peer x W (x R for this project) x size. With rounds > 1 the jobs of one W
    run in turns that many times, so that every peer meets the same quiet and busy moments; a
    row gives the median time and the range of its turns, vs_gloo is Gloo's median over its
    own, and vs_gloo_range the lowest and highest ratio of one turn's pair (Gloo's own spread
    here moves a single run's ratio by 0.15)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    peers = list(peers) or available_peers()
    jobs = [(p, 1) for p in peers] + [(t, r) for r in reducers for t in TRANSPORTS]
    rows: List[Dict] = []
    with tqdm(total=rounds * len(worlds) * len(jobs), desc="loopback", unit="job") as progress:
        for world in worlds:
            turns: Dict[Tuple[str, int], List[List[Dict]]] = {job: [] for job in jobs}
            for _ in range(rounds):
                for peer, r in jobs:
                    turns[peer, r].append(measure(peer, world, r, sizes_mib, iters))
                    progress.update()
            rows += _rows(world, sizes_mib, turns)
    return rows


def _rows(world: int, sizes_mib: Sequence[float], turns: Dict[Tuple[str, int], List[List[Dict]]]) -> List[Dict]:
    """One row per job and size from each job's seconds per turn."""
    gloo = turns.get(("gloo", 1))
    rows = []
    for (peer, r), runs in turns.items():
        for i, mib in enumerate(sizes_mib):
            seconds = [run[i]["seconds"] for run in runs]
            point = medians(seconds)
            algbw = runs[0][i]["bytes"] / point["seconds"] / 1e9
            row = {
                "peer": TRANSPORTS.get(peer, (peer,))[0],
                "W": world,
                "R": r if peer in TRANSPORTS else "-",
                "mib": mib,
                "rounds": len(runs),
                "ms": point["seconds"] * 1e3,
                "ms_range": point["range"],
                "algbw_GBps": algbw,
                "busbw_GBps(ring)": algbw * 2 * (world - 1) / world,
            }
            if gloo is not None:
                theirs = [run[i]["seconds"] for run in gloo]
                ratios = [g / ours for g, ours in zip(theirs, seconds)]
                row["vs_gloo"] = statistics.median(theirs) / point["seconds"]
                row["vs_gloo_range"] = f"{min(ratios):.2f}-{max(ratios):.2f}"
            rows.append(row)
    return rows
