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
import subprocess
import sys
from typing import Dict, List, Sequence

from tqdm import tqdm

COLUMNS = ["peer", "W", "R", "mib", "ms", "algbw_GBps", "busbw_GBps(ring)", "vs_gloo"]
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


def _measure(peer: str, world: int, reducers: int, sizes_mib: Sequence[float], iters: int) -> List[Dict]:
    sizes = ",".join(f"{s:g}" for s in sizes_mib)
    label, extra = TRANSPORTS.get(peer, (peer, {}))
    proc = subprocess.run(_command(peer, world, reducers, sizes, iters), capture_output=True, text=True,
                          timeout=900, cwd="/", env={**os.environ, **extra})
    points = [json.loads(line[line.index("{"):]) for line in proc.stdout.splitlines() if '{"bytes"' in line]
    if proc.returncode != 0 or len(points) != len(sizes_mib):
        raise RuntimeError(f"{peer} W={world} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = []
    for mib, p in zip(sizes_mib, points):
        algbw = p["bytes"] / p["seconds"] / 1e9
        rows.append({"peer": label, "W": world, "R": reducers if peer in TRANSPORTS else "-", "mib": mib, "ms": p["seconds"] * 1e3,
                     "algbw_GBps": algbw, "busbw_GBps(ring)": algbw * 2 * (world - 1) / world})
    return rows


def run(worlds: Sequence[int] = (2, 4), reducers: Sequence[int] = (1, 2),
        sizes_mib: Sequence[float] = (1, 4, 16, 64, 256), peers: Sequence[str] = (), iters: int = 0) -> List[Dict]:
    """Rows for every peer x W (x R for this project) x size; vs_gloo is algbw / Gloo's."""
    peers = list(peers) or available_peers()
    jobs = [(p, w, 1) for w in worlds for p in peers] + [(t, w, r) for w in worlds for r in reducers for t in TRANSPORTS]
    rows: List[Dict] = []
    for peer, world, r in tqdm(jobs, desc="loopback", unit="job"):
        rows += _measure(peer, world, r, sizes_mib, iters)
    gloo = {(row["W"], row["mib"]): row["algbw_GBps"] for row in rows if row["peer"] == "gloo"}
    for row in rows:
        if (row["W"], row["mib"]) in gloo:
            row["vs_gloo"] = row["algbw_GBps"] / gloo[row["W"], row["mib"]]
    return rows
