"""The cluster specs a job's platform hands each process: Vertex AI's CLUSTER_SPEC (pools
workerpool0..workerpool3, or AI Platform's custom-container form with master/worker/ps/evaluator)
and TF_CONFIG (chief or master, worker, ps, evaluator), parsed into what discovery needs: the
worker hosts, the reducers' addresses, and this process's task.

In a cluster spec the primary replica (workerpool0, chief or master) is host 0 and the workers
follow it; the reducer pool (workerpool2 or ps) holds the reducers; evaluators take no part.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..errors import ConfigError

VERTEX_POOLS = ("workerpool0", "workerpool1", "workerpool2", "workerpool3")
TF_POOLS = ("chief", "master", "worker", "ps", "evaluator")
_HOSTNAME = re.compile(r"[A-Za-z0-9_.-]+")  # DNS name or IPv4 address
_IPV6 = re.compile(r"[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9_.-]+)?")  # with optional zone


def parse_address(text: str, variable: str) -> tuple[str, int]:
    """Split "host:port" or "[ipv6]:port" into (host, port); the host loses its brackets.

    Raises ConfigError naming `variable` when the text is not such an address or the port is
    not in 1..65535.
    """
    entry = text.strip()

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{variable}: {text!r} is not a host:port address: {why}")

    if entry.startswith("["):
        host, bracket, rest = entry[1:].partition("]")
        if not bracket:
            raise bad("'[' without a closing ']'")
        if not _IPV6.fullmatch(host):
            raise bad(f"{host!r} inside [...] is not an IPv6 address")
        if not rest.startswith(":"):
            raise bad("expected [ipv6]:port")
        port_text = rest[1:]
    else:
        host, colon, port_text = entry.rpartition(":")
        if not colon:
            raise bad("no :port")
        if ":" in host:
            # "::1:5555" could split several ways; brackets make it unambiguous.
            raise bad("write IPv6 addresses in brackets, like [::1]:5555")
        if not _HOSTNAME.fullmatch(host):
            raise bad("the host is empty or has characters a host name cannot have")
    if not (port_text.isascii() and port_text.isdigit()):
        raise bad(f"the port {port_text!r} is not a number")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise bad(f"the port {port} is not in 1..65535")
    return host, port


@dataclass(frozen=True)
class Task:
    type: str
    index: int
    role: str  # "worker", "reducer" or "evaluator"
    position: int  # host index for a worker, reducer index for a reducer


@dataclass(frozen=True)
class Cluster:
    """A parsed CLUSTER_SPEC or TF_CONFIG, reduced to what discovery needs."""

    variable: str
    hosts: int  # worker hosts: the primary plus the workers
    reducer_pool: str  # "workerpool2" or "ps"
    reducers: tuple[str, ...]
    task: Optional[Task]  # None when the document has no "task"
    job: Any  # CLUSTER_SPEC's "job" field, None when absent (or for TF_CONFIG)

    def require_task(self) -> Task:
        if self.task is None:
            raise ConfigError(f'{self.variable} has no "task" key, so this process cannot tell its role')
        return self.task


def parse_cluster(variable: str, text: str) -> Cluster:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{variable} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
        ) from None
    if not isinstance(document, dict):
        raise ConfigError(f'{variable} must be a JSON object with "cluster" and "task" keys')
    cluster = document.get("cluster")
    if not isinstance(cluster, dict):
        raise ConfigError(f'{variable} has no "cluster" object')
    pools: dict[str, tuple[str, ...]] = {}
    for name, entries in cluster.items():
        if not isinstance(entries, list) or not all(isinstance(entry, str) for entry in entries):
            raise ConfigError(f'{variable}: cluster.{name} must be a list of "host:port" strings')
        pools[name] = tuple(entries)
    raw_task = document.get("task")
    if raw_task is not None and not isinstance(raw_task, dict):
        raise ConfigError(f'{variable}: "task" must be an object with "type" and "index"')
    task_type = raw_task.get("type") if raw_task is not None else None
    if raw_task is not None and (not isinstance(task_type, str) or not task_type):
        raise ConfigError(f"{variable}: task.type must be a non-empty string, got {task_type!r}")

    # AI Platform's CLUSTER_SPEC for custom containers uses TF_CONFIG's names; Vertex AI's
    # uses workerpoolN. Which one this is shows in any pool or task name.
    names = set(pools) | ({task_type} if task_type else set())
    vertex = variable == "CLUSTER_SPEC" and any(name in VERTEX_POOLS for name in names)
    known = VERTEX_POOLS if vertex else TF_POOLS
    for name in pools:
        if name not in known:
            raise ConfigError(f"{variable}: unknown pool {name!r} in cluster (expected {', '.join(known)})")
    if vertex:
        if len(pools.get("workerpool0", ())) != 1:
            raise ConfigError(
                f"{variable}: cluster.workerpool0 must hold exactly one primary replica, "
                f"found {len(pools.get('workerpool0', ()))}"
            )
        worker_pools, reducer_pool, evaluator_pool = ("workerpool0", "workerpool1"), "workerpool2", "workerpool3"
    else:
        heads = [name for name in ("chief", "master") if pools.get(name)]
        if len(heads) == 2:
            raise ConfigError(f"{variable}: cluster has both chief and master; the primary replica is one or the other")
        if heads and len(pools[heads[0]]) > 1:
            raise ConfigError(
                f"{variable}: cluster.{heads[0]} lists {len(pools[heads[0]])} entries; a job has one {heads[0]}"
            )
        worker_pools, reducer_pool, evaluator_pool = (*heads, "worker"), "ps", "evaluator"
    offsets: dict[str, int] = {}
    hosts = 0
    for name in worker_pools:
        offsets[name] = hosts
        hosts += len(pools.get(name, ()))
    if hosts == 0:
        raise ConfigError(f"{variable}: cluster has no chief, master or worker entries, so no worker hosts")

    task = None
    if raw_task is not None:
        if task_type not in known:
            raise ConfigError(f"{variable}: task type {task_type!r} is not one of {', '.join(known)}")
        index = _task_index(variable, raw_task.get("index"))
        listed = pools.get(task_type, ())
        # TF_CONFIG never lists evaluators in "cluster", so an evaluator's index has nothing to check.
        if index >= len(listed) and not (task_type == evaluator_pool and task_type not in pools):
            raise ConfigError(
                f"{variable}: task {task_type}[{index}] is beyond cluster.{task_type}, "
                f"which lists {len(listed)} entries"
            )
        if task_type == reducer_pool:
            task = Task(task_type, index, "reducer", index)
        elif task_type == evaluator_pool:
            task = Task(task_type, index, "evaluator", index)
        else:
            task = Task(task_type, index, "worker", offsets[task_type] + index)
    return Cluster(
        variable=variable,
        hosts=hosts,
        reducer_pool=reducer_pool,
        reducers=pools.get(reducer_pool, ()),
        task=task,
        job=document.get("job") if variable == "CLUSTER_SPEC" else None,
    )


def _task_index(variable: str, index: Any) -> int:
    if isinstance(index, str) and index.isascii() and index.isdigit():
        return int(index)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ConfigError(f"{variable}: task.index must be a non-negative integer, got {index!r}")
    return index


def address_list(where: str, entries: Sequence[str]) -> tuple[tuple[str, int], ...]:
    seen: dict[tuple[str, int], int] = {}
    addresses = []
    for position, entry in enumerate(entries):
        if not entry.strip():
            raise ConfigError(f"{where} has an empty entry at position {position}")
        host, port = parse_address(entry, where)
        key = (host.lower(), port)  # host names are case-insensitive
        if key in seen:
            # Two indices for one reducer would send it two shares of the buffer.
            raise ConfigError(f"{where} lists {join_address(host, port)} twice (positions {seen[key]} and {position})")
        seen[key] = position
        addresses.append((host, port))
    return tuple(addresses)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
