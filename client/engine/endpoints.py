"""Endpoints: where a worker's chunks go, every shard of every reducer.

A reducer started with `serve --shards N` runs N processes on ports port .. port+N-1 and says N in
its WELCOME (reduction_server/reducer/shards.py). The engine first handshakes with each reducer's
listed address; when one has more than one shard it connects to every shard, and the chunk plan
spreads over all of them: to the engine, the plan and failover, each shard is an endpoint of its
own (the engine's rooms index them as `e`), and a lost shard fails over like a lost reducer.

Order: the plan's reducers shard by shard (shard 0 of each, then shard 1 of each, ...), so that
consecutive chunks go to different hosts first; then the spares' shards in the same order, so
that the plan's endpoints come first (chunking.plan) and the spares last (failover.py).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import zmq

from reduction_server.config.cluster_spec import join_address, parse_address
from reduction_server.errors import CollectiveError

#: per endpoint: libzmq sockets (the DEALER, its monitor's pair) and file descriptors (the TCP
#: connection, the sockets' mailboxes), with room for the rest of the process
SOCKETS_EACH, DESCRIPTORS_EACH, DESCRIPTORS_SPARE = 3, 4, 256


@dataclass(frozen=True)
class Endpoint:
    """Shard `shard` of reducer `reducer` (its position in RS_REDUCERS), at `address`."""

    reducer: int
    shard: int
    address: str
    sharded: bool = False  # its reducer runs more than one shard: messages name the shard

    def name(self) -> str:
        """How messages name it: "reducer 1 (host:port)", or "reducer 1 shard 2 (host:port+2)"."""
        return f"reducer {self.reducer}" + (f" shard {self.shard}" if self.sharded else "") + f" ({self.address})"


def listed(addresses: Sequence[str]) -> List[Endpoint]:
    """Each reducer's listed address: its shard 0, all the engine knows before the WELCOMEs."""
    return [Endpoint(r, 0, address) for r, address in enumerate(addresses)]


def expand(addresses: Sequence[str], shards: Sequence[int], spares: int) -> Tuple[List[Endpoint], int]:
    """Every shard of every reducer in plan order (above), given each reducer's shard count,
    and how many of them, the last ones, belong to the `spares` spare reducers."""

    def shard_major(reducers: range) -> List[Endpoint]:
        out = []
        for s in range(max((shards[r] for r in reducers), default=0)):
            for r in reducers:
                if s < shards[r]:
                    host, port = parse_address(addresses[r], "reducers")
                    out.append(Endpoint(r, s, join_address(host, port + s), shards[r] > 1))
        return out

    active = len(addresses) - spares
    spare = shard_major(range(active, len(addresses)))
    return shard_major(range(active)) + spare, len(spare)


def make_room(context: zmq.Context, count: int, rank: int) -> None:
    """Raise libzmq's socket cap (1023 by default) and this process's soft limit on open files
    for `count` endpoints; CollectiveError naming the limit when the hard limit is too low."""
    context.set(zmq.MAX_SOCKETS, max(context.get(zmq.MAX_SOCKETS), SOCKETS_EACH * count + 64))
    need = DESCRIPTORS_EACH * count + DESCRIPTORS_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise CollectiveError(
            f"rank {rank}: {count} reducer endpoints (every shard of every reducer) need about "
            f"{need} open files, and this process may open at most {hard} (ulimit -n): raise "
            "the limit, or run fewer shards per reducer (RS_SHARDS on the reducers)"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def check_shard_counts(ends: Sequence[Endpoint], said: Sequence[int], first_said: Sequence[int], rank: int) -> None:
    """CollectiveError unless every shard's WELCOME (`said`, by endpoint) names the shard count
    its reducer's shard 0 named first (`first_said`, by reducer)."""
    for end, count in zip(ends, said):
        if count != first_said[end.reducer]:
            raise CollectiveError(
                f"rank {rank}: {end.name()} says its reducer runs {count} shards, but its shard 0 "
                f"said {first_said[end.reducer]}: another program listens on one of the shards' "
                "ports, or the reducer restarted with other --shards meanwhile"
            )
