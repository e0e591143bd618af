"""Strangers (peers without the job token) against an elastic job's rendezvous
(reduction_server/launch/rendezvous.py), served in a process of its own as the launcher serves it
(tests/scripts/rendezvous_server.py), over real sockets on loopback, its memory, threads and
descriptors read from /proc: an oversized body is refused before it is read, a malformed proof
header is a clean 400, idle connections hold a bounded number of threads and are closed after
the read timeout, a recorded /join cannot be replayed, and no refusal carries anything computed
from the token. None of them leaves a traceback in the rendezvous's log."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
from typing import Iterator, List, Tuple

import pytest

from helpers.cluster import SCRIPTS, child_env
from helpers.jobs import until
from reduction_server.launch import rendezvous
from reduction_server.launch.rendezvous import Seat

pytestmark = pytest.mark.timeout(60)
TOKEN = "rendezvous-attacks-token"
MiB = 1 << 20
#: the bounds the tests give their rendezvous: a short read timeout, and few connections
#: without a proof, so that each attack is over in a second or two
CAP, READ_TIMEOUT_S = 8, 1.0


class Server:
    """A rendezvous process: its pid, address, the rounds it formed, and its log (stderr)."""

    def __init__(self, proc: subprocess.Popen, address: str, log: str) -> None:
        self.proc, self.address, self.log_path = proc, address, log
        self.rounds: List[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.rounds.append(line.strip())

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def status(self, field: str) -> int:
        """A field of /proc/PID/status, in kiB (VmRSS, VmHWM) or as a count (Threads)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.M).group(1))

    def descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def host_port(self) -> Tuple[str, int]:
        host, port = self.address.rsplit(":", 1)
        return host, int(port)


@contextlib.contextmanager
def served(tmp_path, members=(0,), token: str = TOKEN, **bounds) -> Iterator[Server]:
    log = str(tmp_path / f"rendezvous-{secrets.token_hex(4)}.log")
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "rendezvous_server.py"), token, json.dumps(bounds), *map(str, members)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=child_env(),
        )
    try:
        address = proc.stdout.readline().strip()
        assert address, f"the rendezvous did not start: {open(log).read()}"
        server = Server(proc, address, log)
        yield server
        assert "Traceback" not in server.log(), server.log()
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def exchange(server: Server, raw: bytes) -> bytes:
    """Send `raw` on a new connection; all the rendezvous answers until it closes."""
    with socket.create_connection(server.host_port(), timeout=10) as sock:
        sock.sendall(raw)
        return read_all(sock)


def read_all(sock: socket.socket) -> bytes:
    answer = b""
    for _ in range(1000):
        piece = sock.recv(65536)
        if not piece:
            return answer
        answer += piece
    raise AssertionError("the answer did not end")


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1."), answer[:200]
    return int(answer.split(b" ", 2)[1])


