"""An in-process stand-in for a Reducer's ROUTER socket, for tests that drive Reducer.handle
directly. The reducer sends each message part by part (`send` with SNDMORE on all but the last);
this keeps every whole message as a list of bytes, and fails a send to an identity in `gone` as
libzmq does (ROUTER_MANDATORY) for a peer whose connection has closed."""

from __future__ import annotations

from typing import List, Set

import zmq


class CapturingSocket:
    def __init__(self) -> None:
        self.sent: List[List[bytes]] = []
        self.gone: Set[bytes] = set()
        self._parts: List[bytes] = []

    def send(self, frame, flags: int = 0, copy: bool = True) -> None:
        data = bytes(frame.bytes if isinstance(frame, zmq.Frame) else frame)
        if not self._parts and data in self.gone:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        self._parts.append(data)
        if not flags & zmq.SNDMORE:
            self.sent.append(self._parts)
            self._parts = []
