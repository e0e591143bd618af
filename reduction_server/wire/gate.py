"""The gate of a reducer's socket: no connection that cannot prove the job token gets through
libzmq's handshake, so none reaches the ROUTER that could abort it (issue 37).

Why: a ROUTER names each peer with a routing id. A peer may choose its own (ZMQ_ROUTING_ID, sent
in its handshake); one that does not gets 0x00 + a 32-bit counter that starts from an unseeded
rand(), the same in every reducer. libzmq (4.3.5 and master: router.cpp, identify_peer) checks a
chosen id against the ids in use, but never its own next one against the chosen ids: a stranger
who chooses the next few ids and then connects without one makes add_out_pipe() fail its
`zmq_assert (ok)` (socket_base.cpp:2113) and the process abort. No option of the ROUTER prevents
it (ROUTER_HANDOVER draws the same counter), and ZAP is told the socket's own routing id, never
the peer's. What can be prevented is a stranger's connection reaching identify_peer at all:

- RS_ENCRYPT=1: CURVE already does it (no stranger knows the reducers' public key).
- otherwise, with a job token: the reducer is a ZMQ_PLAIN server, and a ZAP handler (a thread of
  this module, on the reducer's own context) admits a connection only if its PLAIN credential
  proves the token. The credential is one-use: the username is a time and a random nonce, the
  password HMAC-SHA256 over it under the stretched token (job_token.py's key, so a sniffed one is no
  faster to guess the token from than a proof of the job handshake). The handler refuses a
  username it has seen, or older or newer than MAX_AGE_S by its clock. PLAIN touches nothing after
  the handshake: a connection costs one ZAP round trip, a message nothing.
- with no token, a reducer admits anyone anyway; it seeds rand() (seed_routing_ids) so that its
  first routing id is not the one every process has, which makes the attack a guess, not a sure
  thing.
A worker presents a fresh credential on each connection (its sockets never reconnect). The job's
own handshake (auth.py) proves the token again, both ways, over nonces: this gate only keeps
strangers' bytes out of libzmq's routing table.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import logging
import secrets
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import zmq

from ..job_token import key as token_key
from ..log import Throttle, event

#: a credential older or newer than this by the reducer's clock is refused (hosts' clocks may differ)
MAX_AGE_S = 600
#: ZAP's endpoint (RFC 27), in the reducer's own context
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"reduction-server"
_LABEL = b"reduction-server connection credential v1\0"
_NONCE_HEX = 32  # characters: 128 bits
_FORGET_AT = 1024  # credentials seen, past which those too old to be admitted again are forgotten


def applies(token: str, encrypt: bool) -> bool:
    """Whether connections present a PLAIN credential: with a token, unless CURVE already gates."""
    return bool(token) and not encrypt


def _password(token: str, username: bytes) -> bytes:
    return hmac.new(token_key(token), _LABEL + username, hashlib.sha256).hexdigest().encode()


def credential(token: str, now: Optional[float] = None) -> Tuple[bytes, bytes]:
    """A fresh (username, password) proving `token`, for one connection."""
    username = f"{int(time.time() if now is None else now)}.{secrets.token_hex(_NONCE_HEX // 2)}".encode()
    return username, _password(token, username)


def present(socket: zmq.Socket, token: str) -> None:
    """Make a worker's DEALER a PLAIN client with a fresh credential (before it connects)."""
    socket.plain_username, socket.plain_password = credential(token)


def seed_routing_ids() -> None:
    """Seed the C library's rand(), from which libzmq draws a ROUTER's first routing id (before
    the socket is made). Not a defence on its own: see the module's docstring."""
    try:
        ctypes.CDLL(None).srand(int.from_bytes(secrets.token_bytes(4), "little"))
    except (OSError, AttributeError, TypeError):  # no C library to seed: libzmq's ids stay as they are
        pass


