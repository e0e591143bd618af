"""Where this process sits in the job, read from its environment (docs/design.md, "Roles").

A worker learns its rank, the world size and the reducers' addresses; a reducer learns its
index and the port it listens on. Sources, first match wins:

1. explicit variables: RS_RANK and RS_WORLD_SIZE, RS_REDUCER_INDEX, RS_REDUCERS;
2. CLUSTER_SPEC: Vertex AI's pools workerpool0..workerpool3, or AI Platform's custom-container
   form with master/worker/ps/evaluator;
3. TF_CONFIG: chief (or master), worker, ps, evaluator;
4. the launcher's variables: RANK/WORLD_SIZE (torchrun, DeepSpeed's launcher, Ray Train, PyTorchJob),
   HOROVOD_RANK/HOROVOD_SIZE, OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE (Open MPI),
   PMI_RANK/PMI_SIZE (MPICH, Intel MPI), SLURM_PROCID/SLURM_NTASKS (srun, in a job step only).

The place on the host (local rank, processes on this host) comes from the first of LOCAL_RANK
(LOCAL_WORLD_SIZE, or DeepSpeed's LOCAL_SIZE), OMPI_COMM_WORLD_LOCAL_*, HOROVOD_LOCAL_*,
MPI_LOCALRANKID/MPI_LOCALNRANKS and SLURM_LOCALID (this node's entry of SLURM_TASKS_PER_NODE, or
SLURM_NTASKS_PER_NODE) that is set, else RS_PROCS_PER_HOST; what none of them says is unknown
(None). Only a cluster spec needs it, to number each host's processes; elsewhere (torch hands the
backend its rank, a launcher names it) a missing local size is no error: Lightning's launcher, for
one, sets LOCAL_RANK alone. Shared memory needs none of it: each reducer's address and handshake
say whether it shares this host (client/engine/slots.py).

The cluster specs are parsed in cluster_spec.py. Anything malformed or contradictory, and anything
missing that is needed, is a ConfigError naming the variable: a wrong guess here would hang or
silently corrupt a whole job.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Optional

from ..errors import ConfigError
from ..job_token import job_id as job_id_of_token
from . import settings
from .cluster_spec import Cluster, Task, address_list, join_address, parse_address, parse_cluster

__all__ = [
    "ReducerPlace",
    "WorkerPlace",
    "discover_reducer",
    "discover_reducers",
    "discover_worker",
    "job_id_from",
    "parse_address",
    "run_id",
]

# (local rank, its sizes: the first set counts), highest priority first. A launcher's local size
# is read only beside its own local rank: under `sbatch`, Lightning's LOCAL_RANK must not meet
# Slurm's counts of another launch.
_LOCAL_VARIABLES = (
    ("LOCAL_RANK", ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")),
    ("OMPI_COMM_WORLD_LOCAL_RANK", ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    ("HOROVOD_LOCAL_RANK", ("HOROVOD_LOCAL_SIZE",)),
    ("MPI_LOCALRANKID", ("MPI_LOCALNRANKS",)),
    ("SLURM_LOCALID", ("SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")),
)
# (rank, size) pairs, highest priority first.
_LAUNCHER_VARIABLES = (
    ("RANK", "WORLD_SIZE"),
    ("HOROVOD_RANK", "HOROVOD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
)
#: srun sets it in every task of a job step; an sbatch script's own process has SLURM_PROCID=0 and
#: the whole job's SLURM_NTASKS too, and is no rank of anything: SLURM_* count only in a step
_SLURM_STEP = "SLURM_STEP_ID"
_TASKS_PER_NODE = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")

#: what names one run of the job, the same on all its ranks and another on the next run, highest
#: priority first; a tuple's values are joined (a Slurm step: its job's id and its own)
_RUN_VARIABLES = (
    ("RS_RUN_ID",),  # the user's, or `reduction-server run`'s (a fresh one per start of its workers)
    ("TORCHELASTIC_RUN_ID",),  # torchrun's --rdzv-id (--standalone: a fresh one per launch)
    ("SLURM_JOB_ID", _SLURM_STEP),
    ("CLOUD_ML_JOB_ID",),  # Vertex AI's job
)

_JOB_ID_NUMBER = re.compile(r"[0-9]+|0[xX][0-9A-Fa-f]+")


@dataclass(frozen=True)
class WorkerPlace:
    """A worker process's place in the job."""

    rank: int
    world_size: int
    reducers: tuple[str, ...]  # "host:port" ("[v6]:port"), in reducer-index order
    local_rank: Optional[int]  # which of this host's processes this is: picks the device; None: unknown
    local_world_size: Optional[int]  # processes on this host; None: unknown (nothing here needs it)
    job_token: str  # RS_JOB_TOKEN, or "" for no authentication
    job_id: int  # unsigned 64-bit, the same in every process of the job
    generation: int  # RS_GENERATION: bumped when a job restarts, so stale peers are refused
    source: str  # the variable that decided rank and world size ("argument": the caller gave them)


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


