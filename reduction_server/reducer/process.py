"""`reduction-server serve`: one reducer process, from its configuration to its exit.

Its settings are resolved once (options.py: the arguments, else the place discovered from the
cluster spec or RS_* variables, else the environment, else the defaults); it binds, says so on
stdout in one short line (and to a launcher's --ready-fd), logs its configuration at INFO, serves
until SIGTERM or SIGINT, and logs a summary when it stops (NOTICE, shown by default). With
shards it supervises them instead (shards.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from typing import Callable, ContextManager, Dict, List, Optional, Tuple, Union

import zmq

from ..config import settings
from ..errors import ConfigError, ListenError
from ..log import NOTICE, event, get_logger
from ..wire import encryption, gate, protocol
from ..wire.send_buffers import AcceptedBuffers
from . import heap, socket_events
from .core import Reducer
from .options import ReducerConfig
from .shards import Supervisor, port_in_use

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
        if exc.errno == errno.EADDRINUSE and port:
            raise port_in_use(host, port) from None
        raise ListenError.binding(host, port, exc.errno, str(exc)) from None
    return port


def _stopping(on_term: Optional[Callable[[], None]] = None) -> List[int]:
    """A list that SIGTERM and SIGINT append their number to: the loops stop once it is not
    empty. With `on_term`, SIGTERM calls it instead (a reducer drains, drain.py)."""
    stopping: List[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stopping.append(signum))
    if on_term is not None:
        signal.signal(signal.SIGTERM, lambda *_: on_term())
    return stopping


def _check_ready_fd(ready_fd: Optional[int]) -> None:
    """A ConfigError unless `ready_fd` (when given) is open: said before anything else is read."""
    if ready_fd is not None:
        try:
            os.fstat(ready_fd)
        except OSError as exc:
            raise ConfigError(f"--ready-fd {ready_fd} is not an open file descriptor: {exc.strerror}") from None


def _say_ready(ready_fd: Optional[int], port: int, metrics_port: Optional[int] = None) -> None:
    if ready_fd is not None:
        try:
            with os.fdopen(ready_fd, "w") as ready:
                ready.write(f"{port}\n" if metrics_port is None else f"{port} {metrics_port}\n")
        except BrokenPipeError:
            pass  # the launcher gave up on this reducer already, and stops it


def serve(
    host: Optional[str] = None,
    port: Optional[int] = None,
    workers: Optional[int] = None,
    index: Optional[int] = None,
    deterministic: Optional[bool] = None,
    metrics_port: Optional[int] = None,
    ready_fd: Optional[int] = None,
    shards: Union[str, int, None] = None,
    shard: Optional[int] = None,
    insecure_no_token: Optional[bool] = None,
) -> int:
    """Run one reducer until SIGTERM or SIGINT; arguments override the discovered place and
    the environment (deterministic=None: RS_DETERMINISTIC; metrics_port=None: RS_METRICS_PORT,
    0 or unset: no metrics; shards=None: RS_SHARDS). With more than one shard this process
    supervises that many reducer processes on ports port .. port+shards-1 (shards.py); `shard`
    makes it one of them. Once it listens, the bound port and a newline are written to
    `ready_fd`, which is then closed (a launcher waits for that before it starts workers).
    Without RS_JOB_TOKEN it refuses to listen beyond the loopback unless `insecure_no_token`
    (None: RS_ALLOW_NO_TOKEN) says so (options.py)."""
    _check_ready_fd(ready_fd)
    # Every setting is read (and checked) here, before any shard starts: a bad one is one message.
    config = ReducerConfig.resolve(
        host=host,
        port=port,
        workers=workers,
        index=index,
        deterministic=deterministic,
        metrics_port=metrics_port,
        shards=shards,
        shard=shard,
        insecure_no_token=insecure_no_token,
    )
    if config.supervises:
        return _supervise(config, ready_fd)
    heap_kept = heap.keep_freed_memory()  # before libzmq's I/O thread starts
    reducer = _run(config, ready_fd, heap_kept)
    _summarise(config, reducer)
    return 0


def _run(config: ReducerConfig, ready_fd: Optional[int], heap_kept: bool) -> Reducer:
    """Bind, say so, and serve until SIGTERM or SIGINT; the reducer, stopped, for its summary."""
    gate.seed_routing_ids()  # before the ROUTER: its first routing id is not every process's (gate.py)
    # Whatever fails from here on (a busy port, a metrics port in use), the socket and context close.
    with zmq.Context() as context, _gate(context, config) as zap, context.socket(zmq.ROUTER) as socket:
        # made before the socket binds: no connection is accepted unseen (arrivals.py)
        with socket_events.monitoring(socket) as monitor:
            bound = _listen(socket, config, zap)
            send_buffers = AcceptedBuffers(bound) if config.sndbuf == settings.SNDBUF_AUTO else None
            reducer = Reducer(
                socket,
                index=config.index,
                address=f"{config.host}:{bound}",
                world_size=config.workers,
                job_token=config.token,
                max_chunk_bytes=config.max_chunk_bytes,
                max_accumulator_bytes=config.max_accumulator_bytes,
                max_peer_bytes=config.max_peer_bytes,
                max_rounds=config.max_rounds,
                round_timeout=config.round_timeout,
                max_ungreeted=config.max_ungreeted,
                hello_timeout=config.hello_timeout,
                heartbeat_interval=config.heartbeat_interval,
                liveness_timeout=config.liveness_timeout,
                drain_timeout=config.drain_timeout,
                deterministic=config.deterministic,
                encrypt=config.encrypt,
                integrity=config.integrity,
                shared=config.shared,
                shard=config.shard_number,
                shards=config.shards,
                send_buffers=send_buffers,
                monitor=monitor,
            )
            try:
                metrics_at = _serve_metrics(config, reducer)
                stopping = _stopping(reducer.drain.request if config.drain_timeout > 0 else None)
                if reducer.metrics is not None:  # it listens: ready until told to stop
                    reducer.metrics.not_ready = lambda: (
                        "stopping" if stopping else "draining" if reducer.drain.requested else None
                    )
                _announce(config, reducer, bound, metrics_at, heap_kept)
                _say_ready(ready_fd, bound, metrics_at[1] if metrics_at and config.shards > 1 else None)
                reducer.run(lambda: bool(stopping))
                if reducer.drain.draining:
                    # What it queued last (results, DRAINED) leaves before the context closes.
                    left = config.drain_timeout - (time.monotonic() - reducer.drain.started_at)
                    socket.setsockopt(zmq.LINGER, max(100, int(left * 1000)))
            finally:
                if reducer.metrics is not None:
                    reducer.metrics.stop()
                if reducer.results is not None:
                    reducer.results.close()
    return reducer


def _gate(context: zmq.Context, config: ReducerConfig) -> ContextManager[Optional[gate.Gate]]:
    """The ZAP handler that lets through only connections proving the job token (gate.py): a
    stranger's would reach libzmq's routing table, which it can make abort (issue 37). None with
    encryption (CURVE keeps strangers out already) or without a token (anyone is admitted)."""
    if not gate.applies(config.token, config.encrypt):
        return contextlib.nullcontext()
    return gate.Gate(context, config.token, log=log)


def _listen(socket: zmq.Socket, config: ReducerConfig, zap: Optional[gate.Gate] = None) -> int:
    """Set the ROUTER socket's options, all before it binds, then bind it; the bound port."""
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable result is an error, never a silent drop
    socket.setsockopt(zmq.LINGER, 0)
    # libzmq drops a connection whose message exceeds this: a bogus size is never allocated.
    socket.setsockopt(zmq.MAXMSGSIZE, config.max_chunk_bytes + protocol.HEADER_SIZE)
    # Connections without a HELLO are closed after RS_HELLO_TIMEOUT (arrivals.py); libzmq drops one
    # still in its handshake twice as late, should a flood have overrun the socket monitor's queue.
    socket.setsockopt(zmq.HANDSHAKE_IVL, int(2 * config.hello_timeout * 1000))
    if config.sndbuf > 0:  # before bind: libzmq copies a socket's options into its listener and each connection
        socket.setsockopt(zmq.SNDBUF, config.sndbuf)
    protocol.set_heartbeats(socket, config.heartbeat_interval, config.liveness_timeout)
    if config.encrypt:
        encryption.secure_reducer(socket, config.token)
    elif zap is not None:
        zap.guard(socket)
    return _bind(socket, config.host, config.port)


