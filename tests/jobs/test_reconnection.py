"""A reducer's view of ranks that skip a collective, lose their connection, or reconnect after
their job was replaced: hand-driven peers (helpers/peers.py), no heartbeats unless they send PINGs.
The same failures with real worker processes: test_failures.py."""

from __future__ import annotations

import time

import pytest

from helpers.cluster import reducers
from helpers.handshake import hello_payload
from helpers.peers import JOB, Peer, data
from helpers.timing import DETECT, SILENT

pytestmark = pytest.mark.timeout(180)


# -- protocol-level checks with hand-driven peers (no heartbeats unless they send PINGs) ------------
def test_a_rank_that_skips_a_collective_fails_it_at_once_not_at_the_timeout():
    """A rank sends its collectives in seq order: once it contributed to seq 6 on a reducer, it
    will never contribute to seq 5 there (the collective failed on its side)."""
    from reduction_server.wire.protocol import ErrorCode, MsgType

    with reducers(1, workers=2, extra_env={"RS_TIMEOUT": "60"}) as group:
        peers = [Peer(group.addresses[0]) for _ in range(2)]
        for r, peer in enumerate(peers):
            peer.handshake(r, 2, job=JOB)
        peers[0].send(data(0, seq=5), b"\0" * 16)
        peers[1].send(data(1, seq=6), b"\0" * 16)
        start = time.monotonic()
        header, text = peers[0].expect_error(ErrorCode.LOST, "seq=5", "ranks [1] went on", timeout=5)
        assert time.monotonic() - start < 3 and header.seq == 5
        peers[0].send(data(0, seq=6), b"\0" * 16)
        for peer in peers:
            header, _ = peer.recv()
            assert header.type is MsgType.RESULT and header.seq == 6
        for peer in peers:
            peer.close()
        assert group.alive()


def test_a_closed_connection_fails_the_rounds_that_need_it_and_a_new_handshake_readmits():
    from reduction_server.wire import protocol
    from reduction_server.wire.protocol import ErrorCode, MsgType

    with reducers(1, workers=2, extra_env={**SILENT, "RS_TIMEOUT": "60"}) as group:
        peers = [Peer(group.addresses[0]) for _ in range(2)]
        for r, peer in enumerate(peers):
            peer.handshake(r, 2, job=JOB)
        # rank 1 says it can be probed (it PINGs), then its connection closes; rank 0 has a round
        # waiting for it, which fails at once instead of at RS_TIMEOUT
        peers[1].send(protocol.text_header(MsgType.PING, b"", rank=1, world=2, job=JOB))
        peers[0].send(data(0, seq=1), b"\0" * 16)
        time.sleep(0.2)
        start = time.monotonic()
        peers[1].close()
        peers[0].expect_error(ErrorCode.LOST, "rank 1", "connection closed", timeout=DETECT + 5)
        assert time.monotonic() - start < DETECT
        # a new round that needs rank 1 fails at once
        peers[0].send(data(0, seq=2), b"\0" * 16)
        peers[0].expect_error(ErrorCode.LOST, "rank 1", timeout=2)
        # rank 1 is admitted again by a new handshake (a new connection): rounds work again
        again = Peer(group.addresses[0])
        again.handshake(1, 2, job=JOB)
        for r, peer in ((0, peers[0]), (1, again)):
            peer.send(data(r, seq=3), b"\0" * 16)
        for peer in (peers[0], again):
            header, _ = peer.recv()
            assert header.type is MsgType.RESULT and header.seq == 3
        for peer in (peers[0], again):
            peer.close()


def test_a_reconnecting_worker_never_takes_a_reducer_from_another_job():
    from reduction_server.wire import protocol
    from reduction_server.wire.protocol import ErrorCode, MsgType

    with reducers(1, workers=2) as group:
        current = Peer(group.addresses[0])
        current.handshake(0, 2, job=JOB)
        stale = Peer(group.addresses[0])
        info = hello_payload(host="old", pid=1, version="test", rejoin=True)
        stale.send(protocol.text_header(MsgType.HELLO, info, rank=0, world=2, job=JOB + 1), info)
        header, text = stale.recv()
        assert header.type is MsgType.REJECT and b"tried to rejoin" in text, text
        # a PING from a worker the reducer does not know is answered NOT_ADMITTED
        stale.send(protocol.text_header(MsgType.PING, b"", rank=0, world=2, job=JOB + 1))
        stale.expect_error(ErrorCode.NOT_ADMITTED, "not admitted")
        for peer in (current, stale):
            peer.close()
