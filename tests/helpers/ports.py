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


def free_port_range(count: int) -> int:
    """A base port with `count` consecutive free ports from it, below the usual ephemeral range."""
    for base in range(21000, 32000, 97):
        sockets: List[socket.socket] = []
        try:
            for port in range(base, base + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    pytest.skip("no free port range")
