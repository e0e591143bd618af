"""The worker engine's Failover driven in process with its Ledger (helpers/rooms.py): a reducer
lost, where its chunks go (the first reducer not lost in each chunk's preference order, the same
on every rank), what is sent again (MOVED: chunks it had not answered; FINAL: results it had
given), collectives stranded when no reducer is left, spares that join from a boundary (JOIN),
and a lost reducer that comes back and holds collectives until every rank agrees from when."""

from __future__ import annotations

import numpy as np

from helpers.rooms import COUNT, ME, answer, collective, endpoint_of, send_chunks, worker_rooms
from reduction_server.client.engine.collective import SENT, UNSENT
from reduction_server.client.engine.kept import Kept
from reduction_server.wire import protocol
from reduction_server.wire.protocol import REJOIN_LEAD, MsgType

LOST = "reducer 0 (127.0.0.1:7000) was lost: its connection closed"


def _reducers(coll):
    return [endpoint_of(chunk) for chunk in coll.chunks]


def _with_results(coll):
    """coll's result buffer holds 1000 + its index, as if the reducers had written the results."""
    coll.result[:] = 1000 + np.arange(coll.total)
    return coll


# -- a reducer lost: where chunks go, what is sent again -------------------------------------------
def test_a_lost_reducers_chunks_move_to_their_substitutes_and_its_unanswered_ones_are_sent_again():
    ledger, failover = worker_rooms(3)
    coll = collective(0, [0, 1, 2, 0, 1, 2])  # chunk k on reducer (0 + k) mod 3
    ledger.start(coll)
    send_chunks(ledger, coll, [0, 1, 2])  # 3, 4, 5 wait for window slots
    answer(ledger, coll, 1)
    assert ledger.window(0) == [1, 0, 1]
    stranded = failover.move_off(0, LOST, ledger)
    assert stranded == []
    # Chunk 0 (position 0: preference 0, 1, 2) goes to reducer 1; chunk 3 (position 3: 0, 2, 1) to
    # reducer 2: a lost reducer's chunks spread over the others. Chunks on reducers up never move.
    assert _reducers(coll) == [1, 1, 2, 2, 1, 2]
    assert list(coll.moved) == [1, 0, 0, 1, 0, 0]
    # Chunk 0 was sent and not answered: it is sent again (MOVED), outside any window; chunk 3
    # was never sent and goes out as any other chunk.
    assert list(failover.resend) == [(coll, 0)]
    assert coll.state[0] == UNSENT and coll.state[3] == UNSENT and coll.state[2] == SENT
    assert ledger.window(0) == [0, 0, 1]
    assert failover.lost == {0: LOST} and failover.losses == 1 and failover.rerouting
    assert failover.still_owed(coll, 0)
    # The substitute answers it: the collective completes there.
    send_chunks(ledger, coll, [0, 3, 4, 5])
    for k in (0, 2, 3, 4, 5):
        assert answer(ledger, coll, k)
    assert coll.future.result(timeout=0) is coll.result


def test_the_results_a_lost_reducer_gave_are_brought_to_its_substitute_as_finals():
    ledger, failover = worker_rooms(2)
    done = _with_results(collective(0, [0, 1]))
    ledger.start(done)
    send_chunks(ledger, done)
    answer(ledger, done, 0)
    answer(ledger, done, 1)
    assert done.future.done()
    done.result[:] = -1  # the caller writes over its buffer: the kept results were copied out as it ended
    inflight = collective(1, [1, 0])
    ledger.start(inflight)
    send_chunks(ledger, inflight)
    from_0 = list(failover.results.kept[0, 0])  # kept by (group, reducer)
    assert [(item.seq, item.chunk) for item in from_0] == [(0, 0)]
    failover.move_off(0, LOST, ledger)
    # What reducer 0 had not answered (MOVED), then what it had answered this rank (FINAL): the
    # results of reducer 1 are not sent anywhere.
    assert len(failover.resend) == 2 and failover.resend[0] == (inflight, 1)
    kept = failover.resend[1]
    assert isinstance(kept, Kept) and kept is from_0[0] and (0, 0) not in failover.results.kept
    assert np.frombuffer(kept.data, np.float32, COUNT).tolist() == [1000, 1001, 1002, 1003]
    assert failover.bring(kept) == 1  # chunk 0 of seq 0: preference 0, 1
    assert failover.results.brought == {(0, 1): [kept]}  # kept there: reducer 1 may be lost in turn
    h = protocol.unpack(kept.final_header(ME))
    assert h.type is MsgType.FINAL
    assert (h.seq, h.chunk, h.nchunks, h.offset, h.count, h.total, h.nbytes) == (
        0,
        0,
        2,
        0,
        COUNT,
        2 * COUNT,
        4 * COUNT,
    )
    assert (h.rank, h.world, h.job) == (ME.rank, ME.world, ME.job)


