"""Tunables read from the environment, with their defaults, in one place.

Every variable is validated: a value that is not a number, or out of range, is a ConfigError
naming the variable.
"""
from __future__ import annotations

import operator
import os
from typing import Mapping, Optional

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


#: the settings that tune how a collective moves (what `bench netem` passes to its emulated hosts and
#: `--variant` may set), with the range of the three a worker reads as numbers: (default, least, most)
TUNING = ("RS_PIPELINE_DEPTH", "RS_WINDOW", "RS_CHUNK_BYTES", "RS_SNDBUF")
_RANGES = {"RS_CHUNK_BYTES": (DEFAULT_CHUNK_BYTES, 64, None),
           "RS_PIPELINE_DEPTH": (DEFAULT_PIPELINE_DEPTH, 1, MAX_PIPELINE_DEPTH),
           "RS_WINDOW": (DEFAULT_WINDOW, 1, MAX_WINDOW)}


def tuning(name: str, environ: Optional[Mapping[str, str]] = None) -> int:
    """One of TUNING from the environment, validated; a ConfigError names the variable."""
    if name == "RS_SNDBUF":
        return socket_send_buffer(environ=environ)
    default, least, most = _RANGES[name]
    return int(env_number(name, default, minimum=least, maximum=most, environ=environ))


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
