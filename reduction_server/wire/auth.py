"""Mutual proof of the job token in the handshake (docs/protocol.md, "Handshake").

Each side proves it knows the token with HMAC-SHA256 over a nonce the other side chose, so the
token never crosses the wire and no proof can be replayed:
- the reducer proves itself first, over the worker's nonce (sent in HELLO), bound to its index,
  its shard (a `serve --shards N` process on port + shard), the job and the generation: a worker
  sends nothing more (no AUTH, no shared-memory offer, no data) to a reducer whose proof does not
  match;
- the worker then proves itself over the reducer's nonce (sent in CHALLENGE), bound to its rank,
  the world size, the job and the generation.
The two proofs carry different labels, so neither can stand for the other. An empty token on
both sides proves nothing, and admits anyone: that is a job started without RS_JOB_TOKEN.

Anyone who reaches a reducer can have it prove the token over a nonce of their choosing, and
then guess the token offline against that proof: so the HMAC key is the token stretched with
scrypt (job_token.py).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import Tuple

from ..errors import ProtocolError
from ..job_token import key as _key

NONCE_BYTES = 32
PROOF_BYTES = 32  # an HMAC-SHA256 digest
_WORKER_LABEL = b"reduction-server worker proof v2\0"
_REDUCER_LABEL = b"reduction-server reducer proof v2\0"


def new_nonce() -> bytes:
    """A fresh random nonce for one handshake."""
    return secrets.token_bytes(NONCE_BYTES)


def digest(token: str, message: bytes) -> bytes:
    """HMAC-SHA256 of `message` under the stretched token; each use starts `message` with a label of
    its own (the handshake's proofs here, the elastic rendezvous's in launch/rendezvous_proof.py)."""
    return hmac.new(_key(token), message, hashlib.sha256).digest()


def worker_proof(token: str, nonce: bytes, *, job: int, generation: int, rank: int, world: int) -> bytes:
    """What a worker sends in AUTH: its proof of the token over the reducer's nonce."""
    return digest(token, _WORKER_LABEL + nonce + struct.pack("<QIII", job, generation, rank, world))


def reducer_proof(token: str, nonce: bytes, *, index: int, job: int, generation: int, shard: int = 0) -> bytes:
    """What a reducer (shard `shard` of reducer `index`) sends in CHALLENGE: its proof of the
    token over the worker's nonce."""
    return digest(token, _REDUCER_LABEL + nonce + struct.pack("<QIII", job, generation, index, shard))


def verify_worker(
    token: str, nonce: bytes, claimed: bytes, *, job: int, generation: int, rank: int, world: int
) -> bool:
    """Whether `claimed` is the worker proof for this nonce and identity (constant time)."""
    expected = worker_proof(token, nonce, job=job, generation=generation, rank=rank, world=world)
    return hmac.compare_digest(expected, claimed)


def verify_reducer(
    token: str, nonce: bytes, claimed: bytes, *, index: int, job: int, generation: int, shard: int = 0
) -> bool:
    """Whether `claimed` is the reducer proof for this worker nonce and identity (constant time)."""
    expected = reducer_proof(token, nonce, index=index, job=job, generation=generation, shard=shard)
    return hmac.compare_digest(expected, claimed)


def challenge(nonce: bytes, proof: bytes) -> bytes:
    """A CHALLENGE payload: the reducer's nonce, then its proof."""
    return nonce + proof


def parse_challenge(payload: bytes) -> Tuple[bytes, bytes]:
    """(reducer nonce, reducer proof) from a CHALLENGE payload."""
    if len(payload) != NONCE_BYTES + PROOF_BYTES:
        raise ProtocolError(
            f"CHALLENGE payload is {len(payload)} bytes, expected {NONCE_BYTES + PROOF_BYTES} (a nonce and a proof)"
        )
    return payload[:NONCE_BYTES], payload[NONCE_BYTES:]


def split_auth(payload: bytes) -> Tuple[bytes, bytes]:
    """(worker proof, the rest) from an AUTH payload: the rest is JSON (a shared-memory offer), or empty."""
    return payload[:PROOF_BYTES], payload[PROOF_BYTES:]
