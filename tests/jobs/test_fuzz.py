"""Fuzzing a live reducer: malformed, truncated, oversized and reordered frames, headers with
wrong fields, random bytes, huge claimed sizes, DATA before HELLO, HELLO with a wrong token,
duplicate chunks and out-of-range keys. The reducer must never crash, never let a stranger's
bytes into a sum, answer only with frames that parse, and keep its memory bounded.

- live: hypothesis-generated messages from unadmitted peers at a reducer while a real job (two
  Communicators all-reducing, every result checked exactly) runs on it;
- admitted: two admitted ranks of a job send hypothesis-generated contributions (duplicates,
  mismatches, wrong payload sizes, other ranks' claims, keys far apart) interleaved with valid
  collectives whose results are checked; then a real job is served;
- zmtp: hypothesis-generated ZMTP streams over raw TCP (greetings, versions, mechanisms, PLAIN
  credentials, READY properties, identities, frame flags and lengths, streams cut anywhere) at a
  reducer while a real job runs on it: the reducer's memory, descriptors and log stay bounded;
- atheris: coverage-guided, in process (tests/scripts/fuzz_reducer_atheris.py), with the
  reducer's memory accounting checked after every input.

Each runs RS_FUZZ_SECONDS (default 3) of fuzzing; set it higher for a longer campaign.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import List, Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from helpers.cluster import SCRIPTS, TOKEN, child_env, reducers
from helpers.handshake import auth_payload, hello_payload
from helpers.jobs import check_sum_works, communicator, job_loop, ok, parallel, wait_until_idle
from helpers.peers import Peer, RawZmtp, data, port_of
from helpers.probes import open_fds, rss, settled_fds
from reduction_server.config.discovery import job_id_from
from reduction_server.errors import ProtocolError
from reduction_server.wire import gate, protocol
from reduction_server.wire.protocol import DType, MsgType, ReduceOp

FUZZ_SECONDS = float(os.environ.get("RS_FUZZ_SECONDS", "3"))
pytestmark = pytest.mark.timeout(120 + 4 * FUZZ_SECONDS)

JOB = job_id_from(TOKEN)  # the running job's id: strangers' claims name it
MAX_CHUNK = 1 << 20  # RS_MAX_CHUNK_BYTES: libzmq drops a connection whose message is larger
RSS_GROWTH = 64 << 20  # what the reducer may grow by during a fuzz run
BATCH = settings(
    max_examples=20, deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck)
)

u8, u32, u64 = st.integers(0, 0xFF), st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFFFFFFFFFFFFFFFF)
small = st.integers(0, 8)
# A header whose every field is either plausible or anything at all.
headers = st.tuples(
    st.one_of(st.just(protocol.MAGIC), u32),
    st.one_of(st.just(protocol.VERSION), u8),
    st.integers(0, 17),
    st.one_of(st.integers(0, 9), u8),
    st.one_of(st.sampled_from([int(op) for op in ReduceOp]), u8),
    st.one_of(small, u32),
    st.one_of(st.just(2), u32),
    st.one_of(st.just(0), u32),
    st.one_of(small, u32),
    st.one_of(small, u32),
    st.one_of(small, u32),
    st.one_of(st.just(JOB), u64),
    st.one_of(st.just(0), u64),
    st.one_of(small, u64),
    st.one_of(small, u64),
    st.one_of(st.integers(0, 4096), u64),
    st.one_of(st.integers(0, 4096), u64),
    st.one_of(st.integers(0, 16384), u64),
).map(lambda fields: protocol.HEADER.pack(*fields))


@st.composite
def contributions(draw, rank: Optional[int] = None, job: int = JOB) -> List[bytes]:
    """A DATA message that parses: the key, sizes and types drawn small so that they collide."""
    dtype = draw(st.sampled_from(list(DType)))
    op = draw(st.sampled_from([op for op in ReduceOp if op is not ReduceOp.BROADCAST]))
    count = draw(st.integers(1, 300))
    nchunks = draw(st.integers(1, 3))
    header = data(
        draw(st.integers(0, 1)) if rank is None else rank,
        2,
        job=job,
        seq=draw(st.integers(0, 5)),
        chunk=draw(st.integers(0, nchunks - 1)),
        nchunks=nchunks,
        count=count,
        total=count * nchunks,
        dtype=dtype,
        op=op,
    )
    size = draw(st.one_of(st.just(count * dtype.itemsize), st.integers(0, 3000)))
    return [header, draw(st.binary(min_size=size, max_size=size))]


frames = st.one_of(
    headers.flatmap(lambda h: st.tuples(st.just(h), st.binary(max_size=2048)).map(list)),  # wrong fields
    headers.flatmap(lambda h: st.integers(0, protocol.HEADER_SIZE - 1).map(lambda n: [h[:n]])),  # truncated
    st.lists(st.binary(max_size=300), min_size=1, max_size=4),  # random bytes, any number of frames
    contributions(),  # DATA before HELLO
    st.tuples(st.integers(0, 3), st.binary(max_size=200)).map(  # a handshake out of order, or garbled
        lambda t: [
            protocol.text_header(
                [MsgType.HELLO, MsgType.AUTH, MsgType.BYE, MsgType.PING][t[0]], t[1], rank=0, world=2, job=JOB
            ),
            t[1],
        ]
    ),
)
actions = st.one_of(frames, st.just("wrong_token"), st.just("oversized"), st.just("new_identity"))


class Rogues:
    """Four unadmitted peers at a reducer; every answer they get is read, parsed and checked."""

    ANSWERS = {MsgType.ERROR, MsgType.REJECT, MsgType.CHALLENGE, MsgType.PING}

    def __init__(self, address: str) -> None:
        self.address = address
        self.peers = [Peer(address) for _ in range(4)]
        self.sent = 0
        self.answers: dict = {}

    def act(self, slot: int, action) -> None:
        peer = self.peers[slot]
        if action == "new_identity":
            peer.close()
            self.peers[slot] = Peer(self.address)
        elif action == "oversized":  # over libzmq's MAXMSGSIZE: the connection is dropped
            big = Peer(self.address)
            big.send(data(0, 2, job=JOB, count=MAX_CHUNK // 2), b"\0" * (2 * MAX_CHUNK))
            big.close()
        elif action == "wrong_token":
            info = hello_payload()
            peer.send(protocol.text_header(MsgType.HELLO, info, rank=slot % 2, world=2, job=JOB), info)
            challenge = self._first(peer, MsgType.CHALLENGE)
            if challenge is not None:
                proof = auth_payload(challenge, "not-the-token", job=JOB, rank=slot % 2, world=2)
                peer.send(protocol.text_header(MsgType.AUTH, proof, rank=slot % 2, world=2, job=JOB), proof)
        else:
            peer.send(*action)
        self.sent += 1

    def _first(self, peer: Peer, mtype: MsgType) -> Optional[bytes]:
        """Read answers until one of type mtype (its payload), or None after a second of silence."""
        while True:
            reply = peer.recv(1.0)
            if reply is None:
                return None
            self._check(reply[0])
            if reply[0].type is mtype:
                return reply[1]

    def _check(self, header: protocol.Header) -> None:
        assert header.type in self.ANSWERS, f"a stranger got {header.type.name}"
        self.answers[header.type.name] = self.answers.get(header.type.name, 0) + 1

    def drain(self) -> None:
        for peer in self.peers:
            while True:
                reply = peer.recv(0)  # parses every frame it reads
                if reply is None:
                    break
                self._check(reply[0])

    def close(self) -> None:
        for peer in self.peers:
            peer.close()


def huge_zmtp_frame(address: str) -> None:
    """A raw ZMTP frame header announcing a terabyte: the reducer must hang up, not allocate."""
    zmtp = RawZmtp(address)
    zmtp.sock.sendall(b"\x02" + (1 << 40).to_bytes(8, "big") + b"\0" * 4096)
    assert zmtp.closed_by_peer(5), "the reducer kept a connection announcing a 1 TiB frame"
    zmtp.close()


def fuzz_beside_a_job(comms, batch, before, after=lambda: None, min_iterations: int = 20):
    """Two ranks all-reduce, every result checked, while batch() runs for FUZZ_SECONDS once they
    have started (`before()` just ahead of it, `after()` just after it, while the job still runs);
    the checked all-reduces each rank ran, and what before() returned."""
    started, keep_going = threading.Event(), threading.Event()
    keep_going.set()

    def fuzz():
        try:
            assert started.wait(30), "the job did not start"
            measured = before()
            stop = time.monotonic() + FUZZ_SECONDS
            while time.monotonic() < stop:
                batch()
            after()
            return measured
        finally:
            keep_going.clear()  # the job stops after its next collective

    loop = [
        lambda c=c: job_loop(c, started, keep_going, min_iterations=min_iterations, max_iterations=10**7) for c in comms
    ]
    (n0, failures0), (n1, failures1), measured = ok(parallel(*loop, fuzz, timeout=90 + 2 * FUZZ_SECONDS))
    assert n0 == n1 >= min_iterations and failures0 == [] and failures1 == []
    return n0, measured


def test_a_live_reducer_survives_strangers_fuzzing_while_a_job_runs_beside_it():
    env = {"RS_MAX_CHUNK_BYTES": str(MAX_CHUNK), "RS_TIMEOUT": "10"}
    with reducers(1, workers=2, extra_env=env) as group:
        comms = [communicator(group, r, 2) for r in range(2)]
        rogues = Rogues(group.addresses[0])

        @BATCH
        @given(st.lists(st.tuples(st.integers(0, 3), actions), min_size=1, max_size=12))
        def batch(plan):
            for slot, action in plan:
                rogues.act(slot, action)
            rogues.drain()

        def rss_then_a_huge_frame() -> int:
            """The reducer's RSS before fuzzing, then a first 1 TiB frame."""
            measured = rss(group.procs[0].pid)
            huge_zmtp_frame(group.addresses[0])
            return measured

        n0, base = fuzz_beside_a_job(
            comms, batch, rss_then_a_huge_frame, after=lambda: huge_zmtp_frame(group.addresses[0]), min_iterations=50
        )
        time.sleep(0.5)
        rogues.drain()
        print(f"{rogues.sent} fuzz messages beside {n0} checked all-reduces; answers: {rogues.answers}")
        assert rogues.sent > 100 and rogues.answers.get("ERROR", 0) > 50
        wait_until_idle(group)
        grown = rss(group.procs[0].pid) - base
        assert grown < RSS_GROWTH, f"the reducer grew by {grown >> 20} MiB"
        check_sum_works(comms)
        for comm in comms:
            comm.close()
        rogues.close()
        assert group.alive()
        logs = group.stop()
    assert "internal error" not in logs[0]


