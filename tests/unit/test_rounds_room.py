"""The reducer's Rounds driven in process (helpers/rooms.py): each transition of a round, and what
it sends to whom. A round opens with its key's first contribution, completes when all W ranks
have contributed (the result to every rank), or fails (a disagreement, a duplicate, a lost rank,
a skipped collective, RS_TIMEOUT, a cap) and answers every rank once with the same ERROR, late
ones included, until it is forgotten; failed rounds kept are bounded (MAX_FAILED_ROUNDS)."""

from __future__ import annotations

import numpy as np

from helpers.rooms import identity_of, reducer_rooms
from reduction_server.reducer import rounds as rounds_module
from reduction_server.reducer.rounds import RETAIN_FAILED_S
from reduction_server.wire.protocol import DType, ErrorCode, MsgType, ReduceOp

F32 = DType.FLOAT32


def _results(sent):
    """identity -> the elements of the RESULT it was sent (every message sent must be a RESULT)."""
    assert all(m.type is MsgType.RESULT for m in sent), [(m.type.name, m.payload[:200]) for m in sent]
    return {m.to: m.array(F32).tolist() for m in sent}


# -- OPEN -> complete ------------------------------------------------------------------------------
def test_a_round_opens_with_its_first_contribution_and_sends_nothing_until_every_rank_contributed():
    r = reducer_rooms(3)
    p = r.admit_all(3)
    r.contribute(p[0], [1, 2, 3, 4])
    r.contribute(p[2], [100, 200, 300, 400])
    assert r.rounds.open_count == 1 and r.outbox.take() == []
    (key,) = r.rounds.rounds
    assert key[3:] == (0, 0)  # seq 0, chunk 0
    assert r.pool.in_use_bytes > 0  # its accumulator
    r.contribute(p[1], [10, 20, 30, 40])
    assert _results(r.outbox.take()) == {identity_of(k): [111, 222, 333, 444] for k in range(3)}
    assert r.rounds.rounds == {} and r.rounds.open_count == 0
    assert (r.rounds.completed, r.rounds.failed) == (1, 0)
    assert r.pool.in_use_bytes == 0  # the accumulator went back


def test_rounds_of_different_keys_complete_independently_in_any_order():
    r = reducer_rooms(2)
    p0, p1 = r.admit_all(2)
    r.contribute(p0, [1] * 4, seq=0)
    r.contribute(p0, [2] * 4, seq=1)
    r.contribute(p1, [20] * 4, seq=1)
    sent = r.outbox.take()
    assert [(m.to, m.header.seq) for m in sent] == [(identity_of(0), 1), (identity_of(1), 1)]
    assert _results(sent) == {identity_of(0): [22.0] * 4, identity_of(1): [22.0] * 4}
    assert r.rounds.open_count == 1  # seq 0 still waits for rank 1
    r.contribute(p1, [10] * 4, seq=0)
    assert _results(r.outbox.take()) == {identity_of(0): [11.0] * 4, identity_of(1): [11.0] * 4}
    assert r.rounds.completed == 2 and not r.rounds.rounds


# -- OPEN -> FAILED -> forgotten ----------------------------------------------------------------------
def test_a_mismatched_header_fails_the_round_for_every_rank_and_a_late_rank_hears_the_same():
    r = reducer_rooms(3)
    p = r.admit_all(3)
    r.contribute(p[0], [1, 2, 3, 4])
    r.contribute(p[1], [1, 2, 3])  # another count: the ranks disagree on the collective
    errors = r.outbox.errors()
    assert sorted(errors) == [identity_of(0), identity_of(1)]
    (first,), (second,) = errors[identity_of(0)], errors[identity_of(1)]
    assert first.code is second.code is ErrorCode.MISMATCH
    assert first.text == second.text
    assert first.text.startswith("reducer 0: contributions to collective seq=0 chunk=0/1")
    assert "ranks [0] sent" in first.text and "count=4" in first.text and "ranks [1] sent" in first.text
    assert (first.header.seq, first.header.chunk) == (0, 0)  # the ERROR repeats the key it is about
    # Kept, without its memory, until rank 2 has been answered too.
    assert r.rounds.failed_kept == 1 and r.rounds.open_count == 0 and r.pool.in_use_bytes == 0
    r.contribute(p[2], [1, 2, 3, 4])
    (late,) = r.outbox.errors()[identity_of(2)]
    assert late.code is ErrorCode.MISMATCH and late.text == first.text
    assert r.rounds.rounds == {} and r.rounds.failed_kept == 0  # every rank answered: forgotten
    assert r.rounds.failed == 1 and r.rounds.failed_codes == {"MISMATCH": 1}


