"""Strangers who name their own ZeroMQ routing ids cannot abort a reducer (issue 37, item 1).

libzmq's ROUTER gives a peer that names no routing id the next one of its own, 0x00 + a 32-bit
counter that starts from rand(), which no one seeds: every reducer's first is predictable. A peer
may name its own id instead (ZMQ_ROUTING_ID, sent in its handshake), and libzmq 4.3.5 (router.cpp,
identify_peer) never checks its own next id against the ones peers named: a stranger who names
the next ids and then connects without one makes the reducer's process abort on
`Assertion failed: ok (src/socket_base.cpp:2113)`. The reducer must refuse such strangers before
libzmq attaches their connections, and serve its job afterwards.

Bounded: a few dozen connections on loopback, every receive with a timeout, sockets that never
reconnect (ZMQ_RECONNECT_IVL=-1)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import List, Optional

import numpy as np
import pytest
import zmq

from helpers.cluster import ONE_PROCESS, TOKEN, reducers, run_ranks
from helpers.handshake import hello_payload
from helpers.jobs import connect, new_job
from helpers.peers import JOB
from reduction_server.wire import protocol
from reduction_server.wire.protocol import MsgType

pytestmark = pytest.mark.timeout(120)

#: rand() calls a reducer's process may have made before libzmq seeded its ROUTER's counter from
#: two of them (random.cpp, generate_random), and how many ids after each start are named
STARTS, AHEAD = 4, 6
#: the bound on waiting for what a connection's handshake came to (a dead reducer answers nothing)
SETTLE_S = 15.0


def unseeded_ids() -> List[bytes]:
    """The ids a never-seeded ROUTER would give first: rand()'s sequence as a fresh process of this
    host's C library has it (computed in one, so nothing here has called rand() yet), read as
    libzmq's generate_random() reads it, for each of the first STARTS starting points."""
    code = "import ctypes; libc = ctypes.CDLL(None); print([libc.rand() for _ in range(%d)])" % (STARTS + 1)
    r = json.loads(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30).stdout
    )
    starts = [((r[j + 1] & 1) << 31) | r[j] for j in range(STARTS)]
    ids = {b"\x00" + ((start + k) % (1 << 32)).to_bytes(4, "big") for start in starts for k in range(AHEAD)}
    return sorted(ids)