def test_a_reducer_lost_in_turn_takes_on_what_was_brought_to_it():
    ledger, failover = worker_rooms(3)
    done = _with_results(collective(0, [0, 1, 2]))
    ledger.start(done)
    send_chunks(ledger, done)
    for k in range(3):
        answer(ledger, done, k)
    failover.move_off(0, LOST, ledger)
    (kept,) = [item for item in failover.resend if isinstance(item, Kept)]
    failover.resend.clear()
    assert failover.bring(kept) == 1
    failover.move_off(1, "reducer 1 was lost", ledger)
    # Reducer 1's own result of chunk 1, and the one brought to it: both go on to reducer 2.
    taken = [(item.seq, item.chunk) for item in failover.resend]
    assert sorted(taken) == [(0, 0), (0, 1)]
    assert [failover.bring(item) for item in failover.resend] == [2, 2]
    assert failover.reason() == "reducer 0 (127.0.0.1:7000) was lost: its connection closed; reducer 1 was lost"


def test_with_no_reducer_left_the_collectives_in_flight_are_stranded():
    ledger, failover = worker_rooms(2)
    coll = collective(0, [0, 1])
    ledger.start(coll)
    send_chunks(ledger, coll)
    assert failover.move_off(0, LOST, ledger) == []
    assert _reducers(coll) == [1, 1]
    assert failover.survivors(without=1) == []
    assert failover.move_off(1, "reducer 1 was lost", ledger) == [coll]
    assert not failover.place(collective(1, [1, 0]))  # a new collective has nowhere to go either
    failover.reset()  # every reducer lost: start afresh, as every rank does
    assert failover.lost == {} and not failover.resend and not failover.rerouting


def test_a_collective_starting_after_a_loss_is_placed_on_the_substitutes():
    ledger, failover = worker_rooms(3)
    failover.move_off(1, "reducer 1 was lost", ledger)
    coll = collective(4, [1, 2, 0])  # position 4: preference 1, 0, 2; 5: 2, ...; 6: 0, ...
    assert failover.place(coll)
    assert _reducers(coll) == [0, 2, 0] and list(coll.moved) == [1, 0, 0]


def test_a_resend_is_no_longer_owed_once_its_collective_has_failed():
    ledger, failover = worker_rooms(2)
    coll = collective(0, [0, 1])
    ledger.start(coll)
    send_chunks(ledger, coll)
    failover.move_off(0, LOST, ledger)
    assert failover.still_owed(coll, 0)
    ledger.give_up(coll, "timed out")
    assert not failover.still_owed(coll, 0)


def test_results_are_kept_a_window_deep_per_group_and_reducer_and_deeper_after_each_loss():
    ledger, failover = worker_rooms(2, window=2)
    for seq in range(4):
        coll = collective(seq, [0])
        ledger.start(coll)
        send_chunks(ledger, coll)
        answer(ledger, coll, 0)
    assert [item.seq for item in failover.results.kept[0, 0]] == [2, 3]
    failover.move_off(1, "reducer 1 was lost", ledger)  # one loss: a window for it and for each resend
    for seq in range(4, 12):
        coll = collective(seq, [0])
        ledger.start(coll)
        send_chunks(ledger, coll)
        answer(ledger, coll, 0)
    assert [item.seq for item in failover.results.kept[0, 0]] == [6, 7, 8, 9, 10, 11]