def test_a_rank_that_contributes_twice_fails_the_round_as_a_duplicate():
    r = reducer_rooms(3)
    p = r.admit_all(3)
    r.contribute(p[0], [1, 2, 3, 4])
    r.contribute(p[0], [1, 2, 3, 4])
    errors = r.outbox.errors()
    assert sorted(errors) == [identity_of(0)]
    # every message has its answer: both of rank 0's, with the same error
    assert [e.code for e in errors[identity_of(0)]] == [ErrorCode.DUPLICATE] * 2
    assert {e.text for e in errors[identity_of(0)]} == {
        "reducer 0: rank 0 contributed twice to collective seq=0 chunk=0/1 (job=0x7e57, generation=0)"
    }
    for rank in (1, 2):
        r.contribute(p[rank], [1, 2, 3, 4])
        assert [e.code for e in r.outbox.errors()[identity_of(rank)]] == [ErrorCode.DUPLICATE]
    assert r.rounds.rounds == {}


def test_a_round_that_waits_longer_than_the_timeout_fails_stale_naming_who_did_not_contribute():
    r = reducer_rooms(3, round_timeout=30.0)
    p = r.admit_all(3)
    r.contribute(p[0], [1] * 4)
    r.contribute(p[2], [1] * 4)
    r.rounds.expire(r.clock.now + 20.0)  # not yet
    assert r.outbox.take() == [] and r.rounds.open_count == 1
    r.rounds.expire(r.clock.advance(31.0))
    errors = r.outbox.errors()
    assert sorted(errors) == [identity_of(0), identity_of(2)]
    for (error,) in errors.values():
        assert error.code is ErrorCode.STALE
        assert "timed out after 30 s: ranks [0, 2] contributed, ranks [1] did not" in error.text, error.text
    assert r.rounds.failed_kept == 1 and r.pool.in_use_bytes == 0
    r.contribute(p[1], [1] * 4)  # the straggler hears the same as soon as it contributes
    (late,) = r.outbox.errors()[identity_of(1)]
    assert late.code is ErrorCode.STALE and late.text == errors[identity_of(0)][0].text
    assert r.rounds.rounds == {}


def test_the_timeout_is_measured_on_the_reducers_clock():
    r = reducer_rooms(2, round_timeout=5.0, now=0.0)  # a fake clock, far from time.monotonic()
    p0, _ = r.admit_all(2)
    r.contribute(p0, [1] * 4)
    r.clock.advance(6.0)
    r.rounds.expire(r.clock.now)
    errors = r.outbox.errors()
    assert identity_of(0) in errors, f"6 s on the clock after it opened, the round is still open: {errors}"
    assert [e.code for e in errors[identity_of(0)]] == [ErrorCode.STALE]


def test_a_failed_round_that_some_rank_never_answers_is_forgotten_after_its_retention():
    timeout = 5.0
    r = reducer_rooms(2, round_timeout=timeout)
    p0, _ = r.admit_all(2)
    r.contribute(p0, [1] * 4)
    failed_at = r.clock.advance(timeout + 1)
    r.rounds.expire(failed_at)
    assert r.outbox.errors()[identity_of(0)][0].code is ErrorCode.STALE
    retain = RETAIN_FAILED_S + 2 * timeout
    r.rounds.expire(failed_at + retain - 0.5)
    assert r.rounds.failed_kept == 1  # still kept to answer rank 1 alike
    r.rounds.expire(failed_at + retain)
    assert r.rounds.rounds == {} and r.rounds.failed_kept == 0
    assert r.outbox.take() == []  # forgetting sends nothing


def test_a_lost_rank_fails_the_open_rounds_it_did_not_contribute_to_and_new_ones_at_once():
    r = reducer_rooms(3)
    p = r.admit_all(3)
    r.contribute(p[0], [1] * 4, seq=0)
    r.contribute(p[1], [1] * 4, seq=1)
    r.contribute(p[2], [1] * 4, seq=1)
    r.members.lose_rank(1, "it closed its communicator (BYE)")
    errors = r.outbox.errors()
    # seq 1 had rank 1's contribution and waits for rank 0 only: it may still complete.
    assert sorted(errors) == [identity_of(0)]
    (error,) = errors[identity_of(0)]
    assert error.code is ErrorCode.LOST and error.header.seq == 0
    assert "cannot complete: rank 1 was lost: it closed its communicator (BYE)" in error.text, error.text
    r.contribute(p[0], [1] * 4, seq=1)  # rank 1 is lost but had contributed: the others get the result
    sent = r.outbox.take()
    assert {m.to for m in sent} == {identity_of(0), identity_of(2)}
    assert all(m.type is MsgType.RESULT and m.array(F32).tolist() == [3.0] * 4 for m in sent)
    r.contribute(p[2], [1] * 4, seq=2)  # a round that needs the lost rank fails as it opens
    (error,) = r.outbox.errors()[identity_of(2)]
    assert error.code is ErrorCode.LOST and "rank 1 was lost" in error.text


