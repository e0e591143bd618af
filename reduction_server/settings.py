"""Tunables read from the environment, with their defaults, in one place.

Every variable is validated: a value that is not a number, or out of range, is a ConfigError
naming the variable.
"""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import List, Mapping, Optional, Tuple

from .errors import ConfigError

MiB = 1 << 20

#: bytes per chunk a collective is cut into (each chunk goes to one reducer)
DEFAULT_CHUNK_BYTES = 4 * MiB
#: chunks a worker keeps in flight per reducer: overlap of send, reduce and receive
DEFAULT_WINDOW = 4
#: chunks per reducer a collective is cut into at least (RS_PIPELINE_DEPTH; chunks stay >= 64 KiB
#: and <= RS_CHUNK_BYTES). A reducer answers a chunk once every rank's copy has arrived, so the
#: download of a collective trails its upload by a few chunks per reducer: on links, a collective
#: takes about S/B x (1 + 4/depth) (bench/RESULTS.md, "Why chunks must be small on links"), so
#: deeper pipelines run links better, and each chunk costs per-message CPU. On the emulated network
#: (W=8, 200 Mbit/s) 32 gives 0.83-0.86 of the link bound against 0.80 at 16 and 0.67 at 8, and
#: DDP's step is faster at 32 than at 16 (bench/RESULTS.md, session 6)
DEFAULT_PIPELINE_DEPTH = 32
#: the depth `reduction-server run` gives its ranks: on one host no link is the limit, the CPU is,
#: and chunks half as large cost up to a third of small collectives' speed there
ONE_HOST_PIPELINE_DEPTH = 8
MAX_PIPELINE_DEPTH = 1024
#: the reducer never blocks on one peer (its sends are non-blocking), so a worker's unanswered
#: chunks must stay well under libzmq's per-peer queue of 1000 messages
MAX_WINDOW = 256
#: RS_SNDBUF, the kernel send buffer (SO_SNDBUF) of each data connection, in bytes: 0 leaves it to
#: the kernel's autotuning. A small buffer caps the bytes each TCP flow has in flight, so the R flows
#: out of a worker (and the W out of a reducer) take turns on a shaped, deep-buffered link instead of
#: one running ahead of the others; it also caps each flow at about 2 x RS_SNDBUF per round trip, and
#: on loopback (64 KiB MTU) 16 KiB makes a flow wait for delayed ACKs (bench/RESULTS.md, session 7).
#: The kernel cuts the value to net.core.wmem_max, then doubles it
DEFAULT_SNDBUF = 0
MIN_SNDBUF = 4096
MAX_SNDBUF = 1 << 30
#: seconds a collective may wait for its results before it fails on this rank
DEFAULT_TIMEOUT = 300.0
#: seconds between heartbeats (PING) that workers and reducers send each other
DEFAULT_HEARTBEAT_INTERVAL = 1.0
#: seconds of silence after which a worker declares a reducer lost, and a reducer a worker
#: (a process that dies is noticed at once: its connection closes; this covers silent losses)
DEFAULT_LIVENESS_TIMEOUT = 5.0
#: seconds a worker waits for every reducer to admit it
DEFAULT_CONNECT_TIMEOUT = 120.0
#: largest chunk a reducer accepts (a client claiming more is refused, not allocated)
DEFAULT_MAX_CHUNK_BYTES = 64 * MiB
#: accumulator memory a reducer may hold at once
DEFAULT_MAX_ACCUMULATOR_BYTES = 4096 * MiB
#: reducer memory one rank may account for: the accumulators its contributions were loaded into
#: (it reached those chunks first; rank 0 in deterministic mode) and, in deterministic mode, its
#: contributions held for their turn. A rank has at most RS_WINDOW chunks unanswered per reducer,
#: so a well-behaved one needs at most 2 x window x chunk (32 MiB with the defaults, in float32
#: accumulators; 2 GiB covers the largest window, 256, with the default 4 MiB chunks)
DEFAULT_MAX_PEER_BYTES = 2048 * MiB
#: collectives (rounds: one chunk of one collective) in flight on a reducer for its job. Ranks send
#: in one order, so a well-behaved job has at most RS_WINDOW (<= MAX_WINDOW) rounds open per reducer
DEFAULT_MAX_ROUNDS = 1024
#: bytes per fused bucket of all-reduces (Horovod's default)
DEFAULT_FUSION_THRESHOLD = 64 * MiB
#: milliseconds between the Horovod API's negotiation cycles (Horovod's default)
DEFAULT_CYCLE_TIME_MS = 1.0

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_number(name: str, default: float, *, minimum: float, maximum: Optional[float] = None,
               kind: type = int, environ: Optional[Mapping[str, str]] = None) -> float:
    """Read a number from the environment, naming the variable when it is malformed."""
    environ = os.environ if environ is None else environ
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name}={raw!r} must be at most {maximum}")
    return value


