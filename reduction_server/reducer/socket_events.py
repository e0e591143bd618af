"""What libzmq's socket monitor says about a reducer's connections.

- An accepted connection is given its send buffer (`RS_SNDBUF=auto`, send_buffers.py). The
  monitor names its descriptor.
- A closed connection may be a killed worker's. The reducer then probes its heartbeat peers
  (ROUTER_NOTIFY would say whose, but it needs libzmq's draft API).
- A failed security handshake is logged through the reducer's Throttle, once an interval for each
  reason: that peer was never admitted. One the gate refused is logged by the gate alone.
"""

from __future__ import annotations

import logging
from typing import Optional

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..log import Throttle, get_logger
from ..wire import encryption
from ..wire.send_buffers import AcceptedBuffers
from .clock import Clock

log = get_logger("reducer")


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
        send_buffers: Optional[AcceptedBuffers] = None,
        throttle: Optional[Throttle] = None,
    ) -> None:
        self.socket = socket
        self.clock = clock
        self.index = index
        self.encrypt = encrypt
        self.gated = gated  # connections present a PLAIN credential (gate.py)
        self.send_buffers = send_buffers
        self.monitor: Optional[zmq.Socket] = None
        self.handshake_failures = 0  # connections whose security handshake failed
        self.throttle = throttle if throttle is not None else Throttle(log, lambda: clock.now)

    def open(self) -> zmq.Socket:
        """Start monitoring the socket; the monitor's own socket, to poll."""
        accepts = zmq.EVENT_ACCEPTED if self.send_buffers is not None else 0
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | encryption.HANDSHAKE_FAILED | accepts)
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
                self.send_buffers.accepted(message["value"])
                continue
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
