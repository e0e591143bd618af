"""The elastic job's rendezvous (reduction_server/launch/rendezvous.py), over real HTTP on loopback:
rounds form once every live worker asks, ranks follow worker ids, a removed worker lets the
round form without it, and nothing is answered without the job token."""

from __future__ import annotations

import threading

import pytest

from helpers.jobs import parallel
from reduction_server.errors import CollectiveError
from reduction_server.launch import rendezvous
from reduction_server.launch.rendezvous import Rendezvous, Seat

pytestmark = pytest.mark.timeout(60)
TOKEN = "rendezvous-token"


@pytest.fixture
def server():
    rounds = []
    rv = Rendezvous(TOKEN, join_timeout=5, on_round=lambda n, workers: rounds.append((n, workers))).start()
    rv.rounds = rounds
    yield rv
    rv.close()


def test_a_round_forms_once_every_live_worker_asks_and_ranks_follow_ids(server):
    for worker in (7, 2, 5):
        server.add(worker)
    seats = parallel(*(lambda w=w: rendezvous.seat(server.address, TOKEN, w) for w in (7, 2, 5)), timeout=10)
    assert seats == [("ok", Seat(2, 3, 1)), ("ok", Seat(0, 3, 1)), ("ok", Seat(1, 3, 1))]
    assert server.rounds == [(1, [2, 5, 7])]
    assert rendezvous.version(server.address, TOKEN) == 3


def test_a_removed_worker_lets_the_round_form_without_it(server):
    for worker in range(3):
        server.add(worker)
    answers = []
    waiting = [
        threading.Thread(target=lambda w=w: answers.append(rendezvous.seat(server.address, TOKEN, w))) for w in (0, 1)
    ]
    for t in waiting:
        t.start()
    server.remove(2)  # it died before it asked
    for t in waiting:
        t.join(10)
    assert sorted(answers, key=lambda s: s.rank) == [Seat(0, 2, 1), Seat(1, 2, 1)]
    with pytest.raises(CollectiveError, match="worker 2 is not a member"):
        rendezvous.seat(server.address, TOKEN, 2)


def test_a_round_that_waits_for_a_silent_worker_fails_naming_it(server):
    server.add(0)
    server.add(1)
    with pytest.raises(CollectiveError, match=r"workers \[1\] did not rejoin within 5 s"):
        rendezvous.seat(server.address, TOKEN, 0)


def test_nothing_is_answered_without_the_job_token(server):
    server.add(0)
    with pytest.raises(CollectiveError, match="did not prove the job token"):
        rendezvous.seat(server.address, "another-token", 0)
    assert server.asking == set() and server.round == 0  # the server refused it (403) and changed nothing


def test_an_unreachable_rendezvous_is_named():
    with pytest.raises(CollectiveError, match="cannot be reached"):
        rendezvous.ask("127.0.0.1:9", TOKEN, "/version", {}, timeout=2)
