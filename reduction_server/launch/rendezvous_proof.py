"""The proof that every request to the elastic rendezvous carries, and that of its answer.

A request's X-RS-Proof header is `<time> <nonce> <mac>`: the sender's clock in milliseconds, 16
random bytes in hex, and an HMAC under the stretched job token (wire/auth.py: each offline guess
costs scrypt's work) over the time, the nonce, the path and the body. The rendezvous takes a
request only while its time is within FRESHNESS_S of its own clock and only once (it keeps the
nonces of the proved requests of the window), so a recorded request cannot be replayed. The answer
to a proved request carries an HMAC over that request's nonce, the status and the body: a worker
takes no answer made for another request. A refusal carries no proof: nothing in it is computed
from the token.
"""

from __future__ import annotations

import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from ..wire import auth

HEADER = "X-RS-Proof"
#: seconds a request's time may be from the rendezvous's clock (the workers of a local launcher
#: share its clock); the nonces of proved requests are kept for twice that
FRESHNESS_S = 60.0
_REQUEST = b"reduction-server rendezvous request v1\0"
_ANSWER = b"reduction-server rendezvous answer v1\0"
_FORMAT = re.compile(r"([0-9]{1,15}) ([0-9a-f]{32}) ([0-9a-f]{64})")


@dataclass(frozen=True)
class Proof:
    """A request's proof: its time (ms), its nonce and its MAC, as sent (ASCII, hex)."""

    time_ms: int
    nonce: str
    mac: str

    def header(self) -> str:
        return f"{self.time_ms} {self.nonce} {self.mac}"


def _mac(token: str, label: bytes, *fields: bytes) -> str:
    return auth.digest(token, label + b"\n".join(fields)).hex()


def _request_mac(token: str, time_ms: int, nonce: str, path: str, body: bytes) -> str:
    return _mac(token, _REQUEST, str(time_ms).encode(), nonce.encode(), path.encode("utf-8", "replace"), body)


def sign(token: str, path: str, body: bytes) -> Proof:
    """A fresh proof for a request of `body` to `path`."""
    time_ms, nonce = int(time.time() * 1000), secrets.token_hex(16)
    return Proof(time_ms, nonce, _request_mac(token, time_ms, nonce, path, body))


def parse(header: Optional[str]) -> Proof:
    """The proof in an X-RS-Proof header; ValueError naming what is wrong with it."""
    if header is None:
        raise ValueError(f"no {HEADER} header")
    match = _FORMAT.fullmatch(header)
    if match is None:
        raise ValueError(f"malformed {HEADER} header: expected '<time ms> <32 hex digits> <64 hex digits>' in ASCII")
    return Proof(int(match[1]), match[2], match[3])


def proves(token: str, proof: Proof, path: str, body: bytes) -> bool:
    """Whether `proof` is the token's for this request (constant time)."""
    return hmac.compare_digest(proof.mac, _request_mac(token, proof.time_ms, proof.nonce, path, body))


def answer_proof(token: str, nonce: str, status: int, body: bytes) -> str:
    """The proof of an answer to the proved request of `nonce`."""
    return _mac(token, _ANSWER, nonce.encode(), str(status).encode(), body)


def answer_proves(token: str, nonce: str, status: int, body: bytes, header: Optional[str]) -> bool:
    """Whether an answer's X-RS-Proof header proves the token, for the request of `nonce`."""
    return header is not None and hmac.compare_digest(
        header.encode("latin-1", "replace"), answer_proof(token, nonce, status, body).encode()
    )


class Freshness:
    """The nonces of the proved requests of the last 2 x FRESHNESS_S: each request is taken once,
    and only within FRESHNESS_S of its time. Only requests that proved the token are kept."""

    def __init__(self, window_s: float = FRESHNESS_S, clock: Callable[[], float] = time.time) -> None:
        self.window_s = window_s
        self.clock = clock
        self._seen: "OrderedDict[str, float]" = OrderedDict()  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    def refusal(self, proof: Proof) -> Optional[Tuple[str, str]]:
        """Why this proved request is not taken, as (cause, reason), or None: then it is taken, and
        its nonce kept."""
        with self._lock:
            now = self.clock()
            while self._seen and next(iter(self._seen.values())) <= now:
                self._seen.popitem(last=False)
            skew = now - proof.time_ms / 1000
            if abs(skew) > self.window_s:
                return "stale", (
                    f"the request's time is {skew:+.0f} s from the rendezvous's clock, over {self.window_s:g} s "
                    "(a replay, or clocks out of step)"
                )
            if proof.nonce in self._seen:
                return "replay", "the request was taken before (a replay)"
            self._seen[proof.nonce] = now + 2 * self.window_s
            return None


__all__ = ["FRESHNESS_S", "HEADER", "Freshness", "Proof", "answer_proof", "answer_proves", "parse", "proves", "sign"]
