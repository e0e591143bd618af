"""A reducer facing malformed frames, mismatched collectives, failed authentication, stale
generations, oversized claims and duplicates: it answers (ERROR or REJECT), names what is wrong,
stays up, and keeps serving the well-behaved workers. Real reducer processes (helpers/cluster.py);
workers are Communicators in threads, rogue peers are raw ZeroMQ DEALER (or TCP) sockets (helpers/peers.py).

Everything is bounded in time: every receive polls with a timeout, every thread is joined with
one, and Communicators use short timeouts."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import threading
import time
from typing import List

import numpy as np
import pytest
import zmq

from helpers.capture import CapturingSocket
from helpers.cluster import reducers
from helpers.handshake import hello_payload
from helpers.jobs import CHUNK, check_sum_works, communicator, job_loop, ok, parallel, wait_until_idle
from helpers.peers import JOB, Peer, RawZmtp, data, junk_over_tcp, port_of, raw_header
from helpers.probes import rss
from reduction_server import CollectiveError
from reduction_server.wire import protocol, shared_memory
from reduction_server.wire.protocol import DType, ErrorCode, MsgType, ReduceOp

pytestmark = pytest.mark.timeout(90)


# -- 1. malformed frames -----------------------------------------------------------------
def malformed_frames(log: str) -> int:
    """malformed_frame events in a reducer's log: those written, and those its throttle counted."""
    left_out = sum(int(n) for n in re.findall(r"suppressed what=malformed_frame lines=(\d+)", log))
    return log.count("malformed_frame reducer=") + left_out


def test_malformed_frames_are_answered_and_others_keep_being_served():
    with reducers(2, workers=2) as group:
        comms = [communicator(group, r, 2) for r in range(2)]
        started, keep_going = threading.Event(), threading.Event()
        keep_going.set()
        results: List[object] = [None, None]

        def rank_main(r):
            try:
                results[r] = job_loop(comms[r], started, keep_going)
            except BaseException as exc:  # noqa: BLE001
                results[r] = exc

        job = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(2)]
        for t in job:
            t.start()
        try:
            assert started.wait(20), "the job did not start"
            rogue = Peer(group.addresses[0])
            valid = data(seq=7)
            cases = [
                # (frames, expected code, words the error text must contain)
                (
                    [b"\x00\x01garbage that is no header"],
                    ErrorCode.MALFORMED,
                    ["malformed", f"expected {protocol.HEADER_SIZE}"],
                ),
                ([b""], ErrorCode.MALFORMED, ["malformed", "0 bytes"]),
                ([valid[:40]], ErrorCode.MALFORMED, ["malformed", "40 bytes"]),
                ([valid + b"\0"], ErrorCode.MALFORMED, ["malformed", f"{protocol.HEADER_SIZE + 1} bytes"]),
                ([raw_header(magic=0xDEADBEEF), b"\0" * 16], ErrorCode.MALFORMED, ["malformed", "magic"]),
                ([raw_header(version=2), b"\0" * 16], ErrorCode.MALFORMED, ["malformed", "version 2"]),
                ([raw_header(mtype=42)], ErrorCode.MALFORMED, ["malformed", "message type 42"]),
                (
                    [
                        protocol.Header(
                            MsgType.RESULT, dtype=7, world=2, nchunks=1, count=4, total=4, nbytes=16
                        ).pack(),
                        b"\0" * 16,
                    ],
                    ErrorCode.MALFORMED,
                    ["malformed", "RESULT"],
                ),
                (
                    [protocol.text_header(MsgType.AUTH, b"x" * 32), b"x" * 32],
                    ErrorCode.MALFORMED,
                    ["AUTH without a HELLO"],
                ),
                ([valid, b"\0" * 16, b"extra", b"frames"], ErrorCode.MALFORMED, ["malformed", "4 frames"]),
                ([valid, b"\0" * 16, b"extra"], ErrorCode.MALFORMED, ["malformed", "3 frames"]),
                ([valid, b"\0" * 10], ErrorCode.MALFORMED, ["16 payload bytes", "10 arrived"]),
                ([valid, b"\0" * 16], ErrorCode.NOT_ADMITTED, ["handshake"]),
                ([data(seq=8, op=ReduceOp.BROADCAST, nbytes=0)], ErrorCode.NOT_ADMITTED, ["handshake"]),
            ]
            for frames, code, words in cases:
                rogue.send(*frames)
                header, _ = rogue.expect_error(code, *words)
                if code is ErrorCode.NOT_ADMITTED:  # the ERROR repeats the key it answers
                    assert header.key == protocol.unpack(frames[0]).key
            rogue.expect_silence(0.3)  # exactly one answer each

            # Plain TCP junk at both reducers: libzmq's handshake refuses it, nobody notices.
            for address in group.addresses:
                junk_over_tcp(address, os.urandom(4096))
                junk_over_tcp(address, b"GET / HTTP/1.1\r\nHost: reducer\r\n\r\n")
                junk_over_tcp(address, b"\xff" + b"\0" * 8 + b"\x7f" + os.urandom(200))  # a broken ZMTP greeting
            idle = socket.create_connection(("127.0.0.1", port_of(group.addresses[1])), timeout=5)  # says nothing
            # The rogue still gets answers after all that.
            rogue.send(b"more garbage")
            rogue.expect_error(ErrorCode.MALFORMED)
            time.sleep(0.3)
        finally:
            keep_going.clear()
            for t in job:
                t.join(30)
        assert not any(t.is_alive() for t in job), "the job hung"
        for r, result in enumerate(results):
            assert not isinstance(result, BaseException), f"rank {r}: {result!r}"
        (n0, failures0), (n1, failures1) = results
        assert n0 == n1 >= 50
        assert failures0 == [] and failures1 == []
        check_sum_works(comms)  # and after the junk too
        assert group.alive()
        idle.close()
        rogue.close()
        for c in comms:
            c.close()
        logs = group.stop()
    assert malformed_frames(logs[0]) >= 13, logs[0]
    assert "internal error" not in logs[0] + logs[1]


