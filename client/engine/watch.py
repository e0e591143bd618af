"""What each endpoint connection's socket monitor says: how far its handshake got (for the
report of a worker still waiting), and its failed security handshakes in a row (when to give up:
an encryption mismatch, or encrypted handshakes failing for GIVE_UP_AFTER_S)."""

from __future__ import annotations

import time
from typing import List, Optional, Tuple

import zmq
from zmq.utils.monitor import parse_monitor_message

from reduction_server.wire import encryption

# How far an endpoint's handshake got: no connection, no connection and refused, connected, proved;
# CUT: a connection closed after its security handshake, before the peer proved the token.
CONNECTING, REFUSED, CONNECTED, CHALLENGED, CUT = 0, 1, 2, 3, 4
PROGRESS = {
    CONNECTING: "no TCP connection yet (is the host reachable, and the address in RS_REDUCERS right?)",
    REFUSED: "connection refused: nothing listens there (is `reduction-server serve` running there, and the "
    "port in RS_REDUCERS right?)",
    CONNECTED: "connected, but no answer to HELLO yet (is it a reducer?)",
    CHALLENGED: "it proved the job token; waiting for its WELCOME",
    CUT: "connected, but the connection closed before an answer to HELLO: whatever listens there closed it, or "
    "sent a frame larger than a reducer's answer can be (RS_CHUNK_BYTES), which a worker does not take",
}


class Watch:
    """Per endpoint: how far its handshake got, and its failed security handshakes in a row."""

    def __init__(self, count: int, encrypt: bool, gated: bool = False) -> None:
        self.encrypt = encrypt
        self.gated = gated  # connections present a PLAIN credential (gate.py)
        self.progress: List[int] = [CONNECTING] * count
        self.secured: List[bool] = [False] * count  # the current connection's security handshake succeeded
        self.failures: List[Tuple[int, float]] = [(0, 0.0)] * count  # (in a row, since when)

    def drain(self, e: int, monitor: zmq.Socket) -> Tuple[bool, Optional[str]]:
        """Read endpoint e's monitor: whether its connection closed, and why to give up on it if
        its security handshake failed for good."""
        closed, final = False, None
        while monitor.poll(0):
            message = parse_monitor_message(monitor.recv_multipart())
            kind = message["event"]
            if kind == zmq.EVENT_CONNECTED:
                self.progress[e] = max(self.progress[e], CONNECTED)
                self.secured[e] = False
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.secured[e] = True
            elif kind in (zmq.EVENT_CLOSED, zmq.EVENT_DISCONNECTED):
                closed = True
                if kind == zmq.EVENT_DISCONNECTED and self.progress[e] == CONNECTED:
                    self.progress[e] = CUT
                if kind == zmq.EVENT_CLOSED and self.progress[e] < CONNECTED:  # the connect itself failed
                    self.progress[e] = REFUSED
            failure = encryption.handshake_failure(kind, message["value"], self.encrypt, self.gated, self.secured[e])
            if failure is not None:
                count, since = self.failures[e]
                now = time.monotonic()
                count, since = count + 1, since if count else now
                self.failures[e] = (count, since)
                if failure[1] or (
                    count >= encryption.MAX_HANDSHAKE_FAILURES and now - since >= encryption.GIVE_UP_AFTER_S
                ):
                    final = failure[0]
        return closed, final
