"""Tunables read from the environment, with their defaults, in one place.

Every variable is validated: a value that is not a number, or out of range, is a ConfigError
naming the variable.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

from .errors import ConfigError

MiB = 1 << 20

#: bytes per chunk a collective is cut into (each chunk goes to one reducer)
DEFAULT_CHUNK_BYTES = 4 * MiB
#: chunks a worker keeps in flight per reducer: overlap of send, reduce and receive
DEFAULT_WINDOW = 4
#: the reducer never blocks on one peer (its sends are non-blocking), so a worker's unanswered
#: chunks must stay well under libzmq's per-peer queue of 1000 messages
MAX_WINDOW = 256
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


def client_backstop(timeout: float) -> float:
    """A worker's own no-progress limit for a collective: a little longer than the reducer's
    RS_TIMEOUT, so that the reducer's message (the same on every rank) arrives first."""
    return timeout + max(1.0, 0.1 * timeout)