def post(path: str, body: bytes, *headers: bytes, length: int = -1) -> bytes:
    """A raw POST with a Content-Length (that of `body` unless given) and `headers`."""
    length = len(body) if length < 0 else length
    head = [f"POST {path} HTTP/1.1".encode(), b"Host: x", b"Content-Length: %d" % length, *headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def a_proof() -> bytes:
    """A proof header of the current format, its MAC random: well-formed, never right."""
    return f"X-RS-Proof: {int(time.time() * 1000)} {secrets.token_hex(16)} {secrets.token_hex(32)}".encode()


def test_an_oversized_body_is_refused_before_it_is_read(tmp_path):
    with served(tmp_path) as server:
        threads = server.status("Threads")
        for length in (400_000_000, 10**30):
            answer = exchange(server, post("/join", b"", a_proof(), length=length))
            assert status_of(answer) == 413 and b"over the rendezvous's limit" in answer
        # a stranger that streams 64 MiB of a 400 MB body: the rendezvous reads none of it
        rss = server.status("VmRSS")
        with open(f"/proc/{server.proc.pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS: the peak from here on
        with socket.create_connection(server.host_port(), timeout=10) as sock:
            with contextlib.suppress(OSError):  # refused and closed: the send fails
                sock.sendall(post("/join", b"", a_proof(), length=400_000_000))
                for _ in range(64):
                    sock.sendall(b"\0" * MiB)
        until(lambda: server.status("Threads") == threads, "the connections' threads to end", 10)
        assert server.status("VmHWM") - rss < 4 * 1024, "the rendezvous held what a stranger sent"


def test_a_malformed_proof_header_is_a_clean_400_without_a_traceback(tmp_path):
    with served(tmp_path) as server:
        for header in (b"X-RS-Proof: \xe9t\xe9", b"X-RS-Proof: " + "\u00e9".encode() * 64, b"X-RS-Proof: 12 34"):
            answer = exchange(server, post("/version", b"{}", header))
            assert status_of(answer) == 400 and b"malformed X-RS-Proof header" in answer, answer
        answer = exchange(server, post("/version", b"{}"))
        assert status_of(answer) == 400 and b"no X-RS-Proof header" in answer, answer
        assert status_of(exchange(server, post("/version", b"{}", b"X-Long: " + b"a" * 9000))) == 431
        assert status_of(exchange(server, b"POST /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n")) == 414
        assert status_of(exchange(server, b"GET /version HTTP/1.1\r\n\r\n")) == 501
        assert server.rounds == [] and rendezvous.version(server.address, TOKEN) == 1  # still serves
    # served() asserted that its log has no traceback


def test_idle_connections_hold_a_bounded_number_of_threads(tmp_path):
    with served(tmp_path, max_unproved=CAP, read_timeout_s=30) as server:
        threads, descriptors = server.status("Threads"), server.descriptors()
        idle = [socket.create_connection(server.host_port(), timeout=10) for _ in range(5 * CAP)]
        try:
            for sock in idle:
                sock.setblocking(False)

            def closed() -> int:
                count = 0
                for sock in idle:
                    with contextlib.suppress(BlockingIOError):
                        count += sock.recv(1) == b""
                return count

            # the newest CAP are held (a thread each), each newer one having closed the oldest
            until(lambda: closed() == len(idle) - CAP, "all but the newest connections closed", 10)
            until(lambda: server.status("Threads") - threads == CAP, "a thread per connection held", 10)
            assert server.descriptors() - descriptors == CAP
            assert all(sock.recv(1) == b"" for sock in idle[:-CAP])  # the oldest are the ones closed
        finally:
            for sock in idle:
                sock.close()
        refused = [line for line in server.log().splitlines() if "rendezvous_refused" in line]
        assert 1 <= len(refused) <= 2, refused  # throttled: one line per cause and interval


def test_strangers_who_keep_the_cap_full_cannot_lock_a_worker_out(tmp_path):
    """Strangers reopen idle connections as fast as they can, so that the cap of connections not
    proved yet is always full; a worker's join still gets its seat (its connection closes the
    oldest stranger's, and its first packet proves the token)."""
    with served(tmp_path, max_unproved=CAP, read_timeout_s=30) as server:
        stop = threading.Event()
        opened = [0]

        def stranger() -> None:
            held: List[socket.socket] = []
            deadline = time.monotonic() + 20
            while not stop.is_set() and time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    held.append(socket.create_connection(server.host_port(), timeout=1))
                    opened[0] += 1
                while len(held) > 2 * CAP:
                    held.pop(0).close()
            for sock in held:
                sock.close()

        strangers = [threading.Thread(target=stranger, daemon=True) for _ in range(2)]
        for thread in strangers:
            thread.start()
        try:
            until(lambda: opened[0] > 4 * CAP, "the strangers to fill the cap", 10)
            assert rendezvous.seat(server.address, TOKEN, 0) == Seat(0, 1, 1)
            assert opened[0] > 8 * CAP  # they kept at it while the worker joined
        finally:
            stop.set()
            for thread in strangers:
                thread.join(30)
        refused = [line for line in server.log().splitlines() if "rendezvous_refused" in line]
        assert 1 <= len(refused) <= 3, refused  # throttled: one line per cause and interval


def test_idle_and_slow_connections_are_closed_after_the_read_timeout(tmp_path):
    with served(tmp_path, max_unproved=CAP, read_timeout_s=READ_TIMEOUT_S) as server:
        threads, descriptors = server.status("Threads"), server.descriptors()
        idle = [socket.create_connection(server.host_port(), timeout=10) for _ in range(CAP - 1)]
        slow = socket.create_connection(server.host_port(), timeout=10)
        try:
            until(lambda: server.status("Threads") - threads == CAP, "a thread per connection", 10)
            slow.sendall(b"POST /join HTTP/1.1\r\n")
            for _ in range(100):  # a header line every 0.1 s: each read is quick, the request never ends
                try:
                    slow.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError("a connection that sent a header line every 0.1 s was kept for 10 s")
            for sock in idle:
                assert read_all(sock) == b""  # closed by the rendezvous (a socket timeout of 10 s would raise)
        finally:
            for sock in [*idle, slow]:
                sock.close()
        until(lambda: server.status("Threads") == threads, "the connections' threads to end", 10)
        until(lambda: server.descriptors() == descriptors, "the connections' descriptors to close", 10)
        assert rendezvous.seat(server.address, TOKEN, 0) == Seat(0, 1, 1)  # and a worker still joins


def recorder(upstream: Tuple[str, int], record: List[bytes]) -> Tuple[str, threading.Thread]:
    """A relay on loopback that passes one request to `upstream` and its answer back, and keeps a
    copy of the request: what an on-path stranger records."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def relay() -> None:
        with listener, listener.accept()[0] as client, socket.create_connection(upstream, timeout=10) as up:
            client.settimeout(10)
            request = b""
            while b"\r\n\r\n" not in request:
                request += client.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))
            while len(body) < length:
                body += client.recv(65536)
            record.append(head + b"\r\n\r\n" + body)
            up.sendall(record[-1])
            client.sendall(read_all(up))

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    return "127.0.0.1:%d" % listener.getsockname()[1], thread


def test_a_replayed_join_is_refused_and_forms_no_round(tmp_path):
    with served(tmp_path, members=(0,)) as server:
        record: List[bytes] = []
        relay, thread = recorder(server.host_port(), record)
        assert rendezvous.seat(relay, TOKEN, 0) == Seat(0, 1, 1, 1)
        thread.join(10)
        answer = exchange(server, record[0])  # the stranger replays worker 0's signed /join
        assert status_of(answer) == 403 and b"replay" in answer, answer
        assert b"rank" not in answer
        assert rendezvous.seat(server.address, TOKEN, 0) == Seat(0, 1, 2, 1)  # the real worker's round
        until(lambda: len(server.rounds) == 2, "the second round's line", 10)
        assert server.rounds == ["round 1 formed: [0]", "round 2 formed: [0]"]


def test_a_refusal_carries_nothing_derived_from_the_token(tmp_path):
    body = b'{"worker": 0}'
    strangers = [
        post("/join", body, a_proof()),  # a well-formed proof that is wrong
        post("/join", body, b"X-RS-Proof: 0 " + b"0" * 32 + b" " + b"0" * 64),  # and stale
        post("/join", body, b"X-RS-Proof: junk"),
        post("/join", b"", a_proof(), length=1 << 20),
    ]
    with served(tmp_path, token=TOKEN) as one, served(tmp_path, token="another-token") as other:
        for request in strangers:
            answers = [exchange(server, request) for server in (one, other)]
            assert status_of(answers[0]) in (400, 403, 413)
            heads = [
                [line for line in answer.split(b"\r\n") if not line.lower().startswith(b"date:")] for answer in answers
            ]
            assert heads[0] == heads[1], "the same refusal differs between two tokens"
            assert not [line for line in heads[0] if line.lower().startswith(b"x-rs-proof:")], answers[0]
