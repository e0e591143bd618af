"""Reducer host names resolved off libzmq's I/O thread, for the connections opened after a loss.

libzmq resolves a tcp:// endpoint's host name in its I/O thread, which then waits: while a lost
reducer's name does not resolve (its container or pod is gone, and the DNS server forwards a name
it no longer knows to one that does not answer), every other connection's heartbeats wait too, and
the live reducers drop this worker after RS_LIVENESS_TIMEOUT (seen with docker-compose: one reducer
container killed, the other dropped every worker 20 s later). So a new connection to a lost
endpoint goes to an address that a thread of this module resolved first, again for each new
connection: a reducer that comes back may have another address.
"""

from __future__ import annotations

import ipaddress
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Optional

#: resolutions at once (one per lost reducer whose name is being looked up)
_THREADS = 4


def _literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def _resolve(host: str, port: int) -> str:
    """host:port as an address libzmq needs not look up ("[v6]:port" for IPv6)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return f"[{sockaddr[0]}]:{port}" if family == socket.AF_INET6 else f"{sockaddr[0]}:{port}"


class Resolver:
    """Looks names up on threads of its own; `address` answers without waiting."""

    def __init__(self) -> None:
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Dict[str, Future] = {}

    def address(self, endpoint: str) -> Optional[str]:
        """`endpoint` ("host:port") as an address to connect to: at once for a literal address,
        else None while its host name is being looked up (ask again). OSError when the name did
        not resolve; the next call looks it up again."""
        host, _, port = endpoint.rpartition(":")
        if _literal(host):
            return endpoint
        pending = self._pending.get(endpoint)
        if pending is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(_THREADS, thread_name_prefix="rs-resolve")
            self._pending[endpoint] = self._executor.submit(_resolve, host.strip("[]"), int(port))
            return None
        if not pending.done():
            return None
        del self._pending[endpoint]  # each new connection looks the name up again
        return pending.result()  # the address, or the lookup's OSError

    def close(self) -> None:
        """Stop the lookups' threads (a lookup under way finishes in the background)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