class Stranger:
    """One DEALER connection of a stranger, naming `routing_id` (or none), never reconnecting."""

    def __init__(
        self, context: zmq.Context, address: str, routing_id: Optional[bytes] = None, plain: Optional[tuple] = None
    ) -> None:
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, -1)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if plain is not None:  # one that knows how to present a credential, but not the token
            self.sock.plain_username, self.sock.plain_password = plain
        self.monitor = self.sock.get_monitor_socket()
        self.sock.connect(f"tcp://{address}")
        info = hello_payload(host="stranger", pid=0, version="test")
        self.outcome: Optional[str] = None  # "answered" or "refused", once known
        try:
            self.sock.send_multipart(
                [protocol.text_header(MsgType.HELLO, info, rank=0, world=2, job=JOB), info], zmq.NOBLOCK
            )
        except zmq.Again:  # the reducer already refused the connection, and libzmq dropped it
            self.outcome = "refused"

    def settle(self) -> None:
        """Note what this connection came to so far: the reducer answered its HELLO (libzmq
        attached it, under its routing id), or its connection failed or closed."""
        if self.outcome is None and self.sock.poll(0):
            self.sock.recv_multipart()
            self.outcome = "answered"
        while self.outcome is None and self.monitor.poll(0):
            event = zmq.utils.monitor.parse_monitor_message(self.monitor.recv_multipart())["event"]
            if event & (
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_DISCONNECTED
                | zmq.EVENT_CLOSED
            ):
                self.outcome = "refused"

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def settle_all(strangers: List[Stranger]) -> None:
    """Wait (bounded) until each connection was answered or refused."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and any(s.outcome is None for s in strangers):
        for s in strangers:
            s.settle()
        time.sleep(0.01)


def attack(address: str, plain: Optional[tuple] = None) -> List[Stranger]:
    """The attack of the issue: name the ids the reducer would give next, wait until each such
    connection is answered or refused, then connect once without naming one."""
    context = zmq.Context.instance()
    strangers = [Stranger(context, address, routing_id, plain) for routing_id in unseeded_ids()]
    settle_all(strangers)
    last = Stranger(context, address, None, plain)
    settle_all([last])
    return strangers + [last]


def all_reduce_works(group, world: int = 2) -> None:
    """A real job of `world` ranks all-reduces over `group`, exactly."""
    job, count = new_job(), 10_000
    xs = [np.arange(count, dtype=np.float32) * (r + 1) for r in range(world)]
    out = run_ranks(
        world,
        lambda rank: connect(group, rank, world, job, timeout=10, connect_timeout=10),
        lambda comm, rank: comm.all_reduce(xs[rank], "sum"),
        limit=60,
    )
    for y in out:
        np.testing.assert_array_equal(y, sum(xs))


def outlives(group, strangers: List[Stranger]) -> None:
    """The reducer is alive a moment after the strangers, and serves a real job."""
    try:
        time.sleep(0.5)  # an abort is at once: libzmq attaches a connection as its handshake ends
        logs = None if group.alive() else group.stop()
        assert logs is None, f"a stranger aborted the reducer:\n{logs[0][-2000:]}"
        all_reduce_works(group)
        assert group.alive()
    finally:
        for s in strangers:
            s.close()


@pytest.mark.parametrize("knows_the_scheme", [False, True], ids=["no-credential", "wrong-credential"])
def test_strangers_naming_the_reducers_next_routing_ids_cannot_abort_it(knows_the_scheme):
    """Issue 37, item 1: without the job token, a stranger names the routing ids the reducer
    would give next, then connects without one; the reducer survives, serves a job, and never
    answered the stranger (libzmq refused its connections before attaching them)."""
    plain = (b"0" * 64, b"1" * 64) if knows_the_scheme else None
    with reducers(1, extra_env=ONE_PROCESS) as group:
        strangers = attack(group.addresses[0], plain)
        outcomes = [s.outcome for s in strangers]
        outlives(group, strangers)
        assert outcomes == ["refused"] * len(strangers), (
            f"strangers without the token: {outcomes.count('answered')} answered, {outcomes.count(None)} unsettled"
        )


def test_a_job_already_running_keeps_running_through_the_attack():
    """The same attack while two ranks are admitted and connected: their job goes on after it."""
    with reducers(1, extra_env=ONE_PROCESS) as group:
        job, world = new_job(), 2
        comms = run_ranks(
            world,
            lambda rank: connect(group, rank, world, job, timeout=10, connect_timeout=10),
            lambda comm, rank: None,
            limit=30,
        )
        assert comms == [None, None]
        strangers = attack(group.addresses[0])
        outlives(group, strangers)


def test_a_credential_of_the_token_is_used_up_once_and_nothing_else_gets_through():
    """The gate's rule (reduction_server/wire/gate.py): a credential proves the token, is one-use,
    and is of the reducer's time (give or take MAX_AGE_S); a sniffed one cannot be replayed."""
    from reduction_server.wire import gate

    context = zmq.Context()
    keeper = gate.Gate(context, TOKEN)  # not started: check() alone
    try:
        username, password = gate.credential(TOKEN)
        assert keeper.check(username, password) is None
        assert "used before" in keeper.check(username, password)
        assert "does not prove the job token" in keeper.check(*gate.credential("another-token"))
        forged = password[:-1] + (b"1" if password.endswith(b"0") else b"0")
        assert "does not prove the job token" in keeper.check(username, forged)
        assert "does not prove the job token" in keeper.check(b"0" * 64, b"1" * 64)
        now = time.time()
        for skew in (-gate.MAX_AGE_S - 5, gate.MAX_AGE_S + 5):
            assert "clocks differ" in keeper.check(*gate.credential(TOKEN, now + skew))
        for skew in (-gate.MAX_AGE_S + 5, gate.MAX_AGE_S - 5):
            assert keeper.check(*gate.credential(TOKEN, now + skew)) is None
    finally:
        keeper.close()
        context.term()


def test_a_replayed_credential_is_refused_by_a_live_reducer():
    """A credential a worker used (an eavesdropper's copy of it) gets no second connection."""
    from reduction_server.wire import gate

    with reducers(1, extra_env=ONE_PROCESS) as group:
        context = zmq.Context.instance()
        used = gate.credential(TOKEN)
        first = Stranger(context, group.addresses[0], plain=used)
        settle_all([first])
        again = Stranger(context, group.addresses[0], plain=used)
        settle_all([again])
        fresh = Stranger(context, group.addresses[0], plain=gate.credential(TOKEN))
        settle_all([fresh])
        outcomes = [s.outcome for s in (first, again, fresh)]
        for s in (first, again, fresh):
            s.close()
        assert outcomes == ["answered", "refused", "answered"], outcomes
        assert group.alive()
