"""Free TCP ports on loopback for the processes a test starts.

Every port handed out lies below the kernel's ephemeral range (32768 and up here), where no
connection's own port can take it between the check and the listener's bind, and in this
pytest-xdist worker's share of its band: the suite's workers run side by side, and a port one
finds free now must not be the one another takes next.
"""

from __future__ import annotations

import itertools
import socket
from typing import List

import pytest

#: the bands: reducers (helpers.cluster) start theirs at REDUCER_PORTS, free_port_range's callers
#: at TEST_PORTS, free_ports at PICKED_PORTS, so that a port a test picked for its own listener is
#: not the one a reducer picks next
REDUCER_PORTS, TEST_PORTS, PICKED_PORTS, EPHEMERAL = 11000, 21000, 26500, 32000

_worker, _workers = 0, 1  # this pytest-xdist worker's index and their number (share_out)
_next = itertools.count()  # free_ports moves on at each call: a port just handed out may not be bound yet
#: between two ports free_ports hands out: a sharded reducer also listens on the ports after its own
_SPACING = 8


def share_out(worker: int, workers: int) -> None:
    """Ports are shared out among `workers` pytest-xdist workers; this process is `worker`."""
    global _worker, _workers
    _worker, _workers = worker, workers


def _share(first: int, last: int) -> range:
    """This worker's slice of the ports from `first` to `last`."""
    width = (last - first) // _workers
    return range(first + _worker * width, first + (_worker + 1) * width)


def _bindable(port: int, reuse: bool = False, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
    """`count` distinct ports free on `host` now, each for a listener of its own, _SPACING apart."""
    share = _share(PICKED_PORTS, EPHEMERAL)[::_SPACING]
    found: List[int] = []
    for _ in range(len(share)):
        port = share[next(_next) % len(share)]
        if _bindable(port, host=host):
            found.append(port)
            if len(found) == count:
                return found
    pytest.skip(f"fewer than {count} free ports in {share}")


def free_port_range(count: int, first: int = TEST_PORTS, reuse: bool = False) -> int:
    """A base port with `count` consecutive free ports from it, in this worker's share of the band
    that `first` starts (REDUCER_PORTS or TEST_PORTS); `reuse`: free for a listener that sets
    SO_REUSEADDR (libzmq), to which a port whose connections linger in TIME_WAIT is free."""
    share = _share(first, TEST_PORTS if first < TEST_PORTS else PICKED_PORTS)
    for base in range(share.start, share.stop - count, 97):
        if all(_bindable(port, reuse) for port in range(base, base + count)):
            return base
    pytest.skip("no free port range")
