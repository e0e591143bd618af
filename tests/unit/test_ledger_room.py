"""The worker engine's Ledger driven in process (helpers/rooms.py): collectives in flight and every
way one ends. Chunks are "sent" as the pump sends them and "answered" as the inbox hands answers
on (Ledger.pending_chunk, then chunk_done); a collective completes once every chunk is answered,
fails with its lowest chunk's error, on its own time limit, on the backstop (no progress), when
a reducer is lost, or when the engine stops; late answers are dropped, windows freed."""

from __future__ import annotations

import time

import pytest

from helpers.rooms import JOB, answer, collective, result_header, send_chunks, worker_rooms
from reduction_server.client.engine.collective import ANSWERED, SENT, UNSENT
from reduction_server.errors import CollectiveError


def _error(coll) -> str:
    assert coll.future.done(), "the collective has not ended"
    exc = coll.future.exception(timeout=0)
    assert isinstance(exc, CollectiveError), exc
    return str(exc)


def test_a_collective_started_is_active_and_queued_for_sending_in_its_group():
    ledger, _ = worker_rooms(2)
    a, b = collective(0, [0, 1]), collective(0, [0, 1], group=7)
    ledger.start(a)
    ledger.start(b)
    assert ledger.active == {(0, 0): a, (7, 0): b}
    assert list(ledger.sending[0]) == [a] and list(ledger.sending[7]) == [b]
    assert ledger.next_seq == {0: 1, 7: 1}
    assert ledger.window(0) == [0, 0] and ledger.window(7) == [0, 0]  # each group has its own window


def test_a_collective_completes_when_every_chunk_is_answered_and_frees_its_window():
    ledger, _ = worker_rooms(2)
    ends, results = [], []
    ledger.on_end = ends.append
    ledger.on_result = lambda coll, k, r, held: results.append((k, r))
    coll = collective(0, [0, 1, 0])
    ledger.start(coll)
    send_chunks(ledger, coll)
    assert ledger.window(0) == [2, 1]
    assert answer(ledger, coll, 2) and answer(ledger, coll, 0)
    assert not coll.future.done() and ends == [] and ledger.window(0) == [0, 1]
    assert answer(ledger, coll, 1)
    assert coll.future.result(timeout=0) is coll.result
    assert ends == [coll] and results == [(2, 0), (0, 0), (1, 1)]
    assert ledger.active == {} and ledger.window(0) == [0, 0] and bytes(coll.state) == bytes([ANSWERED] * 3)


def test_answers_that_do_not_match_a_chunk_in_flight_are_dropped():
    ledger, _ = worker_rooms(2)
    coll = collective(5, [0, 1])
    ledger.start(coll)
    send_chunks(ledger, coll, [0])
    assert ledger.pending_chunk(result_header(coll, 1, 1), 1) is None  # chunk 1 was not sent
    assert ledger.pending_chunk(result_header(coll, 0, 1), 1) is None  # chunk 0 is on reducer 0, not 1
    assert ledger.pending_chunk(result_header(coll, 0, 0, job=JOB + 1), 0) is None  # another job's
    assert ledger.pending_chunk(result_header(collective(6, [0, 1]), 0, 0), 0) is None  # no such seq
    assert ledger.pending_chunk(result_header(coll, 0, 0), 0) is coll
    assert answer(ledger, coll, 0)
    assert not answer(ledger, coll, 0)  # answered already: a second answer is late
    assert coll.answered == 1 and ledger.window(0) == [0, 0]


def test_a_chunk_error_fails_the_collective_once_every_chunk_is_answered_with_the_lowest_chunks_error():
    ledger, _ = worker_rooms(2)
    ends = []
    ledger.on_end = ends.append
    coll = collective(3, [0, 1, 0, 1])
    ledger.start(coll)
    send_chunks(ledger, coll)
    answer(ledger, coll, 3, error="reducer 1: late")
    answer(ledger, coll, 1, error="reducer 1: first")
    answer(ledger, coll, 0)
    assert not coll.future.done()  # chunk 2 is still out: its answer must not land in a buffer handed back
    answer(ledger, coll, 2)
    text = _error(coll)
    assert text == (
        "rank 0: collective seq=3 (all_reduce sum of 16 x float32) failed: chunk 1 on reducer 1 "
        "(127.0.0.1:7001): reducer 1: first (and 1 more chunk errors)"
    )
    assert ends == [coll] and ledger.active == {} and ledger.window(0) == [0, 0]


def test_a_collective_past_its_own_time_limit_fails_naming_it_and_frees_its_window():
    ledger, _ = worker_rooms(2)
    coll = collective(0, [0, 1], time_limit=2.0)
    other = collective(1, [1, 0])
    for c in (coll, other):
        ledger.start(c)
        send_chunks(ledger, c)
    answer(ledger, coll, 0)
    ledger.expire(time.monotonic(), backstop=60, timeout=30)
    assert not coll.future.done()
    ledger.expire(coll.deadline, backstop=60, timeout=30)
    assert "failed: Timed out after 2 s (the timeout it was given): 1 of 2 chunks had completed" in _error(coll)
    assert not other.future.done() and list(ledger.active) == [(0, 1)]
    assert ledger.window(0) == [1, 1]  # other's two chunks only
    assert not answer(ledger, coll, 1)  # a late answer to it is dropped


