"""Where this process sits in the job, read from its environment (docs/design.md, "Roles").

A worker learns its rank, the world size and the reducers' addresses; a reducer learns its
index and the port it listens on. Sources, first match wins:

1. explicit variables: RS_RANK and RS_WORLD_SIZE, RS_REDUCER_INDEX, RS_REDUCERS;
2. CLUSTER_SPEC: Vertex AI's pools workerpool0..workerpool3, or AI Platform's custom-container
   form with master/worker/ps/evaluator;
3. TF_CONFIG: chief (or master), worker, ps, evaluator;
4. the launcher's variables: RANK/WORLD_SIZE (torchrun, PyTorchJob), HOROVOD_RANK/HOROVOD_SIZE,
   OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE.

The cluster specs are parsed in cluster_spec.py. Anything missing, malformed or contradictory is a ConfigError naming the variable: a wrong guess
here would hang or silently corrupt a whole job.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Optional

from .cluster_spec import Cluster, Task, address_list, join_address, parse_address, parse_cluster
from . import settings
from ..errors import ConfigError

__all__ = ["ReducerPlace", "WorkerPlace", "discover_reducer", "discover_reducers", "discover_worker",
           "job_id_from", "parse_address"]

# (rank, size) pairs, highest priority first.
_LOCAL_VARIABLES = (("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
                    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                    ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"))
_LAUNCHER_VARIABLES = (("RANK", "WORLD_SIZE"),
                       ("HOROVOD_RANK", "HOROVOD_SIZE"),
                       ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))

_JOB_ID_NUMBER = re.compile(r"[0-9]+|0[xX][0-9A-Fa-f]+")


@dataclass(frozen=True)
class WorkerPlace:
    """A worker process's place in the job."""

    rank: int
    world_size: int
    reducers: tuple[str, ...]  # "host:port" ("[v6]:port"), in reducer-index order
    local_rank: int  # which of this host's processes this is: picks the device
    local_world_size: int
    job_token: str  # RS_JOB_TOKEN, or "" for no authentication
    job_id: int  # unsigned 64-bit, the same in every process of the job
    generation: int  # RS_GENERATION: bumped when a job restarts, so stale peers are refused
    source: str  # the variable that decided rank and world size


@dataclass(frozen=True)
class ReducerPlace:
    """A reducer process's place in the job."""

    index: int
    num_reducers: int
    host: str  # address to bind
    port: int  # from this reducer's own "host:port" entry
    world_size: Optional[int]  # worker ranks, None when nothing in the environment says
    job_token: str
    job_id: int
    generation: int
    source: str  # the variable that decided the index


def discover_worker(environ: Optional[Mapping[str, str]] = None) -> WorkerPlace:
    """This worker's rank, world size and reducers, from `environ` (default os.environ)."""
    env = _Environment(environ)
    if env.text("RS_REDUCER_INDEX") is not None:
        raise ConfigError("RS_REDUCER_INDEX is set: this process is a reducer, not a worker")
    if env.text("RS_RANK") is None and env.spec is not None:
        _worker_task(env.spec)  # first: a reducer would otherwise hear about LOCAL_RANK
    local_rank, local_world_size = _local_placement(env)
    rank, world_size, source = _worker_rank(env, local_rank, local_world_size)
    _, reducers = _reducer_addresses(env)
    token, job_id, generation = _identity(env)
    # A worker group that torchrun's agent (or `run --max-restarts`) started again is a new
    # generation: the reducers then drop the rounds and lost ranks of the one before.
    generation += env.integer("TORCHELASTIC_RESTART_COUNT") or 0
    return WorkerPlace(rank=rank, world_size=world_size, reducers=tuple(join_address(h, p) for h, p in reducers),
                       local_rank=local_rank, local_world_size=local_world_size, job_token=token,
                       job_id=job_id, generation=generation, source=source)


def discover_reducers(environ: Optional[Mapping[str, str]] = None) -> tuple[str, ...]:
    """The reducers' addresses alone: what a job's unique id carries before ranks are known."""
    _, reducers = _reducer_addresses(_Environment(environ))
    return tuple(join_address(h, p) for h, p in reducers)


def job_id_from(token: str) -> int:
    """The id of a job known only by its token (0 without one), as discover_worker derives it."""
    return _hash64(token) if token else 0


