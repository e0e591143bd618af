"""What one peer can make a reducer do by misusing the protocol, driven in process
(Reducer.handle over a capturing socket, a real Reducer): strangers flooding HELLOs or failing
AUTH again and again, and admitted ranks that send a second HELLO, broadcast roots beyond the
memory budgets, a world size or root outside the job, or a PROGRESS beyond any collective. Each
is answered by name, bounded, and leaves every other rank's rounds able to complete or fail.
(test_reducer_errors.py drives live reducers over sockets; these need exact counts and clocks.)"""

from __future__ import annotations

import logging
from typing import List, Tuple

import numpy as np
import pytest
import zmq

from helpers.capture import CapturingSocket
from helpers.handshake import hello_payload
from helpers.peers import data
from reduction_server.reducer import Reducer
from reduction_server.reducer import admission as admission_module
from reduction_server.reducer.admission import FORGET_AFTER_S, MAX_STRIKES
from reduction_server.wire import auth, protocol
from reduction_server.wire.protocol import REJOIN_LEAD, ErrorCode, Header, MsgType, ReduceOp

TOKEN = "misuse-token"
JOB = 0x51
MiB = 1 << 20


def new_reducer(world: int = 2, **limits) -> Reducer:
    return Reducer(CapturingSocket(), world_size=world, job_token=TOKEN, **limits)


def send(reducer: Reducer, identity: bytes, *frames: bytes) -> None:
    reducer.handle([zmq.Frame(identity), *(zmq.Frame(f) for f in frames)])


def hello(reducer: Reducer, identity: bytes, rank: int, world: int = 2, **facts) -> None:
    payload = hello_payload(**facts)
    send(reducer, identity, protocol.text_header(MsgType.HELLO, payload, rank=rank, world=world, job=JOB), payload)


def auth_with(reducer: Reducer, identity: bytes, rank: int, world: int = 2, token: str = TOKEN) -> None:
    peer = reducer.members.peers[identity]
    proof = auth.worker_proof(token, peer.nonce, job=JOB, generation=0, rank=rank, world=world)
    send(reducer, identity, protocol.text_header(MsgType.AUTH, proof, rank=rank, world=world, job=JOB), proof)


def admit(reducer: Reducer, identity: bytes, rank: int, world: int = 2) -> None:
    hello(reducer, identity, rank, world)
    auth_with(reducer, identity, rank, world)
    assert reducer.members.admitted(identity) is not None


def answers(reducer: Reducer) -> List[Tuple[bytes, Header, bytes]]:
    """What the reducer sent since the last call: (identity, header, payload or b"")."""
    sent = [(m[0], protocol.unpack(m[1]), m[2] if len(m) > 2 else b"") for m in reducer.socket.sent]
    reducer.socket.sent.clear()
    return sent


def errors(reducer: Reducer) -> List[Tuple[bytes, ErrorCode, str]]:
    return [(who, ErrorCode(h.aux), text.decode()) for who, h, text in answers(reducer) if h.type is MsgType.ERROR]


def progress(reducer: Reducer, identity: bytes, rank: int, seq: int) -> None:
    payload = protocol.seq_pairs_payload([(0, seq)])
    send(reducer, identity, protocol.text_header(MsgType.PROGRESS, payload, rank=rank, world=2, job=JOB), payload)


def joins(reducer: Reducer) -> dict:
    """identity -> the boundary of group 0 each JOIN since the last call named."""
    return {who: protocol.seq_pairs(payload)[0] for who, h, payload in answers(reducer) if h.type is MsgType.JOIN}