def test_one_reducer_has_nowhere_to_move_to_and_keeps_nothing():
    ledger, failover = worker_rooms(1)
    assert not failover.enabled and ledger.on_result is None


# -- spares --------------------------------------------------------------------------------------------
def test_a_spare_is_unused_until_a_loss_then_asked_to_join_and_used_from_the_boundary_it_names():
    ledger, failover = worker_rooms(3, spares=1)  # reducers 0 and 1 in the plan, 2 the spare
    assert failover.active == 2 and list(failover.lost) == [2] and "spare" in failover.lost[2]
    assert not failover.rerouting and failover.route(0, 0, 0) == 0
    coll = collective(4, [0, 1])
    ledger.start(coll)
    send_chunks(ledger, coll)
    failover.move_off(0, LOST, ledger)
    # Before the spare has joined, a chunk of reducer 0 goes to the other reducer in use.
    assert _reducers(coll) == [1, 1] and list(failover.resend) == [(coll, 0)]
    assert failover.survivors(without=0) == [1]
    assert failover.recruitable(down=()) == [2] and failover.recruitable(down={2: None}) == []
    asked = failover.recruit({0: 10}, down=())
    assert asked == {2: {0: 10}} and failover.survivors(without=0) == [1, 2]
    assert failover.recruit({0: 10}, down=()) == {}  # asked once
    failover.joined(2, {0: 12})
    assert failover.joins == 1
    # From seq 12 of group 0 on (the JOIN's boundary), reducer 0's chunks go to the spare.
    assert failover.route(10, 0, 0) == 1 and failover.route(12, 0, 0) == 2
    assert failover.route(11, 0, 0) == 1  # position 11: reducer 1's own
    late = collective(12, [0, 1])
    assert failover.place(late) and _reducers(late) == [2, 1] and list(late.moved) == [1, 0]


# -- a lost reducer that comes back ----------------------------------------------------------------
def test_a_reducer_that_comes_back_holds_collectives_past_the_lead_until_its_join_or_the_timeout():
    ledger, failover = worker_rooms(2)
    failover.move_off(1, "reducer 1 was lost", ledger)
    assert failover.readmitted(0, {0: 10}) is None  # never lost: nothing to agree on
    assert failover.readmitted(1, {0: 10}) == {0: 10}
    reports = []

    def report(r, progress):
        reports.append((r, progress))

    def name(r):
        return f"reducer {r}"

    assert failover.waits(collective(10 + REJOIN_LEAD - 1, [0, 1]), 0.0, 5.0, report, name) is False
    held = collective(10 + REJOIN_LEAD, [0, 1])
    assert failover.waits(held, 100.0, 5.0, report, name) is True
    assert failover.waits(held, 104.9, 5.0, report, name) is True
    verdict = failover.waits(held, 105.0, 5.0, report, name)
    assert verdict.startswith("it waited 5 s (RS_TIMEOUT) for reducer 1, which came back after it was lost")
    assert reports == []  # group 0 was reported as it was readmitted
    other_group = collective(0, [0, 1], group=7)
    assert failover.waits(other_group, 106.0, 5.0, report, name) is False
    assert reports == [(1, {7: 0})]  # a group it had not heard of yet is reported once
    failover.waits(other_group, 106.0, 5.0, report, name)
    assert reports == [(1, {7: 0})]
    failover.joined(1, {0: 12})
    assert failover.waits(held, 107.0, 5.0, report, name) is False
    assert failover.usable(1, 0, 12) and not failover.usable(1, 0, 11) and not failover.usable(1, 7, 100)
    assert failover.rejoined_chunks == 0
    coll = collective(12, [1, 0])
    ledger.start(coll)
    assert failover.place(coll) and _reducers(coll) == [1, 0]
    send_chunks(ledger, coll)
    answer(ledger, coll, 0)
    assert failover.rejoined_chunks == 1  # answered by the reducer that came back
