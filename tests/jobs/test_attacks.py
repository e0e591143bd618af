"""Strangers against a real reducer and a real worker (issue 37): what each attack could make
them hold, log or spend, and the bound that holds it (docs/reliability.md, "Bounds on what a
stranger can cause").

Every attack is bounded: loopback only, a fixed number of connections and bytes, every wait with
a time limit; the reducers run with small timeouts (settings) so that each test takes seconds."""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import struct
import threading
import time
from typing import List, Tuple

import psutil
import pytest

import reduction_server.client as rs
from helpers.cluster import ONE_PROCESS, TOKEN, reducers
from helpers.jobs import check_sum_works, communicator, until
from reduction_server import CollectiveError, job_token
from reduction_server.wire import protocol
from reduction_server.wire.protocol import Header, MsgType

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20
#: the reducers' token here: workers of other jobs on this host (other test runs) are refused by it
OWN_TOKEN = f"attacks-{secrets.token_hex(8)}"
_ZERO_BLOCK = bytes(MiB)


def _greeting(mechanism: bytes, as_server: bool) -> bytes:
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + bytes([as_server]) + b"\0" * 31


def _command(body: bytes) -> bytes:
    return b"\x04" + bytes([len(body)]) + body


def _read(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        more = conn.recv(n - len(buf))
        if not more:
            raise ConnectionError("closed by the worker")
        buf += more
    return buf


def _frame(conn: socket.socket) -> Tuple[int, bytes]:
    flags = _read(conn, 1)[0]
    size = struct.unpack(">Q", _read(conn, 8))[0] if flags & 0x02 else _read(conn, 1)[0]
    return flags, _read(conn, size)


class Impostor:
    """A listener at a reducer's address that does not know the token: a ZMTP PLAIN server spoken
    by hand (it takes any credential, as a ROUTER without a ZAP handler does). For each worker
    connection it reads the HELLO (its header, as anyone on the path sees it), then announces a
    frame of `announce` bytes and streams up to `stream` of them, counting what the worker took."""

    def __init__(self, announce: int = 1 << 30, stream: int = 256 * MiB) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.announce, self.stream = announce, stream
        self.hellos: List[Header] = []
        self.sent: List[int] = []  # bytes of the huge frame each connection took
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    self._one(conn)
                except (OSError, ConnectionError):
                    pass

    def _one(self, conn: socket.socket) -> None:
        conn.sendall(_greeting(b"PLAIN", True))
        _read(conn, 64)
        _frame(conn)  # the worker's PLAIN HELLO: its credential, taken unchecked
        conn.sendall(_command(b"\x07WELCOME"))
        _frame(conn)  # INITIATE
        conn.sendall(_command(b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"ROUTER"))
        _, header = _frame(conn)
        self.hellos.append(protocol.unpack(header))
        _frame(conn)  # the HELLO's JSON
        sent = 0
        try:
            conn.sendall(b"\x02" + struct.pack(">Q", self.announce))
            while sent < self.stream and not self._stop.is_set():
                conn.sendall(_ZERO_BLOCK)
                sent += len(_ZERO_BLOCK)
        finally:
            self.sent.append(sent)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.listener.close()


class PeakRss:
    """The highest RSS of a process, sampled every 10 ms while in the `with` block."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.before = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)


# -- item 3: the job id gives nothing away --------------------------------------------------------
def test_the_job_id_in_clear_headers_is_no_fast_hash_of_the_token():
    """Issue 37, item 3: a job known only by its token sends, in every header, an id that is not
    blake2b-64(token) (~770k guesses/s) but an HMAC under the scrypt-stretched token (job_token.job_id)."""
    impostor = Impostor(announce=1 << 30, stream=0)
    try:
        with pytest.raises(CollectiveError):
            rs.Communicator([impostor.address], 0, 1, job_token=TOKEN, connect_timeout=1, timeout=1)
    finally:
        impostor.close()
    assert impostor.hellos
    fast = int.from_bytes(hashlib.blake2b(TOKEN.encode(), digest_size=8).digest(), "big")
    for h in impostor.hellos:
        assert h.job != fast
        assert h.job == job_token.job_id(TOKEN)


def _everything_a_stranger_hears(address: str, mechanism: bytes, messages: List[bytes], limit: float = 3.0) -> bytes:
    """Open a raw TCP connection to `address`, speak ZMTP with `mechanism` (NULL, or PLAIN with a
    credential of another token), send `messages` as if through, and return every byte that came back."""
    from reduction_server.wire import gate

    with socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])), timeout=limit) as conn:
        conn.sendall(_greeting(mechanism, False))
        heard = conn.recv(64)  # the start of the reducer's greeting, before a refusal may reset the connection
        if mechanism == b"PLAIN":
            username, password = gate.credential("not-" + OWN_TOKEN)
            hello = b"\x05HELLO" + bytes([len(username)]) + username + bytes([len(password)]) + password
            conn.sendall(_command(hello))
        else:
            conn.sendall(_command(b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"))
        for message in messages:
            try:
                conn.sendall(message)
            except OSError:
                break
        deadline = time.monotonic() + limit
        try:
            while time.monotonic() < deadline:
                more = conn.recv(65536)
                if not more:
                    break
                heard += more
        except (socket.timeout, OSError):
            pass
    return heard


def _as_frames(*frames: bytes) -> bytes:
    out = b""
    for i, frame in enumerate(frames):
        assert len(frame) < 256  # short frames only
        out += bytes([0x01 if i < len(frames) - 1 else 0, len(frame)]) + frame
    return out


def test_a_stranger_hears_nothing_of_the_job_a_reducer_serves():
    """Issue 37, item 3: while a job known by its token runs, strangers (no credential, or one of
    another token) send a PING, a HELLO and a rejoining HELLO: nothing that comes back (libzmq's
    handshake bytes included) carries the job id, nor does any log line they cause; the gate's
    refusal is logged once (issue 37, item 6)."""
    from helpers.handshake import hello_payload

    with reducers(1, token=OWN_TOKEN, extra_env=ONE_PROCESS) as group:
        comms = [communicator(group, r, 2, job_token=OWN_TOKEN) for r in range(2)]  # no job_id: the token's
        job = comms[0].job_id
        assert job == job_token.job_id(OWN_TOKEN)
        check_sum_works(comms)
        rejoin = hello_payload(rejoin=True)
        messages = [
            _as_frames(protocol.text_header(MsgType.PING, b"", rank=0, world=2, job=0), b""),
            _as_frames(protocol.text_header(MsgType.HELLO, rejoin, rank=1, world=2, job=0), rejoin),
        ]
        heard = [_everything_a_stranger_hears(group.addresses[0], m, messages) for m in (b"NULL", b"PLAIN")]
        check_sum_works(comms)
        for c in comms:
            c.close()
        logs = group.stop()[0]
    secrets = (job.to_bytes(8, "little"), job.to_bytes(8, "big"), f"{job:x}".encode())
    for bytes_heard in heard:
        assert not any(secret in bytes_heard for secret in secrets)
    stranger_lines = [line for line in logs.splitlines() if "refused" in line or "handshake_failed" in line]
    assert len(stranger_lines) >= 2, logs[-2000:]  # the reducer heard both
    assert not any(f"{job:x}" in line for line in stranger_lines)
    # The gate's refusal of the credential is one line (connection_refused), not two.
    assert any("connection_refused" in line and "does not prove the job token" in line for line in stranger_lines)
    assert not any("handshake_failed" in line and "job tokens differ" in line for line in stranger_lines)


# -- item 5: a worker takes no more from an impostor than a reducer's answer can be --------------
def test_an_impostor_at_a_reducers_address_cannot_stream_gibs_into_a_worker():
    """Issue 37, item 5: a tokenless listener at the reducer's address announces a 1 GiB frame
    and streams it: the worker (ZMQ_MAXMSGSIZE from its chunk size) cuts the connection at the
    frame's size, its RSS does not grow by what was streamed, and it fails naming what happened."""
    impostor = Impostor()
    try:
        with PeakRss(psutil.Process().pid) as rss:
            with pytest.raises(CollectiveError) as info:
                rs.Communicator(
                    [impostor.address], 0, 1, job_token=TOKEN, chunk_bytes=64 * 1024, connect_timeout=2, timeout=2
                )
    finally:
        impostor.close()
    assert impostor.hellos, "the worker never greeted the impostor"
    # Each connection was cut at the frame's announced size: at most the kernel's socket buffers got through.
    assert impostor.sent and max(impostor.sent) < 32 * MiB, impostor.sent
    assert rss.peak - rss.before < 64 * MiB, f"RSS {rss.before / MiB:.0f} -> peak {rss.peak / MiB:.0f} MiB"
    text = str(info.value)
    assert "closed before an answer to HELLO" in text and "RS_CHUNK_BYTES" in text, text


# -- item 7: connections that never say HELLO ----------------------------------------------------
def _descriptors(pid: int) -> int:
    """The process's socket descriptors (/proc/PID/fd), its shared-memory segments left out."""
    fds = os.listdir(f"/proc/{pid}/fd")
    return sum(1 for fd in fds if _link(f"/proc/{pid}/fd/{fd}").startswith("socket:"))


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed meanwhile
        return ""


def _closed_by_reducer(conn: socket.socket, limit: float) -> bool:
    conn.settimeout(limit)
    try:
        while True:
            if not conn.recv(65536):
                return True
    except socket.timeout:
        return False
    except OSError:
        return True


def test_connections_that_never_say_hello_are_capped_and_closed():
    """Issue 37, item 7: 64 raw TCP connections that never say HELLO against a reducer capped at 16
    (RS_MAX_UNGREETED) with a 1 s RS_HELLO_TIMEOUT: its descriptors stay within the cap, a real
    job joins and runs while they are held, all are closed by the timeout, and the log says so in
    a few throttled lines."""
    cap, silent = 16, 64
    env = {**ONE_PROCESS, "RS_MAX_UNGREETED": str(cap), "RS_HELLO_TIMEOUT": "1"}
    with reducers(1, token=OWN_TOKEN, extra_env=env) as group:
        pid = group.procs[0].pid
        port = int(group.addresses[0].rsplit(":", 1)[1])
        idle = _descriptors(pid)
        strangers = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(silent)]
        try:
            # libzmq accepts all 64 at once; the reducer then closes all but the newest `cap`
            until(lambda: _descriptors(pid) <= idle + cap, f"the reducer's descriptors back within {cap} strangers")
            comms = [communicator(group, r, 2, job_token=OWN_TOKEN) for r in range(2)]  # while strangers hold the cap
            check_sum_works(comms)
            until(lambda: _descriptors(pid) <= idle + cap + 2, f"{cap} strangers and the job's 2 connections", 5)
            assert all(_closed_by_reducer(s, 5) for s in strangers)
            until(lambda: _descriptors(pid) <= idle + 2, "the job's 2 connections alone", 5)
            check_sum_works(comms)
            for c in comms:
                c.close()
        finally:
            for s in strangers:
                s.close()
        logs = group.stop()[0]
    closings = [line for line in logs.splitlines() if "connection_closed" in line]
    assert any("RS_MAX_UNGREETED" in line for line in closings), logs[-3000:]
    assert any("RS_HELLO_TIMEOUT" in line for line in closings), logs[-3000:]
    assert len(closings) <= 4, closings
