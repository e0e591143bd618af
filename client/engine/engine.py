"""The Engine: one background thread that owns a worker's sockets and moves every chunk.

ZeroMQ sockets are not thread-safe, so a single thread sends every chunk and receives every
result; user threads hand it collectives through a queue and a wake-up pipe and wait on each
one's Future. The thread first handshakes with every reducer (handshake.py), then loops: take new
collectives, pump chunks (pump.py), read what reducers send (results.py), watch connections
(connections.py), heartbeat, and fail collectives that make no progress (ledger.py).
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Deque, List, Optional, Sequence, Tuple

import zmq

from reduction_server import encryption, shared_memory
from reduction_server.send_buffers import MEASURE_S
from reduction_server.errors import CollectiveError
from reduction_server.log import get_logger
from reduction_server import settings

from .. import timeline
from .collective import Collective
from . import endpoints
from .connections import Connections
from .failover import Failover
from .handshake import Handshake
from .identity import Identity
from .ledger import Ledger
from .pump import Pump
from .results import Results
from .slots import Slots

log = get_logger("client")


class Engine:
    """A worker's progress engine: start() it, submit() collectives, close() it."""

    def __init__(self, reducers: Tuple[str, ...], rank: int, world_size: int, *, job_token: str,
                 job_id: int, generation: int, window: int, timeout: float,
                 connect_timeout: float, io_threads: int, heartbeat_interval: Optional[float] = None,
                 liveness_timeout: Optional[float] = None, encrypt: bool = False,
                 shared: bool = False, slot_bytes: int = shared_memory.MAX_OFFERED_SLOT_BYTES,
                 sndbuf: int = 0, failover: bool = True, spares: int = 0) -> None:
        if encrypt:
            encryption.check(job_token)
        self.rank = rank
        me = Identity(rank, world_size, job_id, generation)
        self.timeout = timeout
        # The reducer fails a round after RS_TIMEOUT with the same message on every rank; this
        # side's own limit is a backstop a little longer, for a reducer that cannot answer.
        self.backstop = settings.client_backstop(timeout)
        heartbeat = heartbeat_interval or settings.read("RS_HEARTBEAT_INTERVAL")
        liveness = liveness_timeout or settings.read("RS_LIVENESS_TIMEOUT")
        self.timeline = timeline.acquire(rank)  # None unless RS_TIMELINE is set
        self._me, self._reducers, self._window, self._spares = me, reducers, window, spares
        self._options = dict(enabled=failover, shared=shared, slot_bytes=slot_bytes, job_token=job_token,
                             encrypt=encrypt, heartbeat=heartbeat, liveness=liveness, sndbuf=sndbuf,
                             io_threads=io_threads, connect_timeout=connect_timeout)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # written under the lock: it must never block
        self._build(endpoints.listed(reducers), spares)
        self._queue: Deque[Collective] = deque()
        self._groups: List[Tuple[int, Tuple[int, ...]]] = []  # groups to announce, before the queue's collectives
        self._closed_groups: List[int] = []  # groups whose kept results (failover.py) can go
        self._lock = threading.Lock()
        self._closing = False
        self._ready = threading.Event()
        self._startup_error: Optional[BaseException] = None
        self._dead: Optional[str] = None  # why the engine stopped, once it has
        self._thread = threading.Thread(target=self._main, name=f"rs-engine-rank{rank}", daemon=True)

    def _build(self, ends: List[endpoints.Endpoint], spares: int) -> None:
        """The parts that know the endpoints: one per shard of every reducer (endpoints.py)."""
        me, window, o = self._me, self._window, self._options
        self.endpoints = ends
        addresses = [e.address for e in ends]
        self.ledger = Ledger(me, [e.name() for e in ends])
        # A segment is offered only to a reducer on this host: only it can map one.
        self.slots = Slots(me, [o["shared"] and shared_memory.is_local(a) for a in addresses], window, o["slot_bytes"])
        self.failover = Failover(me, len(ends), window, o["enabled"], spares)
        if self.failover.enabled:
            self.ledger.on_result = self.failover.keep
            self.ledger.on_end = self.failover.settle
        self.connections = Connections(me, ends, self.ledger, self.slots, self.failover, job_token=o["job_token"],
                                       encrypt=o["encrypt"], heartbeat=o["heartbeat"], liveness=o["liveness"],
                                       sndbuf=o["sndbuf"], io_threads=o["io_threads"])
        self.connections.poller.register(self._wake_r, zmq.POLLIN)
        self.handshake = Handshake(me, self.connections, self.slots, o["job_token"], o["connect_timeout"])
        self.pump = Pump(me, self.ledger, self.connections, self.slots, self.failover, window)
        self.results = Results(self.ledger, self.connections, self.handshake, self.slots, self.failover)

    @property
    def active(self) -> int:
        """The endpoints the chunk plan spreads over (the spares' come after them)."""
        return self.failover.active

    @property
    def max_chunk_bytes(self) -> int:
        """The smallest accumulator chunk any reducer accepts (from WELCOME): it caps the chunk size."""
        return self.handshake.max_chunk_bytes

    @property
    def chunks_shared(self) -> int:
        """Chunks that went through shared memory, both ways."""
        return self.slots.chunks_shared

    # -- user side -----------------------------------------------------------------------
    def start(self) -> None:
        """Connect and handshake with every reducer; raises what went wrong (CollectiveError)."""
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
        """Hand a collective to the engine thread; its Future says how it ended."""
        with self._lock:
            if self._closing or self._dead:
                raise CollectiveError(f"rank {self.rank}: cannot start {coll.describe()}: "
                                      + (self._dead or "the communicator is closed"))
            if self.timeline is not None and coll.traced:
                coll.trace = self.timeline.submitted(coll.trace, *coll.trace_facts())
            self._queue.append(coll)
            self._wake()

    def set_timeline(self, new: Optional["timeline.Timeline"]) -> None:
        """Trace collectives started from now on to `new` (None: none), releasing the one used
        so far; collectives in flight finish on the timeline they began on."""
        with self._lock:
            old, self.timeline = self.timeline, new
        if old is not None:
            old.release()

    def add_group(self, group: int, ranks: Sequence[int]) -> None:
        """Serve collectives of `group` (ranks ascending, this rank among them): the reducers
        hear of it before any of its chunks."""
        with self._lock:
            self._groups.append((group, tuple(ranks)))
            self._wake()

    def remove_group(self, group: int) -> None:
        """`group` takes no more collectives: the results kept for it can go."""
        with self._lock:
            if self._closing:  # the engine, and what it keeps, is gone or going
                return
            self._closed_groups.append(group)
            self._wake()

    def close(self) -> None:
        """Fail what is pending, say BYE, close the sockets; waits for the engine thread."""
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
    def _connect(self) -> None:
        """Handshake with every reducer; when some run shards, with every shard of every reducer."""
        deadline = time.monotonic() + self._options["connect_timeout"]
        self.connections.open_all()
        self.handshake.wait_for_all()
        shards = self.handshake.shards
        if max(shards) == 1:
            return
        first = self.connections
        try:
            self._options["connect_timeout"] = max(0.1, deadline - time.monotonic())  # one limit for both rounds
            ends = endpoints.expand(self._reducers, shards, self._spares)
            endpoints.make_room(first.context, len(ends[0]) + len(first.sockets), self._me.rank)  # both sets open
            self._build(*ends)
            self.connections.open_all()
            self.handshake.wait_for_all()
        finally:
            # Only now: each reducer's shard 0 has taken this rank's new connection in place of the
            # first, so the first one's closing is not taken for this rank's loss. (Not built: the
            # first is still self.connections, which _main closes.)
            if self.connections is not first:
                first.close(bye=False)
        endpoints.check_shard_counts(self.endpoints, self.handshake.shards, shards, self._me.rank)

    def _main(self) -> None:
        try:
            self._connect()
        except BaseException as exc:  # reported to the constructor
            self._startup_error = exc
            self.connections.close(bye=False)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as exc:  # a bug: every waiter hears of it, nobody hangs
            log.exception("engine of rank %d crashed", self.rank)
            self._die(f"the communication engine crashed: {exc!r}")
        finally:
            self.failover.close()
            self.connections.close(bye=True)

    def _loop(self) -> None:
        conn, ledger = self.connections, self.ledger
        next_heartbeat = 0.0  # the first PING goes out at once: the reducer then expects them
        next_measure = time.monotonic() + MEASURE_S
        heartbeat = conn.heartbeat
        wait = int(min(1.0, heartbeat) * 1000)
        while True:
            with self._lock:
                while self._groups:
                    conn.announce(*self._groups.pop(0))
                while self._closed_groups:
                    self.failover.forget_group(self._closed_groups.pop())
                while self._queue and not self._held(self._queue[0]):
                    coll = self._queue.popleft()
                    if coll.future.done():
                        continue  # it failed while it waited (_held)
                    ledger.start(coll)
                    if self.failover.rerouting and not self.failover.place(coll):
                        ledger.give_up(coll, f"no reducer is left for one of its chunks: {self.failover.reason()}")
            if self._closing:
                return self._die("the communicator was closed")
            self.pump.run()
            timeout = min(200, wait) if ledger.active else wait
            if conn.reopen_at:
                timeout = min(timeout, max(0, int((min(conn.reopen_at.values()) - time.monotonic()) * 1000)))
            for item, _ in conn.poller.poll(timeout):
                if item == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                kind, r = conn.index.get(item, ("", -1))
                if kind == "data":
                    self.results.drain(r)
                elif kind == "monitor":
                    conn.on_monitor(r)
            now = time.monotonic()
            conn.reopen_due(now, rejoin=True)
            if now >= next_heartbeat:
                conn.heartbeat_all()
                next_heartbeat = now + heartbeat
            if conn.send_buffers is not None and now >= next_measure:
                conn.send_buffers.measure()
                next_measure = now + MEASURE_S
            if ledger.active:
                ledger.expire(now, self.backstop, self.timeout)

    def _held(self, coll: Collective) -> bool:
        """Whether coll waits to start for a lost reducer that came back (failover.py); one that
        waited past RS_TIMEOUT fails instead."""
        if not self.failover.rejoining:
            return False
        verdict = self.failover.waits(coll, time.monotonic(), self.timeout, self.connections.report,
                                      self.connections.name)
        if isinstance(verdict, str):
            self.ledger.fail(coll, verdict)
            return False
        return verdict

    def _die(self, reason: str) -> None:
        with self._lock:
            self._dead = reason
            queued = list(self._queue)
            self._queue.clear()
        self.ledger.fail_all(reason, queued)