def _serve_metrics(config: ReducerConfig, reducer: Reducer) -> Optional[Tuple[str, int]]:
    """Serve the reducer's metrics page when asked to; where it is, or None."""
    if not config.metrics_port:
        return None
    from .metrics import ReducerMetrics  # prometheus_client takes ~0.1 s to import: only when used

    reducer.metrics = ReducerMetrics(reducer)
    # A shard's page is for its supervisor only (shard_metrics.py), at a port it is told of.
    sharded = config.shards > 1
    metrics_host = "127.0.0.1" if sharded else config.host
    return metrics_host, reducer.metrics.serve(metrics_host, 0 if sharded else config.metrics_port)


def _which_shard(config: ReducerConfig) -> Dict[str, int]:
    """The `shard` field of a shard's log lines; none for a reducer that is not sharded."""
    return {"shard": config.shard_number} if config.shards > 1 else {}


def _announce(
    config: ReducerConfig, reducer: Reducer, bound: int, metrics_at: Optional[Tuple[str, int]], heap_kept: bool
) -> None:
    """The short `listening` line on stdout (what a user or a launcher reads), and the `started`
    event with every setting in force at INFO."""
    address = f"{config.host}:{bound}"
    token, encrypt, deterministic = config.token, config.encrypt, config.deterministic
    print(
        f"{reducer.name.split(' (')[0]} listening on tcp://{address}"
        f"{_settings_in_short(config.workers, token, encrypt, deterministic, config.integrity)}",
        flush=True,
    )
    event(
        log,
        logging.INFO,
        "started",
        reducer=config.index,
        **_which_shard(config),
        address=address,
        workers=config.workers or "from_hello",
        auth="token" if token else "none",
        encrypt=encrypt,
        integrity=config.integrity,
        deterministic=deterministic,
        max_chunk_bytes=config.max_chunk_bytes,
        max_accumulator_bytes=reducer.pool.max_bytes,
        max_peer_bytes=reducer.pool.max_rank_bytes,
        max_rounds=reducer.rounds.max_rounds,
        heap="kept" if heap_kept else "default",
        timeout_s=reducer.round_timeout,
        heartbeat_interval_s=config.heartbeat_interval,
        liveness_timeout_s=config.liveness_timeout,
        sndbuf={0: "kernel", settings.SNDBUF_AUTO: "auto"}.get(config.sndbuf, config.sndbuf),
        metrics=f"http://{metrics_at[0]}:{metrics_at[1]}/metrics" if metrics_at else "off",
        pid=os.getpid(),
    )


