"""A reducer's admission of workers: the job token (refused both ways), the world size, a
reducer without a token, and generations of a job. Real reducer processes (helpers/cluster.py);
workers are Communicators in threads, hand-driven peers raw ZeroMQ sockets (helpers/peers.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from helpers.cluster import TOKEN, reducers
from helpers.handshake import auth_payload, hello_payload
from helpers.jobs import check_sum_works, communicator, parallel
from helpers.peers import JOB, Peer, data
from reduction_server import CollectiveError
from reduction_server.wire import auth, protocol
from reduction_server.wire.protocol import ErrorCode, MsgType

pytestmark = pytest.mark.timeout(90)


# -- 1. authentication -----------------------------------------------------------------------
def test_a_worker_with_a_wrong_or_missing_token_refuses_the_reducers_and_the_job_goes_on():
    """A worker with another token (or none) is refused at once, naming RS_JOB_TOKEN: its connections
    do not prove the reducers' token (gate.py), so libzmq drops them in its handshake, before any
    byte of theirs reaches a reducer (no AUTH, no proof)."""
    with reducers(2, workers=2) as group:
        good = [communicator(group, r, 2) for r in range(2)]
        for token, job_id, why in [
            ("wrong-token", None, "the job tokens differ"),
            ("", None, "it requires a job token (RS_JOB_TOKEN) and this side has none"),
            ("wrong-token", JOB, "the job tokens differ"),
        ]:
            start = time.monotonic()
            with pytest.raises(CollectiveError) as info:
                communicator(group, 1, 2, job_token=token, job_id=job_id, connect_timeout=5)
            assert time.monotonic() - start < 5
            text = str(info.value)
            assert "refused this worker" in text and why in text, text
        # The job that was running is untouched, and a correct newcomer is admitted.
        check_sum_works(good)
        for c in good:
            c.close()
        again = [communicator(group, r, 2) for r in range(2)]
        check_sum_works(again)
        for c in again:
            c.close()
        logs = group.stop()
    assert "auth_failed" not in logs[0] and "auth_failed" not in logs[1]  # no AUTH came from those workers


def test_a_proof_for_another_identity_is_refused():
    """The HMAC binds rank and world: a proof computed for rank 0 does not admit rank 1."""
    with reducers(1, workers=2) as group:
        peer = Peer(group.addresses[0])
        info = hello_payload()
        peer.send(protocol.text_header(MsgType.HELLO, info, rank=1, world=2, job=JOB), info)
        header, challenge = peer.recv()
        assert header.type is MsgType.CHALLENGE and len(challenge) == auth.NONCE_BYTES + auth.PROOF_BYTES
        proof = auth_payload(challenge, TOKEN, job=JOB, rank=0, world=2)
        peer.send(protocol.text_header(MsgType.AUTH, proof, rank=1, world=2, job=JOB), proof)
        header, text = peer.recv()
        assert header.type is MsgType.REJECT and b"RS_JOB_TOKEN" in text
        peer.send(data(rank=1), b"\0" * 16)
        peer.expect_error(ErrorCode.NOT_ADMITTED)
        peer.close()
        logs = group.stop()
    assert "auth_failed" in logs[0]


# -- 2. world size ---------------------------------------------------------------------------
def test_a_world_size_other_than_the_reducers_is_rejected():
    with reducers(1, workers=2) as group:
        start = time.monotonic()
        with pytest.raises(CollectiveError) as info:
            communicator(group, 0, 3, connect_timeout=5)
        assert time.monotonic() - start < 5
        text = str(info.value)
        assert "serves 2 workers" in text and "world size is 3" in text, text
        comms = [communicator(group, r, 2) for r in range(2)]
        check_sum_works(comms)
        for c in comms:
            c.close()


def test_a_world_size_other_than_the_jobs_is_rejected():
    with reducers(1) as group:  # no --workers: the job's first rank sets it
        first = communicator(group, 0, 2)
        with pytest.raises(CollectiveError) as info:
            communicator(group, 1, 3, connect_timeout=5)
        text = str(info.value)
        assert "world size is 3" in text and "said 2" in text, text
        second = communicator(group, 1, 2)
        check_sum_works([first, second])
        first.close()
        second.close()


# -- 3. no token -------------------------------------------------------------------------------
def test_a_reducer_without_a_token_serves_workers_without_one_and_is_refused_by_those_with_one():
    with reducers(1, token="") as group:
        with communicator(group, 0, 1, job_token="") as comm:
            x = np.arange(10, dtype=np.float32)
            np.testing.assert_array_equal(comm.all_reduce(x), x)
        with pytest.raises(CollectiveError, match=r"it has no job token \(it was started without RS_JOB_TOKEN\)"):
            communicator(group, 0, 1, job_token="whatever")


# -- 4. generations --------------------------------------------------------------------------
def test_a_new_generation_replaces_the_old_one():
    with reducers(2, workers=2) as group:
        old = [communicator(group, r, 2, generation=0) for r in range(2)]
        for seed in range(3):
            check_sum_works(old, count=20_000, seed=seed)
        new = [communicator(group, r, 2, generation=1) for r in range(2)]
        for seed in range(3):
            check_sum_works(new, count=20_000, seed=10 + seed)
        # The old generation's communicators are no longer admitted: told so, never left hanging.
        results = parallel(*[lambda c=c: c.all_reduce(np.ones(4, np.float32)) for c in old], timeout=20)
        for kind, exc in results:
            assert kind == "error" and isinstance(exc, CollectiveError), exc
            assert "handshake" in str(exc), str(exc)
        for c in old:
            c.close()
        start = time.monotonic()
        with pytest.raises(CollectiveError) as info:
            communicator(group, 0, 2, generation=0, connect_timeout=5)
        assert time.monotonic() - start < 5
        text = str(info.value)
        assert "generation 0" in text and "generation 1" in text, text
        check_sum_works(new, seed=20)
        for c in new:
            c.close()
        assert group.alive()
        logs = group.stop()
    assert "job_replaced" in logs[0]
