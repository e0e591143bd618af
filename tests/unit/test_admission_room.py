"""The reducer's Admission driven in process (helpers/rooms.py): the handshake's transitions and
what each answers. A HELLO with a nonce is answered by a CHALLENGE carrying the reducer's proof;
an AUTH whose proof holds admits the worker (WELCOME), one that does not is REJECTed and counted
as a strike; MAX_STRIKES of them and the peer is ignored (and its rank lost); HELLOs awaiting
AUTH are capped (MAX_PENDING_HELLOS) and forgotten after FORGET_AFTER_S on the reducer's clock;
generations and jobs replace one another only forward."""

from __future__ import annotations

import json

import pytest

from helpers.rooms import JOB, TOKEN, hello_header, identity_of, reducer_rooms
from reduction_server.reducer import admission as admission_module
from reduction_server.reducer.admission import FORGET_AFTER_S, MAX_STRIKES
from reduction_server.wire import auth
from reduction_server.wire.protocol import ErrorCode, MsgType

A, B = b"peer-a", b"peer-b"


# -- HELLO --------------------------------------------------------------------------------------------
def test_a_hello_is_answered_by_a_challenge_that_proves_the_job_token_over_the_workers_nonce():
    r = reducer_rooms()
    (challenge,), nonce = r.hello(A, 1, 3, host="h1", pid=42, version="x" * 1000)
    assert challenge.to == A and challenge.type is MsgType.CHALLENGE
    h = challenge.header
    assert (h.rank, h.world, h.job, h.generation, h.aux, h.chunk) == (0, 3, JOB, 0, 1, 0)  # aux: a token is set
    theirs, proof = auth.parse_challenge(challenge.payload)
    assert auth.verify_reducer(TOKEN, nonce, proof, index=0, job=JOB, generation=0, shard=0)
    assert not auth.verify_reducer("not-the-token", nonce, proof, index=0, job=JOB, generation=0, shard=0)
    peer = r.members.peers[A]
    assert not peer.admitted and peer.nonce == theirs and (peer.rank, peer.world) == (1, 3)
    assert peer.info == {"host": "h1", "pid": 42}  # nothing else of the HELLO is kept
    assert list(r.admission.pending) == [A] and r.members.admitted(A) is None


@pytest.mark.parametrize(
    "rank, world, words",
    [
        (0, 0, "rank 0 / world size 0 is out of range"),
        (3, 3, "rank 3 / world size 3 is out of range"),
    ],
)
def test_a_hello_outside_any_world_is_rejected_and_nothing_is_kept(rank, world, words):
    r = reducer_rooms()
    (reject,), _ = r.hello(A, rank, world)
    assert reject.type is MsgType.REJECT and reject.text == f"reducer 0: {words}"
    assert A not in r.members.peers and not r.admission.pending


def test_a_hello_for_another_world_size_than_the_reducers_is_rejected():
    r = reducer_rooms(4)  # --workers 4
    (reject,), _ = r.hello(A, 0, 2)
    assert reject.type is MsgType.REJECT
    assert "serves 4 workers (--workers / RS_WORLD_SIZE) but rank 0 says the world size is 2" in reject.text


def test_a_hello_without_a_nonce_is_refused_and_counts_as_a_strike():
    r = reducer_rooms()
    r.admission.hello(A, hello_header(0, 2), None)
    (reject,) = r.outbox.take()
    assert reject.type is MsgType.REJECT and "HELLO carries no 32-byte nonce" in reject.text
    assert r.admission.strikes[A][0] == 1 and A not in r.members.peers


# -- AUTH -----------------------------------------------------------------------------------------------
def test_an_auth_whose_proof_holds_admits_the_worker_and_starts_the_job():
    r = reducer_rooms()
    (challenge,), _ = r.hello(A, 0, 2)
    (welcome,) = r.auth(A, challenge.payload, 0, 2)
    assert welcome.to == A and welcome.type is MsgType.WELCOME
    assert (welcome.header.world, welcome.header.job, welcome.header.generation) == (2, JOB, 0)
    facts = json.loads(welcome.payload)
    assert facts["world_size"] == 2 and facts["index"] == 0 and facts["shared_memory"] is False
    assert facts["max_chunk_bytes"] == 1 << 20
    assert r.members.admitted(A) is not None and r.members.rank_identity == {0: A}
    assert r.members.job == (JOB, 0) and r.members.world == 2
    assert not r.admission.pending and r.admission.admissions == 1 and r.admission.auth_failures == 0


