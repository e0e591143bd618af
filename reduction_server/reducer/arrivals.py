"""Connections that have not said HELLO yet: at most RS_MAX_UNGREETED of them, each for at most
RS_HELLO_TIMEOUT seconds (issue 37, item 7).

A worker's connection says HELLO within milliseconds of being accepted (it queues its HELLO before
it connects). A stranger's may never: one that never finishes libzmq's security handshake (gate.py) stays in it
until libzmq gives up (30 s), one that knows nothing of ZMTP says nothing at all, and each holds a
descriptor of the reducer's. Untended, enough of them take the reducer past its
descriptor limit and no worker can join any more.

libzmq has no per-connection control for a ROUTER, but its socket monitor names each accepted
connection's descriptor, and every message carries its connection's (ZMQ_SRCFD). So a connection
is noted when it is accepted and forgotten when its HELLO comes (or it closes); one that is still
here after the timeout, or the oldest once there are more than the cap, is shut down
(shutdown(2) on the descriptor libzmq owns: libzmq sees the connection end and closes it as it
would any other). Past the cap the oldest goes, not the newest: a worker that connects while a
stranger holds the cap's worth still gets the milliseconds its handshake takes. Each closing is
counted, and logged through the reducer's Throttle (one line per cause and interval).
"""

from __future__ import annotations

import logging
import os
import socket
from collections import OrderedDict
from typing import Optional, Tuple

import zmq

from ..log import Throttle

Address = Tuple[str, int]


def _shut(fd: int, expected: Optional[Address]) -> bool:
    """Shut down the connection at descriptor `fd` if it is still the one accepted (same peer);
    whether it was. libzmq owns the descriptor and closes it itself once it sees the end."""
    try:
        conn = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False  # closed already (and not reused)
    try:
        if _peer(conn) != expected:
            return False  # libzmq closed it and the number went to another connection or file
        conn.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        conn.close()  # the duplicate only


def _peer(conn: socket.socket) -> Optional[Address]:
    try:
        name = conn.getpeername()
    except OSError:
        return None
    return (name[0], name[1]) if isinstance(name, tuple) else None


def peer_of(fd: int) -> Optional[Address]:
    """The remote address of the TCP connection at `fd`, None if it is none (closed, not a socket)."""
    try:
        conn = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        return _peer(conn)
    finally:
        conn.close()


class Arrivals:
    """The connections of one reducer's socket that were accepted and have not said HELLO."""

    def __init__(self, throttle: Throttle, *, index: int, cap: int, timeout: float) -> None:
        self.throttle = throttle
        self.index = index
        self.cap = cap
        self.timeout = timeout
        self.waiting: "OrderedDict[int, Tuple[float, Optional[Address]]]" = OrderedDict()  # fd -> (since, peer)
        self.closed_over_cap = 0
        self.closed_silent = 0

    def accepted(self, fd: int, now: float) -> None:
        """libzmq accepted a connection at `fd`; past the cap the oldest waiting one is shut."""
        self.waiting.pop(fd, None)
        self.waiting[fd] = (now, peer_of(fd))
        while len(self.waiting) > self.cap:
            oldest, (_, peer) = self.waiting.popitem(last=False)
            if _shut(oldest, peer):
                self.closed_over_cap += 1
                self._log("over_cap", f"more than {self.cap} connections without HELLO (RS_MAX_UNGREETED)", peer)

    def closed(self, fd: int) -> None:
        """The connection at `fd` closed."""
        self.waiting.pop(fd, None)

    def greeted(self, frame: zmq.Frame) -> None:
        """The connection `frame` came from said HELLO: it is a worker's, or answered as one
        (admission.py). libzmq names the connection's descriptor (ZMQ_SRCFD)."""
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:  # a frame that came from no connection (made in this process)
            return
        self.waiting.pop(fd, None)

    def expire(self, now: float) -> None:
        """Shut every connection that has waited RS_HELLO_TIMEOUT without a HELLO."""
        while self.waiting:
            fd, (since, peer) = next(iter(self.waiting.items()))
            if now - since < self.timeout:
                return
            del self.waiting[fd]
            if _shut(fd, peer):
                self.closed_silent += 1
                self._log("silent", f"no HELLO within {self.timeout:g} s (RS_HELLO_TIMEOUT)", peer)

    def _log(self, cause: str, reason: str, peer: Optional[Address]) -> None:
        self.throttle.event(
            logging.WARNING,
            "connection_closed",
            cause=cause,
            reducer=self.index,
            reason=reason,
            address=f"{peer[0]}:{peer[1]}" if peer else "unknown",
            closed=self.closed_over_cap + self.closed_silent,
        )