def discover_reducer(environ: Optional[Mapping[str, str]] = None) -> Optional[ReducerPlace]:
    """This reducer's index and port, or None when the environment names no reducer role."""
    env = _Environment(environ)
    index = env.integer("RS_REDUCER_INDEX")
    if index is not None:
        source = index_name = "RS_REDUCER_INDEX"
    else:
        spec = env.spec
        if spec is None:
            return None
        task = spec.require_task()
        if task.role != "reducer":
            return None
        index, source, index_name = task.position, spec.variable, f"{spec.variable} task.index"
    where, reducers = _reducer_addresses(env)
    if index >= len(reducers):
        raise ConfigError(f"{index_name}={index} is out of range: {where} lists {len(reducers)} reducer(s)")
    token, job_id, generation = _identity(env)
    return ReducerPlace(index=index, num_reducers=len(reducers), host=env.text("RS_BIND_HOST") or "0.0.0.0",
                        port=reducers[index][1], world_size=_reducer_world_size(env), job_token=token,
                        job_id=job_id, generation=generation, source=source)


class _Environment:
    """The variables discovery reads, validated one way, with the cluster spec parsed once."""

    def __init__(self, environ: Optional[Mapping[str, str]]) -> None:
        self.environ = os.environ if environ is None else environ

    def text(self, name: str) -> Optional[str]:
        value = self.environ.get(name)
        if value is None:
            return None
        if not value.strip():
            # Usually a template that did not expand; treating it as unset would fall through
            # to a lower-priority source and guess.
            raise ConfigError(f"{name} is set but empty; give it a value or unset it")
        return value.strip()

    def integer(self, name: str) -> Optional[int]:
        """A whole number at least the registry's minimum for `name` (settings.py), or None if unset."""
        value = self.text(name)
        if value is None:
            return None
        minimum = int(settings.BY_NAME[name].least)
        if not (value.isascii() and value.isdigit()) or int(value) < minimum:
            wanted = "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}"
            raise ConfigError(f"{name} must be {wanted}, got {value!r}")
        return int(value)

    @cached_property
    def spec(self) -> Optional[Cluster]:
        """CLUSTER_SPEC if set, else TF_CONFIG if set: Vertex AI sets both, and they agree."""
        for variable in ("CLUSTER_SPEC", "TF_CONFIG"):
            text = self.text(variable)
            if text is not None:
                return parse_cluster(variable, text)
        return None


def _rank_pair(env: _Environment, rank_name: str, size_name: str) -> Optional[tuple[int, int]]:
    """(rank, size) from two variables; None if neither is set."""
    rank = env.integer(rank_name)
    size = env.integer(size_name)
    if rank is None and size is None:
        return None
    if rank is None or size is None:
        present, missing = (rank_name, size_name) if size is None else (size_name, rank_name)
        raise ConfigError(f"{present} is set but {missing} is not set; set both")
    if rank >= size:
        raise ConfigError(f"{rank_name}={rank} must be less than {size_name}={size}")
    return rank, size


def _local_placement(env: _Environment) -> tuple[int, int]:
    """(local rank, processes on this host), from the launcher or RS_PROCS_PER_HOST."""
    per_host = env.integer("RS_PROCS_PER_HOST")
    for rank_name, size_name in _LOCAL_VARIABLES:
        rank = env.integer(rank_name)
        size = env.integer(size_name)
        if rank is None and size is None:
            continue
        if rank is None:
            raise ConfigError(f"{size_name} is set but {rank_name} is not set; set both")
        if size is None:
            if per_host is None:
                raise ConfigError(f"{rank_name} is set but {size_name} is not set; set {size_name} "
                                  f"or RS_PROCS_PER_HOST to the number of processes on this host")
            size, size_name = per_host, "RS_PROCS_PER_HOST"
        elif per_host is not None and per_host != size:
            raise ConfigError(f"RS_PROCS_PER_HOST={per_host} contradicts {size_name}={size}")
        if rank >= size:
            raise ConfigError(f"{rank_name}={rank} must be less than {size_name}={size}")
        return rank, size
    if per_host is None or per_host == 1:
        return 0, 1
    raise ConfigError(f"RS_PROCS_PER_HOST={per_host} puts several processes on this host, but none of "
                      f"LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK or HOROVOD_LOCAL_RANK says which one this is")


