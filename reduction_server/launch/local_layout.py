"""Where a local job's processes listen and what each one is told: the reducers' ports, the
rendezvous port torch.distributed-style ranks meet on, and the environment of the reducers and of
each worker rank (`reduction-server run`, launcher.py)."""

from __future__ import annotations

import errno
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Collection, Dict, List, Optional, Sequence

from ..config import settings
from ..config.cluster_spec import join_address
from ..config.settings import ONE_HOST_PIPELINE_DEPTH
from ..ports import port_holder

FOREIGN_JOB_VARS = ("CLUSTER_SPEC", "TF_CONFIG")  # they describe some other job's layout


@dataclass(frozen=True)
class Layout:
    """Where the job's processes listen."""

    bind_host: str  # what the reducers bind
    connect_host: str  # what the workers connect to
    reducer_ports: List[int]
    master_port: int

    def reducer_addresses(self) -> List[str]:
        return [join_address(self.connect_host, port) for port in self.reducer_ports]


def check_arguments(
    np: int,
    reducers: int,
    command: Sequence[str],
    port_base: Optional[int],
    metrics_port: Optional[int] = None,
    shards: str = "1",
) -> Optional[str]:
    """What is wrong with `reduction-server run`'s arguments, or None."""
    if np < 1:
        return f"-np must be at least 1 (got {np})"
    if reducers < 1:
        return f"--reducers must be at least 1 (got {reducers})"
    if shards != "1" and port_base is not None:
        return (
            f"--port-base with --shards {shards}: each sharded reducer takes a run of free ports of "
            "its own (workers are told where); give --shards 1 to place the reducers yourself"
        )
    if port_base is not None and not (1 <= port_base and port_base + reducers - 1 <= 65535):
        return (
            f"--port-base {port_base} with {reducers} reducer(s) needs ports "
            f"{port_base}-{port_base + reducers - 1}, outside 1-65535"
        )
    if metrics_port and not (1 <= metrics_port and metrics_port + reducers - 1 <= 65535):
        return (
            f"--metrics-port {metrics_port} with {reducers} reducer(s) needs ports "
            f"{metrics_port}-{metrics_port + reducers - 1}, outside 1-65535"
        )
    if (
        port_base is not None
        and metrics_port
        and metrics_port < port_base + reducers
        and port_base < metrics_port + reducers
    ):
        return (
            f"--port-base {port_base} and --metrics-port {metrics_port} with {reducers} reducer(s) overlap: the "
            f"reducers listen on {_span(port_base, reducers)} and serve metrics on "
            f"{_span(metrics_port, reducers)}; choose ranges apart (e.g. --metrics-port {port_base + reducers})"
        )
    if not command:
        return "no command given (usage: reduction-server run -np W --reducers R -- CMD ...)"
    return None


def _span(first: int, count: int) -> str:
    return f"port {first}" if count == 1 else f"ports {first}-{first + count - 1}"


def plan_layout(
    host: str, reducers: int, port_base: Optional[int], metrics_port: Optional[int] = None, sharded: bool = False
) -> Layout:
    """Ports for the reducers on `host` (from `port_base` on, or free ones apart from the metrics
    ports; 0 for `sharded` reducers, each of which takes a free run of its own and says where)
    and for the ranks' rendezvous; OSError when `host` cannot be bound."""
    metrics = list(range(metrics_port, metrics_port + reducers)) if metrics_port else []
    if sharded:
        reducer_ports = [0] * reducers
        (master_port,) = _free_ports(host, 1, avoid=metrics)
    elif port_base is None:
        *reducer_ports, master_port = _free_ports(host, reducers + 1, avoid=metrics)
    else:
        reducer_ports = list(range(port_base, port_base + reducers))
        (master_port,) = _free_ports(host, 1, avoid=reducer_ports + metrics)
    # A wildcard bind address is not something to connect to; the loopback reaches it.
    connect_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return Layout(host, connect_host, reducer_ports, master_port)


def busy_port(layout: Layout, metrics_port: Optional[int] = None) -> Optional[str]:
    """What is wrong, in one line, when a port the job's reducers will listen on (each one's port
    and metrics port) cannot be bound on the bind host now: which port, whose, who holds it and
    what to do; None when all are free. Checked before any process starts."""
    wanted = [(port, f"reducer {i}'s port (--port-base)") for i, port in enumerate(layout.reducer_ports)]
    if metrics_port:
        wanted += [
            (metrics_port + i, f"reducer {i}'s metrics port (--metrics-port)") for i in range(len(layout.reducer_ports))
        ]
    family = socket.getaddrinfo(layout.bind_host, 0, type=socket.SOCK_STREAM)[0][0]
    for port, whose in wanted:
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the reducers bind: TIME_WAIT is free
            try:
                probe.bind((layout.bind_host, port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    return None  # not a matter of ports: the reducers say what it is
                holder = port_holder(port)
                return (
                    f"cannot use {layout.bind_host}:{port}, {whose}: it is already in use "
                    f"({f'by {holder}' if holder else 'another reducer or program listens there'}); stop it, "
                    "or choose other ports (--port-base, --metrics-port; without --port-base the reducers "
                    "take free ones)"
                )
    return None


def _free_ports(host: str, count: int, avoid: Collection[int]) -> List[int]:
    """`count` distinct ports free on `host` right now (bound to port 0 and read back).

    Every socket stays open until all ports are picked, so the kernel never hands one out twice.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sockets: List[socket.socket] = []
    ports: List[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.bind(address)
            port = sock.getsockname()[1]
            if port not in avoid:
                ports.append(port)
        return ports
    finally:
        for sock in sockets:
            sock.close()


def job_environment(layout: Layout, np: int) -> Dict[str, str]:
    """What every child sees: the launcher's environment plus the job's shared facts."""
    env = dict(os.environ)
    for name in FOREIGN_JOB_VARS:
        env.pop(name, None)
    env.update(
        # A caller-provided token lets processes outside this launcher join the same job.
        RS_JOB_TOKEN=settings.read("RS_JOB_TOKEN") or secrets.token_hex(16),
        RS_REDUCERS=",".join(layout.reducer_addresses()),
        RS_WORLD_SIZE=str(np),
        PYTHONUNBUFFERED="1",  # so Python children's lines show up as they happen
    )
    # Every rank is on this host: fewer, larger chunks (the caller's setting wins, as on every rank).
    if not env.get("RS_PIPELINE_DEPTH", "").strip():
        env["RS_PIPELINE_DEPTH"] = str(ONE_HOST_PIPELINE_DEPTH)
    settings.read("RS_PIPELINE_DEPTH", env)  # a bad value is refused here, naming it, not in every rank
    return env


def worker_environment(env: Dict[str, str], layout: Layout, rank: int, np: int) -> Dict[str, str]:
    """`env` plus what worker `rank` of `np` is told (one machine: the local rank is the rank)."""
    ranks = dict(
        RS_RANK=rank,
        RANK=rank,
        WORLD_SIZE=np,
        LOCAL_RANK=rank,
        LOCAL_WORLD_SIZE=np,
        MASTER_ADDR=layout.connect_host,
        MASTER_PORT=layout.master_port,
    )
    return dict(env, **{name: str(value) for name, value in ranks.items()})