def test_a_peer_with_16_malformed_frames_is_ignored_afterwards():
    with reducers(1, workers=2) as group:
        rogue = Peer(group.addresses[0])
        polite = Peer(group.addresses[0])  # another peer that sends garbage once in a while
        for i in range(20):
            rogue.send(b"garbage %d" % i)
        for _ in range(16):
            rogue.expect_error(ErrorCode.MALFORMED, "malformed")
        rogue.expect_silence(0.5)  # frames 17..20: no answer
        rogue.send(data())  # even a well-formed one is ignored now
        info = hello_payload()
        rogue.send(protocol.text_header(MsgType.HELLO, info, rank=0, world=2, job=JOB), info)
        rogue.expect_silence(0.5)
        # The others are served as before.
        polite.send(b"oops")
        polite.expect_error(ErrorCode.MALFORMED)
        comms = [communicator(group, r, 2) for r in range(2)]
        check_sum_works(comms)
        for c in comms:
            c.close()
        assert group.alive()
        logs = group.stop()
    assert "peer_dropped" in logs[0]
    assert malformed_frames(logs[0]) == 17, logs[0]
    assert logs[0].count("malformed_frame reducer=") == 1  # the rest counted in one line (log.Throttle)


def test_a_peer_that_never_reads_its_answers_does_not_block_the_reducer():
    """A rogue floods the reducer with messages that each get an ERROR, and never reads them:
    its queue fills. The reducer must not block on it (ROUTER_MANDATORY + a blocking send would
    hang the whole reducer), and must serve the next job."""
    with reducers(1, workers=2) as group:
        rogue = Peer(group.addresses[0], RCVHWM=1, RCVBUF=4096, SNDHWM=0)
        payload = b"\0" * 16
        message = data(seq=5)
        for _ in range(60_000):
            rogue.send(message, payload)  # NOT_ADMITTED, every one
        wait_until_idle(group)
        comms = parallel(*[lambda r=r: communicator(group, r, 2, connect_timeout=5) for r in range(2)], timeout=15)
        comms = ok(comms)
        check_sum_works(comms)
        for c in comms:
            c.close()
        assert group.alive()
        rogue.close()


