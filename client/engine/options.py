"""A worker's settings, resolved once: where it sits in the job and how its collectives move.

`EngineOptions.resolve` takes what the Communicator was given and fills in the rest: an argument
wins, then the place discovery found (Communicator.from_env passes it as arguments), then the
RS_* variable (reduction_server/config/settings.py), then the variable's default. Everything is
checked here, before any socket is opened, and a ConfigError names the setting that is wrong.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Tuple, Union

from reduction_server.config import settings
from reduction_server.config.discovery import job_id_from, parse_address, run_id
from reduction_server.config.settings import MAX_PIPELINE_DEPTH, MAX_WINDOW, socket_send_buffer, tuning
from reduction_server.errors import ConfigError
from reduction_server.wire import encryption
from reduction_server.wire import integrity as integrity_tags
from reduction_server.wire.shared_memory import enabled as shared_memory_enabled


def _integer(value: Any) -> Any:
    """value as an int if it is an integer of any kind (operator.index), else unchanged."""
    try:
        return operator.index(value)
    except TypeError:
        return value


def _bounded(value: Optional[int], name: str, variable: str, most: int) -> int:
    """value, or the environment's `variable` (settings.tuning), or its default; an integer in 1..most."""
    if value is None:
        return tuning(variable)
    if not 1 <= value <= most:
        raise ConfigError(f"{name} must be in 1..{most}, got {value}")
    return value


def _reducer_list(reducers: Union[Sequence[str], str]) -> Tuple[str, ...]:
    """The reducers' addresses, stripped, from a list or one comma-separated string; a ConfigError
    when there are none, one is not host:port, or one is listed twice."""
    if isinstance(reducers, str):
        reducers = [a for a in reducers.split(",") if a.strip()]
    if not reducers:
        raise ConfigError("no reducers given (reducers=[...] or RS_REDUCERS)")
    seen = {}
    for position, address in enumerate(reducers):
        host, port = parse_address(address, "reducers")
        if (host.lower(), port) in seen:  # two indices for one reducer: two shares of each buffer
            raise ConfigError(
                f"reducers lists {address.strip()} twice (positions {seen[host.lower(), port]} and {position})"
            )
        seen[host.lower(), port] = position
    return tuple(a.strip() for a in reducers)


def _place(rank: Any, world_size: Any) -> Tuple[int, int]:
    """(rank, world_size) as ints (numpy and torch integers too); a ConfigError unless
    0 <= rank < world_size."""
    world_size, rank = _integer(world_size), _integer(rank)
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ConfigError(f"rank {rank!r} is out of range for world size {world_size}")
    return rank, world_size


