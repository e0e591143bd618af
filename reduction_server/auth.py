"""Proof of the job token in the handshake: HMAC-SHA256 over the reducer's nonce and the
worker's claimed identity, so the token itself never crosses the wire and a proof cannot be
replayed to another reducer, rank or job."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

NONCE_BYTES = 32


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: str, nonce: bytes, *, job: int, generation: int, rank: int, world: int) -> bytes:
    message = nonce + struct.pack("<QIII", job, generation, rank, world)
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def verify(token: str, nonce: bytes, claimed: bytes, *, job: int, generation: int, rank: int,
           world: int) -> bool:
    expected = proof(token, nonce, job=job, generation=generation, rank=rank, world=world)
    return hmac.compare_digest(expected, claimed)