def test_a_collective_with_chunks_out_and_no_progress_for_the_backstop_fails_naming_the_silent_reducers():
    ledger, _ = worker_rooms(3)
    coll = collective(0, [0, 1, 2, 1])
    ledger.start(coll)
    send_chunks(ledger, coll)
    answer(ledger, coll, 0)
    progress = coll.last_progress
    ledger.expire(progress + 9.9, backstop=10, timeout=8)
    assert not coll.future.done()
    ledger.expire(progress + 10, backstop=10, timeout=8)
    assert _error(coll).endswith(
        "failed: no answer for 10 s (RS_TIMEOUT=8 and a margin) from reducer 1 (127.0.0.1:7001), "
        "reducer 2 (127.0.0.1:7002); 1 of 4 chunks had completed"
    )
    assert ledger.active == {} and ledger.window(0) == [0, 0, 0]


def test_a_collective_that_waits_for_window_slots_is_not_failed_by_the_backstop():
    ledger, _ = worker_rooms(2)
    coll = collective(0, [0, 1])
    ledger.start(coll)  # nothing sent: earlier collectives hold the window
    ledger.expire(coll.last_progress + 1000, backstop=10, timeout=8)
    assert not coll.future.done() and list(ledger.active) == [(0, 0)]


def test_a_lost_reducer_fails_the_collectives_with_chunks_pending_on_it_and_no_others():
    ledger, _ = worker_rooms(3)
    on_1_sent, on_1_unsent, elsewhere = collective(0, [0, 1]), collective(1, [1, 2]), collective(2, [0, 2])
    for c in (on_1_sent, on_1_unsent, elsewhere):
        ledger.start(c)
    send_chunks(ledger, on_1_sent)
    send_chunks(ledger, elsewhere)
    send_chunks(ledger, on_1_unsent, [1])  # its chunk on reducer 1 is not sent yet
    ledger.fail_pending_on(1, "reducer 1 was lost: its connection closed")
    for c in (on_1_sent, on_1_unsent):
        assert _error(c).endswith("failed: reducer 1 was lost: its connection closed")
    assert not elsewhere.future.done() and list(ledger.active) == [(0, 2)]
    assert ledger.window(0) == [1, 0, 1]  # elsewhere's chunks; nothing counted on reducer 1
    assert list(ledger.sending[0]) == [elsewhere]


def test_unreadable_answers_fail_only_the_collectives_with_a_chunk_sent_to_that_reducer():
    ledger, _ = worker_rooms(2)
    sent, unsent = collective(0, [0, 1]), collective(1, [1, 0])
    for c in (sent, unsent):
        ledger.start(c)
    send_chunks(ledger, sent)
    send_chunks(ledger, unsent, [1])  # chunk 0 on reducer 1 not sent
    ledger.fail_sent_to(1, "its answer could not be read")
    assert "failed: its answer could not be read" in _error(sent)
    assert not unsent.future.done()
    assert bytes(unsent.state) == bytes([UNSENT, SENT])


def test_the_engine_stopping_fails_every_collective_in_flight_and_queued():
    ledger, _ = worker_rooms(2)
    coll, queued = collective(0, [0, 1]), collective(1, [0, 1])
    ledger.start(coll)
    send_chunks(ledger, coll)
    ledger.fail_all("the communicator was closed", [queued])
    for c in (coll, queued):
        assert _error(c) == f"rank 0: {c.describe()} failed: the communicator was closed"
    assert ledger.active == {} and ledger.window(0) == [0, 0] and not ledger.sending[0]


def test_a_collective_that_completed_is_never_failed_after():
    ledger, _ = worker_rooms(1)
    coll = collective(0, [0])
    ledger.start(coll)
    send_chunks(ledger, coll)
    answer(ledger, coll, 0)
    ledger.fail(coll, "too late")
    assert coll.future.exception(timeout=0) is None


def test_a_collective_whose_end_hook_raises_still_fails_its_caller():
    """on_end (kept.py copying results out) raising while a failure is being reported must not
    leave the caller waiting."""
    ledger, _ = worker_rooms(2)

    def broken(coll):
        raise RuntimeError("copy failed")

    ledger.on_end = broken
    coll = collective(0, [0, 1])
    ledger.start(coll)
    send_chunks(ledger, coll)
    with pytest.raises(RuntimeError, match="copy failed"):
        ledger.give_up(coll, "reducer 1 was lost")
    assert "failed: reducer 1 was lost" in _error(coll)
    assert ledger.active == {} and ledger.window(0) == [0, 0]