@dataclass(frozen=True)
class EngineOptions:
    """Every setting of one worker, resolved and checked (`resolve`); the Communicator plans its
    chunks with it and the engine (engine.py) runs on it. Communicator's docstring says what each means."""

    reducers: Tuple[str, ...]  # "host:port" each; reducer i is the i-th (its shard 0: endpoints.py)
    rank: int
    world_size: int
    job_token: str = field(repr=False)  # a secret: kept out of repr() and so out of logs
    job_id: int
    generation: int
    run_id: str  # this run of the job, from its launcher (discovery.run_id; "": none says)
    chunk_bytes: int
    window: int
    pipeline_depth: int
    timeout: float
    connect_timeout: float
    io_threads: int
    encrypt: bool
    integrity: bool  # RS_INTEGRITY: a tag on every message (integrity.py); never with encrypt
    shared_memory: bool
    send_buffer: int  # SO_SNDBUF: settings.SNDBUF_AUTO, 0 (the kernel's autotuning) or bytes
    failover: bool
    spares: int  # how many of the reducers, the last ones, are spares
    heartbeat_interval: float  # RS_HEARTBEAT_INTERVAL: seconds between PINGs and ZMTP heartbeats
    liveness_timeout: float  # RS_LIVENESS_TIMEOUT: seconds of silence after which a connection is lost

    @property
    def active_reducers(self) -> int:
        """The reducers that size the chunk plan: all but the spares."""
        return len(self.reducers) - self.spares

    @classmethod
    def resolve(
        cls,
        reducers: Union[Sequence[str], str],
        rank: int,
        world_size: int,
        *,
        job_token: Optional[str] = None,
        job_id: Optional[int] = None,
        generation: int = 0,
        chunk_bytes: Optional[int] = None,
        window: Optional[int] = None,
        pipeline_depth: Optional[int] = None,
        timeout: Optional[float] = None,
        connect_timeout: Optional[float] = None,
        io_threads: Optional[int] = None,
        encrypt: Optional[bool] = None,
        integrity: Optional[bool] = None,
        shared_memory: Optional[bool] = None,
        send_buffer: Union[int, str, None] = None,
        failover: Optional[bool] = None,
        spares: Optional[int] = None,
        run: Optional[str] = None,
    ) -> "EngineOptions":
        """The options of a Communicator given these arguments (the same as its own): each left
        None (or, for chunk_bytes, the timeouts and io_threads, 0) comes from its RS_* variable or
        that variable's default.

        Raises:
            ConfigError: a setting is malformed or out of range, or two contradict each other
                (the message names them).
        """
        # The checks run in this order so that a setting wrong in several ways is named as before.
        reducers = _reducer_list(reducers)
        rank, world_size = _place(rank, world_size)
        job_token = settings.read("RS_JOB_TOKEN") if job_token is None else job_token
        failover = settings.read("RS_FAILOVER") if failover is None else failover
        spares = settings.read("RS_SPARE_REDUCERS") if spares is None else spares
        if not (isinstance(spares, int) and 0 <= spares < len(reducers)):
            raise ConfigError(
                f"RS_SPARE_REDUCERS={spares!r}: spares must leave at least one of the {len(reducers)} reducers in use"
            )
        if spares and not failover:
            raise ConfigError(f"RS_SPARE_REDUCERS={spares} needs RS_FAILOVER=1: spares take a lost reducer's chunks")
        chunk_bytes = chunk_bytes or tuning("RS_CHUNK_BYTES")
        pipeline_depth = _bounded(pipeline_depth, "pipeline_depth", "RS_PIPELINE_DEPTH", MAX_PIPELINE_DEPTH)
        window = _bounded(window, "window", "RS_WINDOW", MAX_WINDOW)
        timeout = timeout or settings.read("RS_TIMEOUT")
        connect_timeout = connect_timeout or settings.read("RS_CONNECT_TIMEOUT")
        io_threads = io_threads or settings.read("RS_IO_THREADS")
        encrypt = settings.read("RS_ENCRYPT") if encrypt is None else encrypt
        integrity = settings.read("RS_INTEGRITY") if integrity is None else integrity
        # Reducers on this host take chunks through shared memory (RS_SHM, on by default).
        shared_memory = shared_memory_enabled() if shared_memory is None else shared_memory
        send_buffer = socket_send_buffer(send_buffer)
        if encrypt:
            encryption.check(job_token)
        integrity = integrity_tags.applies(integrity, encrypt)
        if integrity:
            integrity_tags.check(job_token)
        return cls(
            reducers=reducers,
            rank=rank,
            world_size=world_size,
            job_token=job_token,
            job_id=job_id_from(job_token) if job_id is None else job_id,
            generation=generation,
            run_id=run_id() if run is None else run,
            chunk_bytes=chunk_bytes,
            window=window,
            pipeline_depth=pipeline_depth,
            timeout=timeout,
            connect_timeout=connect_timeout,
            io_threads=io_threads,
            encrypt=encrypt,
            integrity=integrity,
            shared_memory=shared_memory,
            send_buffer=send_buffer,
            failover=failover,
            spares=spares,
            heartbeat_interval=settings.read("RS_HEARTBEAT_INTERVAL"),
            liveness_timeout=settings.read("RS_LIVENESS_TIMEOUT"),
        )
