"""Free TCP ports on loopback for the processes a test starts."""

from __future__ import annotations

import socket
from typing import List

import pytest


def free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
    """`count` distinct ports free on `host` right now (all bound at once, then released)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


#: where free_port_range looks by default; reducers (helpers.cluster) start theirs at REDUCER_PORTS,
#: so that a port a test picked for its own listener is not the one a reducer picks next
TEST_PORTS, REDUCER_PORTS, EPHEMERAL = 21000, 11000, 32000


def free_port_range(count: int, first: int = TEST_PORTS, reuse: bool = False) -> int:
    """A base port with `count` consecutive free ports from it, from `first` on and below the usual
    ephemeral range; `reuse`: free for a listener that sets SO_REUSEADDR (libzmq), to which a port
    whose connections linger in TIME_WAIT is free."""
    last = TEST_PORTS if first < TEST_PORTS else EPHEMERAL
    for base in range(first, last - count, 97):
        sockets: List[socket.socket] = []
        try:
            for port in range(base, base + count):
                sockets.append(socket.socket())
                sockets[-1].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
                sockets[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    pytest.skip("no free port range")
