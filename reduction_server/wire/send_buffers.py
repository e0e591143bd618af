"""`RS_SNDBUF=auto`, the default: the kernel send buffer of each data connection, chosen from its
segments and what it measures (bench/RESULTS.md, "Send buffer", has what it gains).

Where a host's flows share a shaped, deep-queued link (a cloud VM's egress cap), small send
buffers keep each flow to a few segments in flight, so the flows take turns instead of one
running ahead in the queue (bench/RESULTS.md, "Send buffer"). A fixed small buffer would cap a
fast link (a flow moves at most about 2 x SO_SNDBUF per round trip) and starve loopback (64 KiB
segments). So:

- a connection of Ethernet-sized segments starts with FLOOR_SEGMENTS of them (16 KiB) before it
  carries data: a worker's from its route's MTU before it connects (a connected UDP socket's
  IP_MTU: nothing is sent; `EndpointBuffers`), a reducer's as it accepts the connection, before
  it welcomes the worker and so before any chunk (its MSS from TCP_INFO; `AcceptedBuffers`).
  Set from the start it works as a fixed RS_SNDBUF does; set once a flow has run with a large
  buffer, it gained half as much. Loopback and jumbo frames keep the kernel's autotuning (Linux
  stops autotuning a socket whose buffer is set);
- every turn (a worker's MEASURE_S, a reducer's housekeeping tick) those connections' TCP_INFO
  is read (the minimum round trip, and the delivery rate while not application-limited) and each
  gets the median of its last WANTS_KEPT wants, max(FLOOR_SEGMENTS x MSS, HEADROOM x rate x
  min_rtt) rounded up to a power of two. A flow held back by its buffer delivers at the rate the
  buffer allows and so wants twice as much the next turn: the buffer doubles until the link, not
  the buffer, limits the flow (up to net.core.wmem_max); a flow that shares a link with others
  keeps the floor.

libzmq does not expose its TCP sockets: a worker finds each connection's among this process's
file descriptors (Linux's /proc) by its peer address; a reducer's socket monitor names the
descriptor of each connection it accepts (EVENT_ACCEPTED).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from collections import deque
from typing import Deque, Dict, Hashable, List, Optional, Sequence, Set, Tuple

from ..config.settings import MAX_SNDBUF
from ..log import event, get_logger

log = get_logger("send_buffers")

#: seconds between measurements of every connection (a few getsockopt calls each)
MEASURE_S = 0.1
#: the least buffer a connection is given, in segments (MSS): 16 KiB at Ethernet's 1448 bytes
FLOOR_SEGMENTS = 11
#: the buffer a connection wants beyond its bandwidth-delay product
HEADROOM = 2
#: a connection keeps autotuning unless its floor is at most this much
LOCK_MAX = 64 * 1024
#: seconds between searches of this process's descriptors for a connection not found yet
SCAN_S = 1.0
#: measured wants a buffer follows the median of
WANTS_KEPT = 3
#: bytes a connection sends before its measurements are trusted (past its first round trips)
SETTLE_BYTES = 256 << 10

# struct tcp_info (linux/tcp.h): the fields read here and their offsets
_TCP_INFO_BYTES = 168
_APP_LIMITED_BYTE, _MSS, _BYTES_ACKED, _MIN_RTT, _DELIVERY_RATE = 7, 16, 120, 148, 160
_TCP_INFO = getattr(socket, "TCP_INFO", 11)


def want(mss: int, rate: float, min_rtt_us: int) -> int:
    """The buffer a connection wants: max(FLOOR_SEGMENTS x MSS, HEADROOM x rate x min_rtt),
    rounded up to a power of two, at most MAX_SNDBUF (bytes; `rate` in bytes/s)."""
    need = max(FLOOR_SEGMENTS * mss, int(HEADROOM * rate * min_rtt_us / 1e6))
    return min(MAX_SNDBUF, 1 << (need - 1).bit_length())


def _read_info(sock: socket.socket) -> Optional[Tuple[int, int, int, float, bool]]:
    """(mss, bytes acked, min_rtt in us, delivery rate in bytes/s, app-limited) from TCP_INFO."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_BYTES)
    if len(raw) < _TCP_INFO_BYTES:
        return None  # a kernel older than 4.9 (no delivery rate): the buffer stays as it is
    app_limited = bool(raw[_APP_LIMITED_BYTE] & 1)
    (mss,) = struct.unpack_from("=I", raw, _MSS)  # the kernel's own byte order
    (acked,) = struct.unpack_from("=Q", raw, _BYTES_ACKED)
    (min_rtt,) = struct.unpack_from("=I", raw, _MIN_RTT)
    (rate,) = struct.unpack_from("=Q", raw, _DELIVERY_RATE)
    return mss, acked, min_rtt, float(rate), app_limited


