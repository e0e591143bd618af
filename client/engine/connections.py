"""A worker's connections to its reducers: open, watched, lost, and opened again.

Each reducer gets one DEALER socket, and each socket one TCP connection: libzmq's own reconnect
is off, since it would carry what is queued, or sent next, to whatever listens at the address by
then, before that has proved the job token. When a connection closes the engine opens a new
socket (after RECONNECT_S when the last attempt failed) and handshakes again.

Liveness: libzmq's ZMTP heartbeats (every RS_HEARTBEAT_INTERVAL, in its I/O thread, so a busy
Python thread cannot starve them) close a connection silent for RS_LIVENESS_TIMEOUT, and a
process that exits closes its own; a socket monitor reports either at once. The engine also
sends each reducer a PING every interval: it tells the reducer that this worker can be probed.
"""
from __future__ import annotations

import json
import logging
import os
import socket as pysocket
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import zmq

from reduction_server import __version__

from reduction_server.wire import auth, encryption, protocol
from reduction_server.log import event, get_logger
from reduction_server.wire.protocol import MsgType
from reduction_server.wire.send_buffers import EndpointBuffers
from reduction_server.config.settings import SNDBUF_AUTO

from .endpoints import Endpoint, make_room
from .failover import Failover
from .identity import Identity
from .ledger import Ledger
from .slots import Slots
from .watch import CONNECTING, REFUSED, Watch

log = get_logger("client")

#: seconds before the engine opens a new connection to a reducer whose last one failed (libzmq's
#: own reconnect interval, which it does not use)
RECONNECT_S = 0.1
_MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_CLOSED | encryption.HANDSHAKE_FAILED


