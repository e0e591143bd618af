"""A reducer's settings, resolved once: `ReducerConfig.resolve` turns `serve`'s arguments, the
discovered place and the RS_* variables into one frozen ReducerConfig that the rest of
`serve` (process.py) only reads.

Each setting comes from, first match wins: its argument, the place discovered from the cluster
spec or RS_REDUCER_INDEX (config/discovery.py, for the host, port, index and world size only), the
environment (config/settings.py), its default. A reducer told no index at all takes its own
entry's position in RS_REDUCERS (`own_entry`): the one entry whose port is the port it binds and
whose host names an address of this host that it binds (any, on a wildcard address); none, or
more than one, is a ConfigError naming them. Every setting is read and checked here, in one
place, so that a bad one is one ConfigError before anything binds and before any shard starts.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Tuple, Union

from ..config import settings
from ..config.cluster_spec import address_list
from ..errors import ConfigError
from ..wire import encryption, shared_memory
from ..wire import integrity as integrity_tags
from .shards import count as shard_count


@dataclass(frozen=True)
class ReducerConfig:
    """Everything one `serve` runs with; made by `resolve`, never changed afterwards."""

    host: str  # the address to bind
    port: int  # 0: any free port (with shards: any free run of them)
    index: int  # this reducer's position among the job's reducers
    workers: Optional[int]  # worker ranks; None: each job's HELLO says
    token: str  # RS_JOB_TOKEN, "" for none
    deterministic: bool
    encrypt: bool
    integrity: bool  # RS_INTEGRITY: a tag on every message (integrity.py); never with encrypt
    metrics_port: int  # 0: no metrics
    shards: int  # shard processes of this reducer, 1..settings.MAX_SHARDS
    shard: Optional[int]  # which of them this process is; None: the supervisor, or the only one
    max_chunk_bytes: int
    heartbeat_interval: float
    liveness_timeout: float
    sndbuf: int  # settings.SNDBUF_AUTO, 0 (the kernel's) or bytes
    max_accumulator_bytes: int  # this process's share of RS_MAX_ACCUMULATOR_BYTES
    max_peer_bytes: int
    max_rounds: int
    round_timeout: float
    max_ungreeted: int  # connections without a HELLO (arrivals.py)
    hello_timeout: float
    drain_timeout: float  # 0: SIGTERM closes at once
    shared: bool  # shared memory with the workers on this host (RS_SHM, where supported)

    @property
    def supervises(self) -> bool:
        """Whether this process runs no reducer itself but `shards` shard processes (shards.py)."""
        return self.shard is None and self.shards > 1

    @property
    def shard_number(self) -> int:
        """The shard this process serves as a reducer: 0 when it is the only one."""
        return self.shard or 0

    @classmethod
    def resolve(
        cls,
        *,
        host: Optional[str] = None,
        port: Optional[int] = None,
        workers: Optional[int] = None,
        index: Optional[int] = None,
        deterministic: Optional[bool] = None,
        metrics_port: Optional[int] = None,
        shards: Union[str, int, None] = None,
        shard: Optional[int] = None,
        insecure_no_token: Optional[bool] = None,
    ) -> "ReducerConfig":
        """The settings `serve` runs with: each argument that is not None wins over the discovered
        place and the environment (deterministic: RS_DETERMINISTIC; metrics_port: RS_METRICS_PORT;
        shards: RS_SHARDS; insecure_no_token: RS_ALLOW_NO_TOKEN). A ConfigError names the first
        setting that is wrong."""
        # The order of the reads below is the order in which errors are reported: keep it.
        host, port, index, workers = _place(host, port, index, workers)
        token = settings.read("RS_JOB_TOKEN")
        if shard is None:  # a shard's supervisor has checked it already, with the same environment
            _check_token(host, token, insecure_no_token)
        if deterministic is None:
            deterministic = settings.read("RS_DETERMINISTIC")
        encrypt = settings.read("RS_ENCRYPT")
        if encrypt:
            encryption.check(token)
        integrity = integrity_tags.applies(settings.read("RS_INTEGRITY"), encrypt)
        if integrity:
            integrity_tags.check(token)
        metrics_port = _metrics_port(metrics_port)
        count = _shards(shards, shard)
        max_chunk = settings.read("RS_MAX_CHUNK_BYTES")
        heartbeat = settings.read("RS_HEARTBEAT_INTERVAL")
        liveness = settings.read("RS_LIVENESS_TIMEOUT")
        sndbuf = settings.socket_send_buffer()  # `auto` is set per connection (send_buffers.py)
        budget = settings.read("RS_MAX_ACCUMULATOR_BYTES") // count  # the shards share it
        max_peer, max_rounds = settings.read("RS_MAX_PEER_BYTES"), settings.read("RS_MAX_ROUNDS")
        round_timeout = settings.read("RS_TIMEOUT")
        max_ungreeted, hello_timeout = settings.read("RS_MAX_UNGREETED"), settings.read("RS_HELLO_TIMEOUT")
        drain_timeout = settings.read("RS_DRAIN_TIMEOUT")
        _check_budget(budget, max_chunk, count)
        return cls(
            host=host,
            port=port,
            index=index,
            workers=workers,
            token=token,
            deterministic=deterministic,
            encrypt=encrypt,
            integrity=integrity,
            metrics_port=metrics_port,
            shards=count,
            shard=shard,
            max_chunk_bytes=max_chunk,
            heartbeat_interval=heartbeat,
            liveness_timeout=liveness,
            sndbuf=sndbuf,
            max_accumulator_bytes=budget,
            max_peer_bytes=max_peer,
            max_rounds=max_rounds,
            round_timeout=round_timeout,
            max_ungreeted=max_ungreeted,
            hello_timeout=hello_timeout,
            drain_timeout=drain_timeout,
            shared=shared_memory.enabled(),
        )


def listening_address() -> Tuple[str, int]:
    """The host and port a `serve` given no options listens on, found as it finds them (the
    discovered place, or its own entry in RS_REDUCERS): what the image's healthcheck probes."""
    host, port, _, _ = _place(None, None, None, None)
    return host, port


