"""CurveZMQ encryption of every worker-reducer connection (RS_ENCRYPT=1), with keys derived from
the job token, so that the token stays the only secret to distribute.

HMAC-SHA256(token, label) is a 32-byte Curve25519 secret key; zmq.curve_public gives its public
key. Reducers share one keypair (the CURVE server's) and workers another (one label each). A
CURVE client must know the server's public key, which CurveZMQ never sends: a worker can only
derive it from the right token. So a worker with another token fails the CURVE handshake (the
reducer cannot decrypt its HELLO), and one without encryption fails ZMTP's mechanism check; in
both cases no byte of theirs reaches the reducer's application. The HMAC proof of the job
handshake (auth.py) still admits each rank.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Optional, Tuple

import zmq
from zmq.utils import z85

from ..errors import ConfigError
from . import gate

_REDUCER_LABEL = b"reduction-server CurveZMQ reducer key v1"
_WORKER_LABEL = b"reduction-server CurveZMQ worker key v1"

#: monitor events of a failed security handshake (each is followed by EVENT_DISCONNECTED)
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
#: a worker gives up on a reducer once its encrypted handshakes have failed in a row for this many
#: seconds, at least MAX_HANDSHAKE_FAILURES times (one alone could be a reducer that died in the
#: middle of it, or a proxy that accepts before the reducer is up; libzmq retries every 100 ms)
GIVE_UP_AFTER_S = 2.0
MAX_HANDSHAKE_FAILURES = 3
#: a frame that failed CurveZMQ's authentication on a connection whose handshake had succeeded
ALTERED = (
    "a frame failed CurveZMQ's authentication: it was altered on the way (something between the worker and the "
    "reducer changes the bytes it relays), and RS_ENCRYPT refused it and closed the connection"
)


def check(token: str) -> None:
    """Raise ConfigError if encryption cannot be used: no token to derive keys from, or a
    libzmq built without CURVE."""
    if not token:
        raise ConfigError("RS_ENCRYPT=1 needs RS_JOB_TOKEN: the CurveZMQ keys are derived from the job token")
    if not zmq.has("curve"):
        raise ConfigError(
            f"RS_ENCRYPT=1, but this libzmq ({zmq.zmq_version()}) was built without CURVE "
            "support (zmq.has('curve') is False); install a pyzmq wheel, which bundles libsodium"
        )


def _keypair(token: str, label: bytes) -> Tuple[bytes, bytes]:
    """(public, secret) Z85-encoded Curve25519 keys, derived from the token."""
    secret = z85.encode(hmac.new(token.encode(), label, hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def secure_reducer(socket: zmq.Socket, token: str) -> None:
    """Make a reducer's ROUTER socket a CURVE server (before it binds)."""
    check(token)
    public, secret = _keypair(token, _REDUCER_LABEL)
    socket.curve_server = True
    socket.curve_publickey = public
    socket.curve_secretkey = secret


def secure_worker(socket: zmq.Socket, token: str) -> None:
    """Make a worker's DEALER socket a CURVE client of the token's reducers (before it connects)."""
    check(token)
    socket.curve_serverkey = _keypair(token, _REDUCER_LABEL)[0]
    socket.curve_publickey, socket.curve_secretkey = _keypair(token, _WORKER_LABEL)


def handshake_failure(
    event: int, value: int, encrypt: bool, gated: bool = False, secured: Optional[bool] = None
) -> Optional[Tuple[str, bool]]:
    """What a socket monitor event (parsed: zmq.utils.monitor) says about the security handshake:
    None if it is not a handshake failure, else (reason, certain); `certain` is False for a
    failure that could also be a connection dropped in the middle of the handshake. `gated`: this
    side's connections present a credential of the job token instead (gate.py). `secured`: whether
    the connection's security handshake had succeeded (None: this side cannot tell), since libzmq
    reports a frame that fails CurveZMQ's authentication later with the same event."""
    if not event & HANDSHAKE_FAILED:
        return None
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        if encrypt:
            return (
                "encryption mismatch: this side encrypts (RS_ENCRYPT=1) and the other does not; set RS_ENCRYPT "
                "the same on workers and reducers",
                True,
            )
        # CURVE, PLAIN (a token) or NULL (none) on the other side: this side cannot tell which
        mine, theirs = (
            ("has a job token", "it has no job token (it was started without RS_JOB_TOKEN)")
            if gated
            else ("has no job token", "it requires a job token (RS_JOB_TOKEN) and this side has none")
        )
        return (
            f"encryption mismatch, or one side has no job token: this side does not encrypt and {mine}; the "
            f"other encrypts (RS_ENCRYPT=1), or {theirs}; set RS_ENCRYPT and RS_JOB_TOKEN the same on workers "
            "and reducers",
            True,
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and gated:
        return (
            "the job tokens differ: the connection's credential did not prove the job token (RS_JOB_TOKEN) of "
            "the reducer (another job's reducer, or a mistyped token), or the hosts' clocks differ by more than "
            f"{gate.MAX_AGE_S} s",
            True,
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        if secured:
            return ALTERED, True
        keys = "the encrypted (CurveZMQ) handshake failed: the peer's keys come from another RS_JOB_TOKEN"
        return (keys if secured is False else f"{keys}; or, after the handshake, {ALTERED}"), True
    if not encrypt:
        return None  # a plain connection dropped while greeting: libzmq retries, nothing to say
    return (
        "the encrypted (CurveZMQ) handshake failed: the reducer does not encrypt (set RS_ENCRYPT the same "
        "on workers and reducers) or its key is not the one derived from this worker's RS_JOB_TOKEN (the job "
        "tokens differ)",
        False,
    )
