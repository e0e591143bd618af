"""The worker's side of the handshake, for tests that drive a reducer by hand."""

from __future__ import annotations

import json

from reduction_server.wire import auth


def hello_payload(**facts: object) -> bytes:
    """A HELLO's JSON: a fresh nonce for the reducer to prove the token over, and `facts`."""
    return json.dumps({"nonce": auth.new_nonce().hex(), **facts}).encode()


def auth_payload(challenge: bytes, token: str, *, job: int, generation: int = 0, rank: int, world: int) -> bytes:
    """The AUTH answering a CHALLENGE payload: the worker's proof over the reducer's nonce."""
    nonce, _ = auth.parse_challenge(challenge)
    return auth.worker_proof(token, nonce, job=job, generation=generation, rank=rank, world=world)
