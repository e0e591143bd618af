"""The Engine: one background thread that owns a worker's sockets and moves every chunk.

ZeroMQ sockets are not thread-safe, so a single thread sends every chunk and receives every
result; user threads hand it collectives through its inbox (inbox.py) and wait on each one's
Future. The thread first handshakes with every reducer (handshake.py), then loops: take new
collectives, pump chunks (pump.py), read what reducers send (results.py), watch connections
(connections.py), heartbeat, and fail collectives that make no progress (ledger.py).
"""

from __future__ import annotations

import threading
import time
from typing import List, Optional, Sequence

import zmq

from reduction_server.config import settings
from reduction_server.log import get_logger
from reduction_server.wire import shared_memory
from reduction_server.wire.send_buffers import MEASURE_S

from .. import timeline
from . import endpoints
from .collective import Collective
from .connections import Connections
from .failover import Failover
from .handshake import Handshake
from .identity import Identity
from .inbox import Inbox
from .ledger import Ledger
from .options import EngineOptions
from .pump import Pump
from .results import Results
from .slots import Slots

log = get_logger("client")


class Engine:
    """A worker's progress engine: start() it, submit() collectives, close() it."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.rank = options.rank
        self._me = Identity(options.rank, options.world_size, options.job_id, options.generation)
        self.timeout = options.timeout
        # The reducer fails a round after RS_TIMEOUT with the same message on every rank; this
        # side's own limit is a backstop a little longer, for a reducer that cannot answer.
        self.backstop = settings.client_backstop(options.timeout)
        self.timeline = timeline.acquire(options.rank)  # None unless RS_TIMELINE is set
        self.inbox = Inbox(options.rank)
        self._build(endpoints.listed(options.reducers), options.spares, options.connect_timeout)
        self._ready = threading.Event()
        self._startup_error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._main, name=f"rs-engine-rank{options.rank}", daemon=True)

    def _build(self, ends: List[endpoints.Endpoint], spares: int, connect_timeout: float) -> None:
        """The parts that know the endpoints: one per shard of every reducer (endpoints.py), the
        last `spares` of them the spare reducers'; the handshake waits `connect_timeout` seconds."""
        me, o = self._me, self.options
        self.endpoints = ends
        self.ledger = Ledger(me, [end.name() for end in ends])
        # A segment is offered only to an endpoint on this host: only its process can map one.
        local = [o.shared_memory and shared_memory.is_local(end.address) for end in ends]
        self.slots = Slots(me, local, o.window, o.chunk_bytes)
        self.failover = Failover(me, len(ends), o.window, o.failover, spares)
        if self.failover.enabled:
            self.ledger.on_result = self.failover.keep
            self.ledger.on_end = self.failover.results.settle
        self.connections = Connections(me, ends, self.ledger, self.slots, self.failover, o)
        self.connections.poller.register(self.inbox.wake_fd, zmq.POLLIN)
        self.handshake = Handshake(me, self.connections, self.slots, o.job_token, connect_timeout)
        self.pump = Pump(me, self.ledger, self.connections, self.slots, self.failover, o.window)
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
            self.inbox.close()  # close() is never called on an engine that did not start
            if self.timeline is not None:
                self.timeline.release()
            raise self._startup_error

    def submit(self, coll: Collective) -> None:
        """Hand a collective to the engine thread; its Future says how it ended."""
        self.inbox.put(coll, self._trace)

    def _trace(self, coll: Collective) -> None:
        """coll is submitted: on the timeline, if one is set (under the inbox's lock, as set_timeline)."""
        if self.timeline is not None and coll.traced:
            coll.trace = self.timeline.submitted(coll.trace, *coll.trace_facts())

    def set_timeline(self, new: Optional["timeline.Timeline"]) -> None:
        """Trace collectives started from now on to `new` (None: none), releasing the one used
        so far; collectives in flight finish on the timeline they began on."""
        with self.inbox.lock:
            old, self.timeline = self.timeline, new
        if old is not None:
            old.release()

    def add_group(self, group: int, ranks: Sequence[int]) -> None:
        """Serve collectives of `group` (ranks ascending, this rank among them): the reducers
        hear of it before any of its chunks."""
        self.inbox.add_group(group, ranks)

    def remove_group(self, group: int) -> None:
        """`group` takes no more collectives: the results kept for it go once its last one ends."""
        self.inbox.remove_group(group)

    def close(self) -> None:
        """Fail what is pending, say BYE, close the sockets; waits for the engine thread."""
        if not self.inbox.ask_to_close():
            return
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        self.inbox.close()
        if self.timeline is not None:
            self.timeline.release()

    # -- engine thread -------------------------------------------------------------------
    def _connect(self) -> None:
        """Handshake with every reducer; when some run shards, with every shard of every reducer."""
        deadline = time.monotonic() + self.options.connect_timeout
        self.connections.open_all()
        self.handshake.wait_for_all()
        shards = self.handshake.shards
        if max(shards) == 1:
            return
        first = self.connections
        try:
            ends, spares = endpoints.expand(self.options.reducers, shards, self.options.spares)
            endpoints.make_room(first.context, len(ends) + len(first.sockets), self.rank)  # both sets open
            self._build(ends, spares, max(0.1, deadline - time.monotonic()))  # one limit for both rounds
            self.connections.open_all()
            self.handshake.wait_for_all()
        finally:
            # Only now: each reducer's shard 0 has taken this rank's new connection in place of the
            # first, so the first one's closing is not taken for this rank's loss. (Not built: the
            # first is still self.connections, which _main closes.)
            if self.connections is not first:
                first.close(bye=False)
        endpoints.check_shard_counts(self.endpoints, self.handshake.shards, shards, self.rank)

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
        conn, ledger, inbox = self.connections, self.ledger, self.inbox
        next_heartbeat = 0.0  # the first PING goes out at once: the reducer then expects them
        next_measure = time.monotonic() + MEASURE_S
        heartbeat = conn.heartbeat
        wait = int(min(1.0, heartbeat) * 1000)
        while True:
            with inbox.lock:
                while inbox.groups:
                    conn.announce(*inbox.groups.pop(0))
                for group in inbox.idle_closed_groups(ledger.active.values()):
                    self.failover.results.forget_group(group)
                while inbox.queue and not self._held(inbox.queue[0]):
                    coll = inbox.queue.popleft()
                    if coll.future.done():
                        continue  # it failed while it waited (_held)
                    if (coll.group, coll.seq) in ledger.active:  # its answers could not be told apart
                        ledger.fail(
                            coll,
                            "another collective with its group and seq is in flight on this rank "
                            "(two groups made under one name?)",
                        )
                        continue
                    ledger.start(coll)
                    if self.failover.rerouting and not self.failover.place(coll):
                        ledger.give_up(coll, f"no reducer is left for one of its chunks: {self.failover.reason()}")
            if inbox.closing:
                return self._die("the communicator was closed")
            self.pump.run()
            timeout = min(200, wait) if ledger.active else wait
            if conn.reopen_at:
                timeout = min(timeout, max(0, int((min(conn.reopen_at.values()) - time.monotonic()) * 1000)))
            for item, _ in conn.poller.poll(timeout):
                if item == inbox.wake_fd:
                    inbox.woken()
                    continue
                kind, e = conn.index.get(item, ("", -1))
                if kind == "data":
                    self.results.drain(e)
                elif kind == "monitor":
                    self.results.drain(e)  # what it sent before a close (a DRAINED) is read first
                    conn.on_monitor(e)
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
        """Whether coll waits to start for a lost endpoint that came back (failover.py); one that
        waited past RS_TIMEOUT fails instead."""
        if not self.failover.rejoining:
            return False
        now = time.monotonic()
        if now >= coll.deadline:
            self.ledger.fail(
                coll,
                f"Timed out after {coll.time_limit:g} s (the timeout it was given) before it "
                "started: it waited for a reducer that came back to name the collective from "
                "which every rank uses it again",
            )
            return False
        verdict = self.failover.waits(coll, now, self.timeout, self.connections.report, self.connections.name)
        if isinstance(verdict, str):
            self.ledger.fail(coll, verdict)
            return False
        return verdict

    def _die(self, reason: str) -> None:
        self.ledger.fail_all(reason, self.inbox.die(reason))