def zmtp_frame(flags: int, body: bytes, long: bool) -> bytes:
    """One ZMTP frame: its flags (the long-size bit set for `long`), size and body."""
    if long:
        return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body
    return bytes([flags & ~0x02 & 0xFF, len(body)]) + body


def zmtp_property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


ids = st.one_of(
    st.binary(min_size=1, max_size=8), st.integers(0, (1 << 32) - 1).map(lambda n: b"\0" + n.to_bytes(4, "big"))
)
properties = st.lists(
    st.one_of(
        st.sampled_from([b"DEALER", b"ROUTER", b"PUB", b"PAIR", b"\xff"]).map(
            lambda t: zmtp_property(b"Socket-Type", t)
        ),
        ids.map(lambda i: zmtp_property(b"Identity", i)),
        st.tuples(st.binary(min_size=1, max_size=20), st.binary(max_size=64)).map(lambda t: zmtp_property(*t)),
        st.binary(max_size=40),  # a property that does not parse
    ),
    max_size=4,
).map(b"".join)


@st.composite
def zmtp_streams(draw) -> bytes:
    """What a stranger's connection sends: a greeting (right or not in each field), the handshake
    commands of its mechanism (a PLAIN credential right, wrong or garbled), then frames and
    commands with any flags and sizes; cut anywhere."""
    mechanism = draw(st.sampled_from([b"PLAIN", b"NULL", b"CURVE", b"GSSAPI", b"JUNK"]))
    signature = draw(st.one_of(st.just(b"\xff" + b"\0" * 8 + b"\x7f"), st.binary(min_size=10, max_size=10)))
    version = draw(st.one_of(st.just(b"\x03\x00"), st.just(b"\x03\x01"), st.binary(min_size=2, max_size=2)))
    stream = signature + version + mechanism.ljust(20, b"\0") + bytes([draw(st.integers(0, 1))]) + b"\0" * 31
    if mechanism == b"PLAIN":
        username, password = gate.credential(TOKEN)
        username, password = draw(
            st.one_of(
                st.just((username, password)),  # right: what follows reaches the ROUTER
                st.tuples(st.binary(max_size=60), st.binary(max_size=70)),
            )
        )
        stream += zmtp_frame(
            0x04,
            b"\x05HELLO" + bytes([len(username)]) + username + bytes([len(password)]) + password,
            draw(st.booleans()),
        )
        ready = b"\x08INITIATE"
    else:
        ready = b"\x05READY"
    # A peer with the credential has the token: its Identity is its own business (gate.py)
    props = draw(properties.filter(lambda p: b"Identity" not in p)) if mechanism == b"PLAIN" else draw(properties)
    stream += zmtp_frame(0x04, ready + props, draw(st.booleans()))
    for flags, body, long in draw(
        st.lists(
            st.tuples(st.one_of(u8, st.sampled_from([0, 1, 4])), st.binary(max_size=600), st.booleans()), max_size=5
        )
    ):
        stream += zmtp_frame(flags, body, long or len(body) > 255)
    if draw(st.booleans()):  # a frame announcing more than RS_MAX_CHUNK_BYTES (or far more)
        stream += bytes([draw(st.sampled_from([0x02, 0x03, 0x06]))]) + struct.pack(
            ">Q", draw(st.integers(MAX_CHUNK + 1, 1 << 62))
        )
    return stream[: draw(st.integers(0, len(stream)))] if draw(st.booleans()) else stream


