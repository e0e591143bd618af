"""The progress engine: one background thread that owns a worker's sockets and moves chunks.

ZeroMQ sockets are not thread-safe, so a single thread sends every chunk and receives every
result; user threads hand it collectives through a queue and a wake-up pipe and wait on a
Future. Each chunk is sent without a copy from the user's buffer, and each result is received
with recv_into straight into the output buffer: nothing is allocated per message.

Chunks are sent in one global order (collective by collective, chunk by chunk), never more than
`window` unanswered per reducer. Every rank sends the same sequence, so every key a rank waits
for is one that all ranks reach: the window cannot deadlock, and sending, summing and receiving
overlap across reducers and across consecutive collectives.

Liveness: libzmq's ZMTP heartbeats (every RS_HEARTBEAT_INTERVAL, in its I/O thread, so a busy
Python thread cannot starve them) close a connection silent for RS_LIVENESS_TIMEOUT, and a
process that exits closes its own. A reducer whose connection closes (seen at once through a
socket monitor) is lost: every pending collective that needs it fails naming it, the engine
opens a fresh connection to the same address and redoes the handshake, and collectives started
meanwhile wait for it (at most RS_LIVENESS_TIMEOUT) before failing. The engine also sends each
reducer an application PING every interval: it tells the reducer this worker can be probed.

Same host: with `shared` on (RS_SHM, the default), the HELLO to each reducer whose address is
one of this host's offers a segment of `window` payload slots (reduction_server/shared_memory.py).
A reducer that can map it says so in its WELCOME; chunks of a reduction then go through a free slot (DATA_SHM) and come back in it
(RESULT_SHM), which saves the socket copies. A slot is free again only once the reducer has
answered its chunk, whatever became of the collective; a chunk that finds no free slot, or a
reducer without the segment, travels as a frame.
"""
from __future__ import annotations

import json
import logging
import os
import socket as pysocket
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterable, List, Optional, Tuple

import zmq
from zmq.utils.monitor import parse_monitor_message

from reduction_server import __version__, auth, encryption, protocol, shared_memory
from reduction_server.errors import CollectiveError, ProtocolError
from reduction_server.log import NOTICE, event, get_logger
from reduction_server.protocol import (ITEMSIZE, MSG_DATA, MSG_DATA_SHM, MSG_ERROR, MSG_PING, MSG_RESULT,
                                       MSG_RESULT_SHM, OP_BROADCAST, DType, ErrorCode, MsgType, ReduceOp)
from reduction_server.settings import (DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_LIVENESS_TIMEOUT, client_backstop,
                                       env_number)

from . import timeline
from .chunking import reducer_of
from .timeline import Trace

log = get_logger("client")

_UNSENT, _SENT, _ANSWERED = 0, 1, 2
# How far a reducer's handshake got: no connection, no connection and refused, connected, proved.
_CONNECTING, _REFUSED, _CONNECTED, _CHALLENGED = 0, 1, 2, 3
_PROGRESS = {
    _CONNECTING: "no TCP connection yet (is the host reachable, and the address in RS_REDUCERS right?)",
    _REFUSED: "connection refused: nothing listens there (is `reduction-server serve` running there, and the "
              "port in RS_REDUCERS right?)",
    _CONNECTED: "connected, but no answer to HELLO yet (is it a reducer?)",
    _CHALLENGED: "it proved the job token; waiting for its WELCOME",
}
#: seconds between the lines a worker logs while it waits for reducers to admit it
WAITING_REPORT_S = 5.0
#: seconds before the engine opens a new connection to a reducer whose last one failed (libzmq's
#: own reconnect interval, which the engine does not use: see _open)
RECONNECT_S = 0.1
_MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_CLOSED | encryption.HANDSHAKE_FAILED
# Chunks go through pyzmq's backend send: its Python wrapper adds only draft-API options (~0.5 us a frame).
_NOBLOCK, _SNDMORE, _RCVMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.RCVMORE)
_backend_send = zmq.backend.Socket.send


@dataclass
class Collective:
    seq: int
    dtype: DType
    op: ReduceOp
    root: int
    send: Optional[memoryview]  # None: this rank contributes no payload (broadcast, not root)
    recv: memoryview
    total: int
    chunks: List[Tuple[int, int]]
    result: Any
    future: Future = field(default_factory=Future)
    next: int = 0  # next chunk to send
    answered: int = 0
    state: bytearray = field(default=None)  # per chunk: unsent, sent, answered
    errors: List[Tuple[int, str]] = field(default_factory=list)  # (chunk, what went wrong)
    last_progress: float = 0.0
    blocked_since: Optional[float] = None  # waiting for a lost reducer to come back
    trace: Optional[Trace] = None  # its timeline record, when RS_TIMELINE is set
    traced: bool = True  # False: kept off the timeline (Horovod's negotiation, every cycle)

    def __post_init__(self) -> None:
        self.state = bytearray(len(self.chunks))

    def describe(self) -> str:
        what = "broadcast" if self.op is ReduceOp.BROADCAST else f"all_reduce {self.op.name.lower()}"
        return f"collective seq={self.seq} ({what} of {self.total} x {self.dtype.name.lower()})"


