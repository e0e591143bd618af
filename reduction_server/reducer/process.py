"""`reduction-server serve`: one reducer process, from its configuration to its exit.

Its place (address, port, index, world size, token) comes from the arguments, else from the
cluster spec or the RS_* variables (discovery.py); it binds, says so on stdout (and to a
launcher's --ready-fd), logs its configuration, serves until SIGTERM or SIGINT, and logs a
summary when it stops.
"""
from __future__ import annotations

import os
import signal
import time
from typing import List, Optional, Union

import zmq

from ..wire import encryption, protocol, shared_memory
from . import heap
from ..config import settings
from ..errors import ConfigError, ListenError
from ..log import NOTICE, event, get_logger
from .core import Reducer
from ..wire.send_buffers import AcceptedBuffers
from .shards import Supervisor, count as shard_count

log = get_logger("reducer")


def _bind(socket: zmq.Socket, host: str, port: int) -> int:
    """Bind and return the port; a ListenError says in one line why it cannot, and what to do."""
    if ":" in host:
        socket.setsockopt(zmq.IPV6, 1)
    address = f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
    try:
        if port == 0:
            return socket.bind_to_random_port(address)
        socket.bind(f"{address}:{port}")
    except zmq.ZMQError as exc:
        raise ListenError.binding(host, port, exc.errno, str(exc)) from None
    return port


def _stopping() -> List[bool]:
    """A list that SIGTERM and SIGINT append to: the loops stop once it is not empty."""
    stopping: List[bool] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    return stopping


def _say_ready(ready_fd: Optional[int], port: int, metrics_port: Optional[int] = None) -> None:
    if ready_fd is not None:
        try:
            with os.fdopen(ready_fd, "w") as ready:
                ready.write(f"{port}\n" if metrics_port is None else f"{port} {metrics_port}\n")
        except BrokenPipeError:
            pass  # the launcher gave up on this reducer already, and stops it


