"""The reducer process: receive chunk contributions from W workers, sum them, send the sum back.

One ROUTER socket; every worker connects a DEALER to it. A worker is admitted by the handshake
(HELLO, CHALLENGE, AUTH, WELCOME); then each DATA message is one rank's contribution to one key
(job, generation, seq, chunk). The first contribution to a key is loaded into an accumulator
from a reusable pool, the others are folded in by the native kernel (GIL released); when all W
ranks have contributed, the result goes back to every rank zero-copy and the accumulator returns
to the pool once libzmq has released it. In deterministic mode (RS_DETERMINISTIC=1) the
contributions are folded in rank order (round.py), so a sum does not depend on arrival order.
A worker on the reducer's own host may offer shared-memory slots (shared_memory.py): its chunks
then arrive as DATA_SHM headers and are summed straight from the slot, and the result is written
back into the same slot (RESULT_SHM) instead of being sent as a frame.
Every message gets an answer: a RESULT, or an ERROR that
names the ranks involved; nothing a client sends can take the reducer down.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass
from types import MethodType
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import zmq

from . import _native, auth, encryption, protocol, shared_memory
from .accumulator import AccumulatorPool, PoolExhausted
from .errors import ConfigError, ListenError, ProtocolError
from .log import NOTICE, event, get_logger
from .protocol import (ACCUMULATOR_ITEMSIZE, DTYPES, MSG_DATA, MSG_DATA_SHM, OP_BROADCAST, ErrorCode, Header,
                       MsgType, ReduceOp)
from .round import Round, format_ranks
from .settings import (DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_LIVENESS_TIMEOUT,
                       DEFAULT_MAX_ACCUMULATOR_BYTES, DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_PEER_BYTES,
                       DEFAULT_MAX_ROUNDS, DEFAULT_TIMEOUT, MAX_WINDOW, env_flag, env_number, socket_send_buffer)

if TYPE_CHECKING:
    from .metrics import ReducerMetrics

log = get_logger("reducer")

# Frames from one peer that could not be parsed before it is ignored for good.
MAX_STRIKES = 16
# Longest error or reject text: well inside protocol.MAX_TEXT_PAYLOAD (a longer one would be a
# frame the client must refuse as malformed), and a log line that stays readable.
MAX_ERROR_TEXT = 16 * 1024
# Failed rounds are kept (without their memory) so that ranks that contribute late get the same
# error as the others; at most this many, each for at most RETAIN_FAILED_S + 2 x RS_TIMEOUT.
MAX_FAILED_ROUNDS = 65536
RETAIN_FAILED_S = 60.0
# What the reducer knows of a peer that is not admitted (its malformed-frame count, a HELLO it did
# not follow with AUTH) is dropped once the peer has been silent this long, or at once when a send
# finds its connection gone; at most MAX_STRIKE_ENTRIES strike counts are kept (the oldest go).
FORGET_AFTER_S = 60.0
MAX_STRIKE_ENTRIES = 65536
# After a connection closes, heartbeat peers are probed this many seconds later (the one whose
# pipe is gone answers EHOSTUNREACH): a killed worker is noticed in milliseconds.
PROBE_DELAYS = (0.0, 0.02, 0.1, 0.3, 1.0)


_NOBLOCK, _MORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
#: below this, a received frame may share libzmq's receive buffer (a batch of ZMQ_IN_BATCH_SIZE,
#: 8 KiB by default and not set here, or a larger read's buffer): never held or adopted then
_BATCHED_RECV_BYTES = 64 << 10


def _clip(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """text, cut to at most `limit` UTF-8 bytes with a marker saying so."""
    if len(text.encode()) <= limit:
        return text
    marker = " ... [truncated]"
    return text.encode()[:limit - len(marker)].decode(errors="ignore") + marker


@dataclass
class Peer:
    identity: bytes
    rank: int
    world: int
    job: int
    generation: int
    admitted: bool = False
    nonce: bytes = b""
    info: Optional[dict] = None  # the HELLO's JSON: host, pid, client version
    heartbeats: bool = False  # it sends PINGs: silence longer than the liveness timeout is a loss
    max_seq: int = -1  # highest seq it contributed to (a rank sends collectives in seq order)
    hello_at: float = 0.0  # when its HELLO arrived (a peer that never completes the handshake is dropped)
    segment: Optional[shared_memory.Segment] = None  # its shared-memory slots, when it shares this host

    def describe(self) -> str:
        info = self.info if isinstance(self.info, dict) else {}
        where = ", ".join(f"{k} {info[k]}" for k in ("host", "pid") if k in info)
        return f"rank {self.rank}" + (f" ({where})" if where else "")


class Reducer:
    def __init__(self, socket: zmq.Socket, *, index: int = 0, address: str = "",
                 world_size: Optional[int] = None, job_token: str = "",
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 max_accumulator_bytes: int = DEFAULT_MAX_ACCUMULATOR_BYTES,
                 max_peer_bytes: int = DEFAULT_MAX_PEER_BYTES, max_rounds: int = DEFAULT_MAX_ROUNDS,
                 round_timeout: float = DEFAULT_TIMEOUT,
                 heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
                 liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT, deterministic: bool = False,
                 encrypt: bool = False, shared: bool = False) -> None:
        self.socket = socket
        # A real socket's frames go through pyzmq's backend method: the Python wrapper above it
        # adds only draft-API options, at ~0.5 us a frame.
        self._send_part = (MethodType(zmq.backend.Socket.send, socket) if isinstance(socket, zmq.backend.Socket)
                           else socket.send)
        self.index = index
        self.name = f"reducer {index}" + (f" ({address})" if address else "")
        self.fixed_world = world_size  # from --workers / the cluster spec; None: learn it
        self.world: Optional[int] = world_size
        self.job_token = job_token
        self.max_chunk_bytes = max_chunk_bytes
        self.round_timeout = round_timeout
        self.heartbeat_interval = heartbeat_interval
        self.liveness_timeout = liveness_timeout
        self.deterministic = deterministic
        self.encrypt = encrypt  # CurveZMQ on the socket (set up by serve(), before it binds)
        self.shared = shared  # accept shared-memory slots from workers on this host (RS_SHM)
        self.bytes_shared = 0  # of bytes_in and bytes_out, those that went through shared memory
        self.handshake_failures = 0  # connections whose security handshake failed (logged, rate-limited)
        self.next_handshake_log: Dict[str, float] = {}  # reason -> when it may be logged again
        self.lost: Dict[int, str] = {}  # rank -> why it is gone (until it is admitted again)
        self.unreachable: List[bytes] = []  # identities a send found gone (handled after the batch)
        self.probes: List[float] = []  # times to probe heartbeat peers (after a disconnect)
        self.now = time.monotonic()
        self.pool = AccumulatorPool(max_accumulator_bytes, max_peer_bytes)
        self.max_rounds = max_rounds
        self.job: Optional[tuple] = None  # (job id, generation) now served
        self.peers: Dict[bytes, Peer] = {}
        self.rank_identity: Dict[int, bytes] = {}
        self.rounds: Dict[tuple, Round] = {}
        self.failed_kept = 0  # rounds in self.rounds that failed (kept to answer late contributions)
        self.round_started: Dict[tuple, float] = {}
        self.strikes: Dict[bytes, Tuple[int, float]] = {}  # identity -> (malformed frames, last heard)
        self.unsent: Dict[bytes, int] = {}  # messages that could not be sent, per peer
        self.completed = 0
        self.failed = 0
        # Plain counters for the stop summary and the metrics (metrics.py reads them at scrape time).
        self.failed_codes: Dict[str, int] = {}
        self.bytes_in = 0
        self.bytes_out = 0
        self.admissions = 0
        self.started = time.monotonic()
        self.metrics: Optional["ReducerMetrics"] = None  # timings, when metrics are served

    # -- the loop ------------------------------------------------------------------------
    def run(self, should_stop: Callable[[], bool]) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        # Disconnects, to notice a killed worker at once (ROUTER_NOTIFY needs libzmq's draft API).
        monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | encryption.HANDSHAKE_FAILED)
        poller.register(monitor, zmq.POLLIN)
        tick = max(0.01, min(1.0, self.round_timeout / 4, self.heartbeat_interval / 2))
        next_tick = time.monotonic() + tick
        next_heartbeat = time.monotonic() + self.heartbeat_interval
        try:
            while not should_stop():
                wait = 100 if not self.probes else max(0, min(100, (self.probes[0] - time.monotonic()) * 1000))
                events = dict(poller.poll(10 if self.unreachable else wait))
                self.now = time.monotonic()
                if self.socket in events:
                    # Drain a batch before housekeeping: under load, messages come in bursts.
                    for _ in range(256):
                        try:
                            frames = self._recv()
                        except zmq.Again:
                            break
                        self.handle(frames)
                if self.unreachable:
                    # After a batch: a worker that closed its connection sent BYE first, and libzmq
                    # may fail a send to it before that BYE is read. Read, then judge.
                    self.check_unreachable()
                if monitor in events and self._drain_monitor(monitor):
                    self.probes = [self.now + d for d in PROBE_DELAYS]
                self.pool.reap()
                now = self.now = time.monotonic()
                if self.probes and now >= self.probes[0]:
                    while self.probes and now >= self.probes[0]:
                        self.probes.pop(0)
                    self.ping_peers()
                if now >= next_heartbeat:
                    self.ping_peers()
                    next_heartbeat = now + self.heartbeat_interval
                if now >= next_tick:
                    self.check_skipped()
                    self.expire_rounds(now)
                    self.forget_strangers(now)
                    next_tick = now + tick
        finally:
            self.socket.disable_monitor()
            monitor.close(linger=0)

    def _recv(self) -> List[zmq.Frame]:
        """One message's frames, without copies. Each frame's own `more` flag ends the loop:
        recv_multipart asks the socket (getsockopt) after every frame, twice the cost."""
        frame = self.socket.recv(_NOBLOCK, copy=False)
        frames = [frame]
        while frame.more:
            frame = self.socket.recv(_NOBLOCK, copy=False)
            frames.append(frame)
        return frames

    def _drain_monitor(self, monitor: zmq.Socket) -> bool:
        """Read the socket's events; True if a connection closed that may be a worker's (a
        failed security handshake is logged instead: that peer was never admitted)."""
        closed = 0
        while monitor.poll(0):
            failure = encryption.handshake_failure(monitor.recv_multipart(), self.encrypt)
            if failure is None:
                closed += 1
                continue
            reason, certain = failure
            # A failure of known cause is followed by its EVENT_DISCONNECTED; one of unknown cause
            # may be any connection dropped mid-handshake (a peer that gave up first), so it counts
            # as a closed connection and is logged below the warning level.
            closed += -1 if certain else 1
            self.handshake_failures += 1
            if self.now >= self.next_handshake_log.get(reason, 0.0):  # a worker retries every 100 ms
                self.next_handshake_log[reason] = self.now + 10.0
                event(log, logging.WARNING if certain else logging.INFO, "handshake_failed", reducer=self.index,
                      reason=reason, certain=certain, failures=self.handshake_failures)
        return closed > 0

    def handle(self, frames: List[zmq.Frame]) -> None:
        """Dispatch one message; never raises."""
        identity = frames[0].bytes
        strikes = self.strikes.get(identity)
        if strikes is not None and strikes[0] >= MAX_STRIKES:
            self.strikes[identity] = (strikes[0], self.now)  # still there: not forgotten while it keeps sending
            return  # a peer that keeps sending garbage is dropped
        try:
            self._dispatch(identity, frames)
        except Exception:  # a bug must not take the reducer down; report it to the sender
            text = traceback.format_exc()
            log.error("internal error handling a message from %s:\n%s", identity.hex(), text)
            self._send_error(identity, ErrorCode.INTERNAL, f"{self.name}: internal error: {text.splitlines()[-1]}")

    def _dispatch(self, identity: bytes, frames: List[zmq.Frame]) -> None:
        if len(frames) not in (2, 3):
            return self._malformed(identity, f"expected a header and at most one payload frame, got {len(frames) - 1} frames")
        try:
            h = protocol.unpack(frames[1].buffer)
        except ProtocolError as exc:
            return self._malformed(identity, str(exc))
        payload = frames[2] if len(frames) == 3 else None
        if h.type is MSG_DATA_SHM:
            return self._shared_data(identity, h, payload)
        size = len(payload) if payload is not None else 0
        if size != h.nbytes:
            reason = f"header announces {h.nbytes} payload bytes but {size} arrived"
            peer = self.peers.get(identity)
            if h.type is MsgType.DATA and peer is not None and peer.admitted:
                # Through _data: a claim of another rank or job, or of a chunk over the size cap,
                # is answered as such (to the sender) before the payload is looked at.
                return self._data(identity, h, payload, bad_payload=reason)
            return self._malformed(identity, reason)
        if h.type is MSG_DATA:  # nearly every message: tested first
            self.bytes_in += size
            self._data(identity, h, payload)
        elif h.type is MsgType.HELLO:
            self._hello(identity, h, payload)
        elif h.type is MsgType.AUTH:
            self._auth(identity, h, payload)
        elif h.type is MsgType.BYE:
            self._bye(identity)
        elif h.type is MsgType.PING:
            self._ping(identity)
        else:
            self._malformed(identity, f"a worker does not send {h.type.name} messages")

    def _shared_data(self, identity: bytes, h: Header, frame: Optional[zmq.Frame]) -> None:
        """A DATA_SHM: the contribution is in slot h.aux of the sender's segment."""
        peer = self.peers.get(identity)
        slot, h.type, h.aux = h.aux, MsgType.DATA, 0  # from here on it is a DATA like any other
        view, bad = None, None
        if peer is None or not peer.admitted:
            pass  # _data answers NOT_ADMITTED
        elif frame is not None:
            bad = "a DATA_SHM message carries its payload in a shared-memory slot, not in a frame"
        elif peer.segment is None:
            bad = f"rank {peer.rank} sent DATA_SHM but has no shared-memory segment with {self.name}"
        else:
            try:
                view = peer.segment.slot(slot, h.nbytes)
            except ValueError as exc:
                bad = f"rank {peer.rank}: {exc}"
        if view is not None:
            self.bytes_in += h.nbytes
            self.bytes_shared += h.nbytes
        self._data(identity, h, view, bad_payload=bad, slot=slot)

    # -- handshake -----------------------------------------------------------------------
    def _hello(self, identity: bytes, h: Header, payload: Optional[zmq.Frame]) -> None:
        if not 0 < h.world <= protocol.MAX_WORLD_SIZE or h.rank >= h.world:
            return self._reject(identity, f"rank {h.rank} / world size {h.world} is out of range")
        if self.fixed_world is not None and h.world != self.fixed_world:
            return self._reject(identity, (
                f"{self.name} serves {self.fixed_world} workers (--workers / RS_WORLD_SIZE) "
                f"but rank {h.rank} says the world size is {h.world}"))
        if self.job is not None and h.job == self.job[0] and h.generation < self.job[1]:
            return self._reject(identity, (
                f"rank {h.rank} belongs to generation {h.generation} of job {h.job:#x}, "
                f"but {self.name} already serves generation {self.job[1]}"))
        try:
            info = json.loads(payload.bytes) if payload is not None else {}
        except ValueError as exc:
            return self._reject(identity, f"HELLO payload is not valid JSON: {exc}")
        if (isinstance(info, dict) and info.get("rejoin") and self.job is not None
                and (h.job, h.generation) != self.job):
            # A worker reconnecting after losing this reducer never replaces the job it serves now.
            return self._reject(identity, (
                f"rank {h.rank} of job {h.job:#x} generation {h.generation} tried to rejoin, but "
                f"{self.name} serves job {self.job[0]:#x} generation {self.job[1]} now"))
        try:
            theirs = bytes.fromhex(info["nonce"]) if isinstance(info, dict) else b""
        except (KeyError, TypeError, ValueError):
            theirs = b""
        if len(theirs) != auth.NONCE_BYTES:
            return self._reject(identity, f"rank {h.rank}: HELLO carries no {auth.NONCE_BYTES}-byte nonce (\"nonce\", "
                                          "hex) for this reducer to prove the job token against")
        # Proved before the worker proves anything: a worker sends no more to a reducer that cannot.
        proof = auth.reducer_proof(self.job_token, theirs, index=self.index, job=h.job, generation=h.generation)
        nonce = auth.new_nonce()
        self.peers[identity] = Peer(identity, h.rank, h.world, h.job, h.generation, nonce=nonce, info=info,
                                    hello_at=self.now)
        payload = auth.challenge(nonce, proof)
        self._send(identity, [protocol.text_header(MsgType.CHALLENGE, payload, rank=self.index, world=h.world,
                                                   job=h.job, generation=h.generation,
                                                   aux=int(bool(self.job_token))), payload])

    def _auth(self, identity: bytes, h: Header, payload: Optional[zmq.Frame]) -> None:
        peer = self.peers.get(identity)
        if peer is None or peer.admitted:
            return self._malformed(identity, "AUTH without a HELLO before it")
        claimed, rest = auth.split_auth(payload.bytes if payload is not None else b"")
        if self.job_token and not auth.verify_worker(self.job_token, peer.nonce, claimed, job=peer.job,
                                                     generation=peer.generation, rank=peer.rank, world=peer.world):
            del self.peers[identity]
            event(log, logging.WARNING, "auth_failed", reducer=self.index, rank=peer.rank, job=hex(peer.job),
                  reason="proof does not match RS_JOB_TOKEN")
            return self._reject(identity, f"rank {peer.rank}: authentication failed: wrong or missing job token (RS_JOB_TOKEN)")
        try:
            facts = json.loads(rest) if rest else {}
        except ValueError as exc:
            del self.peers[identity]
            return self._reject(identity, f"rank {peer.rank}: AUTH payload after the proof is not valid JSON: {exc}")
        if self.job != (peer.job, peer.generation):
            self._start_job(peer)
        elif self.world != peer.world:
            del self.peers[identity]
            return self._reject(identity, (
                f"rank {peer.rank} says the world size is {peer.world} but the other ranks of job "
                f"{peer.job:#x} said {self.world}"))
        old = self.rank_identity.get(peer.rank)
        if old is not None and old != identity:
            event(log, logging.INFO, "rank_reconnected", reducer=self.index, rank=peer.rank)
            self.peers.pop(old, None)
        peer.admitted = True
        self.admissions += 1
        self.rank_identity[peer.rank] = identity
        if self.lost.pop(peer.rank, None) is not None:
            event(log, logging.INFO, "rank_readmitted", reducer=self.index, rank=peer.rank)
        offer = facts.get("shared_memory") if isinstance(facts, dict) else None
        if offer is not None and self.shared:
            try:
                peer.segment = shared_memory.Segment.attach(offer, max_slots=MAX_WINDOW,
                                                            max_slot_bytes=self.max_chunk_bytes)
            except shared_memory.Unavailable as exc:
                event(log, logging.INFO, "shared_memory_declined", reducer=self.index, rank=peer.rank, reason=exc)
        welcome = json.dumps({"index": self.index, "world_size": self.world,
                              "max_chunk_bytes": self.max_chunk_bytes,
                              "deterministic": self.deterministic, "encrypted": self.encrypt,
                              "shared_memory": peer.segment is not None}).encode()
        self._send(identity, [protocol.text_header(MsgType.WELCOME, welcome, world=self.world or 0,
                                                   job=peer.job, generation=peer.generation), welcome])
        event(log, logging.INFO, "admitted", reducer=self.index, rank=peer.rank, world=peer.world,
              job=hex(peer.job), generation=peer.generation)

    def _start_job(self, peer: Peer) -> None:
        """A new job or generation replaces the old one: its rounds and peers are dropped."""
        if self.job is not None:
            event(log, logging.WARNING, "job_replaced", reducer=self.index, old_job=hex(self.job[0]),
                  old_generation=self.job[1], job=hex(peer.job), generation=peer.generation,
                  dropped_rounds=len(self.rounds))
        for rnd in self.rounds.values():
            self._free(rnd)
        self.rounds.clear()
        self.failed_kept = 0
        self.round_started.clear()
        self.rank_identity.clear()
        self.lost.clear()
        self.peers = {i: p for i, p in self.peers.items()
                      if (p.job, p.generation) == (peer.job, peer.generation)}
        self.job = (peer.job, peer.generation)
        self.world = self.fixed_world or peer.world

    def _bye(self, identity: bytes) -> None:
        peer = self.peers.get(identity)
        if peer is not None and peer.admitted and self.rank_identity.get(peer.rank) == identity:
            event(log, logging.INFO, "bye", reducer=self.index, rank=peer.rank)
            self.lose_rank(peer.rank, "it closed its communicator (BYE)", quiet=True)
        self.peers.pop(identity, None)

    def _ping(self, identity: bytes) -> None:
        """A worker's heartbeat. From then on it is expected to keep sending them."""
        peer = self.peers.get(identity)
        if peer is not None and peer.admitted:
            peer.heartbeats = True
        elif peer is None:  # a worker this reducer dropped (its job was replaced, or it was lost)
            self._send_error(identity, ErrorCode.NOT_ADMITTED, (
                f"{self.name}: this worker is not admitted (any more)"
                + (f"; this reducer serves job {self.job[0]:#x} generation {self.job[1]} now" if self.job else "")))

    # -- liveness ------------------------------------------------------------------------
    def ping_peers(self) -> None:
        """Send a PING to every worker that heartbeats; a send to one whose connection is gone
        fails at once (EHOSTUNREACH), which is how a closed connection is tied to its rank."""
        for identity, peer in list(self.peers.items()):
            if peer.admitted and peer.heartbeats:
                self._send(identity, [protocol.text_header(MsgType.PING, b"", rank=self.index, world=peer.world,
                                                           job=peer.job, generation=peer.generation)])

    def check_unreachable(self) -> None:
        gone, self.unreachable = self.unreachable, []
        for identity in gone:
            peer = self.peers.get(identity)
            if peer is not None and peer.admitted and self.rank_identity.get(peer.rank) == identity:
                self.lose_rank(peer.rank, (
                    "its connection closed (the process exited, stopped answering heartbeats for "
                    f"RS_LIVENESS_TIMEOUT={self.liveness_timeout:g} s, or the network dropped it)"))
            else:  # one that never completed the handshake, or a connection its rank replaced
                self.peers.pop(identity, None)

    def forget_strangers(self, now: float) -> None:
        """Drop what is kept about peers that are not admitted and went silent (FORGET_AFTER_S):
        their strike counts and unanswered HELLOs. Bounded even under a flood of identities."""
        cutoff = now - FORGET_AFTER_S
        for identity in [i for i, (_, heard) in self.strikes.items() if heard < cutoff]:
            del self.strikes[identity]
        if len(self.strikes) > MAX_STRIKE_ENTRIES:
            oldest = sorted(self.strikes, key=lambda i: self.strikes[i][1])
            for identity in oldest[:len(self.strikes) - MAX_STRIKE_ENTRIES]:
                del self.strikes[identity]
        for identity in [i for i, p in self.peers.items() if not p.admitted and p.hello_at < cutoff]:
            del self.peers[identity]

    def lose_rank(self, rank: int, reason: str, quiet: bool = False) -> None:
        """A rank is gone: every open round it has not contributed to can never complete, so it
        fails now for every other rank; rounds created later that need it fail at once, until
        the rank is admitted again (a new connection, or a new generation of the job)."""
        identity = self.rank_identity.pop(rank, None)
        peer = self.peers.pop(identity, None) if identity is not None else None
        who = peer.describe() if peer is not None else f"rank {rank}"
        text = f"{who} was lost: {reason}"
        self.lost[rank] = text
        failed = 0
        for rnd in list(self.rounds.values()):
            if rnd.error is None and rank not in rnd.contributed:
                self._fail_round(rnd, ErrorCode.LOST, f"{rnd.first.describe()} cannot complete: {text}")
                failed += 1
            elif rnd.error is not None:
                self._maybe_forget(rnd)
        event(log, logging.INFO if quiet else logging.WARNING, "rank_lost", reducer=self.index, rank=rank,
              reason=reason, failed_rounds=failed, open_rounds=sum(1 for r in self.rounds.values() if r.error is None),
              accumulator_bytes_in_use=self.pool.in_use_bytes)
        if not self.rank_identity:
            # Every rank has gone: the job is over (or all of it failed). Ranks that connect
            # again with the same job and generation (a second communicator) start afresh.
            self.lost.clear()

    def check_skipped(self) -> None:
        """A rank sends its collectives in seq order, so a rank that already contributed to a
        later seq here will never contribute to an open round of an earlier one (the collective
        failed on its side, e.g. while a reducer was down): that round fails now, not at RS_TIMEOUT."""
        for rnd in list(self.rounds.values()):
            if rnd.error is not None or (rnd.first.job, rnd.first.generation) != self.job:
                continue
            skipped = []
            for rank in rnd.missing:
                identity = self.rank_identity.get(rank)
                peer = self.peers.get(identity) if identity is not None else None
                if peer is not None and peer.max_seq > rnd.first.seq:
                    skipped.append(rank)
            if skipped:
                self._fail_round(rnd, ErrorCode.LOST, (
                    f"{rnd.first.describe()} cannot complete: ranks {format_ranks(skipped)} went on to later "
                    f"collectives without contributing (it failed on their side); ranks "
                    f"{format_ranks(rnd.contributed)} contributed"))

    # -- data ----------------------------------------------------------------------------
    def _data(self, identity: bytes, h: Header, payload: Union[zmq.Frame, memoryview, None],
              bad_payload: Optional[str] = None, slot: Optional[int] = None) -> None:
        peer = self.peers.get(identity)
        if peer is None or not peer.admitted:
            return self._send_error(identity, ErrorCode.NOT_ADMITTED,
                                    f"{self.name}: DATA for {h.describe()} from a peer that has not completed the handshake",
                                    about=h)
        if (h.rank, h.job, h.generation) != (peer.rank, peer.job, peer.generation):
            return self._send_error(identity, ErrorCode.STALE, (
                f"{self.name}: rank {peer.rank} of job {peer.job:#x} generation {peer.generation} sent "
                f"{h.describe()} claiming rank {h.rank}"), about=h)
        if h.count * ACCUMULATOR_ITEMSIZE[h.dtype] > self.max_chunk_bytes:
            return self._fail_contribution(peer, h, ErrorCode.TOO_LARGE, (
                f"rank {h.rank} sent a chunk of {h.count} x {DTYPES[h.dtype].name.lower()}, over this reducer's "
                f"limit of {self.max_chunk_bytes} bytes per chunk"))
        if bad_payload is not None:
            return self._fail_contribution(peer, h, ErrorCode.BAD_PAYLOAD, bad_payload)
        if h.seq > peer.max_seq:
            peer.max_seq = h.seq
        key = h.key
        if key not in self.rounds and len(self.rounds) >= self.max_rounds:
            in_flight = len(self.rounds) - self.failed_kept
            if in_flight >= self.max_rounds:
                return self._fail_contribution(peer, h, ErrorCode.TOO_LARGE, (
                    f"rank {h.rank} started {h.describe()} while {in_flight} chunks of collectives were in "
                    f"flight on this reducer, its cap (RS_MAX_ROUNDS={self.max_rounds}); ranks that issue "
                    "collectives in the same order stay within their window (RS_WINDOW) of each other"))
        rnd = self._round_for(h)
        if rnd.error is not None:
            return self._answer_failed(rnd, h.rank, h)
        if self.lost:
            gone = [rank for rank in self.lost if rank not in rnd.contributed]
            if gone:
                return self._fail_round(rnd, ErrorCode.LOST, f"{rnd.first.describe()} cannot complete: "
                                        + "; ".join(self.lost[rank] for rank in sorted(gone)[:8]), extra=h)
        reason = rnd.disagreement(h)
        if reason is not None:
            code = ErrorCode.DUPLICATE if h.rank in rnd.contributed else ErrorCode.MISMATCH
            return self._fail_round(rnd, code, reason, extra=h)
        arrived = time.monotonic() if self.metrics is not None else 0.0
        try:
            self._fold(rnd, h, payload)
        except PoolExhausted as exc:
            return self._fail_round(rnd, ErrorCode.TOO_LARGE, str(exc), extra=h)
        except ValueError as exc:
            return self._fail_round(rnd, ErrorCode.BAD_PAYLOAD, f"rank {h.rank}: {exc}", extra=h)
        rnd.contributed[h.rank] = h
        if slot is not None:  # its result goes back into the same slot of the same segment
            rnd.slots[h.rank] = (peer.segment, slot)
        if self.metrics is not None:
            self.metrics.contributed(h.rank, self.round_started[key], arrived)
        if rnd.complete:
            self._finish(rnd)

    def _fold(self, rnd: Round, h: Header, payload: Union[zmq.Frame, memoryview, None]) -> None:
        if h.op == OP_BROADCAST:  # h agrees with the round's first contribution
            if h.rank == h.aux:
                if payload is None:
                    raise ValueError(f"broadcast root {h.rank} sent no payload")
                rnd.adopted = payload  # the root's frame goes back out as it came: no copy
            return
        if payload is None:
            raise ValueError("a contribution without a payload")
        # A frame's view keeps the frame alive while it is held; a slot stays the worker's until
        # it is answered, so its view needs nothing more.
        in_slot = isinstance(payload, memoryview)
        data = payload if in_slot else payload.buffer
        if not self.deterministic:
            return self._fold_one(rnd, h, h.rank, data, payload)
        if h.rank != rnd.next_rank:  # early: kept until the ranks before it are folded
            if len(data) < _BATCHED_RECV_BYTES and not in_slot:
                # libzmq receives small messages into shared batch buffers: holding the frame would
                # pin a whole buffer while counting only the message, so keep a copy instead.
                data = payload.bytes
            # Charged like a frame even when it is a slot (worker memory): the per-rank budget
            # bounds what one rank can make the reducer keep, whichever way it came.
            self.pool.hold(len(data), h.rank)
        ready = rnd.in_rank_order(h.rank, data)
        for rank, held in ready[1:]:
            self.pool.unhold(len(held), rank)
        for i, (rank, held) in enumerate(ready):  # the first is this very contribution: adoptable
            self._fold_one(rnd, h, rank, held, payload if i == 0 else None)

    def _fold_one(self, rnd: Round, h: Header, rank: int, data: Union[bytes, memoryview],
                  payload: Union[zmq.Frame, memoryview, None] = None) -> None:
        """Fold rank's data in; `payload` (its frame or slot) may become the accumulator."""
        if rnd.accumulator is not None:
            return _native.accumulate(rnd.accumulator, data, h.dtype, h.op)
        # The first contribution. When the dtype accumulates in itself its memory becomes the
        # accumulator, so nothing is copied in and the sum ends up in place: a shared-memory slot
        # (the rank leaves it alone until it is answered) or a received frame of its own (not
        # in a shared receive buffer), which then goes back out as the result.
        if payload is not None and rnd.dtype.accumulator is rnd.dtype:
            if isinstance(payload, memoryview):
                rnd.accumulator, rnd.in_slot, rnd.owner = np.frombuffer(data, np.uint8), True, rank
                return
            if len(data) >= _BATCHED_RECV_BYTES:
                self.pool.hold(len(data), rank)  # memory kept on purpose, like a held frame
                rnd.accumulator, rnd.adopted = np.frombuffer(data, np.uint8), payload
                rnd.owner, rnd.charged = rank, len(data)
                return
        nbytes = h.count * rnd.dtype.accumulator.itemsize
        rnd.accumulator = self.pool.acquire(nbytes, rank=rank)
        rnd.owner, rnd.charged = rank, nbytes
        _native.load(rnd.accumulator, data, h.dtype)

    def _finish(self, rnd: Round) -> None:
        h = rnd.first
        buffers = []
        if rnd.op is ReduceOp.BROADCAST:
            out = rnd.adopted
        else:
            acc = rnd.accumulator
            if not rnd.in_slot and rnd.adopted is None:  # pool memory
                buffers.append(acc)
            if rnd.dtype.accumulator is not rnd.dtype:  # 16-bit floats: round once, here
                try:
                    out = self.pool.acquire(h.count * rnd.dtype.itemsize)
                except PoolExhausted as exc:  # every rank hears it, and the accumulator is freed
                    return self._fail_round(rnd, ErrorCode.TOO_LARGE, f"{h.describe()} cannot be sent: {exc}")
                buffers.append(out)
                _native.store(acc, out, h.dtype, h.op, rnd.world)
            else:
                out = acc
                if rnd.op is ReduceOp.AVG:
                    _native.store(acc, acc, h.dtype, h.op, rnd.world)
        nbytes = h.count * rnd.dtype.itemsize
        header = protocol.pack_as(h, MsgType.RESULT, self.index, nbytes)
        frame = None  # made once some rank needs the result as a frame
        # The owner of an accumulator slot may reuse it as soon as it is answered: it goes last,
        # after every copy out of its slot.
        order = range(rnd.world) if not rnd.in_slot else [*(r for r in range(rnd.world) if r != rnd.owner), rnd.owner]
        for rank in order:
            identity = self.rank_identity.get(rank)
            if identity is None:
                event(log, logging.INFO if rank in self.lost else logging.ERROR, "result_undeliverable",
                      reducer=self.index, rank=rank, key=h.describe(), reason="rank is no longer connected")
                continue
            segment, slot = rnd.slots.get(rank, (None, 0))
            peer = self.peers.get(identity)
            if segment is not None and peer is not None and segment is peer.segment:
                if not (rnd.in_slot and rank == rnd.owner):  # the owner's slot holds the sum already
                    segment.slot(slot, nbytes)[:] = out  # the slot is the rank's until this answer
                if self._send(identity, [protocol.pack_as(h, MsgType.RESULT_SHM, self.index, nbytes, aux=slot)]):
                    self.bytes_out += nbytes
                    self.bytes_shared += nbytes
                continue
            if frame is None:
                frame = self._result_frame(rnd, out)
            if self._send(identity, [header, frame]):
                self.bytes_out += len(frame)
        if self.metrics is not None:
            self.metrics.finished(self.round_started.get(h.key))
        self._forget(h.key)
        rnd.accumulator = None
        held = 0
        if rnd.adopted is not None and rnd.charged:
            # An adopted frame's memory stays counted until libzmq has sent the result from it, as
            # a pool buffer's does; its rank no longer accounts for it.
            held, rnd.charged = rnd.charged, 0
            self.pool.discharge(rnd.owner, held)
        self._discharge(rnd)
        if buffers or held:
            self.pool.release(buffers, frame.tracker if frame is not None else None, held=held)
        self.completed += 1

    @staticmethod
    def _result_frame(rnd: Round, out: Union[zmq.Frame, np.ndarray]) -> zmq.Frame:
        """The result as a frame: a broadcast root's as it came; a pool buffer or an adopted
        frame's memory without a copy, tracked so that it counts until sent; a slot copied, since
        libzmq sends later, when the slot's owner may be using it again."""
        if isinstance(out, zmq.Frame):
            return out
        if rnd.in_slot:
            return zmq.Frame(out, copy=True)
        return zmq.Frame(out, copy=False, track=True)

    # -- failures ------------------------------------------------------------------------
    def _fail_contribution(self, peer: Peer, h: Header, code: ErrorCode, reason: str) -> None:
        """A contribution that cannot be used fails its whole round, so no rank waits for it."""
        rnd = self._round_for(h)
        if rnd.error is not None:
            return self._answer_failed(rnd, peer.rank, h)
        self._fail_round(rnd, code, reason, extra=h)

    def _round_for(self, h: Header) -> Round:
        """The round of h's key; a new one, with h as its first contribution, if there is none."""
        rnd = self.rounds.get(h.key)
        if rnd is None:
            rnd = self.rounds[h.key] = Round(first=h, world=self.world)
            self.round_started[h.key] = time.monotonic()
        return rnd

    def _fail_round(self, rnd: Round, code: ErrorCode, reason: str, extra: Optional[Header] = None) -> None:
        reason = _clip(reason)
        if rnd.error is None and self.rounds.get(rnd.first.key) is rnd:
            self.failed_kept += 1
        rnd.error = f"{self.name}: {reason}"
        rnd.code = code
        rnd.failed_at = self.now
        self.failed += 1
        self.failed_codes[code.name] = self.failed_codes.get(code.name, 0) + 1
        event(log, logging.WARNING, "round_failed", reducer=self.index, key=rnd.first.describe(),
              code=code.name, reason=reason)
        self._free(rnd)
        for rank, h in list(rnd.contributed.items()):
            self._answer_failed(rnd, rank, h)
        if extra is not None:
            self._answer_failed(rnd, extra.rank, extra)

    def _answer_failed(self, rnd: Round, rank: int, about: Header) -> None:
        identity = self.rank_identity.get(rank)
        if identity is not None:
            self._send_error(identity, rnd.code, rnd.error, about=about)
        if rank not in rnd.answered:
            rnd.answered.append(rank)
        self._maybe_forget(rnd)

    def _maybe_forget(self, rnd: Round) -> None:
        """A failed round is forgotten once every rank has been answered (or is lost)."""
        answered = len(rnd.answered)
        if answered < rnd.world and self.lost:
            answered += sum(1 for rank in self.lost if rank not in rnd.answered)
        if answered >= rnd.world:
            self._forget(rnd.first.key)

    def expire_rounds(self, now: float) -> None:
        """Fail rounds that waited longer than the timeout for their last contributions. The
        failed round is kept (without its memory) so that a rank that contributes late gets the
        same message as the others; it is forgotten once every rank has been answered."""
        retain = RETAIN_FAILED_S + 2 * self.round_timeout
        failed = 0
        for key, started in list(self.round_started.items()):
            rnd = self.rounds.get(key)
            if rnd is None:
                self.round_started.pop(key, None)
                continue
            if rnd.error is None:
                if now - started >= self.round_timeout:
                    self._fail_round(rnd, ErrorCode.STALE, (
                        f"{rnd.first.describe()} timed out after {self.round_timeout:g} s: ranks "
                        f"{format_ranks(rnd.contributed)} contributed, ranks {format_ranks(rnd.missing)} did not"))
                    failed += 1
            elif now - rnd.failed_at >= retain:
                self._forget(key)
            else:
                failed += 1
        if failed > MAX_FAILED_ROUNDS:  # bounded: the oldest failed rounds go first
            for key in [k for k, r in self.rounds.items() if r.error is not None][:failed - MAX_FAILED_ROUNDS]:
                self._forget(key)

    def _free(self, rnd: Round) -> None:
        if rnd.accumulator is not None:
            if not rnd.in_slot and rnd.adopted is None:  # a slot or frame is not the pool's
                self.pool.release([rnd.accumulator])
            rnd.accumulator = None
        self._discharge(rnd)
        for rank, frame in rnd.held.items():
            self.pool.unhold(len(frame), rank)
        rnd.held.clear()
        rnd.slots.clear()
        rnd.adopted = None

    def _discharge(self, rnd: Round) -> None:
        """The rank charged for rnd's accumulator no longer accounts for it."""
        if rnd.charged:
            if rnd.adopted is not None:  # an adopted frame was held, not taken from the pool
                self.pool.unhold(rnd.charged, rnd.owner)
            else:
                self.pool.discharge(rnd.owner, rnd.charged)
            rnd.charged = 0

    def _forget(self, key: tuple) -> None:
        rnd = self.rounds.pop(key, None)
        if rnd is not None and rnd.error is not None:
            self.failed_kept -= 1
        self.round_started.pop(key, None)

    # -- sending -------------------------------------------------------------------------
    def _malformed(self, identity: bytes, reason: str) -> None:
        strikes = self.strikes.get(identity, (0, 0.0))[0] + 1
        self.strikes[identity] = (strikes, self.now)
        event(log, logging.WARNING, "malformed_frame", reducer=self.index, peer=identity.hex(),
              reason=reason, strikes=strikes)
        if strikes >= MAX_STRIKES:
            event(log, logging.WARNING, "peer_dropped", reducer=self.index, peer=identity.hex(),
                  reason=f"{MAX_STRIKES} malformed messages")
            peer = self.peers.get(identity)
            if peer is not None and peer.admitted and self.rank_identity.get(peer.rank) == identity:
                # its later messages are ignored: the other ranks must not wait for its contributions
                self.lose_rank(peer.rank, f"it sent {MAX_STRIKES} malformed messages and is ignored from now on")
            self.peers.pop(identity, None)
        self._send_error(identity, ErrorCode.MALFORMED, f"{self.name}: malformed message: {reason}")

    def _reject(self, identity: bytes, reason: str) -> None:
        reason = _clip(reason)  # the log line and the reply both stay short
        event(log, logging.WARNING, "rejected", reducer=self.index, peer=identity.hex(), reason=reason)
        text = f"{self.name}: {reason}".encode()
        self._send(identity, [protocol.text_header(MsgType.REJECT, text), text])

    def _send_error(self, identity: bytes, code: ErrorCode, text: str, about: Optional[Header] = None) -> None:
        payload = _clip(text).encode()
        self._send(identity, [protocol.error_header(code, payload, about), payload])

    def _send(self, identity: bytes, frames: list) -> bool:
        """Whether the message was queued for the peer."""
        # Never blocking: with ROUTER_MANDATORY a blocking send waits as long as one peer's queue
        # is full, i.e. a peer that sends but does not read would stop the reducer for everyone.
        # A worker never has more than its window of answers outstanding, so only such a peer
        # (or one that is gone) loses messages here.
        try:
            # Part by part, as send_multipart does, with its flags as plain ints (~1 us per message).
            send = self._send_part
            send(identity, _MORE_NOBLOCK, False)
            for frame in frames[:-1]:
                send(frame, _MORE_NOBLOCK, False)
            send(frames[-1], _NOBLOCK, False)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer is gone; EAGAIN: it does not read
            if exc.errno == zmq.EHOSTUNREACH:
                self.strikes.pop(identity, None)
                if identity in self.peers:
                    self.unreachable.append(identity)  # handled after this batch, not in the middle of it
            if len(self.unsent) > 4096:
                self.unsent.clear()  # bounded: identities of peers long gone
            unsent = self.unsent[identity] = self.unsent.get(identity, 0) + 1
            if unsent == 1 or unsent % 1000 == 0:  # a log line per peer, not per message
                reason = "its send queue is full (it does not read)" if isinstance(exc, zmq.Again) else exc
                # A peer that is gone is no news: its loss, if it matters, is logged as rank_lost.
                level = logging.DEBUG if exc.errno == zmq.EHOSTUNREACH else logging.WARNING
                event(log, level, "send_failed", reducer=self.index, peer=identity.hex(), reason=reason,
                      unsent=unsent)
            return False