def discover_worker(
    environ: Optional[Mapping[str, str]] = None, *, rank: Optional[int] = None, world_size: Optional[int] = None
) -> WorkerPlace:
    """This worker's rank, world size and reducers, from `environ` (default os.environ).
    `rank` and `world_size`: what a framework knows already (torch hands them to the backend);
    they win over every variable, as RS_RANK/RS_WORLD_SIZE do, and source is then "argument"."""
    env = _Environment(environ)
    if env.text("RS_REDUCER_INDEX") is not None:
        raise ConfigError("RS_REDUCER_INDEX is set: this process is a reducer, not a worker")
    given = rank is not None or world_size is not None
    if given and (rank is None or world_size is None or not 0 <= rank < world_size):
        raise ConfigError(f"rank={rank}, world_size={world_size}: give both, with 0 <= rank < world_size")
    if not given and env.text("RS_RANK") is None and env.spec is not None:
        _worker_task(env.spec)  # first: a reducer would otherwise hear about LOCAL_RANK
    local = _local_placement(env)
    if given:
        source, (local_rank, local_world_size) = "argument", (local.rank, local.size)
    else:
        rank, world_size, source, (local_rank, local_world_size) = _worker_rank(env, local)
    _, reducers = _reducer_addresses(env)
    token, job_id, generation = _identity(env)
    # A worker group that torchrun's agent (or `run --max-restarts`) started again is a new
    # generation: the reducers then drop the rounds and lost ranks of the one before.
    generation += env.integer("TORCHELASTIC_RESTART_COUNT") or 0
    return WorkerPlace(
        rank=rank,
        world_size=world_size,
        reducers=tuple(join_address(h, p) for h, p in reducers),
        local_rank=local_rank,
        local_world_size=local_world_size,
        job_token=token,
        job_id=job_id,
        generation=generation,
        source=source,
    )


def discover_reducers(environ: Optional[Mapping[str, str]] = None) -> tuple[str, ...]:
    """The reducers' addresses alone: what a job's unique id carries before ranks are known."""
    _, reducers = _reducer_addresses(_Environment(environ))
    return tuple(join_address(h, p) for h, p in reducers)


def job_id_from(token: str) -> int:
    """The id of a job known only by its token (0 without one), as discover_worker derives it:
    a slow function of the token (job_token.py), since the id travels in clear."""
    return job_id_of_token(token)


def run_id(environ: Optional[Mapping[str, str]] = None) -> str:
    """This run of the job as its launcher names it (_RUN_VARIABLES), "" when none does. A worker
    says it in its HELLOs: a reducer tells a rerun of a job (same id and generation) from a late
    rank of the run before by it (reducer/membership.py)."""
    env = _Environment(environ)
    for names in _RUN_VARIABLES:
        values = [env.text(name) for name in names]
        if None not in values:
            return ".".join(values)
    return ""


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
    return ReducerPlace(
        index=index,
        num_reducers=len(reducers),
        host=env.text("RS_BIND_HOST") or "0.0.0.0",
        port=reducers[index][1],
        world_size=_reducer_world_size(env),
        job_token=token,
        job_id=job_id,
        generation=generation,
        source=source,
    )


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


@dataclass(frozen=True)
class _Local:
    """This process's place on its host as the environment says it; None where it does not."""

    rank: Optional[int]
    size: Optional[int]
    rank_name: str  # the variables that said so (or would have), for messages
    size_name: str

    def for_cluster_spec(self) -> tuple[int, int]:
        """(local rank, processes on this host) to number each host's processes under a cluster
        spec, where they are needed: one process per host unless something says more."""
        if self.rank is None:
            if self.size is None or self.size == 1:
                return 0, 1
            if self.size_name == "RS_PROCS_PER_HOST":
                names = ", ".join(rank for rank, _ in _LOCAL_VARIABLES)
                raise ConfigError(
                    f"RS_PROCS_PER_HOST={self.size} puts several processes on this host, but none "
                    f"of {names} says which one this is"
                )
            raise ConfigError(f"{self.size_name} is set but {self.rank_name} is not set; set both")
        if self.size is None:
            raise ConfigError(
                f"{self.rank_name} is set but {self.size_name} is not set; set {self.size_name} "
                f"or RS_PROCS_PER_HOST to the number of processes on this host"
            )
        return self.rank, self.size


def _local_placement(env: _Environment) -> _Local:
    """This process's local rank and the processes on its host, from the launcher's variables or
    RS_PROCS_PER_HOST; either may be unknown (None). Malformed or contradictory values are errors."""
    per_host = env.integer("RS_PROCS_PER_HOST")
    in_step = env.text(_SLURM_STEP) is not None
    for rank_name, size_names in _LOCAL_VARIABLES:
        if rank_name.startswith("SLURM_") and not in_step:
            continue
        rank = env.integer(rank_name)
        size, size_name = _local_size(env, size_names)
        if rank is None and size is None:
            continue
        if per_host is not None and size is None:
            size, size_name = per_host, "RS_PROCS_PER_HOST"
        elif per_host is not None and per_host != size:
            raise ConfigError(f"RS_PROCS_PER_HOST={per_host} contradicts {size_name}={size}")
        if rank is not None and size is not None and rank >= size:
            raise ConfigError(f"{rank_name}={rank} must be less than {size_name}={size}")
        return _Local(rank, size, rank_name, size_name or size_names[0])
    return _Local(None, per_host, _LOCAL_VARIABLES[0][0], "RS_PROCS_PER_HOST")