def send_zmtp(address: str, stream: bytes) -> None:
    """One connection: the stream, what the reducer answers read for a moment, then closed."""
    with socket.create_connection(("127.0.0.1", port_of(address)), timeout=5) as sock:
        sock.settimeout(0.05)
        with contextlib.suppress(OSError):
            sock.sendall(stream)
            while sock.recv(65536):
                pass


def test_zmtp_streams_from_strangers_leave_a_live_reducer_bounded_while_a_job_runs():
    env = {"RS_MAX_CHUNK_BYTES": str(MAX_CHUNK), "RS_TIMEOUT": "10"}
    with reducers(1, workers=2, extra_env=env) as group:
        comms = [communicator(group, r, 2) for r in range(2)]
        pid, sent = group.procs[0].pid, [0]

        @BATCH
        @given(st.lists(zmtp_streams(), min_size=1, max_size=8))
        def batch(streams):
            for stream in streams:
                send_zmtp(group.addresses[0], stream)
                sent[0] += 1

        n0, (base, fds) = fuzz_beside_a_job(comms, batch, lambda: (rss(pid), open_fds(pid)))
        print(f"{sent[0]} fuzzed ZMTP connections beside {n0} checked all-reduces")
        assert sent[0] > 50
        wait_until_idle(group)
        assert settled_fds(pid, fds) == fds  # every stranger's connection closed
        grown = rss(pid) - base
        assert grown < RSS_GROWTH, f"the reducer grew by {grown >> 20} MiB"
        check_sum_works(comms)
        for comm in comms:
            comm.close()
        assert group.alive()
        logs = group.stop()
    assert "internal error" not in logs[0]
    # what strangers cause is throttled: a line per cause and interval, not one per connection
    lines = logs[0].splitlines()
    print(f"the reducer's log: {len(lines)} lines")
    assert len(lines) <= 20 + 2 * FUZZ_SECONDS, "\n".join(lines[-40:])