class Engine:
    def __init__(self, reducers: Tuple[str, ...], rank: int, world_size: int, *, job_token: str,
                 job_id: int, generation: int, window: int, timeout: float,
                 connect_timeout: float, io_threads: int, heartbeat_interval: Optional[float] = None,
                 liveness_timeout: Optional[float] = None, encrypt: bool = False,
                 shared: bool = False, slot_bytes: int = shared_memory.MAX_OFFERED_SLOT_BYTES,
                 sndbuf: int = 0) -> None:
        if encrypt:
            encryption.check(job_token)
        self.reducers = reducers
        self.rank = rank
        self.world = world_size
        self.job_token = job_token
        self.job = job_id
        self.generation = generation
        self.window = window
        self.timeout = timeout
        # The reducer fails a round after RS_TIMEOUT with the same message on every rank; this
        # side's own limit is a backstop a little longer, for a reducer that cannot answer.
        self.backstop = client_backstop(timeout)
        self.heartbeat = heartbeat_interval or env_number(
            "RS_HEARTBEAT_INTERVAL", DEFAULT_HEARTBEAT_INTERVAL, minimum=0.01, kind=float)
        self.liveness = liveness_timeout or env_number(
            "RS_LIVENESS_TIMEOUT", DEFAULT_LIVENESS_TIMEOUT, minimum=0.05, kind=float)
        self.connect_timeout = connect_timeout
        self.encrypt = encrypt  # CurveZMQ, keys from the job token (encryption.py)
        self.sndbuf = sndbuf  # SO_SNDBUF of each reducer connection (RS_SNDBUF); 0: the kernel's autotuning
        # Per reducer: whether its HELLO offers a segment (only a reducer on this host can map one)
        self._offers = [shared and shared_memory.is_local(address) for address in reducers]
        # as large as the largest chunk (RS_CHUNK_BYTES; a chunk is at least one 8-byte element)
        self.slot_bytes = max(8, min(slot_bytes, shared_memory.MAX_OFFERED_SLOT_BYTES))
        # Per reducer: the segment offered in the last HELLO, its free slots (empty until the
        # reducer accepts it), and which slot each unanswered chunk sent through it is in.
        self._segments: List[Optional[shared_memory.Segment]] = [None] * len(reducers)
        self._free_slots: List[List[int]] = [[] for _ in reducers]
        self._slot_of: List[Dict[Tuple[int, int], int]] = [{} for _ in reducers]
        self.chunks_shared = 0  # chunks that went through shared memory (both ways)
        # Failed security handshakes in a row per reducer: (count, when the first failed).
        self._handshake_failures: List[Tuple[int, float]] = [(0, 0.0)] * len(reducers)
        # Per reducer: the nonce of the last HELLO (its CHALLENGE must prove the token over it), and
        # how far its handshake got (_CONNECTING ... _CHALLENGED), for the waiting log and errors.
        self._nonces: List[bytes] = [b""] * len(reducers)
        self._progress: List[int] = [_CONNECTING] * len(reducers)
        self._reopen_at: Dict[int, float] = {}  # reducer -> when to open a new connection to it
        self._io_threads = io_threads
        self._queue: Deque[Collective] = deque()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # written under the lock: it must never block
        self._closing = False
        #: the smallest accumulator chunk any reducer accepts (from WELCOME): it caps the chunk size
        self.max_chunk_bytes = 1 << 62
        self._ready = threading.Event()
        self._startup_error: Optional[BaseException] = None
        self._dead: Optional[str] = None  # why the engine stopped, once it has
        self._active: Dict[int, Collective] = {}
        self._sending: Deque[Collective] = deque()
        self._inflight = [0] * len(reducers)
        #: reducers not usable now: index -> (why, whether a new connection is being tried)
        self._down: Dict[int, Tuple[str, bool]] = {}
        self._monitors: List[zmq.Socket] = []
        self._poller: Optional[zmq.Poller] = None
        self._index: Dict[Any, Tuple[str, int]] = {}
        self._thread = threading.Thread(target=self._main, name=f"rs-engine-rank{rank}", daemon=True)
        self.timeline = timeline.acquire(rank)  # None unless RS_TIMELINE is set

    # -- user side -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            self._thread.join()
            os.close(self._wake_r)  # close() is never called on an engine that did not start
            os.close(self._wake_w)
            if self.timeline is not None:
                self.timeline.release()
            raise self._startup_error

    def submit(self, coll: Collective) -> None:
        with self._lock:
            if self._closing or self._dead:
                raise CollectiveError(f"rank {self.rank}: cannot start {coll.describe()}: "
                                      + (self._dead or "the communicator is closed"))
            if self.timeline is not None and coll.traced:
                coll.trace = self.timeline.submitted(coll)
            self._queue.append(coll)
            self._wake()

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        with self._lock:  # no submit() can be writing to the pipe while it closes
            os.close(self._wake_r)
            os.close(self._wake_w)
        if self.timeline is not None:
            self.timeline.release()

    def _wake(self) -> None:
        """Wake the engine thread; called with the lock held. A full pipe wakes it already."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    # -- engine thread -------------------------------------------------------------------
    def _main(self) -> None:
        self._context = zmq.Context(self._io_threads)
        self._sockets: List[zmq.Socket] = []
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        try:
            for address in self.reducers:
                sock, monitor = self._open(address)
                self._sockets.append(sock)
                self._monitors.append(monitor)
                self._watch(len(self._sockets) - 1)
            self._handshake()
        except BaseException as exc:  # reported to the constructor
            self._startup_error = exc
            self._shutdown_sockets(bye=False)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as exc:  # a bug: every waiter hears of it, nobody hangs
            log.exception("engine of rank %d crashed", self.rank)
            self._die(f"the communication engine crashed: {exc!r}")
        finally:
            self._shutdown_sockets(bye=True)

    def _open(self, address: str) -> Tuple[zmq.Socket, zmq.Socket]:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)  # a BYE may still be queued at close
        # One connection per socket: libzmq's own reconnect would send what is queued, or sent next,
        # to whatever listens at the address by then, before it has proved the job token. The engine
        # opens a new socket instead, and handshakes again (_reopen).
        sock.setsockopt(zmq.RECONNECT_IVL, -1)
        if self.sndbuf:  # never 0 here: ZMQ_SNDBUF=0 would ask the kernel for its smallest buffer, not autotuning
            sock.setsockopt(zmq.SNDBUF, self.sndbuf)
        protocol.set_heartbeats(sock, self.heartbeat, self.liveness)  # a stopped reducer's connection closes
        if self.encrypt:
            encryption.secure_worker(sock, self.job_token)
        # A closed connection (a reducer that died) is seen at once, not after the liveness timeout;
        # a failed security handshake (RS_ENCRYPT or RS_JOB_TOKEN differ) too, instead of retrying forever.
        monitor = sock.get_monitor_socket(_MONITORED)
        sock.connect(f"tcp://{address}")
        return sock, monitor

    def _name(self, r: int) -> str:
        return f"reducer {r} ({self.reducers[r]})"

    def _hello(self, r: int, rejoin: bool = False) -> None:
        self._nonces[r] = auth.new_nonce()
        if self._progress[r] != _REFUSED:  # refused stays refused until a connection is made
            self._progress[r] = _CONNECTING
        facts: Dict[str, Any] = {"host": pysocket.gethostname(), "pid": os.getpid(), "version": __version__,
                                 "nonce": self._nonces[r].hex()}
        if rejoin:  # a reducer serving another job by now must not be taken back by this one
            facts["rejoin"] = True
        self._drop_segment(r)  # a new connection gets a new segment: nothing old can reach it
        self._send_handshake(self._sockets[r], MsgType.HELLO, json.dumps(facts).encode())

    def _answer_challenge(self, r: int, h: protocol.Header, payload: bytes) -> Optional[str]:
        """Check reducer r's proof of the job token and, if it holds, send AUTH: this worker's
        proof and, to a reducer on this host, the shared-memory offer. Returns why reducer r is
        refused instead (then nothing at all is sent to it), or None."""
        try:
            nonce, proof = auth.parse_challenge(payload)
        except ProtocolError as exc:
            return f"{self._name(r)} answered HELLO with a malformed CHALLENGE: {exc}"
        if h.rank != r:
            return (f"{self._name(r)} says it is reducer {h.rank}, but RS_REDUCERS lists it as reducer {r}: each "
                    "reducer's --index (RS_REDUCER_INDEX) must be its position in RS_REDUCERS")
        if not auth.verify_reducer(self.job_token, self._nonces[r], proof, index=r, job=self.job,
                                   generation=self.generation):
            if not self.job_token:
                why = "it requires a job token and this worker has none: set RS_JOB_TOKEN to the job's token"
            elif not h.aux:
                why = "it has no job token (it was started without RS_JOB_TOKEN)"
            else:
                why = "its RS_JOB_TOKEN is not this worker's (another job's reducer, or a mistyped token)"
            return f"{self._name(r)} did not prove the job token (RS_JOB_TOKEN): {why}; nothing was sent to it"
        self._progress[r] = _CHALLENGED
        facts: Dict[str, Any] = {}
        self._drop_segment(r)
        if self._offers[r]:
            try:
                self._segments[r] = shared_memory.Segment.create(self.window, self.slot_bytes)
                facts["shared_memory"] = self._segments[r].offer
            except OSError as exc:  # no memfd here: frames only
                log.debug("rank %d: no shared-memory segment for %s: %s", self.rank, self._name(r), exc)
        proof = auth.worker_proof(self.job_token, nonce, job=self.job, generation=self.generation, rank=self.rank,
                                  world=self.world)
        self._send_handshake(self._sockets[r], MsgType.AUTH, proof + (json.dumps(facts).encode() if facts else b""))
        return None

    def _send_handshake(self, sock: zmq.Socket, mtype: MsgType, payload: bytes) -> None:
        try:
            sock.send_multipart([protocol.text_header(mtype, payload, rank=self.rank, world=self.world, job=self.job,
                                                      generation=self.generation), payload], zmq.NOBLOCK)
        except zmq.Again:
            # The connection already failed (its security handshake was refused, or it dropped)
            # and libzmq discarded its pipe: the monitor reports that, and _on_disconnect opens
            # another one with a new HELLO, or gives the reducer up.
            log.debug("rank %d: %s not queued: its connection already failed", self.rank, mtype.name)

    def _handshake(self) -> None:
        """HELLO to every reducer and wait until each has proved the token and admitted this worker;
        a reducer whose connection fails is tried again on a new one."""
        for r in range(len(self._sockets)):
            self._hello(r)
        waiting = set(range(len(self._sockets)))
        started = time.monotonic()
        deadline, report = started + self.connect_timeout, started + WAITING_REPORT_S
        while waiting:
            now = time.monotonic()
            if now >= deadline:
                raise CollectiveError(f"rank {self.rank}: no reducer admitted this worker within "
                                      f"{self.connect_timeout:g} s (RS_CONNECT_TIMEOUT): {self._waiting(waiting)}")
            if now >= report:  # a worker that waits says for what, rather than look hung
                event(log, NOTICE, "waiting_for_reducers", rank=self.rank, waited_s=f"{now - started:.0f}",
                      connect_timeout_s=f"{self.connect_timeout:g}", waiting=self._waiting(waiting))
                report = max(report + WAITING_REPORT_S, now + 1.0)
            self._reopen_due(now, rejoin=False)
            until = min(deadline, report, *self._reopen_at.values())
            for item, _ in self._poller.poll(max(0.01, until - now) * 1000):
                kind, r = self._index.get(item, ("", -1))
                if kind == "monitor":
                    closed, refused = self._monitor_events(r)
                    if refused:
                        raise CollectiveError(f"rank {self.rank}: {self._name(r)} refused this worker: {refused}")
                    if closed:  # not there yet, or gone meanwhile: a new connection, a new handshake
                        waiting.add(r)
                        self._reopen_at[r] = time.monotonic() + RECONNECT_S
                elif kind == "data" and self._welcomed(r):
                    waiting.discard(r)

    def _welcomed(self, r: int) -> bool:
        """Handle one handshake message from reducer r; whether it was its WELCOME."""
        frames = self._sockets[r].recv_multipart()
        try:
            h = protocol.unpack(frames[0])
        except ProtocolError as exc:
            raise CollectiveError(f"rank {self.rank}: {self._name(r)} answered the handshake with a malformed frame: {exc}") from None
        text = frames[1] if len(frames) > 1 else b""
        if h.type is MsgType.CHALLENGE:
            refused = self._answer_challenge(r, h, text)
            if refused:
                raise CollectiveError(f"rank {self.rank}: {refused}")
        elif h.type is MsgType.WELCOME and self._progress[r] != _CHALLENGED:
            raise CollectiveError(f"rank {self.rank}: {self._unproved_welcome(r)}")
        elif h.type is MsgType.WELCOME:
            self._handshake_failures[r] = (0, 0.0)
            welcome = json.loads(text)
            self.max_chunk_bytes = min(self.max_chunk_bytes, int(welcome.get("max_chunk_bytes", self.max_chunk_bytes)))
            self._welcomed_segment(r, welcome)
            return True
        elif h.type in (MsgType.REJECT, MsgType.ERROR):
            raise CollectiveError(f"rank {self.rank}: {self._name(r)} refused this worker: "
                                  f"{text.decode(errors='replace')}")
        return False

    def _unproved_welcome(self, r: int) -> str:
        return (f"{self._name(r)} sent WELCOME without proving the job token (RS_JOB_TOKEN) first; "
                "nothing was sent to it")

    def _waiting(self, waiting: Iterable[int]) -> str:
        """The reducers in `waiting` and how far each one's handshake got, in words."""
        return "; ".join(f"{self._name(r)}: {_PROGRESS[self._progress[r]]}" for r in sorted(waiting))

    def _loop(self) -> None:
        poller = self._poller
        next_heartbeat = 0.0  # the first PING goes out at once: the reducer then expects them
        wait = int(min(1.0, self.heartbeat) * 1000)
        while True:
            self._take_submissions()
            if self._closing:
                self._die("the communicator was closed")
                return
            self._pump()
            timeout = min(200, wait) if self._active else wait
            if self._reopen_at:
                timeout = min(timeout, max(0, int((min(self._reopen_at.values()) - time.monotonic()) * 1000)))
            for item, _ in poller.poll(timeout):
                if item == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                kind, r = self._index.get(item, ("", -1))
                if kind == "data":
                    self._drain(r)
                elif kind == "monitor":
                    self._on_disconnect(r)
            now = time.monotonic()
            self._reopen_due(now, rejoin=True)
            if now >= next_heartbeat:
                self._heartbeat()
                next_heartbeat = now + self.heartbeat
            if self._active:
                self._expire(now)

    # -- liveness --------------------------------------------------------------------------
    def _watch(self, r: int) -> None:
        self._poller.register(self._sockets[r], zmq.POLLIN)
        self._poller.register(self._monitors[r], zmq.POLLIN)
        self._index[self._sockets[r]] = ("data", r)
        self._index[self._monitors[r]] = ("monitor", r)

    def _heartbeat(self) -> None:
        ping = protocol.text_header(MsgType.PING, b"", rank=self.rank, world=self.world, job=self.job,
                                    generation=self.generation)
        for r, sock in enumerate(self._sockets):
            if r in self._down:
                continue
            try:
                sock.send(ping, zmq.NOBLOCK)
            except zmq.Again:
                pass  # its queue is full of chunks: it is not the PING it lacks

    def _monitor_events(self, r: int) -> Tuple[bool, Optional[str]]:
        """Drain reducer r's monitor: whether its connection closed, and why to give up on it if
        its security handshake failed for good (an encryption mismatch, or encrypted handshakes
        failing in a row for GIVE_UP_AFTER_S)."""
        closed, final = False, None
        while self._monitors[r].poll(0):
            frames = self._monitors[r].recv_multipart()
            kind = parse_monitor_message(frames)["event"]
            if kind == zmq.EVENT_CONNECTED:
                self._progress[r] = max(self._progress[r], _CONNECTED)
            elif kind in (zmq.EVENT_CLOSED, zmq.EVENT_DISCONNECTED):
                closed = True
                if kind == zmq.EVENT_CLOSED and self._progress[r] < _CONNECTED:  # the connect itself failed
                    self._progress[r] = _REFUSED
            failure = encryption.handshake_failure(frames, self.encrypt)
            if failure is not None:
                count, since = self._handshake_failures[r]
                now = time.monotonic()
                count, since = count + 1, since if count else now
                self._handshake_failures[r] = (count, since)
                if failure[1] or (count >= encryption.MAX_HANDSHAKE_FAILURES
                                  and now - since >= encryption.GIVE_UP_AFTER_S):
                    final = failure[0]
        return closed, final

    def _on_disconnect(self, r: int) -> None:
        closed, refused = self._monitor_events(r)
        if not closed and not refused:
            return  # a connection made: nothing lost
        down = self._down.get(r)
        if down is not None and down[1] and refused:
            self._refused(r, f"{self._name(r)} came back but refused this worker: {refused}")
        elif down is None:
            self._lose_reducer(r, "its connection closed (the process exited, stopped answering heartbeats for "
                                  f"RS_LIVENESS_TIMEOUT={self.liveness:g} s, or the network dropped it); "
                                  "reconnecting", reconnect=True)
        elif down[1]:  # not back yet, or gone again in the middle of the new handshake
            self._reopen_at[r] = time.monotonic() + RECONNECT_S

    def _lose_reducer(self, r: int, reason: str, *, reconnect: bool) -> None:
        """Reducer r is gone: every pending collective that needs it fails now, naming it."""
        text = f"{self._name(r)} was lost: {reason}"
        self._event("reducer_lost", r, reason=reason, reconnecting=reconnect)
        self._down[r] = (text, reconnect)
        num = len(self._sockets)
        for coll in list(self._active.values()):
            if any(s != _ANSWERED and reducer_of(coll.seq, k, num) == r for k, s in enumerate(coll.state)):
                self._abandon(coll)
                self._fail(coll, text)
        self._inflight[r] = 0
        if reconnect:
            self._reopen(r, rejoin=True)

    def _reopen_due(self, now: float, rejoin: bool) -> None:
        for r, at in list(self._reopen_at.items()):
            if now >= at:
                del self._reopen_at[r]
                self._reopen(r, rejoin)

    def _reopen(self, r: int, rejoin: bool) -> None:
        """A fresh connection to reducer r's address and a new handshake: a restarted reducer
        (it keeps no state between collectives) is used again once it admits this worker."""
        for old in (self._sockets[r], self._monitors[r]):
            self._poller.unregister(old)
            self._index.pop(old, None)
        self._sockets[r].disable_monitor()
        self._monitors[r].close(linger=0)
        self._sockets[r].close(linger=0)  # nothing queued for the old connection may reach the new one
        self._sockets[r], self._monitors[r] = self._open(self.reducers[r])
        self._watch(r)
        self._hello(r, rejoin)  # queued until the connection is up

    def _event(self, name: str, r: int, **fields: Any) -> None:
        """A WARNING log line about reducer r, naming this rank and the reducer."""
        event(log, logging.WARNING, name, rank=self.rank, reducer=r, address=self.reducers[r], **fields)

    def _refused(self, r: int, reason: str) -> None:
        """Reducer r came back but cannot be used again: collectives that need it fail with reason."""
        self._down[r] = (reason, False)
        self._reopen_at.pop(r, None)
        self._event("reducer_refused", r, reason=reason)

    def _readmitted(self, r: int, welcome: dict) -> None:
        limit = int(welcome.get("max_chunk_bytes", self.max_chunk_bytes))
        if limit < self.max_chunk_bytes:  # the ranks' chunk plans would no longer agree
            return self._refused(r, f"{self._name(r)} came back with a smaller chunk limit ({limit} < "
                                    f"{self.max_chunk_bytes} bytes, RS_MAX_CHUNK_BYTES); restart the job")
        del self._down[r]
        self._handshake_failures[r] = (0, 0.0)
        self._welcomed_segment(r, welcome)
        self._event("reducer_readmitted", r)
        try:
            self._sockets[r].send(protocol.text_header(MsgType.PING, b"", rank=self.rank, world=self.world,
                                                       job=self.job, generation=self.generation), zmq.NOBLOCK)
        except zmq.Again:
            pass

    # -- shared memory -----------------------------------------------------------------------
    def _welcomed_segment(self, r: int, welcome: dict) -> None:
        """Reducer r admitted this worker: its slots are usable if it mapped the segment."""
        if welcome.get("shared_memory") is True and self._segments[r] is not None:
            self._free_slots[r] = list(range(self._segments[r].slots))
        else:
            self._drop_segment(r)

    def _drop_segment(self, r: int) -> None:
        if self._segments[r] is not None:
            self._segments[r].close()
            self._segments[r] = None
        self._free_slots[r] = []
        self._slot_of[r] = {}

    def _release_slot(self, r: int, h: protocol.Header) -> Optional[int]:
        """The slot of the chunk reducer r has answered with h, now free again; None if that
        chunk did not go through shared memory."""
        if h.nchunks == 0 or (h.job, h.generation) != (self.job, self.generation):
            return None  # an answer about no chunk (an ERROR about a frame, not a key)
        slot = self._slot_of[r].pop((h.seq, h.chunk), None)
        if slot is not None:
            self._free_slots[r].append(slot)
        return slot

    def _startable(self, coll: Collective) -> bool:
        """Whether coll can start now; False: it waits for a lost reducer (or has just failed)."""
        num = len(self._sockets)
        needed = range(num) if len(coll.chunks) >= num else {reducer_of(coll.seq, k, num) for k in range(len(coll.chunks))}
        down = [r for r in needed if r in self._down]
        if not down:
            return True
        now = time.monotonic()
        if coll.blocked_since is None:
            coll.blocked_since = now
        final = [r for r in down if not self._down[r][1]]
        if final or now - coll.blocked_since >= self.liveness:
            r = (final or down)[0]
            reason = self._down[r][0]
            if not final:
                reason += f"; it did not come back within {self.liveness:g} s (RS_LIVENESS_TIMEOUT)"
            self._abandon(coll)
            self._fail(coll, reason)
        return False

    def _take_submissions(self) -> None:
        with self._lock:
            while self._queue:
                coll = self._queue.popleft()
                coll.last_progress = time.monotonic()
                self._active[coll.seq] = coll
                self._sending.append(coll)

    def _pump(self) -> None:
        """Send chunks in global order until one's reducer has a full window."""
        num = len(self._sockets)
        while self._sending:
            coll = self._sending[0]
            if self._down and coll.next == 0 and not self._startable(coll):
                if self._sending and self._sending[0] is coll:
                    return  # it waits for a lost reducer to come back
                continue  # it failed and left the queue
            while coll.next < len(coll.chunks):
                k = coll.next
                r = reducer_of(coll.seq, k, num)
                if self._inflight[r] >= self.window:
                    return
                if not self._send_chunk(coll, k, r):
                    # Its socket has no connection left (and never makes another): the reducer is
                    # gone, though its monitor has not said so yet. This fails coll, among others.
                    return self._lose_reducer(r, "its connection closed; reconnecting", reconnect=True)
                coll.next += 1
            self._sending.popleft()

    def _send_chunk(self, coll: Collective, k: int, r: int) -> bool:
        """Send chunk k of coll to reducer r; False if its connection is gone."""
        offset, count = coll.chunks[k]
        size = ITEMSIZE[coll.dtype]
        payload = coll.send[offset * size:(offset + count) * size] if coll.send is not None else None
        nbytes = len(payload) if payload is not None else 0
        free = self._free_slots[r]
        mtype, aux = MSG_DATA, coll.root
        shared = payload is not None and free and coll.op is not OP_BROADCAST and nbytes <= self.slot_bytes
        if shared:
            mtype, aux = MSG_DATA_SHM, free[-1]
        header = protocol.data_header(
            mtype, dtype=coll.dtype, op=coll.op, rank=self.rank, world=self.world, job=self.job,
            generation=self.generation, seq=coll.seq, chunk=k, nchunks=len(coll.chunks), offset=offset,
            count=count, total=coll.total, nbytes=nbytes, aux=aux)
        if shared:
            self._segments[r].slot(aux, nbytes)[:] = payload
        sock = self._sockets[r]
        try:  # a window of chunks stays far below libzmq's queue: only a lost connection says Again
            if payload is None or shared:
                _backend_send(sock, header, _NOBLOCK)
            else:
                _backend_send(sock, header, _NOBLOCK | _SNDMORE)
                _backend_send(sock, payload, _NOBLOCK, False)  # a message's parts go out together
        except zmq.Again:
            return False
        if shared:
            free.pop()
            self._slot_of[r][coll.seq, k] = aux
            self.chunks_shared += 1
        coll.state[k] = _SENT
        self._inflight[r] += 1
        coll.last_progress = time.monotonic()  # its clock starts when it goes out, not in the queue
        if coll.trace is not None:
            coll.trace.chunk_sent()
        return True

    def _drain(self, r: int) -> None:
        sock = self._sockets[r]
        while True:
            try:
                raw = sock.recv(_NOBLOCK)
            except zmq.Again:
                return
            more = sock.getsockopt(_RCVMORE)
            try:
                h = protocol.unpack(raw)
            except ProtocolError as exc:
                self._skip(sock, more)
                self._fail_reducer(r, f"{self._name(r)} sent a malformed frame: {exc}")
                continue
            if self._sockets[r] is not sock:
                return  # it was lost and replaced while this message was handled
            mtype = h.type
            if mtype is MSG_RESULT:
                self._release_slot(r, h)
                self._on_result(r, sock, h, more)
            elif mtype is MSG_RESULT_SHM:
                self._skip(sock, more)
                self._on_shared_result(r, h, self._release_slot(r, h))
            elif mtype is MSG_ERROR:
                text = sock.recv().decode(errors="replace") if more else "(no message)"
                self._skip(sock, sock.getsockopt(zmq.RCVMORE))
                self._release_slot(r, h)
                self._on_error(r, h, text)
            elif mtype is MSG_PING:
                self._skip(sock, more)
            elif h.type in (MsgType.CHALLENGE, MsgType.WELCOME, MsgType.REJECT) and r in self._down:
                text = sock.recv() if more else b""
                self._skip(sock, sock.getsockopt(zmq.RCVMORE))
                if h.type is MsgType.CHALLENGE:
                    refused = self._answer_challenge(r, h, text)
                    if refused:
                        self._refused(r, f"{refused} (when it came back)")
                elif h.type is MsgType.WELCOME and self._progress[r] != _CHALLENGED:
                    self._refused(r, self._unproved_welcome(r))
                elif h.type is MsgType.WELCOME:
                    try:
                        welcome = json.loads(text)
                    except ValueError:
                        welcome = {}
                    self._readmitted(r, welcome if isinstance(welcome, dict) else {})
                else:
                    self._refused(r, f"{self._name(r)} came back but refused this worker: "
                                     f"{text.decode(errors='replace')}")
            else:
                self._event("unexpected_message", r, type=h.type.name)
                self._skip(sock, more)

    @staticmethod
    def _skip(sock: zmq.Socket, more: int) -> None:
        while more:
            sock.recv(copy=False)
            more = sock.getsockopt(_RCVMORE)

    def _pending_chunk(self, h: protocol.Header) -> Optional[Collective]:
        coll = self._active.get(h.seq)
        if (coll is None or (h.job, h.generation) != (self.job, self.generation)
                or h.chunk >= len(coll.chunks) or coll.state[h.chunk] != _SENT):
            return None  # late answer to a collective that already failed or timed out
        return coll

    def _on_result(self, r: int, sock: zmq.Socket, h: protocol.Header, more: int) -> None:
        coll = self._pending_chunk(h)
        if coll is None:
            return self._skip(sock, more)
        offset, count = coll.chunks[h.chunk]
        size = ITEMSIZE[coll.dtype]
        if not more or self._misshapen(h, coll):
            self._skip(sock, more)
            return self._chunk_done(coll, h.chunk, r, self._shape_error(r, h, coll))
        view = coll.recv[offset * size:(offset + count) * size]
        received = sock.recv_into(view)
        error = None
        if received != len(view):
            error = f"{self._name(r)} returned {received} bytes for chunk {h.chunk}, expected {len(view)}"
        self._skip(sock, sock.getsockopt(_RCVMORE))
        self._chunk_done(coll, h.chunk, r, error)

    @staticmethod
    def _misshapen(h: protocol.Header, coll: Collective) -> bool:
        """Whether an answer's offset, count or dtype differ from its chunk's."""
        return (h.offset, h.count) != coll.chunks[h.chunk] or h.dtype != coll.dtype

    def _shape_error(self, r: int, h: protocol.Header, coll: Collective) -> str:
        offset, count = coll.chunks[h.chunk]
        return (f"{self._name(r)} returned chunk {h.chunk} as {h.count} elements at offset {h.offset} "
                f"(dtype code {h.dtype}), expected {count} at {offset}")

    def _on_shared_result(self, r: int, h: protocol.Header, slot: Optional[int]) -> None:
        coll = self._pending_chunk(h)
        if coll is None:
            return  # late: its slot is free again all the same
        offset, count = coll.chunks[h.chunk]
        size = coll.dtype.itemsize
        error = None
        if slot is None or slot != h.aux:
            error = (f"{self._name(r)} answered chunk {h.chunk} in shared-memory slot {h.aux}, but it was sent "
                     + ("as a frame" if slot is None else f"in slot {slot}"))
        elif self._misshapen(h, coll):
            error = self._shape_error(r, h, coll)
        else:
            coll.recv[offset * size:(offset + count) * size] = self._segments[r].slot(slot, count * size)
            self.chunks_shared += 1
        self._chunk_done(coll, h.chunk, r, error)

    def _on_error(self, r: int, h: protocol.Header, text: str) -> None:
        if h.aux == ErrorCode.NOT_ADMITTED and r not in self._down:
            # It no longer knows this worker (it serves another job now, or declared this worker
            # lost): nothing more can be sent to it. No new handshake: that could take the
            # reducer back from the job that replaced this one.
            return self._lose_reducer(r, f"it no longer admits this worker: {text}", reconnect=False)
        coll = self._pending_chunk(h)
        if coll is None:
            # An error about no pending chunk (a malformed frame of ours, a stale key): log it.
            self._event("reducer_error", r, key=h.describe(), reason=text)
            return
        self._chunk_done(coll, h.chunk, r, text)

    def _chunk_done(self, coll: Collective, k: int, r: int, error: Optional[str]) -> None:
        coll.state[k] = _ANSWERED
        self._inflight[r] -= 1
        coll.answered += 1
        coll.last_progress = time.monotonic()
        if coll.trace is not None:
            coll.trace.chunk_answered()
        if error is not None:
            coll.errors.append((k, f"chunk {k} on {self._name(r)}: {error}"))
        if coll.answered == len(coll.chunks):
            del self._active[coll.seq]
            if coll.errors:
                # The lowest chunk's error, not the first to arrive: every rank reports the same one.
                more = f" (and {len(coll.errors) - 1} more chunk errors)" if len(coll.errors) > 1 else ""
                self._fail(coll, f"{min(coll.errors)[1]}{more}")
            else:
                if coll.trace is not None:
                    self.timeline.finish(coll.trace)
                coll.future.set_result(coll.result)

    def _fail(self, coll: Collective, reason: str) -> None:
        if not coll.future.done():
            if coll.trace is not None:
                self.timeline.finish(coll.trace, reason)
            coll.future.set_exception(CollectiveError(f"rank {self.rank}: {coll.describe()} failed: {reason}"))

    def _expire(self, now: float) -> None:
        for coll in list(self._active.values()):
            if now - coll.last_progress < self.backstop or _SENT not in coll.state:
                continue  # nothing in flight: it waits for window slots held by earlier collectives
            waiting = sorted({reducer_of(coll.seq, k, len(self._sockets))
                              for k, s in enumerate(coll.state) if s == _SENT})
            self._abandon(coll)
            self._fail(coll, (
                f"no answer for {self.backstop:g} s (RS_TIMEOUT={self.timeout:g} and a margin) from "
                + ", ".join(self._name(r) for r in waiting)
                + f"; {coll.answered} of {len(coll.chunks)} chunks had completed"))

    def _fail_reducer(self, r: int, reason: str) -> None:
        """Fail every collective with a chunk waiting on reducer r: its answers are unreadable."""
        num = len(self._sockets)
        for coll in list(self._active.values()):
            if any(s == _SENT and reducer_of(coll.seq, k, num) == r for k, s in enumerate(coll.state)):
                self._abandon(coll)
                self._fail(coll, reason)

    def _abandon(self, coll: Collective) -> None:
        """Stop tracking a collective: its window slots free up, late answers are dropped."""
        num = len(self._sockets)
        for k, s in enumerate(coll.state):
            if s == _SENT:
                self._inflight[reducer_of(coll.seq, k, num)] -= 1
            coll.state[k] = _ANSWERED
        self._active.pop(coll.seq, None)
        if coll in self._sending:
            self._sending.remove(coll)

    def _die(self, reason: str) -> None:
        with self._lock:
            self._dead = reason
            queued = list(self._queue)
            self._queue.clear()
        for coll in [*self._active.values(), *queued]:
            self._abandon(coll)
            self._fail(coll, reason)

    def _shutdown_sockets(self, bye: bool) -> None:
        for r in range(len(self._segments)):
            self._drop_segment(r)
        for sock, monitor in zip(self._sockets, self._monitors):
            sock.disable_monitor()
            monitor.close(linger=0)
        for r, sock in enumerate(self._sockets):
            if bye and r not in self._down:
                try:
                    sock.send(protocol.text_header(MsgType.BYE, b"", rank=self.rank, world=self.world,
                                                   job=self.job, generation=self.generation), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # nobody to say goodbye to
            # A failed handshake, or a reducer that is gone, has nothing worth lingering for.
            sock.close(linger=None if bye and r not in self._down else 0)
        self._context.term()