# -- strangers ------------------------------------------------------------------------------
def test_a_flood_of_hellos_keeps_a_bounded_number_and_none_of_their_padding(monkeypatch):
    """A HELLO needs no token, so what the reducer keeps for it until AUTH must stay small:
    only the host and pid of its JSON, and at most MAX_PENDING_HELLOS of them (the oldest go).
    Once 7,437 HELLOs of 60 KiB in 10 s took a live reducer from 39 MB to 494 MB."""
    monkeypatch.setattr(admission_module, "MAX_PENDING_HELLOS", 100)
    reducer = new_reducer()
    pad = "x" * (60 * 1024)
    for i in range(300):
        hello(reducer, b"s%d" % i, 0, host="h" * 1000, pid=1234, pad=pad)
    assert sorted(reducer.members.peers) == sorted(b"s%d" % i for i in range(200, 300))
    assert len(reducer.admission.pending) == 100
    peer = reducer.members.peers[b"s299"]
    assert peer.info == {"host": "h" * 256, "pid": 1234}  # nothing else of the 61 KiB
    answers(reducer)
    auth_with(reducer, b"s299", 0)  # a HELLO kept is answered as ever
    assert reducer.members.admitted(b"s299") is not None
    assert b"s299" not in reducer.admission.pending and len(reducer.admission.pending) == 99
    send(reducer, b"s0", protocol.text_header(MsgType.AUTH, b"x" * 32, rank=0, world=2, job=JOB), b"x" * 32)
    assert [(code, "AUTH without a HELLO" in text) for _, code, text in errors(reducer)] == [
        (ErrorCode.MALFORMED, True)
    ]
    # the rest go after FORGET_AFTER_S of silence, the admitted one stays
    reducer.admission.forget_strangers(reducer.clock.now + FORGET_AFTER_S + 1)
    assert list(reducer.members.peers) == [b"s299"] and not reducer.admission.pending


def test_a_connection_that_keeps_failing_authentication_is_ignored_and_logged_at_a_bounded_rate(caplog):
    """A wrong proof counts as a malformed message does: after MAX_STRIKES the connection gets no
    answer at all, so it cannot make the reducer prove the token and log for ever."""
    reducer = new_reducer()
    logger = logging.getLogger("reduction_server")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="reduction_server"):
            for _ in range(MAX_STRIKES + 5):
                hello(reducer, b"rogue", 0)
                if b"rogue" in reducer.members.peers:
                    auth_with(reducer, b"rogue", 0, token="not-the-token")
    finally:
        logger.removeHandler(caplog.handler)
    kinds = [h.type for _, h, _ in answers(reducer)]
    assert kinds == [MsgType.CHALLENGE, MsgType.REJECT] * MAX_STRIKES  # then silence
    assert reducer.admission.ignored(b"rogue")
    logged = [r.getMessage() for r in caplog.records]
    assert sum("auth_failed" in line for line in logged) == 1, logged  # once per 10 s, with a count
    assert sum("peer_dropped" in line for line in logged) == 1
    admit(reducer, b"r0", 0)  # honest workers are admitted as ever
    admit(reducer, b"r1", 1)


def test_a_bad_hello_is_a_strike_too():
    reducer = new_reducer()
    header = protocol.text_header(MsgType.HELLO, b"{}", rank=0, world=2, job=JOB)
    for _ in range(MAX_STRIKES):
        send(reducer, b"rogue", header, b"{}")  # no nonce
    rejects = [text for _, h, text in answers(reducer) if h.type is MsgType.REJECT]
    assert len(rejects) == MAX_STRIKES and all(b"nonce" in text for text in rejects)
    send(reducer, b"rogue", header, b"{}")
    assert answers(reducer) == [] and b"rogue" not in reducer.members.peers


# -- admitted ranks ---------------------------------------------------------------------------
def test_a_second_hello_on_an_admitted_connection_is_refused_and_the_ranks_stay_as_they_were():
    """A worker greets each connection once. A second HELLO, as another rank, once replaced that
    rank's connection while the first rank stayed mapped to it, never lost when it closed."""
    reducer = new_reducer(world=3)
    for rank in range(3):
        admit(reducer, b"r%d" % rank, rank, world=3)
    answers(reducer)
    hello(reducer, b"r1", 2, world=3)
    ((who, h, text),) = answers(reducer)
    assert (who, h.type) == (b"r1", MsgType.REJECT) and b"second HELLO" in text
    assert reducer.members.rank_identity == {0: b"r0", 1: b"r1", 2: b"r2"}
    assert reducer.members.admitted(b"r1").rank == 1


