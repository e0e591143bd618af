"""A worker's connections to its endpoints (every shard of every reducer, endpoints.py): open,
watched, lost, and opened again.

Each endpoint gets one DEALER socket, and each socket one TCP connection: libzmq's own reconnect
is off, since it would carry what is queued, or sent next, to whatever listens at the address by
then, before that has proved the job token. When a connection closes the engine opens a new
socket (after RECONNECT_S when the last attempt failed) and handshakes again.

Liveness: libzmq's ZMTP heartbeats (every RS_HEARTBEAT_INTERVAL, in its I/O thread, so a busy
Python thread cannot starve them) close a connection silent for RS_LIVENESS_TIMEOUT, and a
process that exits closes its own; a socket monitor reports either at once. The engine also
sends each endpoint a PING every interval: it tells the reducer that this worker can be probed.

With RS_INTEGRITY every message each way past HELLO and CHALLENGE carries a tag frame
(reduction_server/wire/integrity.py): `tags_out` makes them, `tags_in` checks them; a connection
whose message fails its check is lost, naming why.
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
from reduction_server.config.settings import SNDBUF_AUTO
from reduction_server.log import NOTICE, Throttle, event, get_logger
from reduction_server.wire import auth, encryption, gate, integrity, protocol
from reduction_server.wire.protocol import MsgType
from reduction_server.wire.send_buffers import EndpointBuffers

from ..chunking import largest_frame_bytes
from .endpoints import Endpoint, make_room
from .failover import Failover
from .identity import Identity
from .ledger import Ledger
from .options import EngineOptions
from .resolver import Resolver
from .slots import Slots
from .watch import CONNECTING, CUT, REFUSED, Watch

log = get_logger("client")

#: seconds before the engine opens a new connection to an endpoint whose last one failed (libzmq's
#: own reconnect interval, which it does not use)
RECONNECT_S = 0.1
#: seconds between the attempts at an endpoint that came back but refused this worker: the right
#: reducer may yet answer there (another job's that took its port stopped, or it was restarted as
#: it should be), and only once every rank is admitted again can the ranks agree to use it (JOIN)
REFUSED_RETRY_S = 1.0
#: how often a new connection waiting for its address's lookup (resolver.py) asks again
_LOOKUP_POLL_S = 0.02
_MONITORED = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | encryption.HANDSHAKE_FAILED
)


class Connections:
    """The sockets to every endpoint, which of them are down, and when to try each again.
    Endpoints go by their index in `endpoints` (e); `name(e)` says which reducer's shard it is."""

    def __init__(
        self,
        me: Identity,
        ends: Sequence[Endpoint],
        ledger: Ledger,
        slots: Slots,
        failover: Failover,
        options: EngineOptions,
    ) -> None:
        self.me = me
        self.endpoints = ends
        self.addresses = [end.address for end in ends]
        self.ledger = ledger
        self.slots = slots
        self.failover = failover
        self.options = options  # the job token, encrypt (CurveZMQ), send_buffer (SO_SNDBUF), io_threads
        self.heartbeat, self.liveness = options.heartbeat_interval, options.liveness_timeout
        # SNDBUF_AUTO: reduction_server/wire/send_buffers.py sizes each connection's from what it measures
        self.send_buffers = EndpointBuffers(self.addresses) if options.send_buffer == SNDBUF_AUTO else None
        self.sockets: List[zmq.Socket] = []
        self.monitors: List[zmq.Socket] = []
        self.poller = zmq.Poller()
        self.index: Dict[Any, Tuple[str, int]] = {}  # socket or monitor -> ("data" | "monitor", endpoint)
        #: endpoints not usable now: index -> (why, whether a new connection is being tried)
        self.down: Dict[int, Tuple[str, bool]] = {}
        self.reopen_at: Dict[int, float] = {}  # endpoint -> when to open a new connection to it
        self.resolver = Resolver()  # a new connection's address, looked up off libzmq's I/O thread
        # Per endpoint: the nonce of the last HELLO (its CHALLENGE must prove the token over it), how
        # far its handshake got, and its failed security handshakes in a row (count, first failure).
        self.nonces: List[bytes] = [b""] * len(ends)
        self.hellos: List[bytes] = [b""] * len(ends)  # the last HELLO's payload (RS_INTEGRITY's keys bind it)
        # RS_INTEGRITY: each connection's channels, from its CHALLENGE on (None: no tags, or not yet)
        self.tags_out: List[Optional[integrity.Channel]] = [None] * len(ends)
        self.tags_in: List[Optional[integrity.Channel]] = [None] * len(ends)
        self.watch = Watch(len(ends), options.encrypt, gated=gate.applies(options.job_token, options.encrypt))
        # What answers at a lost reducer's address, tried every REFUSED_RETRY_S, may be a stranger
        # whose every refusal reads otherwise: its reducer_refused lines are bounded per endpoint.
        self.refusals = Throttle(log)
        self.progress = self.watch.progress
        self.context: Optional[zmq.Context] = None
        self.groups: Dict[int, bytes] = {}  # group -> its GROUP message, told to every endpoint that admits us

    def announce(self, group: int, ranks: Sequence[int]) -> None:
        """Tell every endpoint the ranks of `group` (before any of its chunks: one socket keeps
        the order), and every endpoint that admits this worker again later."""
        self.groups[group] = protocol.group_payload(ranks)
        for e in range(len(self.sockets)):
            if e not in self.down:
                self._tell_groups(e, [group])

    def _tell_groups(self, e: int, groups: Sequence[int]) -> None:
        for group in groups:  # far below libzmq's queue; a gone connection is noticed by the next chunk
            self.send_text(e, MsgType.GROUP, self.groups[group], group)

    def name(self, e: int) -> str:
        """Endpoint e as messages name it: "reducer 1 (host:port)", or "reducer 1 shard 2 (host:port+2)"."""
        return self.ledger.names[e]

    def open_all(self) -> None:
        """A socket to every endpoint, each greeted with a HELLO (queued until it connects)."""
        self.context = zmq.Context(self.options.io_threads)
        make_room(self.context, len(self.addresses), self.me.rank)
        for e in range(len(self.addresses)):
            sock, monitor = self._open(e)
            self.sockets.append(sock)
            self.monitors.append(monitor)
            self._watch(e)
            self.hello(e)

    def _open(self, e: int, address: Optional[str] = None) -> Tuple[zmq.Socket, zmq.Socket]:
        """A socket and its monitor, connecting to endpoint e (at `address`, its resolved form)."""
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)  # a BYE may still be queued at close
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one connection per socket (above)
        sndbuf = self.options.send_buffer if self.send_buffers is None else self.send_buffers.initial(e)
        if sndbuf > 0:  # never 0 here: ZMQ_SNDBUF=0 would ask the kernel for its smallest buffer, not autotuning
            sock.setsockopt(zmq.SNDBUF, sndbuf)
        protocol.set_heartbeats(sock, self.heartbeat, self.liveness)  # a stopped reducer's connection closes
        # A peer at a reducer's address that proved nothing yet must not stream GiBs into this
        # process: libzmq cuts off a connection whose frame announces more than a reducer sends.
        sock.setsockopt(zmq.MAXMSGSIZE, largest_frame_bytes(self.options.chunk_bytes))
        if self.options.encrypt:  # keys from the job token (encryption.py)
            encryption.secure_worker(sock, self.options.job_token)
        elif self.options.job_token:  # a fresh credential: a reducer lets no stranger's connection through (gate.py)
            gate.present(sock, self.options.job_token)
        # A closed connection (a reducer that died) is seen at once, not after the liveness timeout;
        # a failed security handshake (RS_ENCRYPT or RS_JOB_TOKEN differ) too, instead of retrying forever.
        monitor = sock.get_monitor_socket(_MONITORED)
        sock.connect(f"tcp://{address or self.addresses[e]}")
        return sock, monitor

    def _watch(self, e: int) -> None:
        self.poller.register(self.sockets[e], zmq.POLLIN)
        self.poller.register(self.monitors[e], zmq.POLLIN)
        self.index[self.sockets[e]] = ("data", e)
        self.index[self.monitors[e]] = ("monitor", e)

    def hello(self, e: int, rejoin: bool = False) -> None:
        """Start endpoint e's handshake: who this worker is, and a nonce to prove the token over."""
        self.nonces[e] = auth.new_nonce()
        self.tags_out[e] = self.tags_in[e] = None  # a new connection: its CHALLENGE brings its keys
        if self.progress[e] not in (REFUSED, CUT):  # either stays until a connection gets further
            self.progress[e] = CONNECTING
        # "heartbeats": this engine PINGs its endpoints once it runs, so a reducer may probe it from
        # its admission on (a worker killed before its first PING is seen lost at once).
        facts: Dict[str, Any] = {
            "host": pysocket.gethostname(),
            "pid": os.getpid(),
            "version": __version__,
            "nonce": self.nonces[e].hex(),
            "heartbeats": True,
        }
        if self.options.run_id:  # a reducer tells this run from a late rank of the last by it
            facts["run_id"] = self.options.run_id
        if rejoin:  # a reducer serving another job by now must not be taken back by this one
            facts["rejoin"] = True
        if self.options.integrity:  # the reducer refuses a worker whose setting is not its own
            facts["integrity"] = True
        self.slots.drop(e)  # a new connection gets a new segment: nothing old can reach it
        self.hellos[e] = json.dumps(facts).encode()
        self.send_text(e, MsgType.HELLO, self.hellos[e])

    def send_small(self, e: int, frames: List[bytes]) -> bool:
        """Queue a small message to endpoint e without blocking, its tag frame after it when its
        connection has tags; False if libzmq would not take it (a full queue, a gone connection)."""
        channel = self.tags_out[e]
        try:
            self.sockets[e].send_multipart(frames if channel is None else [*frames, channel.seal(frames)], zmq.NOBLOCK)
        except zmq.Again:
            if channel is not None:
                channel.seq -= 1  # never sent (libzmq takes a message whole or not at all): its number is the next's
            return False
        return True

    def start_tags(self, e: int, reducer_nonce: bytes) -> None:
        """Endpoint e proved the token: from the AUTH on, every message each way is tagged, with
        keys from this connection's HELLO and the reducer's nonce (RS_INTEGRITY)."""
        if self.options.integrity:
            self.tags_out[e], self.tags_in[e] = integrity.channels(
                self.options.job_token, self.hellos[e], reducer_nonce
            )

    def untag(self, e: int, h: protocol.Header, frames: list) -> Optional[str]:
        """With tags on endpoint e's connection: why the message of header h and these frames (the
        header's first, the tag frame last, taken off the list) fails its check, or None. A REJECT
        is never tagged."""
        channel = self.tags_in[e]
        if channel is None or h.type is MsgType.REJECT:
            return None
        tag = bytes(frames.pop()) if len(frames) > 1 else b""
        why = channel.open(frames, tag)
        return None if why is None else f"{h.type.name} from {self.name(e)}: {why}"

    def send_text(self, e: int, mtype: MsgType, payload: bytes, group: int = 0) -> None:
        """Queue a small message (HELLO, AUTH, GROUP, PROGRESS) to endpoint e without blocking; if
        its connection already failed, it is dropped (the monitor reports the failure, and a new
        connection's handshake says it all again)."""
        if not self.send_small(e, [self.me.header(mtype, payload, group), payload]):
            # The connection already failed (its security handshake was refused, or it dropped):
            # the monitor reports that, and a new connection is opened, or the endpoint given up.
            log.debug("rank %d: %s not queued: its connection already failed", self.me.rank, mtype.name)

    def reopen(self, e: int, rejoin: bool, address: Optional[str] = None) -> None:
        """A fresh connection to endpoint e's address (`address`, resolved) and a new handshake: a
        restarted reducer (it keeps no state between collectives) is used again once it admits
        this worker."""
        for old in (self.sockets[e], self.monitors[e]):
            self.poller.unregister(old)
            self.index.pop(old, None)
        self.sockets[e].disable_monitor()
        self.monitors[e].close(linger=0)
        self.sockets[e].close(linger=0)  # nothing queued for the old connection may reach the new one
        self.sockets[e], self.monitors[e] = self._open(e, address)
        self._watch(e)
        self.hello(e, rejoin)

    def reopen_due(self, now: float, rejoin: bool) -> None:
        """Open a new connection to every endpoint whose reopen_at time has come by `now`;
        `rejoin` marks their HELLOs as a rejoin."""
        for e, at in list(self.reopen_at.items()):
            if now < at:
                continue
            try:
                address = self.resolver.address(self.addresses[e])
            except OSError as exc:  # its name is gone (a container or pod removed): it may come back
                self.event("reducer_unresolved", e, level=logging.DEBUG, reason=str(exc))
                self.reopen_at[e] = now + REFUSED_RETRY_S
                continue
            if address is None:  # being looked up
                self.reopen_at[e] = now + _LOOKUP_POLL_S
                continue
            del self.reopen_at[e]
            self.reopen(e, rejoin, address)

    def monitor_events(self, e: int) -> Tuple[bool, Optional[str]]:
        """Drain endpoint e's monitor (watch.py): whether its connection closed, and why to give
        up on it if its security handshake failed for good."""
        return self.watch.drain(e, self.monitors[e])

    def on_monitor(self, e: int) -> None:
        """Endpoint e's monitor spoke (after the first handshake): a lost or refused connection."""
        closed, refused = self.monitor_events(e)
        if not closed and not refused:
            return  # a connection made: nothing lost
        down = self.down.get(e)
        if down is None:
            # A connection in use refused by its security (a frame altered on the way) says why.
            why = refused or (
                "its connection closed (the process exited, stopped answering heartbeats for "
                f"RS_LIVENESS_TIMEOUT={self.liveness:g} s, or the network dropped it)"
            )
            self.lose(e, f"{why}; reconnecting", reconnect=True)
        elif refused:
            self.refuse(e, f"{self.name(e)} came back but refused this worker: {refused}")
        else:  # not back yet, or gone again in the middle of the new handshake
            self.retry_later(e, RECONNECT_S if down[1] else REFUSED_RETRY_S)

    def retry_later(self, e: int, after: float = RECONNECT_S) -> None:
        """Open a new connection to endpoint e `after` seconds from now."""
        self.reopen_at[e] = time.monotonic() + after

    def drain(self, e: int, boundaries: Dict[int, int]) -> None:
        """Endpoint e drains (DRAIN, reducer/drain.py): with failover, its chunks from the
        boundaries on move to the others (failover.py); without, each it answers DRAINING fails."""
        failover = self.failover
        moving = failover.enabled and e not in self.down
        self.event("reducer_draining", e, level=logging.INFO, groups=len(boundaries), moving=moving)
        if not moving:
            return
        for coll in failover.drain(e, boundaries, self.ledger):
            self.ledger.give_up(coll, f"{self.name(e)} drains (it was told to stop); {self.unmovable()}")

    def unmovable(self) -> str:
        """Why a draining endpoint's chunk past its boundary cannot move (the end of its error)."""
        if not self.failover.enabled:
            if len(self.endpoints) == 1:
                return "there is no other reducer to move its chunks to"
            return "with RS_FAILOVER=0 this worker does not move its chunks to another reducer"
        return "no other reducer is left for one of its chunks" + (
            f": {self.failover.reason()}" if self.failover.lost else ""
        )

    def lose(self, e: int, reason: str, *, reconnect: bool, drained: bool = False) -> None:
        """Endpoint e is gone. With failover and another endpoint in use, its chunks move there
        (failover.py) until it comes back and every rank agrees from when to use it again;
        otherwise every pending collective that needs it fails now, naming it (and every
        endpoint lost before it). Either way, a new connection is tried when `reconnect`.
        `drained`: it said DRAINED (it answered every chunk before the boundaries of the DRAIN
        this rank moved its chunks by): nothing is resent, and it is tried again once it closed."""
        failover = self.failover
        if drained and e not in failover.until:  # it did not move this rank's chunks
            reason += f"; {self.unmovable()}"
        text = f"{self.name(e)} was lost: {reason}"
        # A drained one is tried again later (_part), but nothing waits for it meanwhile.
        self.down[e] = (text, reconnect and not drained)
        if drained:
            self._part(e)
        if drained and e in failover.until:
            self.event("reducer_drained", e, level=NOTICE)
            for coll in failover.drained(e, text, self.ledger):
                self.ledger.give_up(coll, f"{self.name(e)} drained; {self.unmovable()}")
            return
        if failover.enabled and (failover.survivors(without=e) or failover.recruitable(self.down)):
            self.event("reducer_lost", e, reason=reason, failover=True, left=len(failover.survivors(without=e)))
            for coll in failover.move_off(e, text, self.ledger):
                self.ledger.give_up(coll, f"no reducer is left for one of its chunks: {failover.reason()}")
            for spare, progress in failover.recruit(self._progress(), self.down).items():
                self.report(spare, progress)
        else:
            self.event("reducer_lost", e, reason=reason, reconnecting=reconnect)
            if failover.lost:
                text = f"every reducer was lost: {failover.reason()}; {text}"
                for other in [e, *failover.lost]:  # what a collective waiting for any of them hears
                    if other in self.down:
                        self.down[other] = (text, self.down[other][1])
                failover.reset()
            self.ledger.fail_pending_on(e, text)
        if reconnect and not drained:
            self.reopen(e, rejoin=True)

    def _part(self, e: int) -> None:
        """Endpoint e drained: a BYE lets it exit (it waits for every worker's), and a new
        connection is tried once it may be back (a reducer restarted at its address)."""
        try:
            self.sockets[e].send(self.me.header(MsgType.BYE), zmq.NOBLOCK)
        except zmq.Again:
            pass  # gone already: it exits at its RS_DRAIN_TIMEOUT
        self.retry_later(e, REFUSED_RETRY_S)

    def refuse(self, e: int, reason: str) -> None:
        """Endpoint e came back but cannot be used: collectives that need it fail with reason until
        it admits this worker as it should, which is tried every REFUSED_RETRY_S (logged when the
        reason changes, at most once per THROTTLE_S)."""
        previous = self.down.get(e)
        self.down[e] = (reason, False)
        self.retry_later(e, REFUSED_RETRY_S)
        if previous is None or previous[0] != reason:
            self.refusals.event(
                logging.WARNING,
                "reducer_refused",
                cause=str(e),
                rank=self.me.rank,
                reducer=e,
                address=self.addresses[e],
                reason=reason,
            )

    def admitted(self, e: int, welcome: dict) -> None:
        """Endpoint e's WELCOME: its handshake holds, and its shared-memory answer is known."""
        self.watch.failures[e] = (0, 0.0)
        self.slots.welcomed(e, welcome)
        self._tell_groups(e, list(self.groups))

    def readmitted(self, e: int, welcome: dict) -> None:
        """Endpoint e admitted this worker again after it was lost (its WELCOME agrees with the job's)."""
        del self.down[e]
        self.admitted(e, welcome)
        self.event("reducer_readmitted", e)
        self.send_small(e, [self.me.header(MsgType.PING)])
        progress = self.failover.readmitted(e, self._progress())
        if progress:
            self.report(e, progress)

    def _progress(self) -> Dict[int, int]:
        """Where this rank is: each group's seq of the next collective it will start."""
        return {group: self.ledger.next_seq.get(group, 0) for group in [0, *self.groups]}

    def report(self, e: int, progress: Dict[int, int]) -> None:
        """Tell lost endpoint e, back now, where this rank is in these groups (PROGRESS)."""
        self.send_text(e, MsgType.PROGRESS, protocol.seq_pairs_payload(progress.items()))

    def heartbeat_all(self) -> None:
        """Send a PING to every endpoint not down, without blocking; a full queue or a gone connection skips it."""
        ping = self.me.header(MsgType.PING)
        for e in range(len(self.sockets)):
            if e not in self.down:  # a full queue of chunks, or a gone connection (its monitor says so), skips it
                self.send_small(e, [ping])

    def event(self, name: str, e: int, level: int = logging.WARNING, **fields: Any) -> None:
        """A log line (WARNING unless told) about endpoint e, naming this rank, the endpoint and its address."""
        # The field keeps its name, `reducer`, which log readers match on; with shards it is the endpoint's index.
        event(log, level, name, rank=self.me.rank, reducer=e, address=self.addresses[e], **fields)

    def close(self, bye: bool) -> None:
        """Say BYE to every endpoint still up (when `bye`), close every socket and the context."""
        self.slots.close()
        for sock, monitor in zip(self.sockets, self.monitors):
            sock.disable_monitor()
            monitor.close(linger=0)
        for e, sock in enumerate(self.sockets):
            if bye and e not in self.down:
                try:
                    self.send_small(e, [self.me.header(MsgType.BYE)])
                except zmq.ZMQError:
                    pass  # nobody to say goodbye to
            # A failed handshake, or an endpoint that is gone, has nothing worth lingering for.
            sock.close(linger=None if bye and e not in self.down else 0)
        self.resolver.close()
        if self.context is not None:
            self.context.term()