def _bind(socket: zmq.Socket, host: str, port: int) -> int:
    """Bind and return the port; a ListenError says in one line why it cannot, and what to do."""
    if ":" in host:
        socket.setsockopt(zmq.IPV6, 1)
        host = f"[{host}]"
    try:
        if port == 0:
            return socket.bind_to_random_port(f"tcp://{host}")
        socket.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as exc:
        where = f"tcp://{host}:{port or '*'}"
        if exc.errno == zmq.EADDRINUSE:
            raise ListenError(f"cannot listen on {where}: the port is already in use (another reducer or program "
                              "listens there); stop it, or choose another port (--port; 0 picks a free one)") from None
        if exc.errno == zmq.EADDRNOTAVAIL:
            raise ListenError(f"cannot listen on {where}: {host} is not an address of this host "
                              "(--host / RS_BIND_HOST; 0.0.0.0 listens on all of them)") from None
        raise ListenError(f"cannot listen on {where}: {exc}") from None
    return port


def serve(host: Optional[str] = None, port: Optional[int] = None, workers: Optional[int] = None,
          index: Optional[int] = None, deterministic: Optional[bool] = None,
          metrics_port: Optional[int] = None, ready_fd: Optional[int] = None) -> int:
    """Run one reducer until SIGTERM or SIGINT; arguments override the discovered place and
    the environment (deterministic=None: RS_DETERMINISTIC; metrics_port=None: RS_METRICS_PORT,
    0 or unset: no metrics). Once it listens, the bound port and a newline are written to
    `ready_fd`, which is then closed (a launcher waits for that before it starts workers)."""
    from .discovery import discover_reducer

    if ready_fd is not None:
        try:
            os.fstat(ready_fd)
        except OSError as exc:
            raise ConfigError(f"--ready-fd {ready_fd} is not an open file descriptor: {exc.strerror}") from None
    place = discover_reducer() if None in (host, port, index) else None
    host = host or (place.host if place else "0.0.0.0")
    port = port if port is not None else (place.port if place else 0)
    index = index if index is not None else (place.index if place else 0)
    if workers is None:
        workers = place.world_size if place else None
        if workers is None and os.environ.get("RS_WORLD_SIZE"):
            workers = int(env_number("RS_WORLD_SIZE", 0, minimum=1))
    token = os.environ.get("RS_JOB_TOKEN", place.job_token if place else "")
    if deterministic is None:
        deterministic = env_flag("RS_DETERMINISTIC")
    encrypt = env_flag("RS_ENCRYPT")
    if encrypt:
        encryption.check(token)

    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable result is an error, never a silent drop
    socket.setsockopt(zmq.LINGER, 0)
    max_chunk = int(env_number("RS_MAX_CHUNK_BYTES", DEFAULT_MAX_CHUNK_BYTES, minimum=1024))
    # libzmq drops a connection whose message exceeds this: a bogus size is never allocated.
    socket.setsockopt(zmq.MAXMSGSIZE, max_chunk + protocol.HEADER_SIZE)
    sndbuf = socket_send_buffer()
    if sndbuf:  # before bind: libzmq copies a socket's options into its listener, and each accepted connection gets them
        socket.setsockopt(zmq.SNDBUF, sndbuf)
    heartbeat = env_number("RS_HEARTBEAT_INTERVAL", DEFAULT_HEARTBEAT_INTERVAL, minimum=0.01, kind=float)
    liveness = env_number("RS_LIVENESS_TIMEOUT", DEFAULT_LIVENESS_TIMEOUT, minimum=0.05, kind=float)
    protocol.set_heartbeats(socket, heartbeat, liveness)
    if encrypt:
        encryption.secure_reducer(socket, token)
    try:
        bound = _bind(socket, host, port)
    except ListenError:
        socket.close(linger=0)
        context.term()
        raise
    reducer = Reducer(
        socket, index=index, address=f"{host}:{bound}", world_size=workers, job_token=token,
        max_chunk_bytes=max_chunk,
        max_accumulator_bytes=int(env_number("RS_MAX_ACCUMULATOR_BYTES", DEFAULT_MAX_ACCUMULATOR_BYTES, minimum=1024)),
        max_peer_bytes=int(env_number("RS_MAX_PEER_BYTES", DEFAULT_MAX_PEER_BYTES, minimum=1024)),
        max_rounds=int(env_number("RS_MAX_ROUNDS", DEFAULT_MAX_ROUNDS, minimum=1)),
        round_timeout=env_number("RS_TIMEOUT", DEFAULT_TIMEOUT, minimum=0.1, kind=float),
        heartbeat_interval=heartbeat,
        liveness_timeout=liveness,
        deterministic=deterministic,
        encrypt=encrypt,
        shared=shared_memory.enabled(),
    )
    if metrics_port is None:
        metrics_port = int(env_number("RS_METRICS_PORT", 0, minimum=0, maximum=65535))
    elif not 0 <= metrics_port <= 65535:
        raise ConfigError(f"--metrics-port {metrics_port} is outside 0-65535")
    if metrics_port:
        from .metrics import ReducerMetrics  # prometheus_client takes ~0.1 s to import: only when used

        reducer.metrics = ReducerMetrics(reducer)
        reducer.metrics.serve(host, metrics_port)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    print(f"reducer {index} listening on tcp://{host}:{bound} workers={workers or 'from HELLO'} "
          f"auth={'token' if token else 'none'} encrypt={'curve' if encrypt else 'off'} "
          f"deterministic={'on' if deterministic else 'off'}", flush=True)
    event(log, NOTICE, "started", reducer=index, address=f"{host}:{bound}", workers=workers or "from_hello",
          auth="token" if token else "none", encrypt=encrypt, deterministic=deterministic, max_chunk_bytes=max_chunk,
          max_accumulator_bytes=reducer.pool.max_bytes, max_peer_bytes=reducer.pool.max_rank_bytes,
          max_rounds=reducer.max_rounds, timeout_s=reducer.round_timeout,
          heartbeat_interval_s=heartbeat, liveness_timeout_s=liveness, sndbuf=sndbuf or "auto",
          metrics=f"http://{host}:{metrics_port}/metrics" if metrics_port else "off", pid=os.getpid())
    if ready_fd is not None:
        try:
            with os.fdopen(ready_fd, "w") as ready:
                ready.write(f"{bound}\n")
        except BrokenPipeError:
            pass  # the launcher gave up on this reducer already, and stops it
    try:
        reducer.run(lambda: bool(stopping))
    finally:
        socket.close(linger=0)
        context.term()
        if reducer.metrics is not None:
            reducer.metrics.stop()
    failed = ",".join(f"{code}:{n}" for code, n in sorted(reducer.failed_codes.items()))
    event(log, NOTICE, "stopped", reducer=index, completed=reducer.completed, failed=reducer.failed,
          failed_by_code=failed or "none", bytes_in=reducer.bytes_in, bytes_out=reducer.bytes_out,
          bytes_shared_memory=reducer.bytes_shared,
          peers_admitted=reducer.admissions, uptime_s=f"{time.monotonic() - reducer.started:.1f}",
          open_rounds=len(reducer.rounds), accumulator_bytes_in_use=reducer.pool.in_use_bytes)
    return 0
