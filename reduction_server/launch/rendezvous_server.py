"""The elastic rendezvous's HTTP server, bounded against peers that have not proved the job token.

Anyone who reaches the launcher's host can connect. Until a connection's request has proved the
token (rendezvous_proof.py), the server holds at most MAX_UNPROVED such connections (one thread
each; a new connection past the cap closes the oldest: a worker proves the token in its first
packet, so strangers who keep the cap full cannot lock workers out), each for at most
READ_TIMEOUT_S for its whole request (a peer that sends nothing, or a byte at a time, is closed
then), a request head of at most MAX_HEAD_BYTES, and a body of at most MAX_BODY_BYTES, its
Content-Length checked before any of it is read. The proof is checked before the body is parsed.
Every refusal is a 4xx answer naming what was wrong, with nothing computed from the token, and its
log line goes through a throttle (log.Throttle), as does any error of a connection: a stranger
causes neither a traceback nor an unbounded log.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Optional, Protocol, Tuple

from .. import log
from . import rendezvous_proof

#: largest request body taken (a /join is about 20 bytes)
MAX_BODY_BYTES = 4096
#: largest request line and headers taken together (a worker's are about 250 bytes)
MAX_HEAD_BYTES = 8192
#: seconds a connection has to deliver its whole request (a worker's takes milliseconds)
READ_TIMEOUT_S = 10.0
#: connections held at once whose request has not proved the token yet
MAX_UNPROVED = 32
#: bytes of a refused request still arriving that are read and dropped before its connection
#: closes, so that the peer reads the refusal (a close with unread input resets the connection)
LINGER_BYTES = 65536
#: characters of a logged field that a stranger chose (a reason quoting its request line)
_FIELD_CHARS = 200
_LENGTH = re.compile(r"[0-9]+")
_log = log.get_logger("rendezvous")


class Membership(Protocol):
    """What the server serves: the job token, and the answer to each proved request."""

    token: str

    def answer(self, path: str, body: bytes) -> Tuple[int, Dict[str, Any]]: ...


class Refused(Exception):
    """A request refused before it proved the token: the status, the cause (one of a fixed set, for
    the log's throttle) and the reason the answer names."""

    def __init__(self, status: int, cause: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.cause, self.reason = status, cause, reason


class _Head:
    """A connection's input with the request head held to MAX_HEAD_BYTES: past it, the line being
    read is refused (http.client.LineTooLong: 431 for a header, 414 for the request line)."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.left = MAX_HEAD_BYTES

    def readline(self, limit: int = -1) -> bytes:
        allowed = self.left + 1 if limit < 0 else min(limit, self.left + 1)
        line = self.file.readline(allowed)
        self.left -= len(line)
        if self.left < 0:
            raise http.client.LineTooLong(f"request head over {MAX_HEAD_BYTES} bytes")
        return line

    def __getattr__(self, name: str) -> Any:  # read (the body, already bounded), close, closed
        return getattr(self.file, name)


class _Handler(BaseHTTPRequestHandler):
    server: "Server"

    def setup(self) -> None:
        super().setup()
        self.rfile = _Head(self.rfile)
        self.refused = False

    def finish(self) -> None:
        super().finish()
        if self.refused:
            self._linger()

    def _linger(self) -> None:
        """Stop writing, then drop what the refused peer still sends, up to LINGER_BYTES (within
        its read deadline: the connection still counts as not proved)."""
        try:
            self.request.shutdown(socket.SHUT_WR)
            for _ in range(LINGER_BYTES // 4096):
                if not self.request.recv(4096):
                    return
        except OSError:
            pass

    def handle(self) -> None:
        try:
            super().handle()
        except http.client.LineTooLong as exc:  # the request line (http.server answers for headers)
            # what http.server sets before it parses a request line; answered in HTTP/1.0
            self.command, self.requestline, self.request_version = None, "", "HTTP/1.0"
            self.close_connection = True
            self.send_error(414, str(exc))

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """http.server's own refusals (a malformed request line or header, a method other than POST)."""
        self.server.note("rendezvous_refused", f"http_{int(code)}", peer=self.client_address[0], reason=message)
        self.refused = True
        super().send_error(code, message, explain)

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        try:
            proof, body = self._proved()
        except Refused as refusal:
            return self._refuse(refusal)
        if not self.server.proved(self.request):
            # shut while it proved (past the cap or its deadline): its worker, cut off, asks again,
            # so nothing is done for this one (a join answered here would count twice)
            self.close_connection = True
            return
        status, document = self.server.membership.answer(self.path, body)
        answer = _json(document)
        self._send(
            status, answer, rendezvous_proof.answer_proof(self.server.membership.token, proof.nonce, status, answer)
        )

    def _proved(self) -> Tuple[rendezvous_proof.Proof, bytes]:
        """The request's proof and body, once it has proved the token; Refused otherwise."""
        length = self.headers.get("Content-Length")
        if length is None or not _LENGTH.fullmatch(length):
            raise Refused(411, "length", "a request needs a Content-Length of decimal digits")
        if len(length) > 9 or int(length) > MAX_BODY_BYTES:
            shown = length if len(length) <= 12 else f"{length[:12]}... ({len(length)} digits)"
            raise Refused(
                413, "too_large", f"a body of {shown} bytes is over the rendezvous's limit of {MAX_BODY_BYTES}"
            )
        try:
            proof = rendezvous_proof.parse(self.headers.get(rendezvous_proof.HEADER))
        except ValueError as exc:
            raise Refused(400, "malformed_proof", str(exc)) from None
        body = self.rfile.read(int(length))
        if len(body) < int(length):
            raise Refused(400, "short_body", f"the body ended after {len(body)} of {length} bytes")
        if not rendezvous_proof.proves(self.server.membership.token, proof, self.path, body):
            raise Refused(403, "wrong_proof", "the request did not prove the job token (RS_JOB_TOKEN)")
        stale = self.server.freshness.refusal(proof)
        if stale is not None:
            raise Refused(403, *stale)
        return proof, body

    def _refuse(self, refusal: Refused) -> None:
        self.server.note("rendezvous_refused", refusal.cause, peer=self.client_address[0], reason=refusal.reason)
        self.close_connection = self.refused = True
        self._send(refusal.status, _json({"error": refusal.reason}), None)

    def _send(self, status: int, body: bytes, proof: Optional[str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if proof is not None:
            self.send_header(rendezvous_proof.HEADER, proof)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # refusals are noted, throttled
        pass


def _shut(request: socket.socket) -> None:
    """End a connection not proved in time: its handler's read returns, and the handler closes it."""
    try:
        request.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _json(document: Dict[str, Any]) -> bytes:
    return json.dumps(document).encode()


class Server(ThreadingHTTPServer):
    """The rendezvous's HTTP server: a thread per connection, at most `max_unproved` of them for
    connections not proved yet, each closed `read_timeout_s` after it was accepted unless proved."""

    daemon_threads = True
    request_queue_size = 64  # connections the kernel queues while one is accepted

    def __init__(
        self,
        host: str,
        membership: Membership,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_unproved: int = MAX_UNPROVED,
    ) -> None:
        self.membership = membership
        self.read_timeout_s = read_timeout_s
        self.max_unproved = max_unproved
        self.freshness = rendezvous_proof.Freshness()
        self.unproved: Dict[socket.socket, float] = {}  # connection -> when it is closed
        self.lock = threading.Lock()  # unproved, and the throttle
        self.throttle = log.Throttle(_log)
        super().__init__((host, 0), _Handler)

    def note(self, name: str, cause: str, **fields: Any) -> None:
        """A log line a stranger can cause, throttled per cause, its text fields shortened."""
        short = {key: value[:_FIELD_CHARS] if isinstance(value, str) else value for key, value in fields.items()}
        with self.lock:
            self.throttle.event(logging.WARNING, name, cause, kind=cause, **short)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Take every connection; past the cap, close the oldest one not proved yet (the first
        to have been accepted, as each has the same read timeout)."""
        with self.lock:
            oldest = next(iter(self.unproved)) if len(self.unproved) >= self.max_unproved else None
            if oldest is not None:
                del self.unproved[oldest]
                _shut(oldest)  # its handler's read ends; the handler closes it
            self.unproved[request] = time.monotonic() + self.read_timeout_s
        if oldest is not None:
            self.note("rendezvous_refused", "connections", peer=client_address[0], cap=self.max_unproved)
        return True

    def proved(self, request: Any) -> bool:
        """The connection's request proved the token: it no longer counts against the bounds. False
        when it was shut first (closed as the oldest past the cap, or at its read deadline)."""
        with self.lock:
            return self.unproved.pop(request, None) is not None

    def shutdown_request(self, request: Any) -> None:
        self.proved(request)  # taken out before it is closed: _reap never shuts down a closed socket
        super().shutdown_request(request)

    def service_actions(self) -> None:
        """Every poll of the serving loop: close the connections whose time is up."""
        self._reap(time.monotonic())

    def _reap(self, now: float) -> None:
        with self.lock:
            late = [request for request, deadline in self.unproved.items() if deadline <= now]
            for request in late:
                del self.unproved[request]
                _shut(request)
            self.throttle.flush()
        if late:
            self.note("rendezvous_refused", "read_timeout", connections=len(late), read_timeout_s=self.read_timeout_s)

    def handle_error(self, request: Any, client_address: Any) -> None:  # no traceback a peer can cause
        self.note("rendezvous_connection_failed", type(sys.exc_info()[1]).__name__, peer=client_address[0])

    def server_close(self) -> None:
        self._reap(float("inf"))
        super().server_close()
        with self.lock:
            self.throttle.flush(everything=True)


__all__ = [
    "LINGER_BYTES",
    "MAX_BODY_BYTES",
    "MAX_HEAD_BYTES",
    "MAX_UNPROVED",
    "READ_TIMEOUT_S",
    "Membership",
    "Refused",
    "Server",
]