class Connections:
    """The sockets to every reducer, which of them are down, and when to try each again."""

    def __init__(self, me: Identity, ends: Sequence[Endpoint], ledger: Ledger, slots: Slots, failover: Failover, *,
                 job_token: str, encrypt: bool, heartbeat: float, liveness: float, sndbuf: int,
                 io_threads: int) -> None:
        self.me = me
        self.endpoints = ends  # every shard of every reducer (endpoints.py); "reducer r" below is endpoint r
        self.addresses = [e.address for e in ends]
        self.ledger = ledger
        self.slots = slots
        self.failover = failover
        self.job_token = job_token
        self.encrypt = encrypt  # CurveZMQ, keys from the job token (encryption.py)
        self.heartbeat = heartbeat
        self.liveness = liveness
        # SO_SNDBUF of each reducer connection (RS_SNDBUF): a size, 0 (the kernel's autotuning) or
        # SNDBUF_AUTO (reduction_server/wire/send_buffers.py sizes each connection's from what it measures)
        self.sndbuf = sndbuf
        self.send_buffers = EndpointBuffers(self.addresses) if sndbuf == SNDBUF_AUTO else None
        self.io_threads = io_threads
        self.sockets: List[zmq.Socket] = []
        self.monitors: List[zmq.Socket] = []
        self.poller = zmq.Poller()
        self.index: Dict[Any, Tuple[str, int]] = {}  # socket or monitor -> ("data" | "monitor", reducer)
        #: reducers not usable now: index -> (why, whether a new connection is being tried)
        self.down: Dict[int, Tuple[str, bool]] = {}
        self.reopen_at: Dict[int, float] = {}  # reducer -> when to open a new connection to it
        # Per reducer: the nonce of the last HELLO (its CHALLENGE must prove the token over it), how
        # far its handshake got, and its failed security handshakes in a row (count, first failure).
        self.nonces: List[bytes] = [b""] * len(ends)
        self.watch = Watch(len(ends), encrypt)
        self.progress = self.watch.progress
        self.context: Optional[zmq.Context] = None
        self.groups: Dict[int, bytes] = {}  # group -> its GROUP message, told to every reducer that admits us

    def announce(self, group: int, ranks: Sequence[int]) -> None:
        """Tell every reducer the ranks of `group` (before any of its chunks: one socket keeps
        the order), and every reducer that admits this worker again later."""
        self.groups[group] = protocol.group_payload(ranks)
        for r in range(len(self.sockets)):
            if r not in self.down:
                self._tell_groups(r, [group])

    def _tell_groups(self, r: int, groups: Sequence[int]) -> None:
        for group in groups:  # far below libzmq's queue; a gone connection is noticed by the next chunk
            self.send_text(r, MsgType.GROUP, self.groups[group], group)

    def name(self, r: int) -> str:
        """Reducer r as messages name it: "reducer r (host:port)"."""
        return self.ledger.names[r]

    def open_all(self) -> None:
        """A socket to every reducer, each greeted with a HELLO (queued until it connects)."""
        self.context = zmq.Context(self.io_threads)
        make_room(self.context, len(self.addresses), self.me.rank)
        for r in range(len(self.addresses)):
            sock, monitor = self._open(r)
            self.sockets.append(sock)
            self.monitors.append(monitor)
            self._watch(r)
            self.hello(r)

    def _open(self, r: int) -> Tuple[zmq.Socket, zmq.Socket]:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)  # a BYE may still be queued at close
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one connection per socket (above)
        sndbuf = self.sndbuf if self.send_buffers is None else self.send_buffers.initial(r)
        if sndbuf > 0:  # never 0 here: ZMQ_SNDBUF=0 would ask the kernel for its smallest buffer, not autotuning
            sock.setsockopt(zmq.SNDBUF, sndbuf)
        protocol.set_heartbeats(sock, self.heartbeat, self.liveness)  # a stopped reducer's connection closes
        if self.encrypt:
            encryption.secure_worker(sock, self.job_token)
        # A closed connection (a reducer that died) is seen at once, not after the liveness timeout;
        # a failed security handshake (RS_ENCRYPT or RS_JOB_TOKEN differ) too, instead of retrying forever.
        monitor = sock.get_monitor_socket(_MONITORED)
        sock.connect(f"tcp://{self.addresses[r]}")
        return sock, monitor

    def _watch(self, r: int) -> None:
        self.poller.register(self.sockets[r], zmq.POLLIN)
        self.poller.register(self.monitors[r], zmq.POLLIN)
        self.index[self.sockets[r]] = ("data", r)
        self.index[self.monitors[r]] = ("monitor", r)

    def hello(self, r: int, rejoin: bool = False) -> None:
        """Start reducer r's handshake: who this worker is, and a nonce to prove the token over."""
        self.nonces[r] = auth.new_nonce()
        if self.progress[r] != REFUSED:  # refused stays refused until a connection is made
            self.progress[r] = CONNECTING
        # "heartbeats": this engine PINGs its reducers once it runs, so a reducer may probe it from
        # its admission on (a worker killed before its first PING is seen lost at once).
        facts: Dict[str, Any] = {"host": pysocket.gethostname(), "pid": os.getpid(), "version": __version__,
                                 "nonce": self.nonces[r].hex(), "heartbeats": True}
        if rejoin:  # a reducer serving another job by now must not be taken back by this one
            facts["rejoin"] = True
        self.slots.drop(r)  # a new connection gets a new segment: nothing old can reach it
        self.send_text(r, MsgType.HELLO, json.dumps(facts).encode())

    def send_text(self, r: int, mtype: MsgType, payload: bytes, group: int = 0) -> None:
        """Queue a small message (HELLO, AUTH, GROUP, PROGRESS) to reducer r without blocking; if
        its connection already failed, it is dropped (the monitor reports the failure, and a new
        connection's handshake says it all again)."""
        try:
            self.sockets[r].send_multipart([self.me.header(mtype, payload, group), payload], zmq.NOBLOCK)
        except zmq.Again:
            # The connection already failed (its security handshake was refused, or it dropped):
            # the monitor reports that, and a new connection is opened, or the reducer given up.
            log.debug("rank %d: %s not queued: its connection already failed", self.me.rank, mtype.name)

    def reopen(self, r: int, rejoin: bool) -> None:
        """A fresh connection to reducer r's address and a new handshake: a restarted reducer
        (it keeps no state between collectives) is used again once it admits this worker."""
        for old in (self.sockets[r], self.monitors[r]):
            self.poller.unregister(old)
            self.index.pop(old, None)
        self.sockets[r].disable_monitor()
        self.monitors[r].close(linger=0)
        self.sockets[r].close(linger=0)  # nothing queued for the old connection may reach the new one
        self.sockets[r], self.monitors[r] = self._open(r)
        self._watch(r)
        self.hello(r, rejoin)

    def reopen_due(self, now: float, rejoin: bool) -> None:
        """Open a new connection to every reducer whose reopen_at time has come by `now`;
        `rejoin` marks their HELLOs as a rejoin."""
        for r, at in list(self.reopen_at.items()):
            if now >= at:
                del self.reopen_at[r]
                self.reopen(r, rejoin)

    def monitor_events(self, r: int) -> Tuple[bool, Optional[str]]:
        """Drain reducer r's monitor (watch.py): whether its connection closed, and why to give
        up on it if its security handshake failed for good."""
        return self.watch.drain(r, self.monitors[r])

    def on_monitor(self, r: int) -> None:
        """Reducer r's monitor spoke (after the first handshake): a lost or refused connection."""
        closed, refused = self.monitor_events(r)
        if not closed and not refused:
            return  # a connection made: nothing lost
        down = self.down.get(r)
        if down is not None and down[1] and refused:
            self.refuse(r, f"{self.name(r)} came back but refused this worker: {refused}")
        elif down is None:
            self.lose(r, "its connection closed (the process exited, stopped answering heartbeats for "
                         f"RS_LIVENESS_TIMEOUT={self.liveness:g} s, or the network dropped it); reconnecting",
                      reconnect=True)
        elif down[1]:  # not back yet, or gone again in the middle of the new handshake
            self.retry_later(r)

    def retry_later(self, r: int) -> None:
        """Open a new connection to reducer r after RECONNECT_S."""
        self.reopen_at[r] = time.monotonic() + RECONNECT_S

    def lose(self, r: int, reason: str, *, reconnect: bool) -> None:
        """Reducer r is gone. With failover and another reducer in use, its chunks move there
        (failover.py) until it comes back and every rank agrees from when to use it again;
        otherwise every pending collective that needs it fails now, naming it (and every
        reducer lost before it). Either way, a new connection is tried when `reconnect`."""
        text = f"{self.name(r)} was lost: {reason}"
        failover = self.failover
        self.down[r] = (text, reconnect)
        if failover.enabled and (failover.survivors(without=r) or failover.recruitable(self.down)):
            self.event("reducer_lost", r, reason=reason, failover=True, left=len(failover.survivors(without=r)))
            for coll in failover.move_off(r, text, self.ledger):
                self.ledger.give_up(coll, f"no reducer is left for one of its chunks: {failover.reason()}")
            for spare, progress in failover.recruit(self._progress(), self.down).items():
                self.report(spare, progress)
        else:
            self.event("reducer_lost", r, reason=reason, reconnecting=reconnect)
            if failover.lost:
                text = f"every reducer was lost: {failover.reason()}; {text}"
                for other in [r, *failover.lost]:  # what a collective waiting for any of them hears
                    if other in self.down:
                        self.down[other] = (text, self.down[other][1])
                failover.reset()
            self.ledger.fail_pending_on(r, text)
        if reconnect:
            self.reopen(r, rejoin=True)

    def refuse(self, r: int, reason: str) -> None:
        """Reducer r came back but cannot be used again: collectives that need it fail with reason."""
        self.down[r] = (reason, False)
        self.reopen_at.pop(r, None)
        self.event("reducer_refused", r, reason=reason)

    def admitted(self, r: int, welcome: dict) -> None:
        """Reducer r's WELCOME: its handshake holds, and its shared-memory answer is known."""
        self.watch.failures[r] = (0, 0.0)
        self.slots.welcomed(r, welcome)
        self._tell_groups(r, list(self.groups))

    def readmitted(self, r: int, welcome: dict, max_chunk_bytes: int) -> None:
        """Reducer r admitted this worker again after it was lost."""
        limit = int(welcome.get("max_chunk_bytes", max_chunk_bytes))
        if limit < max_chunk_bytes:  # the ranks' chunk plans would no longer agree
            return self.refuse(r, f"{self.name(r)} came back with a smaller chunk limit ({limit} < "
                                  f"{max_chunk_bytes} bytes, RS_MAX_CHUNK_BYTES); restart the job")
        del self.down[r]
        self.admitted(r, welcome)
        self.event("reducer_readmitted", r)
        try:
            self.sockets[r].send(self.me.header(MsgType.PING), zmq.NOBLOCK)
        except zmq.Again:
            pass
        progress = self.failover.readmitted(r, self._progress())
        if progress:
            self.report(r, progress)

    def _progress(self) -> Dict[int, int]:
        """Where this rank is: each group's seq of the next collective it will start."""
        return {group: self.ledger.next_seq.get(group, 0) for group in [0, *self.groups]}

    def report(self, r: int, progress: Dict[int, int]) -> None:
        """Tell lost reducer r, back now, where this rank is in these groups (PROGRESS)."""
        self.send_text(r, MsgType.PROGRESS, protocol.seq_pairs_payload(progress.items()))

    def heartbeat_all(self) -> None:
        """Send a PING to every reducer not down, without blocking; a full queue or a gone connection skips it."""
        ping = self.me.header(MsgType.PING)
        for r, sock in enumerate(self.sockets):
            if r in self.down:
                continue
            try:
                sock.send(ping, zmq.NOBLOCK)
            except zmq.Again:
                pass  # its queue is full of chunks, or its connection is gone (its monitor says so)

    def event(self, name: str, r: int, **fields: Any) -> None:
        """A WARNING log line about reducer r, naming this rank and the reducer."""
        event(log, logging.WARNING, name, rank=self.me.rank, reducer=r, address=self.addresses[r], **fields)

    def close(self, bye: bool) -> None:
        """Say BYE to every reducer still up (when `bye`), close every socket and the context."""
        self.slots.close()
        for sock, monitor in zip(self.sockets, self.monitors):
            sock.disable_monitor()
            monitor.close(linger=0)
        for r, sock in enumerate(self.sockets):
            if bye and r not in self.down:
                try:
                    sock.send(self.me.header(MsgType.BYE), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # nobody to say goodbye to
            # A failed handshake, or a reducer that is gone, has nothing worth lingering for.
            sock.close(linger=None if bye and r not in self.down else 0)
        if self.context is not None:
            self.context.term()
