"""What libzmq's socket monitor says about a reducer's connections.

- An accepted connection is given its send buffer (`RS_SNDBUF=auto`, send_buffers.py), and
  waits among the arrivals until it says HELLO (arrivals.py). The monitor names its descriptor.
- A closed connection may be a killed worker's. The reducer then probes its heartbeat peers
  (ROUTER_NOTIFY would say whose, but it needs libzmq's draft API).
- A failed security handshake is logged through the reducer's Throttle, once an interval for each
  reason: that peer was never admitted. One the gate refused is logged by the gate alone.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..log import Throttle, get_logger
from ..wire import encryption
from ..wire.send_buffers import AcceptedBuffers
from .arrivals import Arrivals
from .clock import Clock

log = get_logger("reducer")


_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | encryption.HANDSHAKE_FAILED


@contextlib.contextmanager
def monitoring(socket: zmq.Socket) -> Iterator[zmq.Socket]:
    """A monitor of the events SocketEvents reads, on a reducer's socket, closed on leaving (if
    SocketEvents has not closed it). Made before the socket binds, it misses no connection's
    acceptance (arrivals.py counts on each)."""
    monitor = socket.get_monitor_socket(_EVENTS)
    try:
        yield monitor
    finally:
        if not monitor.closed:
            socket.disable_monitor()
            monitor.close(linger=0)


class SocketEvents:
    """The monitor of one reducer's socket, read from open() until close()."""

    def __init__(
        self,
        socket: zmq.Socket,
        clock: Clock,
        *,
        index: int,
        encrypt: bool,
        gated: bool = False,
        arrivals: Arrivals,
        send_buffers: Optional[AcceptedBuffers] = None,
        throttle: Optional[Throttle] = None,
        monitor: Optional[zmq.Socket] = None,
    ) -> None:
        self.socket = socket
        self.clock = clock
        self.index = index
        self.encrypt = encrypt
        self.gated = gated  # connections present a PLAIN credential (gate.py)
        self.arrivals = arrivals
        self.send_buffers = send_buffers
        self.monitor: Optional[zmq.Socket] = monitor  # made by monitoring(), or by open()
        self.handshake_failures = 0  # connections whose security handshake failed
        self.throttle = throttle if throttle is not None else Throttle(log, lambda: clock.now)

    def open(self) -> zmq.Socket:
        """Start monitoring the socket (unless monitoring() did, before it bound); the monitor's
        own socket, to poll."""
        if self.monitor is None:
            self.monitor = self.socket.get_monitor_socket(_EVENTS)
        return self.monitor

    def close(self) -> None:
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            self.socket.disable_monitor()
            monitor.close(linger=0)

    def read(self) -> bool:
        """Read every event so far; True if a connection closed that may be a worker's."""
        monitor, closed = self.monitor, 0
        while monitor is not None and monitor.poll(0):
            message = parse_monitor_message(monitor.recv_multipart())
            if message["event"] == zmq.EVENT_ACCEPTED:
                if self.send_buffers is not None:
                    self.send_buffers.accepted(message["value"])
                self.arrivals.accepted(message["value"], self.clock.now)
                continue
            if message["event"] == zmq.EVENT_DISCONNECTED:
                self.arrivals.closed(message["value"])
            failure = encryption.handshake_failure(message["event"], message["value"], self.encrypt, self.gated)
            if failure is None:
                closed += 1
                continue
            reason, certain = failure
            # A failure of known cause is followed by its EVENT_DISCONNECTED; one of unknown cause
            # may be any connection dropped mid-handshake (a peer that gave up first), so it counts
            # as a closed connection and is logged below the warning level.
            closed += -1 if certain else 1
            self.handshake_failures += 1
            if self.gated and message["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                continue  # the gate refused it, and logged that (connection_refused): one line, not two
            self.throttle.event(
                logging.WARNING if certain else logging.INFO,
                "handshake_failed",
                cause=reason,
                reducer=self.index,
                reason=reason,
                certain=certain,
                failures=self.handshake_failures,
            )
        return closed > 0