def _worker_task(spec: Cluster) -> Task:
    """This process's task in the spec; an error if it is a reducer or an evaluator."""
    task = spec.require_task()
    if task.role == "reducer":
        raise ConfigError(f"{spec.variable}: task type {task.type!r} is a reducer (the {spec.reducer_pool} "
                          f"pool), not a worker; run `reduction-server serve` there")
    if task.role == "evaluator":
        raise ConfigError(f"{spec.variable}: task type {task.type!r} is an evaluator, not a worker; "
                          f"evaluators take no part in the all-reduce")
    return task


def _worker_rank(env: _Environment, local_rank: int, local_world_size: int) -> tuple[int, int, str]:
    """(rank, world size, deciding variable), first match wins."""
    explicit = _rank_pair(env, "RS_RANK", "RS_WORLD_SIZE")
    if explicit is not None:
        return explicit[0], explicit[1], "RS_RANK"
    spec = env.spec
    if spec is not None:
        task = _worker_task(spec)
        # Specs list hosts; each process on a host is its own rank, numbered host by host.
        return (task.position * local_world_size + local_rank, spec.hosts * local_world_size, spec.variable)
    for rank_name, size_name in _LAUNCHER_VARIABLES:
        pair = _rank_pair(env, rank_name, size_name)
        if pair is not None:
            return pair[0], pair[1], rank_name
    raise ConfigError("no rank for this worker: set RS_RANK and RS_WORLD_SIZE, or run it where CLUSTER_SPEC, "
                      "TF_CONFIG, RANK/WORLD_SIZE, HOROVOD_RANK/HOROVOD_SIZE or "
                      "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE is set")


def _reducer_addresses(env: _Environment) -> tuple[str, tuple[tuple[str, int], ...]]:
    """(where the list came from, [(host, port)] in reducer-index order)."""
    text = env.text("RS_REDUCERS")
    if text is not None:
        return "RS_REDUCERS", address_list("RS_REDUCERS", text.split(","))
    spec = env.spec
    if spec is None:
        raise ConfigError("RS_REDUCERS is not set and neither CLUSTER_SPEC nor TF_CONFIG is, so there are "
                          "no reducer addresses; set RS_REDUCERS to host:port,host:port,...")
    if not spec.reducers:
        raise ConfigError(f"RS_REDUCERS is not set and {spec.variable} has no {spec.reducer_pool} pool "
                          f"(the reducers); add that pool to the job or set RS_REDUCERS")
    where = f"{spec.variable} cluster.{spec.reducer_pool}"
    return where, address_list(where, spec.reducers)


def _reducer_world_size(env: _Environment) -> Optional[int]:
    world_size = env.integer("RS_WORLD_SIZE")
    if world_size is not None:
        return world_size
    spec = env.spec
    if spec is None:
        return None
    # A reducer host has no LOCAL_WORLD_SIZE of its own: the workers' count comes from the job.
    return spec.hosts * (env.integer("RS_PROCS_PER_HOST") or 1)


def _identity(env: _Environment) -> tuple[str, int, int]:
    """(job token, job id, generation): what every process of one job shares."""
    token = settings.read("RS_JOB_TOKEN", env.environ)
    generation = env.integer("RS_GENERATION")
    return token, _job_id(env, token), generation or 0


def _job_id(env: _Environment, token: str) -> int:
    text = env.text("RS_JOB_ID")
    if text is not None:
        if _JOB_ID_NUMBER.fullmatch(text):
            value = int(text, 16) if text[:2].lower() == "0x" else int(text)
            if value >= 1 << 64:
                raise ConfigError(f"RS_JOB_ID={text} does not fit in 64 bits")
            return value
        return _hash64(text)
    cloud_job = env.text("CLOUD_ML_JOB_ID")
    if cloud_job is not None:
        return _hash64(cloud_job)
    spec = env.spec if env.text("CLUSTER_SPEC") is not None else None
    if spec is not None and spec.job is not None:
        # Canonical JSON, so key order in the variable cannot change the id.
        return _hash64(json.dumps(spec.job, sort_keys=True, separators=(",", ":")))
    return job_id_from(token)


def _hash64(text: str) -> int:
    """blake2b-64 of the UTF-8 text, read big-endian (so it equals int(hexdigest, 16))."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "big")