def env_flag(name: str, default: bool = False, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Read an on/off switch (1/0, true/false, yes/no, on/off), naming the variable when it is
    anything else: a typo must not silently leave a safety feature off."""
    environ = os.environ if environ is None else environ
    raw = environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}={environ[name]!r} is not a switch; use 1 or 0 (true/false, yes/no, on/off)")


def socket_send_buffer(value: Optional[int] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    """`value`, or RS_SNDBUF, or the default: 0 (the kernel's autotuning) or MIN_SNDBUF..MAX_SNDBUF bytes."""
    if value is None:
        value = int(env_number("RS_SNDBUF", DEFAULT_SNDBUF, minimum=0, maximum=MAX_SNDBUF, environ=environ))
        name = "RS_SNDBUF"
    else:
        name = "send_buffer"
        try:
            value = operator.index(value)  # numpy and torch integers too, never a float or a string
        except TypeError:
            raise ConfigError(f"send_buffer={value!r} is not an integer number of bytes") from None
    if value != 0 and not MIN_SNDBUF <= value <= MAX_SNDBUF:
        raise ConfigError(f"{name}={value} must be 0 (the kernel's autotuning) or {MIN_SNDBUF}..{MAX_SNDBUF} bytes")
    return value


def client_backstop(timeout: float) -> float:
    """A worker's own no-progress limit for a collective: a little longer than the reducer's
    RS_TIMEOUT, so that the reducer's message (the same on every rank) arrives first."""
    return timeout + max(1.0, 0.1 * timeout)


# -- the registry: every variable the project reads, declared once ------------------------------
WORKERS, REDUCERS, LAUNCHER, BENCH = "workers", "reducers", "launcher", "bench"


@dataclass(frozen=True)
class Variable:
    """One environment variable: who reads it, its default in words, and what it means."""

    name: str
    readers: Tuple[str, ...]
    default: str
    meaning: str


def _bytes(value: int) -> str:
    return f"{value >> 30} GiB" if value >= 1 << 30 and not value % (1 << 30) else f"{value >> 20} MiB"


_BOTH = (WORKERS, REDUCERS)
VARIABLES: Tuple[Variable, ...] = (
    Variable("RS_REDUCERS", (WORKERS,), "from the cluster spec",
             "reducer addresses, `host:port,...`; reducer i is the i-th"),
    Variable("RS_RANK", (WORKERS,), "from the spec or launcher", "this worker's rank"),
    Variable("RS_WORLD_SIZE", _BOTH, "from the spec or launcher", "number of worker ranks W"),
    Variable("RS_REDUCER_INDEX", (REDUCERS,), "from the spec", "this reducer's index: its position in `RS_REDUCERS`"),
    Variable("RS_BIND_HOST", (REDUCERS,), "`0.0.0.0`", "address a discovered reducer binds"),
    Variable("RS_PROCS_PER_HOST", _BOTH, "1", "processes per worker host under a cluster spec"),
    Variable("RS_JOB_TOKEN", (*_BOTH, LAUNCHER), "none (`run`: a random one)",
             "the job's shared secret, random (`openssl rand -hex 16`): every worker and every reducer proves it "
             "to the other before any data moves"),
    Variable("RS_JOB_ID", _BOTH, "from the job", "job identity; a reducer serves one job at a time"),
    Variable("RS_GENERATION", _BOTH, "0", "job generation; a newer one replaces an older one on the reducers"),
    Variable("RS_CHUNK_BYTES", (WORKERS, BENCH), _bytes(DEFAULT_CHUNK_BYTES),
             "largest chunk a collective is cut into (the same on every rank)"),
    Variable("RS_WINDOW", (WORKERS, BENCH), str(DEFAULT_WINDOW), "chunks in flight per reducer"),
    Variable("RS_PIPELINE_DEPTH", (WORKERS, LAUNCHER, BENCH),
             f"{DEFAULT_PIPELINE_DEPTH} ({ONE_HOST_PIPELINE_DEPTH} under `reduction-server run`)",
             "chunks per reducer a collective is cut into at least (the same on every rank); deeper runs links "
             "better and costs CPU per chunk (bench/RESULTS.md)"),
    Variable("RS_SHM", _BOTH, "1", "chunks between a worker and a reducer on one host go through shared memory; "
             "0 turns it off on either side"),
    Variable("RS_SNDBUF", (*_BOTH, BENCH), "0 (the kernel's autotuning)",
             "kernel send buffer (SO_SNDBUF) of each connection, bytes: 0, or 4096 and up; 16384 keeps flows in "
             "step on a shaped cloud link, and slows loopback (bench/RESULTS.md)"),
    Variable("RS_TIMEOUT", _BOTH, f"{DEFAULT_TIMEOUT:g} s",
             "a collective waiting longer fails on every rank, naming who had and had not contributed"),
    Variable("RS_HEARTBEAT_INTERVAL", _BOTH, f"{DEFAULT_HEARTBEAT_INTERVAL:g} s",
             "how often workers and reducers ping each other"),
    Variable("RS_LIVENESS_TIMEOUT", _BOTH, f"{DEFAULT_LIVENESS_TIMEOUT:g} s",
             "silence after which a peer is lost (a closed connection is seen at once)"),
    Variable("RS_CONNECT_TIMEOUT", (WORKERS,), f"{DEFAULT_CONNECT_TIMEOUT:g} s",
             "how long a worker waits for every reducer to admit it (it says what it waits for every few seconds)"),
    Variable("RS_IO_THREADS", (WORKERS,), "1", "libzmq I/O threads"),
    Variable("RS_ENCRYPT", _BOTH, "0", "1: every connection encrypted with CurveZMQ, keys derived from `RS_JOB_TOKEN`"),
    Variable("RS_FUSION_THRESHOLD", (WORKERS,), f"{_bytes(DEFAULT_FUSION_THRESHOLD)} (or `HOROVOD_FUSION_THRESHOLD`)",
             "bytes per fused bucket; 0 turns fusion off"),
    Variable("RS_CYCLE_TIME", (WORKERS,), f"{DEFAULT_CYCLE_TIME_MS:g} ms (or `HOROVOD_CYCLE_TIME`)",
             "Horovod API: time between negotiation cycles"),
    Variable("RS_TIMELINE", (WORKERS,), "off", "path of a Chrome trace of each rank's collectives"),
    Variable("RS_DETERMINISTIC", (REDUCERS,), "0", "1: sum in rank order, so results are bitwise reproducible"),
    Variable("RS_MAX_CHUNK_BYTES", (REDUCERS,), _bytes(DEFAULT_MAX_CHUNK_BYTES),
             "largest chunk accepted; larger claims are refused, not allocated"),
    Variable("RS_MAX_ACCUMULATOR_BYTES", (REDUCERS,), _bytes(DEFAULT_MAX_ACCUMULATOR_BYTES),
             "accumulator memory a reducer may hold"),
    Variable("RS_MAX_PEER_BYTES", (REDUCERS,), _bytes(DEFAULT_MAX_PEER_BYTES),
             "reducer memory one rank may account for"),
    Variable("RS_MAX_ROUNDS", (REDUCERS,), str(DEFAULT_MAX_ROUNDS), "collective chunks in flight on a reducer"),
    Variable("RS_METRICS_PORT", (REDUCERS,), "off", "serve Prometheus metrics on this port"),
    Variable("RS_HEALTHCHECK_PORT", (REDUCERS,), "the discovered port",
             "the image's healthcheck: the port to probe when `--port` was given on the command line"),
    Variable("RS_LOG_LEVEL", _BOTH, "`NOTICE`", "`DEBUG`, `INFO`, `NOTICE`, `WARNING`, `ERROR`; one "
             "`event key=value` line each"),
)


def variables_read_by(*readers: str) -> List[Variable]:
    """The registry's variables that any of `readers` reads, in the registry's order."""
    return [v for v in VARIABLES if set(v.readers) & set(readers)]


def markdown_table() -> str:
    """The README's table of variables, made from the registry."""
    rows = ["| variable | who reads it | default | meaning |", "| --- | --- | --- | --- |"]
    for v in VARIABLES:
        who = "both" if set(_BOTH) <= set(v.readers) else ", ".join(r for r in v.readers if r != BENCH)
        rows.append(f"| `{v.name}` | {who} | {v.default} | {v.meaning} |")
    return "\n".join(rows)


#: the settings that tune how a collective moves (what `bench netem` passes to its emulated hosts and
#: `--variant` may set), with the range of the three a worker reads as numbers: (default, least, most)
TUNING = tuple(v.name for v in variables_read_by(BENCH))
_RANGES = {"RS_CHUNK_BYTES": (DEFAULT_CHUNK_BYTES, 64, None),
           "RS_PIPELINE_DEPTH": (DEFAULT_PIPELINE_DEPTH, 1, MAX_PIPELINE_DEPTH),
           "RS_WINDOW": (DEFAULT_WINDOW, 1, MAX_WINDOW)}
assert set(TUNING) == {*_RANGES, "RS_SNDBUF"}, "every setting bench hosts inherit needs its range here"


def tuning(name: str, environ: Optional[Mapping[str, str]] = None) -> int:
    """One of TUNING from the environment, validated; a ConfigError names the variable."""
    if name == "RS_SNDBUF":
        return socket_send_buffer(environ=environ)
    default, least, most = _RANGES[name]
    return int(env_number(name, default, minimum=least, maximum=most, environ=environ))