def serve(host: Optional[str] = None, port: Optional[int] = None, workers: Optional[int] = None,
          index: Optional[int] = None, deterministic: Optional[bool] = None,
          metrics_port: Optional[int] = None, ready_fd: Optional[int] = None,
          shards: Union[str, int, None] = None, shard: Optional[int] = None) -> int:
    """Run one reducer until SIGTERM or SIGINT; arguments override the discovered place and
    the environment (deterministic=None: RS_DETERMINISTIC; metrics_port=None: RS_METRICS_PORT,
    0 or unset: no metrics; shards=None: RS_SHARDS). With more than one shard this process
    supervises that many reducer processes on ports port .. port+shards-1 (shards.py); `shard`
    makes it one of them. Once it listens, the bound port and a newline are written to
    `ready_fd`, which is then closed (a launcher waits for that before it starts workers)."""
    from ..config.discovery import discover_reducer

    if ready_fd is not None:
        try:
            os.fstat(ready_fd)
        except OSError as exc:
            raise ConfigError(f"--ready-fd {ready_fd} is not an open file descriptor: {exc.strerror}") from None
    place = discover_reducer() if None in (host, port, index) else None
    host = host or (place.host if place else "0.0.0.0")
    port = port if port is not None else (place.port if place else 0)
    index = index if index is not None else (place.index if place else 0)
    if workers is None:
        workers = place.world_size if place else None
        if workers is None:
            workers = settings.read("RS_WORLD_SIZE")
    token = settings.read("RS_JOB_TOKEN")
    if deterministic is None:
        deterministic = settings.read("RS_DETERMINISTIC")
    encrypt = settings.read("RS_ENCRYPT")
    if encrypt:
        encryption.check(token)
    if metrics_port is None:
        metrics_port = settings.read("RS_METRICS_PORT")
    elif not 0 <= metrics_port <= 65535:
        raise ConfigError(f"--metrics-port {metrics_port} is outside 0-65535")
    count = shard_count(settings.read("RS_SHARDS") if shards is None else shards,
                        "RS_SHARDS" if shards is None else "--shards")
    if shard is not None and not 0 <= shard < count:
        raise ConfigError(f"--shard {shard} is not one of the {count} shards (0..{count - 1})")
    # Every setting is read (and checked) here, before any shard starts: a bad one is one message.
    max_chunk = settings.read("RS_MAX_CHUNK_BYTES")
    heartbeat = settings.read("RS_HEARTBEAT_INTERVAL")
    liveness = settings.read("RS_LIVENESS_TIMEOUT")
    sndbuf = settings.socket_send_buffer()  # a size is set below; `auto` per connection (send_buffers.py)
    limits = dict(max_accumulator_bytes=settings.read("RS_MAX_ACCUMULATOR_BYTES") // count,  # the shards share it
                  max_peer_bytes=settings.read("RS_MAX_PEER_BYTES"), max_rounds=settings.read("RS_MAX_ROUNDS"),
                  round_timeout=settings.read("RS_TIMEOUT"))
    if count > 1 and limits["max_accumulator_bytes"] < max_chunk <= limits["max_accumulator_bytes"] * count:
        raise ConfigError(f"RS_MAX_ACCUMULATOR_BYTES shared by {count} shards leaves each "
                          f"{limits['max_accumulator_bytes']} bytes, less than one chunk (RS_MAX_CHUNK_BYTES="
                          f"{max_chunk}): raise it, or run fewer shards (--shards, RS_SHARDS)")
    shared = shared_memory.enabled()
    if shard is None and count > 1:
        return _supervise(Supervisor(host=host, port=port, index=index, shards=count, workers=workers,
                                     deterministic=deterministic, metrics_port=metrics_port),
                          token=token, encrypt=encrypt, ready_fd=ready_fd)
    shard = shard or 0
    heap_kept = heap.keep_freed_memory()  # before libzmq's I/O thread starts

    # Whatever fails from here on (a busy port, a metrics port in use), the socket and context close.
    with zmq.Context() as context, context.socket(zmq.ROUTER) as socket:
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable result is an error, never a silent drop
        socket.setsockopt(zmq.LINGER, 0)
        # libzmq drops a connection whose message exceeds this: a bogus size is never allocated.
        socket.setsockopt(zmq.MAXMSGSIZE, max_chunk + protocol.HEADER_SIZE)
        if sndbuf > 0:  # before bind: libzmq copies a socket's options into its listener and each connection
            socket.setsockopt(zmq.SNDBUF, sndbuf)
        protocol.set_heartbeats(socket, heartbeat, liveness)
        if encrypt:
            encryption.secure_reducer(socket, token)
        bound = _bind(socket, host, port)
        send_buffers = AcceptedBuffers(bound) if sndbuf == settings.SNDBUF_AUTO else None
        reducer = Reducer(
            socket, index=index, address=f"{host}:{bound}", world_size=workers, job_token=token,
            max_chunk_bytes=max_chunk, **limits,
            heartbeat_interval=heartbeat,
            liveness_timeout=liveness,
            deterministic=deterministic,
            encrypt=encrypt,
            shared=shared, shard=shard, shards=count, send_buffers=send_buffers,
        )
        try:
            metrics_at = None
            if metrics_port:
                from .metrics import ReducerMetrics  # prometheus_client takes ~0.1 s to import: only when used

                reducer.metrics = ReducerMetrics(reducer)
                # A shard's page is for its supervisor only (shard_metrics.py), at a port it is told of.
                metrics_host = "127.0.0.1" if count > 1 else host
                metrics_at = (metrics_host, reducer.metrics.serve(metrics_host, 0 if count > 1 else metrics_port))
            stopping = _stopping()
            print(f"{reducer.name.split(' (')[0]} listening on tcp://{host}:{bound} workers={workers or 'from HELLO'} "
                  f"auth={'token' if token else 'none'} encrypt={'curve' if encrypt else 'off'} "
                  f"deterministic={'on' if deterministic else 'off'}", flush=True)
            event(log, NOTICE, "started", reducer=index, **({"shard": shard} if count > 1 else {}),
                  address=f"{host}:{bound}", workers=workers or "from_hello",
                  auth="token" if token else "none", encrypt=encrypt, deterministic=deterministic,
                  max_chunk_bytes=max_chunk, max_accumulator_bytes=reducer.pool.max_bytes,
                  max_peer_bytes=reducer.pool.max_rank_bytes, max_rounds=reducer.rounds.max_rounds,
                  heap="kept" if heap_kept else "default",
                  timeout_s=reducer.round_timeout, heartbeat_interval_s=heartbeat, liveness_timeout_s=liveness,
                  sndbuf={0: "kernel", settings.SNDBUF_AUTO: "auto"}.get(sndbuf, sndbuf), metrics=f"http://{metrics_at[0]}:{metrics_at[1]}/metrics" if metrics_at else "off",
                  pid=os.getpid())
            _say_ready(ready_fd, bound, metrics_at[1] if metrics_at and count > 1 else None)
            reducer.run(lambda: bool(stopping))
        finally:
            if reducer.metrics is not None:
                reducer.metrics.stop()
            if reducer.results is not None:
                reducer.results.close()
    rounds = reducer.rounds
    failed = ",".join(f"{code}:{n}" for code, n in sorted(rounds.failed_codes.items()))
    event(log, NOTICE, "stopped", reducer=index, **({"shard": shard} if count > 1 else {}), completed=rounds.completed, failed=rounds.failed,
          failed_by_code=failed or "none", bytes_in=reducer.bytes_in, bytes_out=rounds.bytes_out,
          bytes_shared_memory=reducer.bytes_shared, shared_results=rounds.delivery.results_shared,
          peers_admitted=reducer.admission.admissions, uptime_s=f"{time.monotonic() - reducer.started:.1f}",
          open_rounds=len(rounds.rounds), accumulator_bytes_in_use=reducer.pool.in_use_bytes)
    return 0


def _supervise(supervisor: Supervisor, *, token: str, encrypt: bool, ready_fd: Optional[int]) -> int:
    """Run the shards of one reducer until SIGTERM or SIGINT (shards.py)."""
    stopping = _stopping()
    index, count = supervisor.index, supervisor.count
    metrics = None
    try:
        if supervisor.metrics_port:  # first: a taken port starts no shard
            from .shard_metrics import ShardMetrics

            metrics = ShardMetrics(supervisor)
            metrics.serve(supervisor.host, supervisor.metrics_port)
        base = supervisor.start()
        address = f"{supervisor.host}:{base}"
        print(f"reducer {index} listening on tcp://{address} shards={count} (ports {base}-{base + count - 1}) "
              f"workers={supervisor.workers or 'from HELLO'} auth={'token' if token else 'none'} "
              f"encrypt={'curve' if encrypt else 'off'} deterministic={'on' if supervisor.deterministic else 'off'}",
              flush=True)
        event(log, NOTICE, "started", reducer=index, address=address, shards=count,
              ports=f"{base}-{base + count - 1}", pid=os.getpid())
        _say_ready(ready_fd, base)
        supervisor.watch(lambda: bool(stopping))
    finally:
        supervisor.stop()
        if metrics is not None:
            metrics.stop()
    event(log, NOTICE, "stopped", reducer=index, shards=count,
          shard_restarts=sum(s.restarts for s in supervisor.shards))
    return 0