def _place(
    host: Optional[str], port: Optional[int], index: Optional[int], workers: Optional[int]
) -> Tuple[str, int, int, Optional[int]]:
    """Host, port, index and world size: each argument, else the discovered place's, else the
    default (the index: this reducer's own entry in RS_REDUCERS, else 0; the world size:
    RS_WORLD_SIZE, else None)."""
    from ..config.discovery import discover_reducer

    # Only when one is missing: a shard, which its supervisor starts with all three, takes them
    # as they are and does not discover (nor check) its place again.
    place = discover_reducer() if None in (host, port, index) else None
    if place is None and index is None and os.environ.get("RS_REDUCERS"):
        host = host or settings.read("RS_BIND_HOST")
        index, port = own_entry(host, port, os.environ["RS_REDUCERS"])
    host = host or (place.host if place else "0.0.0.0")
    port = port if port is not None else (place.port if place else 0)
    index = index if index is not None else (place.index if place else 0)
    if workers is None:
        workers = place.world_size if place else None
        if workers is None:
            workers = settings.read("RS_WORLD_SIZE")
    return host, port, index, workers


_WILDCARDS = ("0.0.0.0", "::", "*", "")
_SHOWN = 8  # entries a ConfigError lists at most


def _resolved(host: str) -> FrozenSet[str]:
    """The addresses `host` (a name or an address) resolves to; none when it does not resolve."""
    try:
        return frozenset(info[4][0] for info in socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP))
    except (socket.gaierror, UnicodeError):
        return frozenset()