# -- 2. mismatches ---------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["size", "dtype", "op"])
def test_mismatched_collectives_fail_on_every_rank_and_the_next_one_works(what):
    with reducers(2, workers=2) as group:
        comms = [communicator(group, r, 2) for r in range(2)]
        check_sum_works(comms, seed=1)  # seq 0
        if what == "size":
            args = [(np.ones(10, np.float32), "sum"), (np.ones(20, np.float32), "sum")]
            words = ["count=10", "count=20"]
        elif what == "dtype":
            args = [(np.ones(10, np.float32), "sum"), (np.ones(10, np.float64), "sum")]
            words = ["dtype=float32", "dtype=float64"]
        else:
            args = [(np.ones(10, np.float32), "sum"), (np.ones(10, np.float32), "max")]
            words = ["op=sum", "op=max"]
        results = parallel(*[lambda c=c, a=a: c.all_reduce(*a) for c, a in zip(comms, args)], timeout=20)
        for rank, (kind, exc) in enumerate(results):
            assert kind == "error" and isinstance(exc, CollectiveError), f"rank {rank}: {exc!r}"
            text = str(exc)
            assert f"rank {rank}:" in text and "seq=1" in text
            assert "disagree" in text and "ranks [0]" in text and "ranks [1]" in text, text
            for word in words:
                assert word in text, f"{word!r} not in {text!r}"
        check_sum_works(comms, seed=2)  # seq 2: the same communicators, the same reducers
        for c in comms:
            c.close()
        assert group.alive()
        logs = group.stop()
    assert "round_failed" in logs[0] + logs[1]