def test_a_round_skipped_by_a_rank_that_went_on_to_a_later_collective_fails_before_the_timeout():
    r = reducer_rooms(2)
    p0, p1 = r.admit_all(2)
    r.contribute(p0, [1] * 4, seq=3)
    r.contribute(p1, [1] * 4, seq=4)  # rank 1 went on: seq 3 failed on its side
    r.rounds.check_skipped()
    errors = r.outbox.errors()
    assert sorted(errors) == [identity_of(0)]  # the one rank that contributed to seq 3
    (error,) = errors[identity_of(0)]
    assert error.code is ErrorCode.LOST and error.header.seq == 3
    assert "ranks [1] went on to later collectives without contributing" in error.text, error.text
    assert "ranks [0] contributed" in error.text
    # seq 4 waits for rank 0, which has not gone past it: it stays open, and completes.
    assert r.rounds.open_count == 1
    r.contribute(p0, [2] * 4, seq=4)
    assert _results(r.outbox.take()) == {identity_of(0): [3.0] * 4, identity_of(1): [3.0] * 4}


def test_contributions_over_the_chunk_cap_or_with_a_bad_payload_fail_the_round_for_all():
    r = reducer_rooms(2, max_chunk_bytes=64)
    p0, p1 = r.admit_all(2)
    r.contribute(p0, [1] * 16, seq=0)  # 64 bytes: at the cap
    r.contribute(p1, [1] * 17, seq=1)  # over it
    (error,) = r.outbox.errors()[identity_of(1)]
    assert error.code is ErrorCode.TOO_LARGE and "over this reducer's limit of 64 bytes per chunk" in error.text
    r.contribute(p1, [1] * 16, seq=0, bad_payload="header announces 64 payload bytes but 3 arrived")
    errors = r.outbox.errors()
    assert sorted(errors) == [identity_of(0), identity_of(1)]
    assert {e.code for (e,) in errors.values()} == {ErrorCode.BAD_PAYLOAD}
    assert all("but 3 arrived" in e.text for (e,) in errors.values())


# -- limits -----------------------------------------------------------------------------------------------
def test_a_new_round_past_the_rounds_cap_fails_and_the_open_ones_still_complete():
    r = reducer_rooms(2, max_rounds=2)
    p0, p1 = r.admit_all(2)
    r.contribute(p0, [1] * 4, seq=0)
    r.contribute(p0, [1] * 4, seq=1)
    r.contribute(p0, [1] * 4, seq=2)
    (error,) = r.outbox.errors()[identity_of(0)]
    assert error.code is ErrorCode.TOO_LARGE and error.header.seq == 2
    assert "2 chunks of collectives were in flight on this reducer, its cap (RS_MAX_ROUNDS=2)" in error.text
    r.contribute(p1, [1] * 4, seq=2)  # the other rank hears the same
    (late,) = r.outbox.errors()[identity_of(1)]
    assert late.code is ErrorCode.TOO_LARGE and late.text == error.text
    for seq in (0, 1):
        r.contribute(p1, [2] * 4, seq=seq)
    assert [(m.type, m.header.seq) for m in r.outbox.take()] == [(MsgType.RESULT, 0)] * 2 + [(MsgType.RESULT, 1)] * 2


def test_failed_rounds_kept_are_bounded_and_the_oldest_go_first(monkeypatch):
    monkeypatch.setattr(rounds_module, "MAX_FAILED_ROUNDS", 3)
    r = reducer_rooms(2, round_timeout=5.0)
    p0, _ = r.admit_all(2)
    for seq in range(5):
        r.contribute(p0, [1] * 4, seq=seq)
    r.rounds.expire(r.clock.advance(6.0))  # all five time out; rank 1 never answers any
    assert len(r.outbox.errors()[identity_of(0)]) == 5
    assert sorted(key[3] for key in r.rounds.rounds) == [2, 3, 4]
    assert r.rounds.failed_kept == 3 and r.rounds.open_count == 0


def test_a_new_job_drops_every_round_and_gives_their_memory_back():
    r = reducer_rooms(2)
    p0, _ = r.admit_all(2)
    r.contribute(p0, [1] * 4, seq=0)
    r.contribute(p0, [1] * 4, seq=1)
    assert r.pool.in_use_bytes > 0
    assert r.rounds.drop_all() == 2
    assert r.rounds.rounds == {} and r.rounds.open_count == 0 and r.pool.in_use_bytes == 0
    assert r.outbox.take() == []


def test_a_contribution_to_an_unannounced_group_is_refused_to_its_sender_alone():
    r = reducer_rooms(2)
    p0, _ = r.admit_all(2)
    r.contribute(p0, [1] * 4, group=0x99)
    (error,) = r.outbox.errors()[identity_of(0)]
    assert error.code is ErrorCode.MISMATCH and "a group none of its ranks announced (GROUP)" in error.text
    assert r.rounds.rounds == {}  # no round of the group was opened


def test_an_average_is_divided_by_the_world_size():
    r = reducer_rooms(4)
    p = r.admit_all(4)
    for rank in range(4):
        r.contribute(p[rank], [rank * 4.0] * 4, op=ReduceOp.AVG)
    sent = r.outbox.take()
    assert len(sent) == 4 and all(np.array_equal(m.array(F32), [6.0] * 4) for m in sent)
