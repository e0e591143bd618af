"""One all-reduce through the reducer pool, from first principles and measured constants
(`size --simulate`, `bench sizing`).

Every worker sends its S bytes and receives the sum, S bytes, cut into the chunks of the real
plan (the planner is handed in: it is client/chunking.py's `plan_chunks`, which this layer may
not import; the command line and the benchmarks pass it). Chunk k goes to reducer host k mod R
(client/engine/endpoints.py orders a host's shards so), so the busiest host carries the chunks
k = 0, R, 2R, ... of every worker, both ways. Each resource needs its own time, and the slowest
binds (the pipeline keeps the others busy beside it):

- worker link: S on the wire (payload, TCP/IP and Ethernet headers, a header frame per chunk)
  over the worker's rate, each way;
- reducer link: W times the busiest host's chunks, each way;
- reducer CPU: its CPU per GiB and per contribution, over its cores (one shard each);
- worker CPU: the engine's CPU per chunk (its Python thread) or per GiB (libzmq's I/O thread and
  the kernel's TCP under it), whichever thread is busier;
- latency: each worker keeps at most RS_WINDOW chunks unanswered per endpoint, so an endpoint's
  chunks take one round trip per window;
- shared CPU: where the hosts share one machine's cores (the emulated network), all the traffic's
  CPU over those cores.

Then the lag of the pipeline: a sum goes back only once its round's W contributions are in (the
reducer link carries W chunks for it, or a worker's link its own chunk, whichever is slower), so
the results trail the contributions by that; a link that idled meanwhile with a token bucket
catches up its burst. Plus the round trip of the first chunk there and the last result back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Sequence, Tuple

from ..wire.protocol import HEADER_SIZE
from .measured_costs import GIB, MEASURED, Costs
from .network_model import Network

#: client/chunking.py's plan_chunks(total, itemsize, reducers, chunk_bytes, depth) -> [(offset, count)]
Planner = Callable[[int, int, int, int, int], Sequence[Tuple[int, int]]]
#: ZMTP's frame headers of a chunk's two frames (header, payload): 2 and 9 bytes
ZMTP_FRAMING = 11
#: the names of the limits, in the order a tie is reported
LIMITS = ("worker link", "reducer link", "reducer CPU", "worker CPU", "latency", "shared CPU")


@dataclass(frozen=True)
class Chunking:
    """The chunk settings of a job (RS_CHUNK_BYTES, RS_PIPELINE_DEPTH, RS_WINDOW)."""

    chunk_bytes: int
    depth: int
    window: int


@dataclass(frozen=True)
class Timing:
    """A collective's predicted time: `transfer_s` keeps the pipeline busy (the binding limit's
    time), `lag_s` follows it (first chunk there, last result back). `limits`: each limit's time."""

    transfer_s: float
    lag_s: float
    binds: str
    limits: Dict[str, float] = field(default_factory=dict)
    chunks: int = 0
    chunk_bytes: int = 0

    @property
    def seconds(self) -> float:
        return self.transfer_s + self.lag_s


def binding(limits: Dict[str, float]) -> Tuple[str, float]:
    """The limit that takes longest, and its time."""
    name = max(limits, key=lambda key: limits[key])
    return name, limits[name]


def allreduce(
    net: Network, elements: int, itemsize: float, planner: Planner, chunking: Chunking, costs: Costs = MEASURED
) -> Timing:
    """One all-reduce of `elements` elements of `itemsize` bytes (on average) through net's R
    reducer hosts."""
    if elements < 1:
        return Timing(0.0, 0.0, "nothing to send")
    # The Communicator plans an int8 element as its byte; its block's scale rides along.
    spans = planner(elements, int(itemsize), net.reducers, chunking.chunk_bytes, chunking.depth)
    n = len(spans)
    payload = elements * itemsize
    chunk = spans[0][1] * itemsize
    host_spans = spans[:: net.reducers]  # the busiest host's: chunks 0, R, 2R, ...
    host_payload = sum(count for _, count in host_spans) * itemsize
    framing = HEADER_SIZE + ZMTP_FRAMING
    worker_wire = net.wire_bytes(payload + n * framing, n)
    host_wire = net.workers * net.wire_bytes(host_payload + len(host_spans) * framing, len(host_spans))
    w = net.workers
    limits = {
        "worker link": max(worker_wire / net.worker_up, worker_wire / net.worker_down),
        "reducer link": max(host_wire / net.reducer_down, host_wire / net.reducer_up),
        "reducer CPU": (
            w * host_payload / GIB * costs.reducer_cpu_s_per_gib
            + w * len(host_spans) * costs.reducer_s_per_contribution
        )
        / net.reducer_parallelism,
        "worker CPU": max(n * costs.worker_s_per_chunk, payload / GIB * costs.worker_cpu_s_per_gib),
        "latency": math.ceil(math.ceil(n / (net.reducers * net.shards)) / chunking.window) * net.rtt_s,
    }
    if net.shared_cores:
        per_worker = payload / GIB * net.shared_pool_s_per_gib + n * net.shared_pool_s_per_chunk
        limits["shared CPU"] = w * per_worker / net.shared_cores
    binds, transfer = binding(limits)
    # The first round: W chunks over the reducer's link, or a worker's chunk over its own.
    chunk_wire = net.wire_bytes(chunk + framing, 1)
    first = max(w * chunk_wire / net.reducer_down, chunk_wire / net.worker_up)
    results_rate = min(net.worker_down, net.reducers * net.reducer_up / w)  # per worker, the way back
    bursting_link = net.worker_down if results_rate == net.worker_down else net.reducer_up
    lag = max(0.0, first - net.burst_bytes / bursting_link) + net.rtt_s
    return Timing(transfer, lag, binds, limits, n, chunk)
