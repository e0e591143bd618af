"""The proofs of the job token (reduction_server/wire/auth.py): each binds what it says it binds, the
two kinds never stand for each other, and the token is stretched before it keys an HMAC."""

from __future__ import annotations

import hashlib
import hmac
import struct

import pytest

from reduction_server.errors import ProtocolError
from reduction_server.wire import auth

TOKEN, NONCE = "a-token", bytes(range(32))
WORKER = dict(job=7, generation=2, rank=1, world=4)
REDUCER = dict(index=1, job=7, generation=2)


def test_each_side_verifies_its_own_proof():
    assert auth.verify_worker(TOKEN, NONCE, auth.worker_proof(TOKEN, NONCE, **WORKER), **WORKER)
    assert auth.verify_reducer(TOKEN, NONCE, auth.reducer_proof(TOKEN, NONCE, **REDUCER), **REDUCER)


@pytest.mark.parametrize("field, value", [("index", 0), ("job", 8), ("generation", 3), ("shard", 1)])
def test_a_reducer_proof_is_bound_to_its_index_shard_job_and_generation(field, value):
    proof = auth.reducer_proof(TOKEN, NONCE, **REDUCER)
    assert not auth.verify_reducer(TOKEN, NONCE, proof, **{**REDUCER, field: value})


@pytest.mark.parametrize("field, value", [("rank", 0), ("world", 5), ("job", 8), ("generation", 3)])
def test_a_worker_proof_is_bound_to_its_rank_world_job_and_generation(field, value):
    proof = auth.worker_proof(TOKEN, NONCE, **WORKER)
    assert not auth.verify_worker(TOKEN, NONCE, proof, **{**WORKER, field: value})


def test_a_proof_is_bound_to_the_nonce_and_the_token():
    proof = auth.reducer_proof(TOKEN, NONCE, **REDUCER)
    assert not auth.verify_reducer(TOKEN, bytes(32), proof, **REDUCER)
    assert not auth.verify_reducer("another-token", NONCE, proof, **REDUCER)
    assert not auth.verify_reducer("", NONCE, proof, **REDUCER)


def test_neither_kind_of_proof_stands_for_the_other():
    """Same token, nonce and numbers: a worker's proof does not pass as a reducer's (a
    reflection), and back."""
    same = dict(job=7, generation=2)
    assert auth.worker_proof(TOKEN, NONCE, rank=1, world=0, **same) != auth.reducer_proof(TOKEN, NONCE, index=1, **same)
    assert not auth.verify_reducer(
        TOKEN, NONCE, auth.worker_proof(TOKEN, NONCE, rank=1, world=4, **same), index=1, **same
    )


STRETCHED = hashlib.scrypt(TOKEN.encode(), salt=b"reduction-server job token v2", n=1 << 14, r=8, p=1, dklen=32)


def test_the_hmac_key_is_the_stretched_token_not_the_token():
    message = b"reduction-server reducer proof v2\0" + NONCE + struct.pack("<QIII", 7, 2, 1, 0)
    plain = hmac.new(TOKEN.encode(), message, hashlib.sha256).digest()
    assert auth.reducer_proof(TOKEN, NONCE, **REDUCER) == hmac.new(STRETCHED, message, hashlib.sha256).digest() != plain


def test_a_worker_proof_is_labelled_as_one():
    """The known answer pins the worker's label and layout: the wire format of protocol v2."""
    message = b"reduction-server worker proof v2\0" + NONCE + struct.pack("<QIII", 7, 2, 1, 4)
    assert auth.worker_proof(TOKEN, NONCE, **WORKER) == hmac.new(STRETCHED, message, hashlib.sha256).digest()


def test_a_challenge_of_the_wrong_size_is_malformed():
    nonce, proof = auth.parse_challenge(auth.challenge(NONCE, bytes(32)))
    assert (nonce, proof) == (NONCE, bytes(32))
    with pytest.raises(ProtocolError, match="CHALLENGE payload is 40 bytes, expected 64"):
        auth.parse_challenge(bytes(40))
