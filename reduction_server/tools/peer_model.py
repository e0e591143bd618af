"""The peers on the same network, for comparison: a ring (Gloo's, NCCL's) and NCCL's double
binary tree. The alpha-beta model: alpha, a step's latency, is half the round trip (one way);
beta the per-worker link, its payload share taken out as for the pool (network_model.py).

- ring: reduce-scatter then all-gather, 2(W-1) steps of S/W each: 2(W-1)/W x S per worker each
  way, and 2(W-1) latencies. A ring's links never idle between collectives issued back to back,
  so a token bucket (network_model.py) gives it nothing: its bucket stays empty.
- tree: reduce up and broadcast down two binary trees, each half the buffer, pipelined: about 2 x S
  on a worker's busiest link (an inner node sends its half up and down), and 2 x ceil(log2 W)
  latencies: below the ring's time only where latency dominates (small buffers, many workers).
"""

from __future__ import annotations

import math

from .measured_costs import GIB
from .network_model import Network
from .pool_model import Timing, binding


def _link(net: Network) -> float:
    return min(net.worker_up, net.worker_down)


def ring(net: Network, nbytes: float) -> Timing:
    """A ring all-reduce of `nbytes` per worker over the W workers' links."""
    w = net.workers
    if w == 1 or nbytes <= 0:
        return Timing(0.0, 0.0, "nothing to send")
    per_worker = 2 * (w - 1) / w * nbytes
    steps = 2 * (w - 1)
    wire = net.wire_bytes(per_worker, steps)
    limits = {"worker link": wire / _link(net)}
    if net.shared_cores:
        limits["shared CPU"] = w * per_worker / GIB * net.shared_ring_s_per_gib / net.shared_cores
    binds, transfer = binding(limits)
    return Timing(transfer, steps * net.rtt_s / 2, binds, limits, steps, math.ceil(nbytes / w))


def tree(net: Network, nbytes: float) -> Timing:
    """A double binary tree all-reduce (NCCL's) of `nbytes` per worker, pipelined."""
    w = net.workers
    if w == 1 or nbytes <= 0:
        return Timing(0.0, 0.0, "nothing to send")
    depth = math.ceil(math.log2(w))
    wire = net.wire_bytes(2 * nbytes, 4 * depth)
    limits = {"worker link": wire / _link(net)}
    binds, transfer = binding(limits)
    return Timing(transfer, 2 * depth * net.rtt_s / 2, binds, limits)
