"""Integrity without secrecy (RS_INTEGRITY=1): every message between a worker and a reducer after
HELLO and CHALLENGE carries a tag frame, so that a message altered, dropped, replayed or
reordered on the way is refused by name instead of changing a sum (docs/protocol.md, "Integrity").

- Keys: per connection and direction, HMAC-SHA256 under the stretched job token (job_token.py)
  over the SHA-256 of the HELLO's payload (the worker's nonce, and every fact it states) and the
  reducer's nonce from CHALLENGE: a recorded connection cannot be replayed into another one, and
  an altered HELLO fails the AUTH's tag.
- Tags: message n of a direction carries n (uint64) and the Poly1305 tag of its header and
  payload frames under a one-time key, keyed BLAKE2b of the direction's key over n and the number
  of frames (Poly1305 may tag one message per key). The receiver expects n = 0, 1, 2, ...
- What is not tagged: HELLO and CHALLENGE (the HELLO's payload and the CHALLENGE's nonce make the
  keys, its proof is checked, and the proofs bind the headers' identities), a REJECT (it only ends
  a handshake: forging one denies service, which a relay can always do by cutting the
  connection), and shared-memory slots (same host: the header that names the slot is).

RS_ENCRYPT=1 makes this redundant (CurveZMQ authenticates every frame, in order): with it,
RS_INTEGRITY adds no tags (`applies`).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Optional, Sequence, Tuple

from ..errors import ConfigError
from ..job_token import key as token_key
from . import poly1305

SEQ_BYTES = 8
#: a tag frame: the message's number in its direction, then its Poly1305 tag
TAG_FRAME_BYTES = SEQ_BYTES + poly1305.TAG_BYTES
_UP_LABEL = b"reduction-server integrity worker->reducer v1\0"
_DOWN_LABEL = b"reduction-server integrity reducer->worker v1\0"
#: the words every integrity failure ends with, so that logs and tests can find them
ALTERED = (
    "refused by RS_INTEGRITY: something between the worker and the reducer changes, drops or replays the messages "
    "it relays"
)


def applies(integrity: bool, encrypt: bool) -> bool:
    """Whether messages carry tags: RS_INTEGRITY=1, unless CurveZMQ authenticates them already."""
    return integrity and not encrypt


def check(token: str) -> None:
    """Raise ConfigError if tags cannot be made: no token to derive keys from, or no Poly1305."""
    if not token:
        raise ConfigError("RS_INTEGRITY=1 needs RS_JOB_TOKEN: the keys of its tags are derived from the job token")
    if poly1305.UNAVAILABLE is not None:
        raise ConfigError(
            f"RS_INTEGRITY=1 needs OpenSSL 3's Poly1305, through the libcrypto hashlib uses: {poly1305.UNAVAILABLE}"
        )


def mismatch(mine: bool, rank: int) -> str:
    """Why a reducer refuses rank `rank`'s HELLO whose integrity setting is not its own (`mine`)."""
    this, other = ("requires", "does not") if mine else ("does not use", "does")
    return (
        f"integrity mismatch: this reducer {this} tags on every message (RS_INTEGRITY=1) and rank {rank} {other}; "
        "set RS_INTEGRITY the same on workers and reducers"
    )


class Channel:
    """One direction of one connection: the key and the number of the next message."""

    __slots__ = ("key", "seq", "what")

    def __init__(self, key: bytes, what: str) -> None:
        self.key = key
        self.seq = 0
        self.what = what  # "worker->reducer" or "reducer->worker", for error messages

    def _tag(self, seq: int, parts: Sequence[poly1305.Buffer]) -> bytes:
        one_time = hashlib.blake2b(
            seq.to_bytes(SEQ_BYTES, "little") + bytes((len(parts),)), key=self.key, digest_size=poly1305.KEY_BYTES
        ).digest()
        return poly1305.tag(one_time, parts)

    def seal(self, parts: Sequence[poly1305.Buffer]) -> bytes:
        """The tag frame of the next message, whose header and payload frames are `parts`."""
        seq = self.seq
        self.seq = seq + 1
        return seq.to_bytes(SEQ_BYTES, "little") + self._tag(seq, parts)

    def open(self, parts: Sequence[poly1305.Buffer], frame: poly1305.Buffer) -> Optional[str]:
        """None if `frame` is the tag of the next message, made of `parts`; else what went wrong,
        in words that end with ALTERED."""
        expected = self.seq
        if len(frame) != TAG_FRAME_BYTES:
            return f"a {self.what} message came without its {TAG_FRAME_BYTES}-byte tag frame: {ALTERED}"
        seq = int.from_bytes(frame[:SEQ_BYTES], "little")
        if not hmac.compare_digest(self._tag(seq, parts), bytes(frame[SEQ_BYTES:])):
            return f"{self.what} message #{expected} failed its integrity check (it was altered on the way): {ALTERED}"
        if seq < expected:
            return f"{self.what} message #{seq} came again after #{expected - 1} (a replay): {ALTERED}"
        if seq > expected:
            return f"{self.what} message #{expected} never came (#{seq} came instead: one was dropped): {ALTERED}"
        self.seq = expected + 1
        return None


def channels(token: str, hello: bytes, reducer_nonce: bytes) -> Tuple[Channel, Channel]:
    """(worker->reducer, reducer->worker) channels of the connection whose HELLO had the payload
    `hello` (with the worker's nonce) and whose CHALLENGE the nonce `reducer_nonce`."""
    stretched = token_key(token)
    handshake = hashlib.sha256(hello).digest() + reducer_nonce
    up = hmac.new(stretched, _UP_LABEL + handshake, hashlib.sha256).digest()
    down = hmac.new(stretched, _DOWN_LABEL + handshake, hashlib.sha256).digest()
    return Channel(up, "worker->reducer"), Channel(down, "reducer->worker")
