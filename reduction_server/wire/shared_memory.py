"""Shared-memory payload slots between a worker and a reducer on the same host.

Over loopback, ZeroMQ copies every chunk four times (into the kernel and out of it, both ways)
and the worker copies each result once more out of libzmq's buffer. When a reducer shares the
worker's host, the worker offers it a segment of `slots` payload slots instead: it copies a
chunk into a free slot and sends only the header (DATA_SHM, slot in `aux`); the reducer sums
straight from the slot and writes the result back into the same slot (RESULT_SHM). Control
messages, errors and broadcasts still travel over ZeroMQ.

Safety, because the reducer must never crash or read another job's memory:
- The segment is a memfd sealed against shrinking and growing, so a worker cannot truncate it
  under the reducer's mapping (which would kill the reducer with SIGBUS). The reducer checks
  the seals itself.
- The reducer opens it through /proc/<pid>/fd/<fd> only after the worker has authenticated,
  only when boot id, network and pid namespaces are its own (so emulated hosts in separate
  network namespaces keep using their links), and only when the random nonce written at the
  segment's start matches the one in the HELLO.
- Anything that does not check out means "no shared memory": the worker falls back to frames.
- A slot is reused only after the reducer has answered the chunk in it (RESULT_SHM, RESULT or
  ERROR for that key), so a late result can never overwrite a newer chunk.

Shared results: a reducer also makes a segment of its own, of result slots, and offers it in its
WELCOME; a worker maps it read-only and says so in its own segment's header (accept_results). A
round's result can then be written once, into a result slot, and every such rank copies it from
there (RESULT_SHARED: slot and use in `aux`) instead of the reducer writing it into each rank's
slot. A rank that has copied a result out, and keeps it no longer, releases the slot by writing
the use it was told into its own segment's header (release); the reducer writes a result slot
again only once every rank it handed the slot to has released it (released). The counters are
written and read with release/acquire ordering (_native.store_release, load_acquire), so a copy
out is complete before the slot can be overwritten. A rank can only release its own reads: a
rank that releases early can only spoil its own result, and one that never releases only pins
slots, after which results go into each rank's slot as before.

Nothing is left behind: a memfd has no name, and its memory goes with the last process to close
or unmap it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import mmap
import os
import secrets
import socket
import stat
from typing import Any, Dict, Optional, Tuple

from .. import _native
from ..config import settings
from ..errors import ReductionServerError

_MAGIC = b"RSSHM1\0\0"
_NONCE_BYTES = 16
_HEADER_BYTES = 4096  # the first page holds magic, nonce and counters; slots start page-aligned
_ACCEPTS_AT = 32  # a worker's header: nonzero once it reads shared results (accept_results)
_RELEASED_AT = 64  # a worker's header: by result slot, the use of it that this rank last released
#: result slots a reducer's segment may have: one counter each fits a worker's header page
MAX_RESULT_SLOTS = (_HEADER_BYTES - _RELEASED_AT) // 8
_SLOT_ALIGN = 4096
#: memfd sealing is Linux's (3.17+); elsewhere payloads always travel as frames
SUPPORTED = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")
_REQUIRED_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
#: larger slots than this are not offered: bigger chunks simply travel as frames
MAX_OFFERED_SLOT_BYTES = 64 << 20


class Unavailable(ReductionServerError):
    """A segment offer that cannot be used here; the reason says why (payloads go as frames)."""


def enabled() -> bool:
    """RS_SHM (default on where supported): offer (worker) or accept (reducer) shared-memory slots."""
    return settings.read("RS_SHM") and SUPPORTED


def is_local(address: str) -> bool:
    """Whether `host:port` names an address of this host, in this network namespace: only a
    reducer there can map a segment, so only it is offered one (an offer names a pid, an fd, the
    boot id and namespaces). A name that does not resolve now counts as local: the reducer's own
    checks still decide."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:  # an IP address needs no lookup
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        candidates = [(family, (host, 0))]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM, flags=socket.AI_ADDRCONFIG)
        except OSError:
            return True
        candidates = [(family, (sockaddr[0], 0, *sockaddr[2:])) for family, _, _, _, sockaddr in infos]
    for family, where in candidates:
        try:  # only this host's own addresses bind; a family this host lacks is no match either
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind(where)
                return True
        except OSError:
            continue
    return False