def test_broadcast_roots_count_against_the_memory_budgets_until_sent():
    """The root's frame is kept until every rank has the result: it is charged to the root, so one
    rank cannot pin RS_MAX_ROUNDS frames of RS_MAX_CHUNK_BYTES by never being joined."""
    reducer = new_reducer(max_chunk_bytes=4 * MiB, max_accumulator_bytes=8 * MiB, max_peer_bytes=4 * MiB)
    admit(reducer, b"r0", 0)
    admit(reducer, b"r1", 1)
    answers(reducer)
    payload = np.arange(MiB, dtype=np.float32).tobytes()  # 4 MiB

    def header(rank: int, seq: int, nbytes: int) -> bytes:
        return data(rank, 2, job=JOB, seq=seq, count=MiB, op=ReduceOp.BROADCAST, nbytes=nbytes)

    send(reducer, b"r0", header(0, 1, len(payload)), payload)
    assert reducer.pool.held_bytes == 4 * MiB and reducer.pool.by_rank == {0: 4 * MiB}
    send(reducer, b"r0", header(0, 2, len(payload)), payload)  # rank 0's budget is spent
    ((who, code, text),) = errors(reducer)
    assert (who, code) == (b"r0", ErrorCode.TOO_LARGE) and "RS_MAX_PEER_BYTES" in text
    send(reducer, b"r1", header(1, 1, 0))  # the first broadcast completes
    results = {who: (h.nbytes, body) for who, h, body in answers(reducer) if h.type is MsgType.RESULT}
    assert results == {b"r0": (0, b""), b"r1": (len(payload), payload)}
    assert reducer.pool.held_bytes == 0 and reducer.pool.by_rank == {}
    small = np.arange(16, dtype=np.float32).tobytes()  # a small root frame is copied, and charged as well
    send(reducer, b"r1", data(1, 2, job=JOB, seq=3, count=16, op=ReduceOp.BROADCAST, aux=1), small)
    assert reducer.pool.by_rank == {1: len(small)}
    send(reducer, b"r0", data(0, 2, job=JOB, seq=3, count=16, op=ReduceOp.BROADCAST, aux=1, nbytes=0))
    assert [body for who, h, body in answers(reducer) if who == b"r0"] == [small]
    assert reducer.pool.held_bytes == 0 and reducer.pool.by_rank == {}


@pytest.mark.parametrize("what", ["world", "root"])
def test_a_contribution_outside_the_job_is_refused_and_no_round_is_left_waiting(what: str):
    """A header's world size is the job's: an average divides by it, and a broadcast's root is
    checked against it. A round whose root was rank 2 of a 2-rank job (its headers saying 3
    ranks) once "completed" with no root, an internal error to its last sender, and the other
    rank waited for RS_TIMEOUT."""
    reducer = new_reducer()
    admit(reducer, b"r0", 0)
    admit(reducer, b"r1", 1)
    answers(reducer)
    for rank in (0, 1):
        if what == "world":
            send(reducer, b"r%d" % rank, data(rank, 3, job=JOB, seq=1, count=4), bytes(16))
        else:
            send(reducer, b"r%d" % rank, data(rank, 3, job=JOB, seq=1, count=4, op=ReduceOp.BROADCAST, aux=2, nbytes=0))
    said = errors(reducer)
    assert sorted(who for who, _, _ in said) == [b"r0", b"r1"], said  # each rank hears it, none waits
    assert all(code == ErrorCode.MISMATCH for _, code, _ in said), said
    assert all("saying the world size is 3" in text for _, _, text in said), said
    assert reducer.rounds.open_count == 0
    for rank in (0, 1):  # and the job goes on
        send(reducer, b"r%d" % rank, data(rank, 2, job=JOB, seq=2, count=4), np.ones(4, np.float32).tobytes())
    assert [np.frombuffer(body, np.float32).tolist() for _, h, body in answers(reducer)] == [[2.0] * 4] * 2


# -- PROGRESS and JOIN (a reducer the workers lost and use again) ----------------------------------
def test_a_progress_beyond_any_collective_is_refused_and_the_group_still_agrees():
    """A boundary REJOIN_LEAD past a seq near 2**64 does not fit a JOIN: the report is refused
    (MISMATCH, by name) instead of storing a boundary that failed every later report."""
    reducer = new_reducer()
    admit(reducer, b"r0", 0)
    admit(reducer, b"r1", 1)
    answers(reducer)
    progress(reducer, b"r0", 0, (1 << 64) - 1)
    ((who, code, text),) = errors(reducer)
    assert (who, code) == (b"r0", ErrorCode.MISMATCH) and "beyond any collective" in text
    progress(reducer, b"r0", 0, 7)
    progress(reducer, b"r1", 1, 9)
    assert joins(reducer) == {b"r0": 9 + REJOIN_LEAD, b"r1": 9 + REJOIN_LEAD}