def _settings_in_short(
    workers: Optional[int], token: str, encrypt: bool, deterministic: bool, integrity: bool = False
) -> str:
    """The start line's settings: the world size and the authentication always, the others only
    when on (the `started` event at INFO has them all)."""
    return (
        f" workers={workers or 'from HELLO'} auth={'token' if token else 'none'}"
        + (" encrypt=curve" if encrypt else "")
        + (" integrity=poly1305" if integrity else "")
        + (" deterministic=on" if deterministic else "")
    )


def _summarise(config: ReducerConfig, reducer: Reducer) -> None:
    """The `stopped` event: what the reducer did, and what it still held when it stopped."""
    rounds = reducer.rounds
    failed = ",".join(f"{code}:{n}" for code, n in sorted(rounds.failed_codes.items()))
    event(
        log,
        NOTICE,
        "stopped",
        reducer=config.index,
        **_which_shard(config),
        completed=rounds.completed,
        failed=rounds.failed,
        failed_by_code=failed or "none",
        bytes_in=reducer.bytes_in,
        bytes_out=rounds.bytes_out,
        bytes_shared_memory=reducer.bytes_shared,
        shared_results=rounds.delivery.results_shared,
        peers_admitted=reducer.admission.admissions,
        uptime_s=f"{time.monotonic() - reducer.started:.1f}",
        open_rounds=len(rounds.rounds),
        drain=reducer.drain.outcome,
        accumulator_bytes_in_use=reducer.pool.in_use_bytes,
    )


def _supervise(config: ReducerConfig, ready_fd: Optional[int]) -> int:
    """Run the shards of one reducer until SIGTERM or SIGINT (shards.py)."""
    supervisor = Supervisor(
        host=config.host,
        port=config.port,
        index=config.index,
        shards=config.shards,
        workers=config.workers,
        deterministic=config.deterministic,
        metrics_port=config.metrics_port,
    )
    token, encrypt = config.token, config.encrypt
    stopping = _stopping()
    index, count = supervisor.index, supervisor.count
    metrics = None
    try:
        if supervisor.metrics_port:  # first: a taken port starts no shard
            from .shard_metrics import ShardMetrics

            metrics = ShardMetrics(supervisor)
            metrics.not_ready = lambda: "stopping" if stopping else supervisor.not_listening()
            metrics.serve(supervisor.host, supervisor.metrics_port)
        base = supervisor.start()
        address = f"{supervisor.host}:{base}"
        print(
            f"reducer {index} listening on tcp://{address} shards={count} (ports {base}-{base + count - 1})"
            f"{_settings_in_short(supervisor.workers, token, encrypt, supervisor.deterministic, config.integrity)}",
            flush=True,
        )
        event(
            log,
            logging.INFO,
            "started",
            reducer=index,
            address=address,
            shards=count,
            ports=f"{base}-{base + count - 1}",
            pid=os.getpid(),
        )
        _say_ready(ready_fd, base)
        supervisor.watch(lambda: bool(stopping))
    finally:  # SIGTERM has every shard drain, SIGINT stop at once
        supervisor.stop(stopping[0] if stopping else signal.SIGTERM, config.drain_timeout)
        if metrics is not None:
            metrics.stop()
    event(
        log, NOTICE, "stopped", reducer=index, shards=count, shard_restarts=sum(s.restarts for s in supervisor.shards)
    )
    return 0
