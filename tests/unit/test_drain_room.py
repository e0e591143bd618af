"""A drain driven in process (helpers/rooms.py): the reducer's Drain (its boundaries from what it
has seen, chunks past them refused, DRAINED once no round is open, the exit once every worker
said BYE or at its timeout) and the worker's Failover (a draining reducer's chunks move from its
boundary per group, nothing before it; once it drained, nothing kept of it is brought anywhere)."""

from __future__ import annotations

from helpers.rooms import answer, collective, endpoint_of, header, identity_of, reducer_rooms, send_chunks, worker_rooms
from reduction_server.client.engine.collective import UNSENT
from reduction_server.reducer.drain import Drain
from reduction_server.wire import protocol
from reduction_server.wire.protocol import ErrorCode, MsgType


def _drain(r, timeout: float = 10.0) -> Drain:
    return Drain(r.outbox, r.members, r.rounds, r.clock, index=0, name="reducer 0", timeout=timeout)


def test_a_reducer_drains_from_the_seq_after_the_furthest_it_has_seen_in_each_group():
    r = reducer_rooms(2)
    p0, p1 = r.admit_all(2)
    r.contribute(p0, [1] * 4, seq=3)
    r.contribute(p1, [1] * 4, seq=3)  # complete: seq 3 is the furthest both ranks sent
    r.contribute(p0, [1] * 4, seq=4)  # open: rank 1 has not sent it yet
    for peer in (p0, p1):
        assert r.members.announce(peer, 7, (0, 1)) is None
    r.contribute(p0, [1] * 4, seq=9, group=7)
    r.outbox.take()
    drain = _drain(r)
    drain.start()
    sent = r.outbox.take()
    assert {m.to for m in sent} == {identity_of(0), identity_of(1)}
    assert all(m.type is MsgType.DRAIN for m in sent)
    assert protocol.seq_pairs(sent[0].payload) == {0: 5, 7: 10}
    # seq 4 is still its job: rank 1's contribution is summed; seq 5, and a group it has not
    # seen, are refused DRAINING (the rank moves them), nothing summed
    h4 = r.contribute(p1, [2] * 4, seq=4)
    assert not drain.refuses(identity_of(1), h4)
    assert [m.type for m in r.outbox.take()] == [MsgType.RESULT, MsgType.RESULT]
    for seq, group in ((5, 0), (0, 3)):
        late = header(0, 2, seq=seq, group=group)
        assert drain.refuses(identity_of(0), late)
        (refusal,) = r.outbox.take()
        assert refusal.type is MsgType.ERROR and refusal.header.aux == ErrorCode.DRAINING
        assert (refusal.header.group, refusal.header.seq) == (group, seq)
        assert f"from seq {5 if group == 0 else 0} on" in refusal.text


def test_it_says_drained_once_no_round_is_open_and_exits_once_every_worker_said_bye():
    r = reducer_rooms(2)
    p0, p1 = r.admit_all(2)
    r.contribute(p0, [1] * 4, seq=0)
    r.outbox.take()
    drain = _drain(r)
    drain.start()
    r.outbox.take()
    assert not drain.over() and r.outbox.take() == []  # seq 0 waits for rank 1
    r.contribute(p1, [1] * 4, seq=0)
    r.outbox.take()
    assert not drain.over()  # DRAINED said, the BYEs not heard yet
    assert [(m.to, m.type) for m in r.outbox.take()] == [
        (identity_of(0), MsgType.DRAINED),
        (identity_of(1), MsgType.DRAINED),
    ]
    r.members.leave(identity_of(0))
    assert not drain.over()
    r.members.leave(identity_of(1))
    assert drain.over() and drain.outcome == "drained"
    assert r.outbox.take() == []  # DRAINED once


def test_a_drain_that_cannot_end_exits_at_its_timeout():
    r = reducer_rooms(2)
    p0, _ = r.admit_all(2)
    r.contribute(p0, [1] * 4, seq=0)
    drain = _drain(r, timeout=2.0)
    drain.start()
    r.clock.now += 1.9
    assert not drain.over()
    r.clock.now += 0.2
    assert drain.over() and drain.outcome == "drain_timed_out"


def test_a_draining_reducers_chunks_move_from_its_boundary_per_group_and_nothing_before_it():
    ledger, failover = worker_rooms(3)
    before = collective(4, [1, 2, 0, 1])  # chunk k of seq s on (s + k) mod 3; seq 4 < the boundary 5
    past = collective(5, [2, 0, 1, 2])
    other = collective(0, [0, 1], group=7)  # a group the DRAIN does not name: none of it stays
    for coll in (before, past, other):
        ledger.start(coll)
    send_chunks(ledger, before, [0, 1, 2])
    send_chunks(ledger, past, [0, 1])  # sent before the DRAIN reached this rank
    send_chunks(ledger, other, [0])
    assert failover.drain(0, {0: 5}, ledger) == []
    assert [endpoint_of(c) for c in before.chunks] == [1, 2, 0, 1] and not any(before.moved)
    assert endpoint_of(past.chunks[1]) != 0 and past.moved[1] and past.state[1] == UNSENT
    assert endpoint_of(other.chunks[0]) != 0 and other.moved[0] and other.state[0] == UNSENT
    assert [endpoint_of(c) for c in past.chunks][::2] == [2, 1]  # chunks on reducers up never move
    assert list(failover.resend) == [(past, 1), (other, 0)] and failover.drain_moved == 2
    assert ledger.window(0)[0] == 1 and ledger.window(7)[0] == 0  # before's chunk 2 alone is out there
    assert failover.usable(0, 0, 4) and not failover.usable(0, 0, 5) and not failover.usable(0, 7, 0)
    assert failover.rerouting and failover.losses == 0 and not failover.lost
    # It answers what it holds, then DRAINED: nothing of it is brought anywhere, and it is no loss
    assert answer(ledger, before, 2)
    assert (0, 0) in failover.results.kept  # (group, reducer): kept in case it is lost
    failover.resend.clear()
    assert failover.drained(0, "reducer 0 was lost: it drained", ledger) == []
    assert not any(key[1] == 0 for key in failover.results.kept)
    assert list(failover.resend) == [] and failover.losses == 0 and failover.drains == 1
    assert 0 in failover.lost and not failover.usable(0, 0, 4)


def test_a_reducer_used_again_after_a_loss_that_drains_is_left_from_its_boundary():
    ledger, failover = worker_rooms(3)
    failover.move_off(1, "reducer 1 was lost", ledger)
    failover.readmitted(1, {0: 0})
    failover.joined(1, {0: 2})  # used again from seq 2
    assert not failover.usable(1, 0, 1) and failover.usable(1, 0, 4)
    failover.drain(1, {0: 4}, ledger)
    assert failover.usable(1, 0, 3) and not failover.usable(1, 0, 4) and not failover.usable(1, 0, 1)