def _host_identity() -> Dict[str, Any]:
    """What must match for two processes to share memory through /proc: the same boot of the
    same machine, and the same network and pid namespaces."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    ident: Dict[str, Any] = {"boot_id": boot}
    for ns in ("net", "pid"):
        st = os.stat(f"/proc/self/ns/{ns}")
        ident[f"{ns}_namespace"] = [st.st_dev, st.st_ino]
    return ident


def _whose(writable: bool) -> str:
    """Who offered a segment mapped writable (a worker: its slots) or not (a reducer: its result slots)."""
    return "the worker's" if writable else "the reducer's"


def _layout(slots: int, slot_bytes: int) -> Tuple[int, int]:
    """(stride between slots, size of the whole segment)."""
    stride = -(-slot_bytes // _SLOT_ALIGN) * _SLOT_ALIGN
    return stride, _HEADER_BYTES + slots * stride


class Segment:
    """`slots` payload slots of `slot_bytes` each, mapped into this process. Nothing unmaps it
    explicitly: the mapping goes when the last view of it does (a reducer may still hold views
    of a departed peer's slots in rounds that are being failed)."""

    def __init__(self, mapping: mmap.mmap, slots: int, slot_bytes: int, offer: Optional[dict] = None) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._stride = _layout(slots, slot_bytes)[0]
        self._view = memoryview(mapping)
        # The counters stay usable after close(): a rank may release a result slot it kept
        # through a connection that has since been replaced.
        self._header = self._view[:_HEADER_BYTES]
        #: what the worker puts in its HELLO (None on the reducer's side)
        self.offer = offer
        self._fd: Optional[int] = None  # the worker's memfd, open until close()

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> "Segment":
        """A new sealed segment, offered to another process (a worker's slots, or a reducer's
        result slots). Raises OSError where memfd is missing."""
        if not SUPPORTED:
            raise OSError("shared-memory slots need Linux's sealed memfds")
        identity = _host_identity()
        size = _layout(slots, slot_bytes)[1]
        fd = os.memfd_create("reduction-server", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        nonce = secrets.token_bytes(_NONCE_BYTES)
        mapping[: len(_MAGIC) + _NONCE_BYTES] = _MAGIC + nonce
        offer = {
            "pid": os.getpid(),
            "fd": fd,
            "slots": slots,
            "slot_bytes": slot_bytes,
            "nonce": nonce.hex(),
            **identity,
        }
        segment = cls(mapping, slots, slot_bytes, offer)
        segment._fd = fd  # the reducer opens it through /proc/<pid>/fd/<fd>
        return segment

    @classmethod
    def attach(cls, offer: Any, *, max_slots: int, max_slot_bytes: int, writable: bool = True) -> "Segment":
        """Map another process's segment: a worker's on the reducer's side, or (not writable) a
        reducer's result slots on a worker's; raise Unavailable saying why not. Offers of more
        slots or larger ones than this side can use are declined: a peer cannot make it map more
        than its window of its largest chunks."""
        if not isinstance(offer, dict):
            raise Unavailable("the offer is not a JSON object")
        try:
            pid, fd, slots, slot_bytes = (int(offer[k]) for k in ("pid", "fd", "slots", "slot_bytes"))
            nonce = bytes.fromhex(offer["nonce"])
        except (KeyError, TypeError, ValueError) as exc:
            raise Unavailable(f"malformed offer: {exc!r}") from None
        if not (0 < slots <= max_slots and 0 < slot_bytes <= max_slot_bytes and len(nonce) == _NONCE_BYTES):
            raise Unavailable(
                f"offer of {slots} slots of {slot_bytes} bytes is out of range (at most "
                f"{max_slots} slots of {max_slot_bytes} bytes, RS_MAX_CHUNK_BYTES)"
            )
        try:
            return cls._map(pid, fd, slots, slot_bytes, nonce, offer, writable)
        except OSError as exc:  # /proc hidden, an address space or map count used up, ...
            raise Unavailable(f"cannot map {_whose(writable)} segment: {exc}") from None

    @classmethod
    def _map(
        cls, pid: int, fd: int, slots: int, slot_bytes: int, nonce: bytes, offer: dict, writable: bool
    ) -> "Segment":
        for key, value in _host_identity().items():
            if offer.get(key) != value:
                raise Unavailable(f"not the same host ({key.replace('_', ' ')} differs)")
        path = f"/proc/{pid}/fd/{fd}"
        try:
            st = os.stat(path)
        except OSError as exc:
            raise Unavailable(f"cannot open {_whose(writable)} segment: {exc.strerror}") from None
        # A peer names the descriptor: only a regular file is opened (a tty, a FIFO or a device
        # could block the reducer or become its terminal), and never in a blocking mode.
        if not stat.S_ISREG(st.st_mode):
            raise Unavailable(f"{_whose(writable)} descriptor is not a regular file")
        size = _layout(slots, slot_bytes)[1]
        if st.st_size != size:
            raise Unavailable(f"the segment is {st.st_size} bytes, expected {size}")
        mode = os.O_RDWR if writable else os.O_RDONLY
        opened = os.open(path, mode | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            try:
                seals = fcntl.fcntl(opened, fcntl.F_GET_SEALS)
            except OSError:
                raise Unavailable(f"{_whose(writable)} descriptor is not a sealable memfd") from None
            if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
                raise Unavailable(f"{_whose(writable)} segment is not sealed against resizing")
            mapping = mmap.mmap(opened, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        finally:
            os.close(opened)  # the mapping stays valid without it
        if mapping[: len(_MAGIC) + _NONCE_BYTES] != _MAGIC + nonce:
            mapping.close()
            raise Unavailable("the segment's nonce does not match the offer (another process's descriptor)")
        return cls(mapping, slots, slot_bytes)

    def slot(self, index: int, nbytes: int) -> memoryview:
        """The first nbytes of slot `index` (writable unless mapped read-only); ValueError naming
        what is out of range."""
        if not 0 <= index < self.slots:
            raise ValueError(f"shared-memory slot {index} out of range (0..{self.slots - 1})")
        if not 0 <= nbytes <= self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a shared-memory slot of {self.slot_bytes}")
        start = _HEADER_BYTES + index * self._stride
        return self._view[start : start + nbytes]

    def accept_results(self) -> None:
        """Say in this (a worker's) segment that its rank reads results from the reducer's result
        slots (it mapped them)."""
        _native.store_release(self._header, _ACCEPTS_AT, 1)

    def accepts_results(self) -> bool:
        """Whether this worker's segment says its rank reads results from result slots."""
        return _native.load_acquire(self._header, _ACCEPTS_AT) != 0

    def release(self, index: int, use: int) -> None:
        """Say in this (a worker's) segment that its rank is done with `use` of result slot
        `index`: everything it read from there before is read."""
        _native.store_release(self._header, _RELEASED_AT + 8 * index, use)

    def released(self, index: int) -> int:
        """The use of result slot `index` that this worker's rank last released (0: none)."""
        return _native.load_acquire(self._header, _RELEASED_AT + 8 * index)

    def close(self) -> None:
        """Drop this side's descriptor and slots; the memory is unmapped once no slot view, and
        this object (its counters), is alive."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._view = memoryview(b"")