class Gate:
    """The ZAP handler of one reducer's context: a thread answering libzmq's requests, from
    start() (before the reducer's socket binds) until close()."""

    def __init__(
        self,
        context: zmq.Context,
        token: str,
        clock: Callable[[], float] = time.time,
        log: Optional[logging.Logger] = None,
    ) -> None:
        self.token = token
        self.clock = clock
        self.log = log
        self.seen: Dict[bytes, float] = {}  # username -> when it may be forgotten (its age refuses it then)
        self.admitted = 0
        self.refused: Dict[str, int] = {}  # reason -> count
        # strangers' refusals are logged as the reducer's are: once a cause each interval, then a count
        self.throttle = Throttle(log) if log is not None else None
        token_key(token)  # the scrypt stretch, once, before any connection waits for it
        self._zap = context.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)  # here, not in the thread: bound before the reducer binds
        self._stop = context.socket(zmq.PAIR)
        self._stop.linger = 0
        endpoint = f"inproc://reduction-server.gate.{id(self):x}"
        self._stop.bind(endpoint)
        self._wake = context.socket(zmq.PAIR)
        self._wake.linger = 0
        self._wake.connect(endpoint)
        self._thread = threading.Thread(target=self._serve, name="zap-gate", daemon=True)

    def start(self) -> "Gate":
        self._thread.start()
        return self

    def guard(self, socket: zmq.Socket) -> None:
        """Make the reducer's ROUTER a PLAIN server that asks this gate (before it binds)."""
        socket.plain_server = True
        socket.zap_domain = DOMAIN

    def check(self, username: bytes, password: bytes) -> Optional[str]:
        """None if the credential admits its connection (it is then used up), else why not."""
        if not hmac.compare_digest(_password(self.token, username), password):
            return "the credential does not prove the job token (RS_JOB_TOKEN)"
        now = self.clock()
        made_at = username.split(b".", 1)[0]
        if not made_at.isdigit():  # only a holder of the token gets here: a worker of another version
            return "malformed credential"
        made = int(made_at)
        if abs(now - made) > MAX_AGE_S:
            return f"the credential is {now - made:+.0f} s old: the hosts' clocks differ by more than {MAX_AGE_S} s"
        if len(self.seen) >= _FORGET_AT:
            self.seen = {u: until for u, until in self.seen.items() if until >= now}
        if username in self.seen:
            return "the credential was used before (a replay)"
        self.seen[username] = made + MAX_AGE_S
        return None

    def _answer(self, frames: list) -> list:
        if len(frames) < 6:
            return []  # not a ZAP request: libzmq never sends one
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        why = "not a PLAIN credential"
        if mechanism == b"PLAIN" and len(frames) == 8:
            why = self.check(frames[6], frames[7])
        if why is None:
            self.admitted += 1
            return [version, request_id, b"200", b"OK", b"", b""]
        self.refused[why] = self.refused.get(why, 0) + 1
        if self.throttle is not None:
            self.throttle.event(
                logging.WARNING,
                "connection_refused",
                cause=why,
                reason=why,
                address=address.decode(errors="replace"),
                refused=self.refused[why],
            )
        return [version, request_id, b"400", why.encode(), b"", b""]

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._stop, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._stop in ready:
                    return
                request = self._zap.recv_multipart()
                try:
                    reply = self._answer(request)
                except Exception as exc:  # noqa: BLE001 - a connection must get an answer, never wait for one
                    if self.log is not None:
                        event(self.log, logging.ERROR, "gate_failed", error=repr(exc))
                    reply = request[:2] + [b"400", b"internal error", b"", b""] if len(request) >= 2 else []
                self._zap.send_multipart(reply or [b"1.0", b"", b"500", b"malformed", b"", b""])
        except zmq.ContextTerminated:
            return
        finally:
            self._zap.close(linger=0)
            self._stop.close(linger=0)

    def close(self) -> None:
        """Stop the thread (the reducer's socket is closed first: no handshake waits for it)."""
        if self._thread.is_alive():
            self._wake.send(b"")
            self._thread.join(5)
        elif not self._zap.closed:
            self._zap.close(linger=0)
            self._stop.close(linger=0)
        self._wake.close(linger=0)
        if self.throttle is not None:
            self.throttle.flush(everything=True)

    def __enter__(self) -> "Gate":
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()