def _of_this_host(address: str) -> bool:
    """Whether `address` is one of this host's: one it can bind."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
            return True
        except OSError:
            return False


def own_entry(host: str, port: Optional[int], listed: str) -> Tuple[int, int]:
    """(index, port) of this reducer's own entry in `listed` (RS_REDUCERS), for a reducer given
    no index: the entry whose port is `port` (any port when None or 0) and whose host resolves to
    an address this reducer binds at `host` (any of this host's on a wildcard address). A
    ConfigError when no entry is, or more than one: it names them and what to give instead."""
    entries = address_list("RS_REDUCERS", listed.split(","))
    wildcard = host.strip("[]") in _WILDCARDS
    bound, where = (frozenset(), "this host") if wildcard else (_resolved(host), host)

    def ours(entry: str) -> bool:
        addresses = _resolved(entry)
        return any(_of_this_host(a) for a in addresses) if wildcard else bool(addresses & bound)

    at = f" at port {port}" if port else ""
    mine = [(i, h, p) for i, (h, p) in enumerate(entries) if (not port or p == port) and ours(h)]
    if len(mine) == 1:
        return mine[0][0], mine[0][2]

    def named(items: List[Tuple[int, str, int]]) -> str:
        shown = ", ".join(f"{i}: {h}:{p}" for i, h, p in items[:_SHOWN])
        return shown + (f", ... ({len(items)} in all)" if len(items) > _SHOWN else "")

    if not mine:
        raise ConfigError(
            f"no --index (RS_REDUCER_INDEX) given, and none of the {len(entries)} address(es) of RS_REDUCERS "
            f"({named([(i, h, p) for i, (h, p) in enumerate(entries)])}) is {where}'s{at}: give --index, "
            "this reducer's position in the workers' RS_REDUCERS (behind NAT or a port mapping its "
            "address there is not its own)"
        )
    raise ConfigError(
        f"no --index (RS_REDUCER_INDEX) given, and RS_REDUCERS lists {len(mine)} addresses of {where}{at} "
        f"({named(mine)}): give --index, this reducer's position in RS_REDUCERS"
        + ("" if port else ", or --port, its own entry's port")
    )


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1, `localhost`): reachable from this
    host only. A name, an interface or a wildcard address is not."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _check_token(host: str, token: str, insecure_no_token: Optional[bool]) -> None:
    """A ConfigError, in one line, when a reducer would listen beyond the loopback without a job
    token (anyone who reaches the port could send it data and read the sums) and was not told
    explicitly that this is wanted (--insecure-no-token, RS_ALLOW_NO_TOKEN=1)."""
    if token or is_loopback(host):
        return
    if insecure_no_token is None:
        insecure_no_token = settings.read("RS_ALLOW_NO_TOKEN")
    if not insecure_no_token:
        raise ConfigError(
            f"refusing to listen on {host} without a job token: anyone who reaches the port could "
            "join the job, send it data and read its sums; set RS_JOB_TOKEN to a random secret "
            "shared with the workers (openssl rand -hex 16), or bind the loopback (--host 127.0.0.1), "
            "or accept the risk with --insecure-no-token (RS_ALLOW_NO_TOKEN=1)"
        )


def _metrics_port(metrics_port: Optional[int]) -> int:
    """The argument, checked (RS_METRICS_PORT's range is checked by settings.read), else RS_METRICS_PORT."""
    if metrics_port is None:
        return settings.read("RS_METRICS_PORT")
    if not 0 <= metrics_port <= 65535:
        raise ConfigError(f"--metrics-port {metrics_port} is outside 0-65535")
    return metrics_port


def _shards(shards: Union[str, int, None], shard: Optional[int]) -> int:
    """How many shards (the argument, else RS_SHARDS), with `shard` checked to be one of them."""
    count = shard_count(
        settings.read("RS_SHARDS") if shards is None else shards,
        "RS_SHARDS" if shards is None else "--shards",
        settings.read("RS_LOCAL_REDUCERS"),
    )
    if shard is not None and not 0 <= shard < count:
        raise ConfigError(f"--shard {shard} is not one of the {count} shards (0..{count - 1})")
    return count


def _check_budget(budget: int, max_chunk: int, count: int) -> None:
    """A ConfigError when sharding alone leaves each shard less accumulator memory than one chunk
    (one process with too small a budget is left to refuse each chunk, naming the setting)."""
    if count > 1 and budget < max_chunk <= budget * count:
        raise ConfigError(
            f"RS_MAX_ACCUMULATOR_BYTES shared by {count} shards leaves each "
            f"{budget} bytes, less than one chunk (RS_MAX_CHUNK_BYTES="
            f"{max_chunk}): raise it, or run fewer shards (--shards, RS_SHARDS)"
        )
