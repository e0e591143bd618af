"""Every setting the project reads from the environment, declared once: its type, default, range,
who reads it and what it means (VARIABLES), and the one way to read it (`read`).

A value that is not of its type, or out of its range, is a ConfigError naming the variable. The
The table of variables in docs/configuration.md and each subcommand's --help are made from this registry. Why a
default is what it is: the comments here, and the figures in bench/RESULTS.md.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from ..errors import ConfigError

MiB = 1 << 20

# -- defaults and limits ---------------------------------------------------------------------
#: bytes per chunk a collective is cut into at most (each chunk goes to one reducer)
DEFAULT_CHUNK_BYTES = 4 * MiB
#: chunks a worker keeps in flight per reducer: send, sum and receive overlap
DEFAULT_WINDOW = 4
#: chunks per reducer a collective is cut into at least (chunks stay >= 64 KiB). A reducer answers
#: a chunk once every rank's copy has arrived, so a collective's download trails its upload by a
#: few chunks per reducer and takes about S/B x (1 + 4/depth) on links: deeper runs links better,
#: and each chunk costs CPU (bench/RESULTS.md, "Emulated network" and "Tuning settings")
DEFAULT_PIPELINE_DEPTH = 32
#: the depth `reduction-server run` gives its ranks: on one host the CPU is the limit, not a link,
#: and chunks half as large cost up to a third of small collectives' speed there
ONE_HOST_PIPELINE_DEPTH = 8
MAX_PIPELINE_DEPTH = 1024
#: the reducer never blocks on one peer (its sends are non-blocking), so a worker's unanswered
#: chunks must stay well under libzmq's per-peer queue of 1000 messages
MAX_WINDOW = 256
#: RS_SNDBUF: a small send buffer caps the bytes each TCP flow has in flight, so the flows sharing a
#: shaped, deep-buffered link take turns; it also caps a flow at about 2 x RS_SNDBUF per round
#: trip, which slows loopback and fast links (bench/RESULTS.md, "Tuning settings"). So by default
#: (`auto`, SNDBUF_AUTO) each connection's, a worker's and a reducer's, starts at a few of its
#: segments where they are Ethernet-sized and follows what it measures (send_buffers.py); 0
#: leaves every buffer to the kernel's autotuning; a size fixes them all. The kernel cuts a size
#: to net.core.wmem_max, then doubles it
SNDBUF_AUTO = -1
MIN_SNDBUF = 4096
MAX_SNDBUF = 1 << 30
#: seconds a collective may wait for its results before it fails
DEFAULT_TIMEOUT = 300.0
#: seconds between heartbeats (PING) that workers and reducers send each other
DEFAULT_HEARTBEAT_INTERVAL = 1.0
#: seconds of silence after which a peer is lost (a process that dies is noticed at once: its
#: connection closes; this covers silent losses)
DEFAULT_LIVENESS_TIMEOUT = 5.0
#: seconds a worker waits for every reducer to admit it
DEFAULT_CONNECT_TIMEOUT = 120.0
#: largest chunk a reducer accepts (a client claiming more is refused, not allocated)
DEFAULT_MAX_CHUNK_BYTES = 64 * MiB
#: accumulator memory a reducer may hold at once
DEFAULT_MAX_ACCUMULATOR_BYTES = 4096 * MiB
#: reducer memory one rank may account for: the accumulators its contributions were loaded into
#: and, in deterministic mode, its contributions held for their turn. A rank has at most RS_WINDOW
#: chunks unanswered per reducer and group, so a well-behaved one using one group at a time needs
#: at most 2 x window x chunk (32 MiB with the defaults; 2 GiB covers the largest window, 256, with
#: 4 MiB chunks)
DEFAULT_MAX_PEER_BYTES = 2048 * MiB
#: rounds (one chunk of one collective) in flight on a reducer for its job: ranks send in one
#: order, so a well-behaved job has at most RS_WINDOW (<= MAX_WINDOW) open per reducer and group
DEFAULT_MAX_ROUNDS = 1024
#: connections a reducer keeps that have not said HELLO (a worker's says it within milliseconds):
#: past it the oldest is closed (reducer/arrivals.py), and it reconnects. It also bounds what
#: strangers make a reducer buffer before the token is proved: libzmq takes a frame of up to
#: RS_MAX_CHUNK_BYTES on each such connection (docs/reliability.md)
DEFAULT_MAX_UNGREETED = 128
#: seconds a connection may stay without saying HELLO before the reducer closes it
DEFAULT_HELLO_TIMEOUT = 10.0
#: seconds a reducer told to stop (SIGTERM) drains before it exits whatever it holds
DEFAULT_DRAIN_TIMEOUT = 10.0
#: shards one `serve` may run (each a process with its own port)
MAX_SHARDS = 256
#: bytes per fused bucket of all-reduces (Horovod's default)
DEFAULT_FUSION_THRESHOLD = 64 * MiB
#: milliseconds between the Horovod API's negotiation cycles (Horovod's default)
DEFAULT_CYCLE_TIME_MS = 1.0
#: elements per block of the int8 wire format (wire/formats.py): a power of two in this range
DEFAULT_INT8_BLOCK, MIN_INT8_BLOCK, MAX_INT8_BLOCK = 256, 32, 1 << 16
LOG_LEVELS = ("DEBUG", "INFO", "NOTICE", "WARNING", "ERROR", "CRITICAL")

# -- the registry ----------------------------------------------------------------------------
WORKERS, REDUCERS, LAUNCHER, BENCH = "workers", "reducers", "launcher", "bench"
_BOTH = (WORKERS, REDUCERS)


@dataclass(frozen=True)
class Variable:
    """One environment variable: who reads it, what it means, and its type, default and range.

    `kind` is int, float, bool (a switch) or str; the variables of where each process sits
    (addresses, ranks, job identities) are parsed by discovery.py and cluster_spec.py and have no `value`."""

    name: str
    readers: Tuple[str, ...]
    default: str  # in words, for docs/configuration.md and --help
    meaning: str
    kind: type = str
    value: Any = None  # the default value
    least: Optional[float] = None
    most: Optional[float] = None
    exact: bool = False  # a str read as it is, spaces included (a secret): only "" means unset


def _bytes(value: int) -> str:
    return f"{value >> 30} GiB" if value >= 1 << 30 and not value % (1 << 30) else f"{value >> 20} MiB"


def _seconds(value: float) -> str:
    return f"{value:g} s"


VARIABLES: Tuple[Variable, ...] = (
    # where each process sits (discovery.py)
    Variable(
        "RS_REDUCERS",
        _BOTH,
        "from the cluster spec",
        "reducer addresses, `host:port,...`; reducer i is the i-th (a reducer without an index finds its own)",
    ),
    Variable("RS_RANK", (WORKERS,), "from the spec or launcher", "this worker's rank", int, least=0),
    Variable("RS_WORLD_SIZE", _BOTH, "from the spec or launcher", "number of worker ranks W", int, least=1),
    Variable(
        "RS_REDUCER_INDEX",
        (REDUCERS,),
        "from the spec",
        "this reducer's index: its position in `RS_REDUCERS`",
        int,
        least=0,
    ),
    Variable("RS_BIND_HOST", (REDUCERS,), "`0.0.0.0`", "address a discovered reducer binds", value="0.0.0.0"),
    Variable("RS_PROCS_PER_HOST", _BOTH, "1", "processes per worker host under a cluster spec", int, least=1),
    Variable(
        "RS_JOB_TOKEN",
        (*_BOTH, LAUNCHER),
        "none (`run`: a random one)",
        "the job's shared secret, random (`openssl rand -hex 16`): every worker and every reducer proves it "
        "to the other before any data moves",
        value="",
        exact=True,
    ),
    Variable("RS_JOB_ID", _BOTH, "from the job", "job identity; a reducer serves one job at a time"),
    Variable(
        "RS_GENERATION", _BOTH, "0", "job generation; a newer one replaces an older one on the reducers", int, least=0
    ),
    Variable(
        "RS_RUN_ID",
        (WORKERS, LAUNCHER),
        "from the launcher (`run`: a fresh one per start of its workers)",
        "this run of the job, the same on all its ranks: a reducer that remembers another run of the same job "
        "and generation starts afresh for it (else `TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID`.`SLURM_STEP_ID`, "
        "`CLOUD_ML_JOB_ID`)",
    ),
    Variable("TORCHELASTIC_RUN_ID", (WORKERS,), "-", "torchrun's `--rdzv-id`: the run id after `RS_RUN_ID`"),
    Variable("SLURM_JOB_ID", (WORKERS,), "-", "with `SLURM_STEP_ID`, srun's job step: the run id after those above"),
    Variable(
        "TORCHELASTIC_RESTART_COUNT",
        (WORKERS,),
        "0",
        "how many times torchrun's agent (or `run "
        "--max-restarts`) restarted the workers: added to a worker's `RS_GENERATION`",
        int,
        least=0,
    ),
    # the launchers' variables a worker honours, in this order of precedence (after RS_RANK / RS_WORLD_SIZE)
    Variable(
        "RS_RENDEZVOUS",
        (WORKERS,),
        "none (`run --min-np/--max-np`: the launcher's)",
        "host:port of an elastic job's rendezvous: Horovod's init() takes its rank, size and generation there",
        value="",
    ),
    Variable(
        "RS_WORKER_ID",
        (WORKERS,),
        "from `run --min-np/--max-np`",
        "an elastic job's id of this worker process, for its whole life",
        int,
        0,
        0,
    ),
    Variable("RANK", (WORKERS,), "-", "torchrun's (and a PyTorchJob's) rank", int, least=0),
    Variable("WORLD_SIZE", (WORKERS,), "-", "torchrun's world size", int, least=1),
    Variable("HOROVOD_RANK", (WORKERS,), "-", "horovodrun's rank", int, least=0),
    Variable("HOROVOD_SIZE", (WORKERS,), "-", "horovodrun's world size", int, least=1),
    Variable("OMPI_COMM_WORLD_RANK", (WORKERS,), "-", "mpirun's rank", int, least=0),
    Variable("OMPI_COMM_WORLD_SIZE", (WORKERS,), "-", "mpirun's world size", int, least=1),
    Variable(
        "LOCAL_RANK",
        (WORKERS,),
        "-",
        "this process's index on its host (torchrun); with a cluster spec, several processes per host",
        int,
        least=0,
    ),
    Variable("LOCAL_WORLD_SIZE", (WORKERS,), "-", "processes on this host (torchrun)", int, least=1),
    Variable("OMPI_COMM_WORLD_LOCAL_RANK", (WORKERS,), "-", "mpirun's LOCAL_RANK", int, least=0),
    Variable("OMPI_COMM_WORLD_LOCAL_SIZE", (WORKERS,), "-", "mpirun's LOCAL_WORLD_SIZE", int, least=1),
    Variable("HOROVOD_LOCAL_RANK", (WORKERS,), "-", "horovodrun's LOCAL_RANK", int, least=0),
    Variable("HOROVOD_LOCAL_SIZE", (WORKERS,), "-", "horovodrun's LOCAL_WORLD_SIZE", int, least=1),
    Variable(
        "LOCAL_SIZE",
        (WORKERS,),
        "-",
        "DeepSpeed's launcher's LOCAL_WORLD_SIZE (after `LOCAL_WORLD_SIZE`)",
        int,
        least=1,
    ),
    Variable("PMI_RANK", (WORKERS,), "-", "MPICH's and Intel MPI's rank (mpiexec)", int, least=0),
    Variable("PMI_SIZE", (WORKERS,), "-", "MPICH's and Intel MPI's world size", int, least=1),
    Variable("MPI_LOCALRANKID", (WORKERS,), "-", "MPICH's and Intel MPI's LOCAL_RANK", int, least=0),
    Variable("MPI_LOCALNRANKS", (WORKERS,), "-", "MPICH's and Intel MPI's LOCAL_WORLD_SIZE", int, least=1),
    Variable(
        "SLURM_STEP_ID",
        (WORKERS,),
        "-",
        "set by srun in each task of a job step: the `SLURM_*` below count "
        "only there (an sbatch script has SLURM_PROCID=0 and the whole job's SLURM_NTASKS too)",
    ),
    Variable("SLURM_PROCID", (WORKERS,), "-", "srun's rank", int, least=0),
    Variable("SLURM_NTASKS", (WORKERS,), "-", "srun's world size", int, least=1),
    Variable("SLURM_LOCALID", (WORKERS,), "-", "srun's LOCAL_RANK", int, least=0),
    Variable(
        "SLURM_NODEID",
        (WORKERS,),
        "-",
        "srun's index of this node: picks its entry of `SLURM_TASKS_PER_NODE`",
        int,
        least=0,
    ),
    Variable(
        "SLURM_TASKS_PER_NODE",
        (WORKERS,),
        "-",
        "srun's tasks on each node, `2(x3),1`: this node's entry is its LOCAL_WORLD_SIZE",
    ),
    Variable(
        "SLURM_NTASKS_PER_NODE",
        (WORKERS,),
        "-",
        "`--ntasks-per-node`: LOCAL_WORLD_SIZE where `SLURM_TASKS_PER_NODE` does not say",
        int,
        least=1,
    ),
    Variable("CLUSTER_SPEC", _BOTH, "-", "Vertex AI's job layout (JSON): pools, and this process's task"),
    Variable("TF_CONFIG", _BOTH, "-", "TensorFlow's job layout (JSON): chief, worker, ps, and this task"),
    # how a collective moves
    Variable(
        "RS_CHUNK_BYTES",
        (WORKERS, BENCH),
        _bytes(DEFAULT_CHUNK_BYTES),
        "largest chunk a collective is cut into (the same on every rank)",
        int,
        DEFAULT_CHUNK_BYTES,
        64,
    ),
    Variable(
        "RS_WINDOW",
        (WORKERS, BENCH),
        str(DEFAULT_WINDOW),
        "chunks in flight per reducer (and group)",
        int,
        DEFAULT_WINDOW,
        1,
        MAX_WINDOW,
    ),
    Variable(
        "RS_PIPELINE_DEPTH",
        (WORKERS, LAUNCHER, BENCH),
        f"{DEFAULT_PIPELINE_DEPTH} ({ONE_HOST_PIPELINE_DEPTH} under `reduction-server run`)",
        "chunks per reducer a collective is cut into at least (the same on every rank); deeper runs links "
        "better and costs CPU per chunk (bench/RESULTS.md)",
        int,
        DEFAULT_PIPELINE_DEPTH,
        1,
        MAX_PIPELINE_DEPTH,
    ),
    Variable(
        "RS_INT8_BLOCK",
        (WORKERS,),
        str(DEFAULT_INT8_BLOCK),
        'elements per block of `compression="int8"` (each block carries its float32 scale): a power of two, '
        "the same on every rank; the reducers read it from each chunk's size",
        int,
        DEFAULT_INT8_BLOCK,
        MIN_INT8_BLOCK,
        MAX_INT8_BLOCK,
    ),
    Variable(
        "RS_SHM",
        _BOTH,
        "1",
        "chunks between a worker and a reducer on one host go through shared memory; 0 turns it off on either side",
        bool,
        True,
    ),
    Variable(
        "RS_SNDBUF",
        (*_BOTH, BENCH),
        "`auto`: each connection's, from its segment size, round trip and delivery rate",
        "kernel send buffer (SO_SNDBUF) of each connection: `auto`, 0 (the kernel's "
        "autotuning), or bytes, 4096 and up (a fixed 16384 keeps flows in step on a shaped cloud link, and "
        "slows loopback; bench/RESULTS.md)",
        int,
        SNDBUF_AUTO,
        SNDBUF_AUTO,
        MAX_SNDBUF,
    ),  # see socket_send_buffer
    Variable("RS_IO_THREADS", (WORKERS,), "1", "libzmq I/O threads", int, 1, 1),
    # time limits
    Variable(
        "RS_TIMEOUT",
        _BOTH,
        _seconds(DEFAULT_TIMEOUT),
        "a collective waiting longer fails on every rank, naming who had and had not contributed",
        float,
        DEFAULT_TIMEOUT,
        0.01,
    ),
    Variable(
        "RS_HEARTBEAT_INTERVAL",
        _BOTH,
        _seconds(DEFAULT_HEARTBEAT_INTERVAL),
        "how often workers and reducers ping each other",
        float,
        DEFAULT_HEARTBEAT_INTERVAL,
        0.01,
    ),
    Variable(
        "RS_LIVENESS_TIMEOUT",
        _BOTH,
        _seconds(DEFAULT_LIVENESS_TIMEOUT),
        "silence after which a peer is lost (a closed connection is seen at once)",
        float,
        DEFAULT_LIVENESS_TIMEOUT,
        0.05,
    ),
    Variable(
        "RS_FAILOVER",
        (WORKERS,),
        "1",
        "a lost reducer's chunks move to the reducers left and collectives "
        "complete (each rank keeps a copy of its last results per reducer); 0: they fail, naming it",
        bool,
        True,
    ),
    Variable(
        "RS_SPARE_REDUCERS",
        (WORKERS,),
        "0",
        "how many of `RS_REDUCERS`, the last ones, are spares: unused "
        "until a reducer is lost, then they take its chunks from a collective every rank agrees on",
        int,
        0,
        0,
    ),
    Variable(
        "RS_CONNECT_TIMEOUT",
        (WORKERS,),
        _seconds(DEFAULT_CONNECT_TIMEOUT),
        "how long a worker waits for every reducer to admit it (it says what it waits for every few seconds)",
        float,
        DEFAULT_CONNECT_TIMEOUT,
        0.01,
    ),
    # security
    Variable(
        "RS_ENCRYPT",
        (*_BOTH, BENCH),
        "0",
        "1: every connection encrypted with CurveZMQ, keys derived from `RS_JOB_TOKEN`",
        bool,
        False,
    ),
    Variable(
        "RS_INTEGRITY",
        (*_BOTH, BENCH),
        "0",
        "1: every message between workers and reducers carries a Poly1305 tag (keys derived from `RS_JOB_TOKEN` "
        "and each connection's handshake), so a message altered, dropped or replayed on the way is refused by name; "
        "no secrecy, at about a fifth of `RS_ENCRYPT`'s CPU (which authenticates already: with it, this adds nothing)",
        bool,
        False,
    ),
    Variable(
        "RS_ALLOW_NO_TOKEN",
        (REDUCERS,),
        "0",
        "1: a reducer without `RS_JOB_TOKEN` starts on an address "
        "other than the loopback, where anyone who reaches it may send it data (as `serve --insecure-no-token`); "
        "0: it refuses to start",
        bool,
        False,
    ),
    # the client's adapters
    Variable(
        "RS_TORCH_AUTOLOAD",
        (WORKERS,),
        "1",
        "`import torch` registers the `reduction_server` backend (a "
        "`torch.backends` entry point; nothing more until a process asks for it); 0 turns it off, as "
        "`TORCH_DEVICE_BACKEND_AUTOLOAD=0` does for every such entry point",
        bool,
        True,
    ),
    Variable(
        "RS_FUSION_THRESHOLD",
        (WORKERS,),
        f"{_bytes(DEFAULT_FUSION_THRESHOLD)} (or `HOROVOD_FUSION_THRESHOLD`)",
        "bytes per fused bucket; 0 turns fusion off",
        int,
        DEFAULT_FUSION_THRESHOLD,
        0,
    ),
    Variable(
        "HOROVOD_FUSION_THRESHOLD",
        (WORKERS,),
        _bytes(DEFAULT_FUSION_THRESHOLD),
        "Horovod's name for `RS_FUSION_THRESHOLD` (which wins)",
        int,
        DEFAULT_FUSION_THRESHOLD,
        0,
    ),
    Variable(
        "RS_CYCLE_TIME",
        (WORKERS,),
        f"{DEFAULT_CYCLE_TIME_MS:g} ms (or `HOROVOD_CYCLE_TIME`)",
        "Horovod API: milliseconds between negotiation cycles",
        float,
        DEFAULT_CYCLE_TIME_MS,
        0.0,
        10_000.0,
    ),
    Variable(
        "HOROVOD_CYCLE_TIME",
        (WORKERS,),
        f"{DEFAULT_CYCLE_TIME_MS:g} ms",
        "Horovod's name for `RS_CYCLE_TIME` (which wins)",
        float,
        DEFAULT_CYCLE_TIME_MS,
        0.0,
        10_000.0,
    ),
    Variable("RS_TIMELINE", (WORKERS,), "off", "path of a Chrome trace of each rank's collectives", value=""),
    Variable(
        "HOROVOD_TIMELINE",
        (WORKERS,),
        "off",
        "Horovod API: a timeline path (rank 0 writes it, the others "
        "beside it, `.rank<N>`), or DYNAMIC: none until `hvd.start_timeline()`",
        value="",
    ),
    Variable(
        "HOROVOD_TIMELINE_MARK_CYCLES",
        (WORKERS,),
        "0",
        "Horovod API: 1 marks each negotiation cycle (CYCLE_START) on the timeline",
        bool,
        False,
    ),
    # the reducer
    Variable(
        "RS_SHARDS",
        (REDUCERS,),
        "`auto`: the cores it may use (`run`'s reducers: 1)",
        "reducer processes one `serve` runs, on ports `port` .. `port`+N-1, each a share of every "
        "worker's chunks; `auto` or a count",
        value="auto",
    ),
    Variable(
        "RS_LOCAL_REDUCERS",
        (REDUCERS,),
        "1 (`run` sets it to its reducers' count)",
        "reducers a launcher started on this host, which share its cores: `auto` shards count the "
        "cores this reducer may use divided by it",
        int,
        1,
        least=1,
    ),
    Variable(
        "RS_DETERMINISTIC", (REDUCERS,), "0", "1: sum in rank order, so results are bitwise reproducible", bool, False
    ),
    Variable(
        "RS_MAX_CHUNK_BYTES",
        (REDUCERS,),
        _bytes(DEFAULT_MAX_CHUNK_BYTES),
        "largest chunk accepted; larger claims are refused, not allocated",
        int,
        DEFAULT_MAX_CHUNK_BYTES,
        1024,
    ),
    Variable(
        "RS_MAX_ACCUMULATOR_BYTES",
        (REDUCERS,),
        _bytes(DEFAULT_MAX_ACCUMULATOR_BYTES),
        "accumulator memory a reducer may hold",
        int,
        DEFAULT_MAX_ACCUMULATOR_BYTES,
        1024,
    ),
    Variable(
        "RS_MAX_PEER_BYTES",
        (REDUCERS,),
        _bytes(DEFAULT_MAX_PEER_BYTES),
        "reducer memory one rank may account for",
        int,
        DEFAULT_MAX_PEER_BYTES,
        1024,
    ),
    Variable(
        "RS_MAX_ROUNDS",
        (REDUCERS,),
        str(DEFAULT_MAX_ROUNDS),
        "collective chunks in flight on a reducer",
        int,
        DEFAULT_MAX_ROUNDS,
        1,
    ),
    Variable(
        "RS_MAX_UNGREETED",
        (REDUCERS,),
        str(DEFAULT_MAX_UNGREETED),
        "connections without a HELLO a reducer keeps (the oldest is closed past it)",
        int,
        DEFAULT_MAX_UNGREETED,
        1,
    ),
    Variable(
        "RS_HELLO_TIMEOUT",
        (REDUCERS,),
        _seconds(DEFAULT_HELLO_TIMEOUT),
        "a connection that has not said HELLO by then is closed",
        float,
        DEFAULT_HELLO_TIMEOUT,
        0.1,
    ),
    Variable(
        "RS_DRAIN_TIMEOUT",
        (REDUCERS,),
        _seconds(DEFAULT_DRAIN_TIMEOUT),
        "on SIGTERM a reducer drains (its workers move its chunks, it answers what it holds) for at most "
        "this long, then exits; 0: it closes at once, as on SIGINT",
        float,
        DEFAULT_DRAIN_TIMEOUT,
        0.0,
    ),
    Variable("RS_METRICS_PORT", (REDUCERS,), "off", "serve Prometheus metrics on this port", int, 0, 0, 65535),
    Variable(
        "RS_HEALTHCHECK_PORT",
        (REDUCERS,),
        "the discovered port",
        "the image's healthcheck: the port to probe when `--port` was given on the command line",
        int,
        None,
        1,
        65535,
    ),
    # logs and benchmarks
    Variable(
        "RS_LOG_LEVEL",
        _BOTH,
        "`NOTICE`",
        ", ".join(f"`{level}`" for level in LOG_LEVELS) + "; one `event key=value` line each",
        value="NOTICE",
    ),
    Variable(
        "RS_BENCH_KERNEL_MIB",
        (BENCH,),
        "4,64",
        "`bench kernels`: accumulator sizes, MiB, comma-separated",
        value="4,64",
    ),
)
BY_NAME: Dict[str, Variable] = {v.name: v for v in VARIABLES}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def read(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The value of a declared variable: parsed as its kind, checked against its range, or its
    default when unset or empty; a ConfigError names the variable otherwise."""
    var = BY_NAME[name]
    environ = os.environ if environ is None else environ
    if var.exact:
        return environ.get(name) or var.value
    raw = environ.get(name, "").strip()
    if not raw:
        return var.value
    if var.kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ConfigError(f"{name}={environ[name]!r} is not a switch; use 1 or 0 (true/false, yes/no, on/off)")
    if var.kind is str:
        return raw
    try:
        value = var.kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {var.kind.__name__}") from None
    if var.least is not None and value < var.least:
        raise ConfigError(f"{name}={raw!r} must be at least {var.least}")
    if var.most is not None and value > var.most:
        raise ConfigError(f"{name}={raw!r} must be at most {var.most}")
    return value