def test_multi_chunk_size_mismatch_fails_every_rank_in_bounded_time():
    """Ranks that cut different chunk counts: the shared chunks fail as MISMATCH, the chunks
    only one rank sent fail when the reducer's round times out (RS_TIMEOUT)."""
    with reducers(1, workers=2, extra_env={"RS_TIMEOUT": "1"}) as group:
        comms = [communicator(group, r, 2) for r in range(2)]
        sizes = [7 * CHUNK // 4, 3 * CHUNK // 4]  # 7 chunks vs 3 chunks of float32
        start = time.monotonic()
        results = parallel(
            *[lambda c=c, n=n: c.all_reduce(np.ones(n, np.float32)) for c, n in zip(comms, sizes)], timeout=20
        )
        assert time.monotonic() - start < 8
        for rank, (kind, exc) in enumerate(results):
            assert kind == "error" and isinstance(exc, CollectiveError), f"rank {rank}: {exc!r}"
            assert f"total={sizes[0]}" in str(exc) and f"total={sizes[1]}" in str(exc), str(exc)
        check_sum_works(comms, count=CHUNK)
        for c in comms:
            c.close()
        assert group.alive()


# -- 3. oversized claims ---------------------------------------------------------------------
def test_oversized_chunk_claims_are_refused_without_allocating():
    limit = 1 << 20
    with reducers(1, workers=2, extra_env={"RS_MAX_CHUNK_BYTES": str(limit)}) as group:
        peer = Peer(group.addresses[0])
        welcome = peer.handshake(0, 2, job=0x5EED)
        assert welcome["max_chunk_bytes"] == limit and welcome["world_size"] == 2
        base = rss(group.procs[0].pid)
        huge = 1 << 40  # elements: 4 TiB of float32
        # Header-only claims, with and without the right nbytes: refused as TOO_LARGE.
        peer.send(data(job=0x5EED, seq=1, count=huge))
        peer.expect_error(ErrorCode.TOO_LARGE, "over this reducer's limit", str(limit))
        peer.send(data(job=0x5EED, seq=2, count=huge, total=huge + 5, offset=5))
        peer.expect_error(ErrorCode.TOO_LARGE, str(limit))
        peer.send(data(job=0x5EED, seq=3, count=huge, op=ReduceOp.BROADCAST, nbytes=0))
        peer.expect_error(ErrorCode.TOO_LARGE, str(limit))
        # Just over the limit, with the payload really sent (it fits in libzmq's MAXMSGSIZE).
        over = limit // 4 + 1
        peer.send(data(job=0x5EED, seq=4, count=over), b"\0" * (over * 4))
        peer.expect_error(ErrorCode.TOO_LARGE, str(limit))
        # float16 accumulates in float32: 600 KB on the wire is 1.2 MB of accumulator.
        half = 300_000
        peer.send(data(job=0x5EED, seq=5, count=half, dtype=DType.FLOAT16), b"\0" * (half * 2))
        peer.expect_error(ErrorCode.TOO_LARGE, str(limit))
        # Exactly at the limit is fine (it waits for rank 1, so no answer yet).
        peer.send(data(job=0x5EED, seq=6, count=limit // 4), b"\0" * limit)
        peer.expect_silence(0.3)
        assert rss(group.procs[0].pid) - base < 16 << 20
        # A payload frame over the limit: libzmq drops the connection, nothing is answered.
        big = Peer(group.addresses[0])
        big.send(data(job=0x5EED, seq=7, count=limit // 2), b"\0" * (limit * 2))
        big.expect_silence(0.5)
        # A raw ZMTP frame header announcing a terabyte: the reducer hangs up before allocating.
        zmtp = RawZmtp(group.addresses[0])
        zmtp.send_message(b"hello")  # the session works: a malformed message gets its ERROR
        frames = zmtp.recv_message()
        assert protocol.unpack(frames[0]).aux == ErrorCode.MALFORMED
        zmtp.sock.sendall(b"\x02" + struct.pack(">Q", 1 << 40) + b"\0" * 4096)
        assert zmtp.closed_by_peer(5), "the reducer kept a connection announcing a 1 TiB frame"
        zmtp.close()
        assert group.alive()
        assert rss(group.procs[0].pid) - base < 16 << 20, (
            f"reducer RSS grew by {(rss(group.procs[0].pid) - base) >> 20} MiB"
        )
        # and it still serves (a new job: the hand-made one is replaced)
        comms = [communicator(group, r, 2) for r in range(2)]
        check_sum_works(comms)
        for c in comms:
            c.close()
        big.close()
        peer.close()


# -- 4. duplicates, bad payloads, impersonation ----------------------------------------------
def test_a_duplicate_contribution_fails_the_round():
    with reducers(1, workers=2) as group:
        peer = Peer(group.addresses[0])
        peer.handshake(0, 2, job=0xD0)
        payload = np.arange(4, dtype=np.float32).tobytes()
        peer.send(data(job=0xD0, seq=1), payload)
        peer.expect_silence(0.3)  # waiting for rank 1
        peer.send(data(job=0xD0, seq=1), payload)
        # both of rank 0's contributions are answered, each with DUPLICATE
        for _ in range(2):
            header, text = peer.expect_error(ErrorCode.DUPLICATE, "rank 0 contributed twice", "seq=1")
            assert header.key == (0xD0, 0, 0, 1, 0)
        peer.expect_silence(0.3)
        # rank 1 arrives late and hears of the failure instead of waiting forever
        late = Peer(group.addresses[0])
        late.handshake(1, 2, job=0xD0)
        late.send(data(rank=1, job=0xD0, seq=1), payload)
        late.expect_error(ErrorCode.DUPLICATE, "contributed twice")
        # the next key works
        peer.send(data(job=0xD0, seq=2), payload)
        late.send(data(rank=1, job=0xD0, seq=2), payload)
        for p in (peer, late):
            header, result = p.recv()
            assert header.type is MsgType.RESULT and header.seq == 2
            np.testing.assert_array_equal(np.frombuffer(result, np.float32), 2 * np.arange(4, dtype=np.float32))
        assert group.alive()
        peer.close()
        late.close()


def test_bad_payloads_and_impersonation_are_answered_to_the_sender():
    with reducers(1, workers=2) as group:
        peer = Peer(group.addresses[0])
        peer.handshake(0, 2, job=0xB0)
        # payload shorter than the header says: BAD_PAYLOAD, to the sender
        peer.send(data(job=0xB0, seq=1), b"\0" * 10)
        peer.expect_error(ErrorCode.BAD_PAYLOAD, "16 payload bytes", "10 arrived")
        # a contribution without its payload
        peer.send(data(job=0xB0, seq=2))
        peer.expect_error(ErrorCode.BAD_PAYLOAD)
        # claiming another rank, job or generation is STALE; the sender hears of it, nobody else
        other = Peer(group.addresses[0])
        other.handshake(1, 2, job=0xB0)
        for header, frames in [
            (data(rank=1, job=0xB0, seq=3), [b"\0" * 16]),
            (data(rank=1, job=0xB0, seq=4), [b"\0" * 10]),  # and a bad payload
            (data(rank=1, job=0xB0, seq=5), []),
            (data(job=0xB1, seq=6), [b"\0" * 16]),
            (data(job=0xB1, seq=7), [b"\0" * 3]),
            (data(job=0xB0, generation=1, seq=8), [b"\0" * 3]),
        ]:
            peer.send(header, *frames)
            peer.expect_error(ErrorCode.STALE, "claiming")
        other.expect_silence(0.3)
        # rank 1's own contributions to seq 3 and 4 still work: the impersonation did not fail them
        for seq in (3, 4):
            other.send(data(rank=1, job=0xB0, seq=seq), np.ones(4, np.float32).tobytes())
            peer.send(data(rank=0, job=0xB0, seq=seq), np.ones(4, np.float32).tobytes())
            for p in (peer, other):
                header, result = p.recv()
                assert header.type is MsgType.RESULT and header.seq == seq, (header, result)
                np.testing.assert_array_equal(np.frombuffer(result, np.float32), np.full(4, 2, np.float32))
        assert group.alive()
        peer.close()
        other.close()


def test_shared_memory_contributions_that_do_not_check_out_fail_naming_what_is_wrong():
    """DATA_SHM from a peer without a segment, for a slot that does not exist, for more bytes
    than a slot holds, with a frame besides, or for a broadcast: each is answered to the sender,
    and the reducer goes on summing from (and into) the slots of the peers that offered them."""
    segment = shared_memory.Segment.create(2, 64)
    with reducers(1, workers=2) as group, contextlib.closing(segment):
        offered, plain = Peer(group.addresses[0]), Peer(group.addresses[0])
        assert offered.handshake(0, 2, job=0xC0, shared_memory=segment.offer)["shared_memory"] is True
        assert plain.handshake(1, 2, job=0xC0)["shared_memory"] is False
        shm = dict(job=0xC0, mtype=MsgType.DATA_SHM)
        for peer, header, frames, words in [
            (plain, data(rank=1, seq=1, **shm), [], ["rank 1 sent DATA_SHM", "no shared-memory segment"]),
            (offered, data(seq=2, aux=2, **shm), [], ["slot 2 out of range (0..1)"]),
            (offered, data(seq=3, count=32, **shm), [], ["128 bytes do not fit", "slot of 64"]),
            (offered, data(seq=4, **shm), [b"\0" * 16], ["payload in a shared-memory slot, not in a frame"]),
        ]:
            peer.send(header, *frames)
            peer.expect_error(ErrorCode.BAD_PAYLOAD, *words)
        offered.send(data(seq=5, op=ReduceOp.BROADCAST, **shm))
        offered.expect_error(ErrorCode.MALFORMED, "DATA_SHM cannot carry a broadcast")
        # a good round: rank 0 through slot 1, rank 1 as a frame; each gets the sum its own way
        segment.slot(1, 16)[:] = np.arange(4, dtype=np.float32).tobytes()
        offered.send(data(seq=6, aux=1, **shm))
        plain.send(data(rank=1, job=0xC0, seq=6), np.full(4, 10, np.float32).tobytes())
        expected = np.arange(4, dtype=np.float32) + 10
        header, _ = offered.recv()
        assert (header.type, header.seq, header.aux) == (MsgType.RESULT_SHM, 6, 1), header
        np.testing.assert_array_equal(np.frombuffer(segment.slot(1, 16), np.float32), expected)
        header, result = plain.recv()
        assert header.type is MsgType.RESULT and header.seq == 6, header
        np.testing.assert_array_equal(np.frombuffer(result, np.float32), expected)
        assert group.alive()
        offered.close()
        plain.close()


def test_error_texts_always_fit_the_protocol():
    """A round of a very large world that times out names the missing ranks: the ERROR must
    still be a frame the client can parse (text payloads are capped at 64 KiB)."""
    with reducers(1, extra_env={"RS_TIMEOUT": "0.5"}) as group:
        world = 50_000
        peer = Peer(group.addresses[0])
        peer.handshake(0, world, job=0xB16)
        peer.send(data(world=world, job=0xB16, seq=1), b"\0" * 16)
        header, text = peer.expect_error(ErrorCode.STALE, "timed out", timeout=10)  # recv() parses it
        assert header.nbytes <= protocol.MAX_TEXT_PAYLOAD
        assert "ranks [0] contributed, ranks [1-49999] (49999 ranks) did not" in text, text
        assert "timed out after 0.5 s" in text
        assert header.key == (0xB16, 0, 0, 1, 0)
        assert group.alive()
        peer.close()


def test_a_mismatch_among_thousands_of_ranks_still_fits_an_error_frame():
    """In process (a real network of 30,000 peers is too slow for a unit test): half the ranks
    of a 30,000-rank world contribute, every other rank, then one disagrees. The MISMATCH text
    names the ranks on each side; it must stay short, and a frame the client can parse."""
    from reduction_server.reducer import Reducer

    world = 30_000
    sock = CapturingSocket()
    reducer = Reducer(sock, world_size=world, job_token="")
    payload = zmq.Frame(b"\0" * 16)

    def deliver(identity: bytes, *frames: bytes) -> None:
        reducer.handle([zmq.Frame(identity), *[zmq.Frame(f) for f in frames]])

    info = hello_payload()
    for rank in range(1, world, 2):
        ident = dict(rank=rank, world=world, job=7)
        deliver(b"r%d" % rank, protocol.text_header(MsgType.HELLO, info, **ident), info)
        deliver(b"r%d" % rank, protocol.text_header(MsgType.AUTH, b"", **ident))
    deliver(b"r0", protocol.text_header(MsgType.HELLO, info, rank=0, world=world, job=7), info)
    deliver(b"r0", protocol.text_header(MsgType.AUTH, b"", rank=0, world=world, job=7))
    assert sum(1 for m in sock.sent if protocol.unpack(m[1]).type is MsgType.WELCOME) == world // 2 + 1
    sock.sent.clear()
    for rank in range(1, world, 2):
        reducer.handle([zmq.Frame(b"r%d" % rank), zmq.Frame(data(rank, world, job=7, seq=1)), payload])
    assert sock.sent == []
    deliver(b"r0", data(0, world, job=7, seq=1, count=8), b"\0" * 32)
    assert len(sock.sent) == world // 2 + 1  # every contributor hears of it, and the sender
    for _identity, header, text in sock.sent:
        h = protocol.unpack(header)
        assert (h.type, h.aux, h.nbytes) == (MsgType.ERROR, ErrorCode.MISMATCH, len(text))
        assert h.nbytes <= 4096  # long rank lists are summarized, far inside MAX_TEXT_PAYLOAD
        assert text.startswith(b"reducer 0: contributions to collective seq=1")
        # both sides are named: the 15,000 that agreed and the one that did not
        assert b"ranks [1, 3, 5, " in text and b"29999] (15000 ranks) sent" in text and b"count=4 " in text
        assert b"ranks [0] sent" in text and b"count=8 " in text
