"""The cluster a prediction is made for: W worker hosts and R reducer hosts, each link's rate
each way, the round trip between hosts, the reducer hosts' cores, and what a link carries besides
the payload. Rates are in bytes/s of the link (what a NIC's or tbf's Gbit/s counts: Ethernet
frames), so the payload rate is a little less: TCP/IP and Ethernet headers ride on every frame.

`burst_bytes`: what a link may send at once after an idle spell (a token bucket's depth): tc's
tbf in the emulated network has 256 KiB (bench/emulated_network.py), so a link that waited at the
start of a collective catches up that much; a real NIC has none. `shared_cores`: where every
host shares one machine's cores (the emulated network), how many, and the CPU seconds that
all-reducing one worker's gradient costs there, all processes and the kernel's networking
together: through the pool per GiB and per chunk, through a ring per GiB (measured by `bench
sizing`'s calibration): all the hosts' traffic then also waits for those cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

#: the most reducer hosts a simulation takes (`--reducers`): past it, the model's assumptions (one
#: connection per worker per shard) are far from anything measured
MAX_REDUCERS = 4096
MAX_WORKERS = 100_000
#: Ethernet's MTU, and what rides on each full frame: IPv4 20 + TCP 20 + timestamps 12 inside it,
#: the Ethernet header 14 outside it (what tbf and a NIC's rate count; no preamble on a veth)
MTU = 1500
TCP_IP_BYTES = 52
ETHERNET_BYTES = 14
GBIT = 1e9 / 8  # bytes/s


def payload_share(mtu: int = MTU) -> float:
    """The payload's share of a link's bytes in full TCP segments: 1448 / 1514 at an MTU of 1500."""
    return (mtu - TCP_IP_BYTES) / (mtu + ETHERNET_BYTES)


@dataclass(frozen=True)
class Network:
    """Link rates in bytes/s each way; `rtt_s` between any two hosts."""

    workers: int
    reducers: int
    worker_up: float
    worker_down: float
    reducer_up: float
    reducer_down: float
    rtt_s: float = 0.0
    shards: int = 1
    reducer_cores: Optional[int] = None  # None: as many as shards
    burst_bytes: float = 0.0
    shared_cores: Optional[float] = None
    shared_pool_s_per_gib: float = 0.0
    shared_pool_s_per_chunk: float = 0.0
    shared_ring_s_per_gib: float = 0.0
    mtu: int = MTU

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"--workers must be in 1..{MAX_WORKERS}, got {self.workers}")
        if not 1 <= self.reducers <= MAX_REDUCERS:
            raise ConfigError(f"--reducers must be in 1..{MAX_REDUCERS}, got {self.reducers}")
        for name, value in (
            ("worker link rate", self.worker_up),
            ("worker link rate", self.worker_down),
            ("reducer link rate", self.reducer_up),
            ("reducer link rate", self.reducer_down),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"the {name} must be positive and finite, got {value:g} bytes/s")
        if not (self.rtt_s >= 0 and math.isfinite(self.rtt_s)):
            raise ConfigError(f"the round trip must be 0 or more, got {self.rtt_s * 1e3:g} ms")
        if self.shards < 1 or (self.reducer_cores is not None and self.reducer_cores < 1):
            raise ConfigError(f"shards and --reducer-cores must be at least 1, got {self.shards}, {self.reducer_cores}")
        if self.shared_cores is not None and not self.shared_cores > 0:
            raise ConfigError(f"shared cores must be positive, got {self.shared_cores}")

    @classmethod
    def symmetric(
        cls, workers: int, reducers: int, worker_gbps: float, reducer_gbps: float, rtt_ms: float = 0.0, **kw
    ) -> "Network":
        """Every link as fast up as down, rates in Gbit/s, the round trip in ms."""
        return cls(
            workers,
            reducers,
            worker_gbps * GBIT,
            worker_gbps * GBIT,
            reducer_gbps * GBIT,
            reducer_gbps * GBIT,
            rtt_ms / 1e3,
            **kw,
        )

    @property
    def reducer_parallelism(self) -> int:
        """Cores a reducer host sums on: one per shard, at most its cores."""
        return min(self.shards, self.reducer_cores or self.shards)

    def wire_bytes(self, payload: float, messages: int) -> float:
        """Link bytes of `payload` bytes sent as `messages` messages: frame headers on each full
        segment's worth, and one more frame's headers per message (its last, partial segment)."""
        share = payload_share(self.mtu)
        return payload / share + messages * (TCP_IP_BYTES + ETHERNET_BYTES)