class Buffers:
    """The send buffers given to some of this process's connections (`locked`, by key), their
    descriptors as last found, and each one's last wants; measured and set each turn."""

    def __init__(self) -> None:
        self.fds: Dict[Hashable, int] = {}  # key -> the descriptor of its connection, last seen
        self.locked: Dict[Hashable, int] = {}  # key -> the buffer it was given (bytes)
        self.wants: Dict[Hashable, Deque[int]] = {}  # key -> its last WANTS_KEPT measured wants
        self.enabled = os.path.isdir("/proc/self/fd")

    def measure(self) -> None:
        """Measure every connection given a buffer and set the buffers that should change."""
        if not self.enabled:
            return
        for key, fd in list(self.fds.items()):
            sock = _open(fd)
            if sock is None or not self._matches(key, sock):
                del self.fds[key]  # closed, or the number is another descriptor's by now
                if sock is not None:
                    sock.close()
                continue
            try:
                self._adjust(key, sock)
            except OSError:
                pass  # it closed meanwhile
            finally:
                sock.close()

    def forget(self, key: Hashable) -> None:
        """`key`'s connection is gone or replaced: nothing measured on it holds."""
        self.fds.pop(key, None)
        self.locked.pop(key, None)
        self.wants.pop(key, None)

    def _matches(self, key: Hashable, sock: socket.socket) -> bool:
        raise NotImplementedError

    def _adjust(self, key: Hashable, sock: socket.socket) -> None:
        current = self.locked.get(key)
        info = _read_info(sock) if current is not None else None
        if info is None:
            return
        mss, acked, min_rtt, rate, app_limited = info
        if app_limited or acked < SETTLE_BYTES or not min_rtt or not rate:
            return
        wants = self.wants.setdefault(key, deque(maxlen=WANTS_KEPT))
        wants.append(want(mss, rate, min_rtt))
        size = sorted(wants)[len(wants) // 2]  # the median: one burst of acks is not a faster link
        if size != current:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            self.locked[key] = size
            event(
                log,
                logging.INFO,
                "send_buffer_set",
                connection=key,
                bytes=size,
                was=current,
                delivery_rate_Bps=int(rate),
                min_rtt_us=min_rtt,
                mss=mss,
            )


class EndpointBuffers(Buffers):
    """A worker's: the connection to each reducer endpoint, keyed by its index."""

    def __init__(self, addresses: Sequence[str]) -> None:
        super().__init__()
        hosts: Dict[str, Optional[set]] = {}  # one lookup per host, whatever its shards' ports
        self.peers: List[Optional[set]] = [_resolve(a, hosts) for a in addresses]
        self.next_scan = 0.0  # a connection not found is looked for again at most every SCAN_S

    def initial(self, r: int) -> int:
        """The send buffer to give endpoint r's next connection before it connects: the floor
        when its route's MTU makes that at most LOCK_MAX (Ethernet), else 0 (autotuning:
        loopback, jumbo frames)."""
        self.forget(r)
        mtu = _route_mtu(self.peers[r])
        if mtu is None:
            return 0
        size = want(mtu - _TCP_IP_HEADERS, 0.0, 0)
        if size > LOCK_MAX:
            return 0
        self.locked[r] = size
        return size

    def measure(self) -> None:
        missing = [r for r in self.locked if r not in self.fds]  # the autotuned are the kernel's
        now = time.monotonic()
        if self.enabled and missing and now >= self.next_scan:
            self.next_scan = now + SCAN_S
            wanted = {peer: r for r in missing for peer in (self.peers[r] or ())}
            for fd, sock in _sockets(set(self.fds.values())):
                r = wanted.get(_peer(sock))
                sock.close()
                if r is not None and r not in self.fds:
                    self.fds[r] = fd
        super().measure()

    def _matches(self, key: Hashable, sock: socket.socket) -> bool:
        return _peer(sock) in (self.peers[key] or ())


class AcceptedBuffers(Buffers):
    """A reducer's: the connections it accepted on `port`, keyed by the worker's address."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port

    def accepted(self, fd: int) -> None:
        """Give the connection just accepted on descriptor `fd` (the reducer's socket monitor
        names it) its floor, when its segments are Ethernet-sized: before its worker is welcomed
        and so before it sends any chunk."""
        sock = _open(fd)
        if sock is None:
            return  # closed already
        try:
            key = _peer(sock)
            if key is None or sock.getsockname()[1] != self.port:
                return  # closed, and the number is another descriptor's by now
            info = _read_info(sock)
            size = want(info[0], 0.0, 0) if info is not None else LOCK_MAX + 1
            if size <= LOCK_MAX:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
                self.forget(key)  # a new connection from an address a closed one had
                self.locked[key], self.fds[key] = size, fd
        except OSError:
            return  # it closed meanwhile
        finally:
            sock.close()

    def _matches(self, key: Hashable, sock: socket.socket) -> bool:
        try:
            return _peer(sock) == key and sock.getsockname()[1] == self.port
        except OSError:
            return False

    def measure(self) -> None:
        super().measure()
        for key in [k for k in self.locked if k not in self.fds]:  # closed: a new one is a new key
            self.forget(key)


def _sockets(skip: Set[int]):
    """(descriptor, socket over a duplicate of it) for every TCP socket of this process not in
    `skip`; the caller closes each socket."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in skip:
            continue
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
        except OSError:
            continue
        sock = _open(fd)
        if sock is not None:
            yield fd, sock


_TCP_IP_HEADERS = 52  # IPv4 (20) + TCP with timestamps (32): MSS = MTU - 52 (1448 at 1500)


def _route_mtu(peers: Optional[set]) -> Optional[int]:
    """The MTU of the route to the first of `peers` (a connected UDP socket sends nothing)."""
    for host, port in sorted(peers or ()):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((host, port))
                return probe.getsockopt(
                    socket.IPPROTO_IP if family == socket.AF_INET else socket.IPPROTO_IPV6,
                    getattr(socket, "IP_MTU", 14) if family == socket.AF_INET else getattr(socket, "IPV6_MTU", 24),
                )
        except OSError:
            continue
    return None


def _resolve(address: str, hosts: Dict[str, Optional[set]]) -> Optional[set]:
    """The (ip, port) pairs "host:port" may connect to; None when it does not resolve. `hosts`
    caches each host's addresses."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host not in hosts:
        try:
            hosts[host] = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
        except OSError:
            hosts[host] = None
    ips = hosts[host]
    return None if ips is None else {(ip, int(port)) for ip in ips}


def _open(fd: int) -> Optional[socket.socket]:
    """A socket object over a duplicate of `fd` if it is a TCP socket (close it soon: while it is
    open, the connection outlives libzmq's close of its own descriptor)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.close()
        return None
    return sock


def _peer(sock: socket.socket) -> Optional[Tuple[str, int]]:
    try:
        peer = sock.getpeername()
    except OSError:
        return None
    return peer[0], peer[1]