VALID_SEQS = 1 << 40  # the checked collectives' keys start here; fuzzed ones stay below


def harmless_to_later_keys(frames: List[bytes]) -> bool:
    """Whether a fuzzed message leaves the checked collective that follows it alone. Some may
    not, by design: a BYE or a new HELLO ends the rank's admission, and a contribution to a later
    key says the rank went on without the checked one (the reducer fails it as skipped)."""
    try:
        h = protocol.unpack(frames[0])
    except ProtocolError:
        return True  # malformed: answered, and counted (fewer than 16 per connection per batch)
    return h.type not in (MsgType.HELLO, MsgType.AUTH, MsgType.BYE) and h.seq < VALID_SEQS


def recv_result(peer: Peer, seq: int) -> np.ndarray:
    """Skip the answers to fuzzed contributions until the RESULT of seq (an ERROR about seq
    fails the test with its text)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        reply = peer.recv(1.0)
        if reply is not None and reply[0].seq == seq and reply[0].type in (MsgType.RESULT, MsgType.ERROR):
            assert reply[0].type is MsgType.RESULT, reply[1].decode()
            return np.frombuffer(reply[1], np.int64)
    raise AssertionError(f"no RESULT for seq {seq}")


def test_admitted_ranks_fuzzing_contributions_get_errors_and_valid_collectives_stay_right():
    job = 0xF022
    with reducers(1, workers=2, extra_env={"RS_TIMEOUT": "2", "RS_DETERMINISTIC": "1"}) as group:
        ranks = [Peer(group.addresses[0]) for _ in range(2)]
        base = rss(group.procs[0].pid)
        seq = [VALID_SEQS]  # valid collectives: above the fuzzed keys, which then count as skipped

        @BATCH
        @given(
            st.lists(
                st.tuples(
                    st.integers(0, 1),
                    st.one_of(contributions(job=job), headers.map(lambda h: [h])).filter(harmless_to_later_keys),
                ),
                min_size=1,
                max_size=15,
            ),
            st.integers(-1000, 1000),
        )
        def batch(plan, value):
            # Fresh connections each batch: what a rank did to its own admission (malformed frames
            # count against its connection) does not carry over.
            for rank in range(2):
                ranks[rank].close()
                ranks[rank] = Peer(group.addresses[0])
                ranks[rank].handshake(rank, 2, job=job)
            for sender, message in plan:  # rank claims that are not the sender's are answered as such
                ranks[sender].send(*message)
            seq[0] += 1
            xs = [np.arange(500, dtype=np.int64) * (r + 1) + value for r in range(2)]
            for rank in (1, 0):
                ranks[rank].send(data(rank, 2, job=job, seq=seq[0], count=500, dtype=DType.INT64), xs[rank].tobytes())
            for peer in ranks:
                np.testing.assert_array_equal(recv_result(peer, seq[0]), xs[0] + xs[1])

        stop = time.monotonic() + FUZZ_SECONDS
        while time.monotonic() < stop:
            batch()
        wait_until_idle(group)
        grown = rss(group.procs[0].pid) - base
        assert grown < RSS_GROWTH, f"the reducer grew by {grown >> 20} MiB"
        for peer in ranks:
            peer.close()
        comms = [communicator(group, r, 2) for r in range(2)]  # a new job replaces the fuzzed one
        check_sum_works(comms, count=100_000)
        for comm in comms:
            comm.close()
        assert group.alive()
        logs = group.stop()
    assert "internal error" not in logs[0]
    print(f"{seq[0] - VALID_SEQS} checked collectives between fuzzed ones")


@pytest.mark.parametrize("mode", ["default", "deterministic"])
def test_atheris_coverage_guided_fuzzing_of_the_reducer(mode, tmp_path):
    pytest.importorskip(
        "atheris",
        reason="atheris is not installed (pip install atheris: a wheel for x86-64 "
        "Linux, else it needs clang and libFuzzer to build)",
    )
    seconds = max(2, int(FUZZ_SECONDS))
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "fuzz_reducer_atheris.py"),
            str(seconds),
            str(tmp_path),
            *(["deterministic"] if mode == "deterministic" else []),
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60 + 2 * seconds,
    )
    summary = [line for line in proc.stdout.splitlines() if line.startswith("atheris:")]
    assert proc.returncode == 0 and summary, proc.stdout[-2000:] + proc.stderr[-6000:]
    print(summary[0])
    answers = json.loads(summary[0].split("answers: ", 1)[1].replace("'", '"'))
    assert answers.get("RESULT", 0) > 0 and answers.get("ERROR MALFORMED", 0) > 0  # it reached deep and shallow
