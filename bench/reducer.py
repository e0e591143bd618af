"""`reduction-server bench reducer`: one reducer process under the load of W local worker
processes (RS_SHM=0 on both sides: chunks come through tcp sockets, as between hosts), and what
that costs it (issue 18):

- cpu_s_per_GiB: the reducer process's CPU time (every thread) over the timed all-reduces, per GiB
  of incoming gradient (W x size x iterations);
- limit_s_per_GiB: the copy limit measured in the same run (copy_limit.py): receiving a GiB over
  ZeroMQ/tcp, sending one, and one in-place float32 add, each per GiB; a reducer receives each
  byte once, sends it back once and adds it at most once, so it cannot cost less. vs_limit is
  their ratio;
- busiest_share: the share of the reducer's CPU time spent in its busiest thread (it says
  whether more cores would help), its name (libzmq calls its I/O threads ZMQbg/IO/N), and the
  count of threads that did work;
- Gbit_s_in: incoming gradient per second (the workers share this machine's cores with it).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Dict, List, Sequence

import psutil
from tqdm import tqdm

from reduction_server import settings
from reduction_server.client.chunking import plan_chunks

from . import copy_limit

COLUMNS = ["W", "mib", "iters", "Gbit_s_in", "cpu_s_per_GiB", "limit_s_per_GiB", "vs_limit", "recv", "send", "add",
           "threads", "busiest_share", "busiest"]
_GIB = 1 << 30
_TOKEN = "bench-reducer"
_LISTENING = re.compile(r"listening on tcp://(\S+):(\d+)")


def _clocks(reducer: psutil.Process) -> Dict[int, float]:
    """CPU seconds of each of the reducer's threads so far, by thread id."""
    return {t.id: t.user_time + t.system_time for t in reducer.threads()}


def _thread_name(pid: int, tid: int) -> str:
    """A thread's name as the kernel has it (Linux), else its id."""
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return str(tid)


def _load(world: int, mib: float, iters: int) -> Dict[str, float]:
    """Run the load on a fresh reducer; its CPU time over the timed loop, by thread, and the loop's seconds."""
    env = {**os.environ, "RS_SHM": "0", "RS_JOB_TOKEN": _TOKEN}
    reducer = subprocess.Popen([sys.executable, "-m", "reduction_server", "serve", "--host", "127.0.0.1", "--port",
                                "0", "--index", "0", "--workers", str(world)], stdout=subprocess.PIPE, text=True,
                               env=env, cwd="/")
    workers: List[subprocess.Popen] = []
    try:
        match = _LISTENING.search(reducer.stdout.readline())
        if not match:
            raise RuntimeError("the reducer did not start")
        address = f"{match.group(1)}:{match.group(2)}"
        for rank in range(world):
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "reduction_server.bench.reducer_job", f"{mib:g}", str(iters)], cwd="/",
                env=dict(env, RS_REDUCERS=address, RS_RANK=str(rank), RS_WORLD_SIZE=str(world)),
                stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stdout=subprocess.PIPE, text=True))
        lead = workers[0]
        if lead.stdout.readline().strip() != "READY":
            raise RuntimeError("the workers did not get ready")
        process = psutil.Process(reducer.pid)
        before = _clocks(process)
        lead.stdin.write("go\n")
        lead.stdin.flush()
        done = lead.stdout.readline()
        after = _clocks(process)
        busiest = _thread_name(reducer.pid, max(after, key=lambda tid: after[tid] - before.get(tid, 0.0)))
        if not done.startswith("DONE "):
            raise RuntimeError(f"the workers failed: {done!r}")
        lead.stdin.write("end\n")
        lead.stdin.flush()
        for w in workers:
            if w.wait(timeout=120) != 0:
                raise RuntimeError(f"a worker exited with {w.returncode}")
    finally:
        for proc in [*workers, reducer]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    return {"seconds": json.loads(done[5:])["seconds"], "threads": spent, "busiest": busiest}


def _chunk_bytes(mib: float) -> int:
    """The size of the chunks the workers cut a `mib` MiB float32 all-reduce into for one reducer."""
    count = int(mib * (1 << 20)) // 4
    return plan_chunks(count, 4, 1, settings.tuning("RS_CHUNK_BYTES"), settings.tuning("RS_PIPELINE_DEPTH"))[0][1] * 4


def run(worlds: Sequence[int] = (2, 4), sizes_mib: Sequence[float] = (64,), iters: int = 20,
        limit_gib: float = 2.0) -> List[Dict]:
    """One row per W x size; the copy limit measured for each size's chunks, before its loads,
    in the same run."""
    rows: List[Dict] = []
    for mib in sizes_mib:
        sockets = copy_limit.sockets(limit_gib, _chunk_bytes(mib))
        add = copy_limit.add(limit_gib)
        rows += _loads(worlds, mib, iters, sockets, add)
    return rows


def _loads(worlds: Sequence[int], mib: float, iters: int, sockets: Dict[str, float], add: float) -> List[Dict]:
    limit = sockets["recv"] + sockets["send"] + add
    rows: List[Dict] = []
    for world in tqdm(worlds, desc=f"reducer {mib:g} MiB", unit="load"):
        load = _load(world, mib, iters)
        total = sum(load["threads"].values())
        incoming = world * mib * (1 << 20) * iters / _GIB
        if total <= 0:  # the kernel counts CPU time in ticks (10 ms)
            raise RuntimeError(f"W={world}, {mib:g} MiB x {iters}: too little work to measure; raise --mib or iters")
        busy = [t for t in load["threads"].values() if t > 0.01 * total]
        rows.append({"W": world, "mib": mib, "iters": iters,
                     "Gbit_s_in": incoming * _GIB * 8 / load["seconds"] / 1e9,
                     "cpu_s_per_GiB": total / incoming, "limit_s_per_GiB": limit, "vs_limit": total / incoming / limit,
                     "recv": sockets["recv"], "send": sockets["send"], "add": add, "threads": len(busy),
                     "busiest_share": max(load["threads"].values()) / total, "busiest": load["busiest"]})
    return rows