@pytest.mark.parametrize("wrong", ["token", "rank"])
def test_an_auth_whose_proof_fails_is_rejected_struck_and_forgets_the_hello(wrong):
    r = reducer_rooms()
    (challenge,), _ = r.hello(A, 0, 2)
    # A wrong token, or a proof made for another rank than the HELLO said: the proof binds both.
    kw = {"token": "not-the-token"} if wrong == "token" else {"rank": 1}
    (reject,) = r.auth(A, challenge.payload, **{"rank": 0, "world": 2, **kw})
    assert reject.type is MsgType.REJECT
    assert reject.text == ("reducer 0: rank 0: authentication failed: wrong or missing job token (RS_JOB_TOKEN)")
    assert A not in r.members.peers and r.members.job is None and not r.admission.pending
    assert r.admission.strikes[A][0] == 1 and r.admission.auth_failures == 1
    # The HELLO is spent: an AUTH again is one without a HELLO.
    (error,) = r.auth(A, challenge.payload, 0, 2)
    assert error.type is MsgType.ERROR and error.code is ErrorCode.MALFORMED
    assert "AUTH without a HELLO before it" in error.text
    assert r.admission.strikes[A][0] == 2


def test_a_reducer_without_a_token_admits_any_proof_and_says_so_in_its_challenge():
    r = reducer_rooms(token="")
    (challenge,), _ = r.hello(A, 0, 1)
    assert challenge.header.aux == 0
    (welcome,) = r.auth(A, challenge.payload, 0, 1, token="not-the-token")
    assert welcome.type is MsgType.WELCOME


def test_a_rank_that_says_another_world_size_than_the_job_is_rejected():
    r = reducer_rooms()  # world learnt from the job's first rank
    r.handshake(A, 0, 2)
    (challenge,), _ = r.hello(B, 1, 3)
    (reject,) = r.auth(B, challenge.payload, 1, 3)
    assert reject.type is MsgType.REJECT
    assert f"rank 1 says the world size is 3 but the other ranks of job {JOB:#x} said 2" in reject.text
    assert B not in r.members.peers and r.members.rank_identity == {0: A}


def test_a_second_hello_on_an_admitted_connection_is_refused_and_its_rank_stays():
    r = reducer_rooms()
    r.handshake(A, 0, 2)
    (reject,), _ = r.hello(A, 1, 2)
    assert reject.type is MsgType.REJECT and "a second HELLO (rank 1) on a connection admitted already" in reject.text
    assert r.members.rank_identity == {0: A} and r.members.admitted(A).rank == 0
    assert r.admission.strikes[A][0] == 1


# -- jobs and generations ------------------------------------------------------------------------------
def test_a_newer_generation_replaces_the_job_and_drops_its_rounds_an_older_one_is_rejected():
    r = reducer_rooms()
    r.handshake(A, 0, 2)
    r.contribute(r.members.admitted(A), [1.0] * 4)
    assert r.rounds.open_count == 1 and r.pool.in_use_bytes > 0
    r.handshake(B, 0, 2, generation=1)
    assert r.members.job == (JOB, 1) and r.members.rank_identity == {0: B}
    assert A not in r.members.peers  # the old generation's peers went with it
    assert r.rounds.rounds == {} and r.pool.in_use_bytes == 0
    (reject,), _ = r.hello(b"peer-c", 1, 2, generation=0)
    assert reject.type is MsgType.REJECT
    assert f"rank 1 belongs to generation 0 of job {JOB:#x}, but reducer 0 already serves generation 1" in reject.text


def test_a_worker_rejoining_never_takes_the_reducer_from_the_job_it_serves():
    r = reducer_rooms()
    r.handshake(A, 0, 2)
    (reject,), _ = r.hello(B, 0, 2, job=JOB + 1, rejoin=True)
    assert reject.type is MsgType.REJECT and "tried to rejoin" in reject.text
    assert f"{JOB:#x}" not in reject.text  # which job it serves is not told to a peer that proved nothing
    assert r.members.job == (JOB, 0)