def first_set(names: Tuple[str, ...], environ: Optional[Mapping[str, str]] = None) -> Any:
    """The first of `names` that is set (RS_FUSION_THRESHOLD before HOROVOD_FUSION_THRESHOLD),
    read as itself; the first one's default when none is."""
    environ = os.environ if environ is None else environ
    for name in names:
        if environ.get(name, "").strip():
            return read(name, environ)
    return BY_NAME[names[0]].value


def variables_read_by(*readers: str) -> List[Variable]:
    """The registry's variables that any of `readers` reads, in the registry's order."""
    return [v for v in VARIABLES if set(v.readers) & set(readers)]


def markdown_table() -> str:
    """The table of variables of docs/configuration.md, made from the registry."""
    rows = ["| variable | who reads it | default | meaning |", "| --- | --- | --- | --- |"]
    for v in VARIABLES:
        who = "both" if set(_BOTH) <= set(v.readers) else ", ".join(r for r in v.readers if r != BENCH) or "bench"
        rows.append(f"| `{v.name}` | {who} | {v.default} | {v.meaning} |")
    return "\n".join(rows)


#: the settings that tune how a collective moves (and RS_ENCRYPT, what protects it): what `bench
#: netem` passes to its emulated hosts and `--variant` may set
TUNING = tuple(v.name for v in variables_read_by(BENCH) if v.name.startswith("RS_") and v.kind in (int, bool))