def _local_size(env: _Environment, names: tuple[str, ...]) -> tuple[Optional[int], Optional[str]]:
    """The first of `names` that gives this host's process count, and its name; (None, None)."""
    for name in names:
        size = _slurm_tasks_here(env) if name == "SLURM_TASKS_PER_NODE" else env.integer(name)
        if size is not None:
            return size, name
    return None, None


def _slurm_tasks_here(env: _Environment) -> Optional[int]:
    """This node's entry of SLURM_TASKS_PER_NODE ("2(x3),1": three nodes of 2 tasks, one of 1),
    the node picked by SLURM_NODEID; None if unset, or if the entries differ and no SLURM_NODEID says."""
    text = env.text("SLURM_TASKS_PER_NODE")
    if text is None:
        return None
    runs = []  # (tasks, nodes)
    for part in text.split(","):
        match = _TASKS_PER_NODE.fullmatch(part.strip())
        if match is None or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
            raise ConfigError(f"SLURM_TASKS_PER_NODE={text!r} is not a list of task counts per node such as 2(x3),1")
        runs.append((int(match.group(1)), int(match.group(2) or 1)))
    if len({tasks for tasks, _ in runs}) == 1:
        return runs[0][0]
    node = env.integer("SLURM_NODEID")
    if node is None:
        return None
    for tasks, nodes in runs:
        if node < nodes:
            return tasks
        node -= nodes
    raise ConfigError(
        f"SLURM_NODEID={env.integer('SLURM_NODEID')} is out of range: SLURM_TASKS_PER_NODE={text} "
        f"lists {sum(nodes for _, nodes in runs)} node(s)"
    )


def _worker_task(spec: Cluster) -> Task:
    """This process's task in the spec; an error if it is a reducer or an evaluator."""
    task = spec.require_task()
    if task.role == "reducer":
        raise ConfigError(
            f"{spec.variable}: task type {task.type!r} is a reducer (the {spec.reducer_pool} "
            f"pool), not a worker; run `reduction-server serve` there"
        )
    if task.role == "evaluator":
        raise ConfigError(
            f"{spec.variable}: task type {task.type!r} is an evaluator, not a worker; "
            f"evaluators take no part in the all-reduce"
        )
    return task


def _worker_rank(env: _Environment, local: _Local) -> tuple[int, int, str, tuple[Optional[int], Optional[int]]]:
    """(rank, world size, deciding variable, (local rank, local size)), first match wins."""
    explicit = _rank_pair(env, "RS_RANK", "RS_WORLD_SIZE")
    if explicit is not None:
        return explicit[0], explicit[1], "RS_RANK", (local.rank, local.size)
    spec = env.spec
    if spec is not None:
        task = _worker_task(spec)
        # Specs list hosts; each process on a host is its own rank, numbered host by host.
        local_rank, local_size = local.for_cluster_spec()
        return (
            task.position * local_size + local_rank,
            spec.hosts * local_size,
            spec.variable,
            (local_rank, local_size),
        )
    in_step = env.text(_SLURM_STEP) is not None
    for rank_name, size_name in _LAUNCHER_VARIABLES:
        if rank_name.startswith("SLURM_") and not in_step:
            continue
        pair = _rank_pair(env, rank_name, size_name)
        if pair is not None:
            return pair[0], pair[1], rank_name, (local.rank, local.size)
    raise ConfigError(
        "no rank for this worker: set RS_RANK and RS_WORLD_SIZE, or run it where CLUSTER_SPEC, "
        "TF_CONFIG, RANK/WORLD_SIZE, HOROVOD_RANK/HOROVOD_SIZE, "
        "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE, PMI_RANK/PMI_SIZE or (in an srun step) "
        "SLURM_PROCID/SLURM_NTASKS is set"
    )


def _reducer_addresses(env: _Environment) -> tuple[str, tuple[tuple[str, int], ...]]:
    """(where the list came from, [(host, port)] in reducer-index order)."""
    text = env.text("RS_REDUCERS")
    if text is not None:
        return "RS_REDUCERS", address_list("RS_REDUCERS", text.split(","))
    spec = env.spec
    if spec is None:
        raise ConfigError(
            "RS_REDUCERS is not set and neither CLUSTER_SPEC nor TF_CONFIG is, so there are "
            "no reducer addresses; set RS_REDUCERS to host:port,host:port,..."
        )
    if not spec.reducers:
        raise ConfigError(
            f"RS_REDUCERS is not set and {spec.variable} has no {spec.reducer_pool} pool "
            f"(the reducers); add that pool to the job or set RS_REDUCERS"
        )
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