def test_a_ping_from_a_peer_not_admitted_is_told_so_and_one_from_a_member_turns_on_its_heartbeats():
    r = reducer_rooms()
    r.handshake(A, 0, 2)
    r.admission.ping(B)
    (error,) = r.outbox.take()
    assert error.to == B and error.code is ErrorCode.NOT_ADMITTED
    assert "not admitted (any more)" in error.text and f"{JOB:#x}" not in error.text  # nothing told to a stranger
    assert not r.members.peers[A].heartbeats
    r.admission.ping(A)
    assert r.members.peers[A].heartbeats and r.outbox.take() == []


# -- strikes ---------------------------------------------------------------------------------------------
def test_a_peer_is_ignored_at_max_strikes_and_forgotten_only_once_silent_for_forget_after_s():
    r = reducer_rooms()
    for n in range(1, MAX_STRIKES):
        r.admission.malformed(A, "junk")
        assert not r.admission.ignored(A) and r.admission.strikes[A][0] == n
        (error,) = r.outbox.take()
        assert error.code is ErrorCode.MALFORMED and error.text == "reducer 0: malformed message: junk"
    r.admission.malformed(A, "junk")
    assert r.admission.ignored(A) and r.admission.strikes[A][0] == MAX_STRIKES
    r.admission.malformed(B, "junk")  # another peer's strikes are its own
    assert not r.admission.ignored(B)
    # A keeps sending (ignored() is asked for each message), B is silent.
    r.clock.advance(FORGET_AFTER_S - 1)
    assert r.admission.ignored(A)
    r.admission.forget_strangers(r.clock.advance(2))
    assert B not in r.admission.strikes and r.admission.ignored(A)
    r.admission.forget_strangers(r.clock.advance(FORGET_AFTER_S + 1))
    assert not r.admission.ignored(A) and r.admission.strikes == {}


def test_an_admitted_rank_that_strikes_out_is_lost_and_the_rounds_waiting_for_it_fail():
    r = reducer_rooms()
    r.handshake(identity_of(0), 0, 2)
    r.handshake(identity_of(1), 1, 2)
    r.contribute(r.members.admitted(identity_of(0)), [1.0] * 4)
    for _ in range(MAX_STRIKES):
        r.admission.malformed(identity_of(1), "junk")
    errors = [m for m in r.outbox.take() if m.to == identity_of(0)]
    assert [e.code for e in errors] == [ErrorCode.LOST]
    assert f"rank 1 was lost: it sent {MAX_STRIKES} malformed messages and is ignored from now on" in errors[0].text
    assert 1 in r.members.lost and identity_of(1) not in r.members.peers
    assert r.rounds.rounds == {}  # answered, or lost: every rank of it


# -- HELLOs awaiting AUTH ---------------------------------------------------------------------------------
def test_hellos_awaiting_auth_are_capped_the_oldest_dropped_first(monkeypatch):
    monkeypatch.setattr(admission_module, "MAX_PENDING_HELLOS", 3)
    r = reducer_rooms()
    challenges = {}
    for i in range(5):
        (challenges[i],), _ = r.hello(b"s%d" % i, 0, 2)
    assert list(r.admission.pending) == [b"s2", b"s3", b"s4"]
    assert sorted(r.members.peers) == [b"s2", b"s3", b"s4"]
    (error,) = r.auth(b"s0", challenges[0].payload, 0, 2)  # its HELLO was dropped
    assert error.code is ErrorCode.MALFORMED and "AUTH without a HELLO" in error.text
    (welcome,) = r.auth(b"s4", challenges[4].payload, 0, 2)  # a kept one is answered as ever
    assert welcome.type is MsgType.WELCOME and list(r.admission.pending) == [b"s2", b"s3"]


def test_hellos_never_followed_by_auth_are_forgotten_after_forget_after_s_on_the_clock():
    r = reducer_rooms()
    r.hello(b"early", 0, 2)
    r.clock.advance(30)
    r.hello(b"late", 1, 2)
    r.handshake(A, 0, 2)  # admitted: stays whatever the time
    r.admission.forget_strangers(r.clock.now + FORGET_AFTER_S - 30 + 1)  # past "early"'s, not "late"'s
    assert b"early" not in r.members.peers and list(r.admission.pending) == [b"late"]
    r.admission.forget_strangers(r.clock.now + FORGET_AFTER_S + 1)
    assert sorted(r.members.peers) == [A] and not r.admission.pending