def tuning(name: str, environ: Optional[Mapping[str, str]] = None) -> int:
    """One of TUNING from the environment, validated; a ConfigError names the variable."""
    return socket_send_buffer(environ=environ) if name == "RS_SNDBUF" else read(name, environ)


def socket_send_buffer(value: Union[int, str, None] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    """`value`, or RS_SNDBUF, or the default: SNDBUF_AUTO (`auto`), 0 (the kernel's autotuning) or
    MIN_SNDBUF..MAX_SNDBUF bytes."""
    if value is None:
        environ = os.environ if environ is None else environ
        name = "RS_SNDBUF"
        if environ.get(name, "").strip().lower() in ("", "auto"):
            return SNDBUF_AUTO
        value = read(name, environ)
    elif isinstance(value, str) and value.strip().lower() == "auto":
        return SNDBUF_AUTO
    else:
        name = "send_buffer"
        try:
            value = operator.index(value)  # numpy and torch integers too, never a float or another string
        except TypeError:
            raise ConfigError(f"send_buffer={value!r} is neither `auto` nor an integer number of bytes") from None
    if value != 0 and not MIN_SNDBUF <= value <= MAX_SNDBUF:
        raise ConfigError(
            f"{name}={value} must be `auto`, 0 (the kernel's autotuning) or {MIN_SNDBUF}..{MAX_SNDBUF} bytes"
        )
    return value


def client_backstop(timeout: float) -> float:
    """A worker's own no-progress limit for a collective: a little longer than the reducer's
    RS_TIMEOUT, so that the reducer's message (the same on every rank) arrives first."""
    return timeout + max(1.0, 0.1 * timeout)