def test_ranks_past_the_boundary_that_lost_the_reducer_again_agree_on_a_new_one():
    """A reducer stopped (not restarted) twice keeps the boundary of the first time. A rank that
    reports a seq past it used the reducer from there and lost it again: the boundary is agreed
    anew, once every member has reported, instead of sending each rank at once to a seq its
    peers left behind. A rank short of it (reconnected before it got there) hears it as before."""
    reducer = new_reducer()
    admit(reducer, b"r0", 0)
    admit(reducer, b"r1", 1)
    answers(reducer)
    progress(reducer, b"r0", 0, 5)
    progress(reducer, b"r1", 1, 3)
    first = 5 + REJOIN_LEAD
    assert joins(reducer) == {b"r0": first, b"r1": first}
    progress(reducer, b"r1", 1, first)  # not past it: the same boundary, at once
    assert joins(reducer) == {b"r1": first}
    progress(reducer, b"r0", 0, first + 10)  # past it: no JOIN until the group agrees again
    assert joins(reducer) == {}
    progress(reducer, b"r1", 1, first + 4)
    assert joins(reducer) == {b"r0": first + 10 + REJOIN_LEAD, b"r1": first + 10 + REJOIN_LEAD}


def _logged_lines(caplog, run) -> List[str]:
    logger = logging.getLogger("reduction_server")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.DEBUG, logger="reduction_server"):
            run()
    finally:
        logger.removeHandler(caplog.handler)
    return [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("refused", ["world out of range", "another world", "an older generation", "rejoin"])
def test_refused_hellos_strike_and_log_a_bounded_number_of_lines(caplog, refused: str):
    """Each refusal of a HELLO was logged at WARNING and answered without a strike: 1,000 refused
    HELLOs on one connection were 1,000 log lines. Now a connection is ignored after MAX_STRIKES,
    and 1,000 connections refused once each leave one line and one summary per interval."""
    reducer = new_reducer(world=2)
    admit(reducer, b"r0", 0)
    reducer.members.job = (JOB, 1)  # serving generation 1: generation 0 is older
    answers(reducer)

    def refuse(identity: bytes) -> None:
        world, facts, generation = 2, {}, 1
        if refused == "world out of range":
            world = 0
        elif refused == "another world":
            world = 3
        elif refused == "an older generation":
            generation = 0
        else:
            facts = {"rejoin": True}
        payload = hello_payload(**facts)
        header = protocol.text_header(
            MsgType.HELLO,
            payload,
            rank=0,
            world=world,
            job=JOB + 1 if refused == "rejoin" else JOB,
            generation=generation,
        )
        send(reducer, identity, header, payload)

    def one_connection() -> None:
        for _ in range(1000):
            refuse(b"rogue")
        reducer.clock.now += 11
        reducer.outbox.throttle.flush()

    lines = _logged_lines(caplog, one_connection)
    kinds = [h.type for _, h, _ in answers(reducer)]
    assert kinds == [MsgType.REJECT] * MAX_STRIKES  # then silence
    assert reducer.admission.ignored(b"rogue")
    assert (
        sum(line.startswith("rejected ") for line in lines) == 1 and sum("peer_dropped" in line for line in lines) == 1
    )
    assert f"suppressed what=rejected lines={MAX_STRIKES - 1} interval_s=10.0" in lines and len(lines) == 3, lines
    caplog.clear()

    def many_connections() -> None:
        for i in range(1000):
            refuse(b"rogue-%d" % i)
        reducer.clock.now += 11  # the next tick after the interval writes the count
        reducer.outbox.throttle.flush()

    lines = _logged_lines(caplog, many_connections)
    assert len(answers(reducer)) == 1000  # each is still told why
    assert [line for line in lines if "rejected" in line or "suppressed" in line] == [
        lines[0],
        "suppressed what=rejected lines=999 interval_s=10.0",
    ], lines
    assert len(lines) == 2, lines


def test_nothing_a_stranger_is_told_names_the_job_served():
    reducer = new_reducer(world=2)
    admit(reducer, b"r0", 0)
    answers(reducer)
    payload = hello_payload(rejoin=True)
    send(reducer, b"stranger", protocol.text_header(MsgType.HELLO, payload, rank=1, world=2, job=JOB + 1), payload)
    send(reducer, b"stranger2", protocol.text_header(MsgType.PING, b""))
    told = [payload for _, _, payload in answers(reducer)]
    assert len(told) == 2 and not [text for text in told if f"{JOB:#x}".encode() in text], told
