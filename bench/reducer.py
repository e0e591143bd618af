"""`reduction-server bench reducer`: one reducer under the load of W local worker processes
(reduction_server/tools/reducer_load.py: RS_SHM=0, chunks through tcp sockets as between hosts), run as
1, 2, 4 ... shards (`serve --shards N`), and what that costs it (issue 18):

- cpu_s_per_GiB: the CPU time of every thread of the reducer's processes over the timed
  all-reduces, per GiB of incoming gradient (W x size x iterations);
- chunk_KiB: the chunks the workers cut each all-reduce into, which the limits below are measured
  in: `RS_PIPELINE_DEPTH` of them for the one reducer (client/chunking.py sizes chunks by reducers,
  not shards, and spreads them over the shards), so the same for every shard count;
- limit_s_per_GiB: the copy limit measured in the same run (copy_limit.py): receiving a GiB over
  ZeroMQ/tcp, sending one, and one in-place float32 add, each per GiB; a reducer receives each
  byte once, sends it back once and adds it at most once, so it cannot cost less. vs_limit is
  their ratio;
- duplex_s_per_GiB: the same limit with the socket part measured as the reducer moves its bytes,
  both ways at once over the same connections (copy_limit.duplex: `shards` processes that return
  every chunk to its sender under W peers with the workers' chunks and window), plus the add;
  vs_duplex is the reducer's cost over it. On tcp loopback this is well above receive + send apart;
- busiest_share: the share of the reducer's CPU time spent in its busiest thread, its name
  (libzmq's I/O threads are ZMQbg/IO/N), and the count of threads that did work. 1 / busiest_share
  (scales_to) is how many cores the reducer can keep busy before that thread is the limit;
- per_core_Gbit_s: what one core sums at this CPU cost; host_Gbit_s: what a host of `shards`
  cores sums, per_core x min(shards, scales_to) (these machines have 2 cores, shared with the
  workers: the per-thread split is what shows scaling here);
- Gbit_s_in: incoming gradient per second measured (a lower bound: the workers share the cores);
- worker_cpu_s_per_GiB: the lead worker's CPU time (every thread) over the same all-reduces, per
  GiB it all-reduces: the other side's price of a setting;
- compression: the workers' `compression=` (`--compression none,int8`); a GiB stays float32's, and
  vs_float32 is a compressed load's CPU per GiB over the float32 load's of the same W, shards and
  variant;
- variant: the settings of the run (`--variant RS_ENCRYPT=1`: every load again with them, in
  turns with the defaults, so that both meet the same quiet and busy moments).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from tqdm import tqdm

from reduction_server.client import compression
from reduction_server.client.chunking import plan_chunks
from reduction_server.config import settings
from reduction_server.tools import reducer_load

from . import copy_limit
from .netem import variant_runs

COLUMNS = [
    "variant",
    "W",
    "mib",
    "shards",
    "compression",
    "chunk_KiB",
    "iters",
    "Gbit_s_in",
    "cpu_s_per_GiB",
    "worker_cpu_s_per_GiB",
    "limit_s_per_GiB",
    "vs_limit",
    "recv",
    "send",
    "add",
    "duplex_s_per_GiB",
    "vs_duplex",
    "threads",
    "busiest_share",
    "busiest",
    "scales_to",
    "per_core_Gbit_s",
    "host_Gbit_s",
    "vs_float32",
]


def _chunk_bytes(mib: float) -> int:
    """The size of the chunks the workers cut a `mib` MiB float32 all-reduce into for one reducer,
    whatever its shard count."""
    count = int(mib * (1 << 20)) // 4
    return plan_chunks(count, 4, 1, settings.tuning("RS_CHUNK_BYTES"), settings.tuning("RS_PIPELINE_DEPTH"))[0][1] * 4


def run(
    worlds: Sequence[int] = (2, 4),
    sizes_mib: Sequence[float] = (64,),
    shards: Sequence[int] = (1, 2, 4),
    iters: int = 20,
    limit_gib: float = 2.0,
    compressions: Sequence[str] = ("none",),
    variants: Sequence[Dict[str, str]] = (),
) -> List[Dict]:
    """One row per size x W x shards x compression x the defaults and each of `variants`
    (netem.parse_variant's settings), the compressions and variants of one W and shard count in
    turns; the copy limits measured for each size's chunks (and each W's and shard count's, both
    ways), before its loads, in the same run."""
    for name in compressions:
        compression.parse(name)  # a ValueError naming the unknown one, before anything starts
    runs = variant_runs(variants)
    rows: List[Dict] = []
    window = settings.tuning("RS_WINDOW")
    for mib in sizes_mib:
        chunk = _chunk_bytes(mib)
        sockets = copy_limit.sockets(limit_gib, chunk)
        add = copy_limit.add(limit_gib)
        limit = sockets["recv"] + sockets["send"] + add
        shapes = [(w, n) for w in worlds for n in shards]
        duplex = {
            (world, count): copy_limit.duplex(limit_gib, chunk, world, window, processes=count) + add
            for world, count in shapes
        }
        loads = [(w, n, c, run) for w, n in shapes for run in runs for c in compressions]
        float32: Dict[tuple, float] = {}
        for world, count, kind, (label, extra) in tqdm(loads, desc=f"reducer {mib:g} MiB", unit="load"):
            load = reducer_load.run(world, mib, iters, count, compression=kind, env=extra)
            if kind == "none":
                float32[world, count, label] = load.cpu_s_per_gib
            name, share = load.busiest()
            per_core = reducer_load.GBIT_PER_GIB / load.cpu_s_per_gib
            rows.append(
                {
                    "variant": label.partition(" ")[2] or "-",
                    "W": world,
                    "mib": mib,
                    "shards": count,
                    "compression": kind,
                    "chunk_KiB": chunk / 1024,
                    "iters": iters,
                    "Gbit_s_in": load.gbit_s_in,
                    "cpu_s_per_GiB": load.cpu_s_per_gib,
                    "worker_cpu_s_per_GiB": load.worker_cpu_s_per_gib,
                    "limit_s_per_GiB": limit,
                    "vs_limit": load.cpu_s_per_gib / limit,
                    "recv": sockets["recv"],
                    "send": sockets["send"],
                    "add": add,
                    "duplex_s_per_GiB": duplex[world, count],
                    "vs_duplex": load.cpu_s_per_gib / duplex[world, count],
                    "threads": load.busy_threads(),
                    "busiest_share": share,
                    "busiest": name,
                    "scales_to": 1 / share,
                    "per_core_Gbit_s": per_core,
                    "host_Gbit_s": per_core * min(count, 1 / share),
                    "vs_float32": load.cpu_s_per_gib / float32[world, count, label]
                    if (world, count, label) in float32
                    else None,
                }
            )
    return rows
