"""The Reducer: one ROUTER socket, its event loop, and each message handed to its room.

Every message gets an answer: a RESULT, or an ERROR that names the ranks involved; nothing a
client sends can take the reducer down (an exception while handling one is reported to its
sender as INTERNAL).
"""

from __future__ import annotations

import time
import traceback
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import zmq

from ..config.settings import (
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HELLO_TIMEOUT,
    DEFAULT_LIVENESS_TIMEOUT,
    DEFAULT_MAX_ACCUMULATOR_BYTES,
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_PEER_BYTES,
    DEFAULT_MAX_ROUNDS,
    DEFAULT_MAX_UNGREETED,
    DEFAULT_TIMEOUT,
)
from ..errors import ProtocolError
from ..log import Throttle, get_logger
from ..wire import gate, protocol
from ..wire.protocol import MOVED_TYPES, MSG_DATA, MSG_DATA_SHM, ErrorCode, Header, MsgType
from ..wire.send_buffers import AcceptedBuffers
from ..wire.shared_memory import MAX_OFFERED_SLOT_BYTES
from .accumulator import AccumulatorPool
from .admission import Admission
from .arrivals import Arrivals
from .clock import Clock
from .drain import Drain
from .fold import Payload
from .membership import Membership, Peer
from .outbox import Outbox
from .rounds import Rounds
from .shared_results import SharedResults
from .socket_events import SocketEvents

if TYPE_CHECKING:
    from .metrics import ReducerMetrics

log = get_logger("reducer")

_NOBLOCK = int(zmq.NOBLOCK)
_CONTRIBUTIONS = frozenset((MSG_DATA, *MOVED_TYPES))  # chunks that come as frames
# After a connection closes, heartbeat peers are probed this many seconds later (the one whose
# pipe is gone answers EHOSTUNREACH): a killed worker is noticed in milliseconds.
PROBE_DELAYS = (0.0, 0.02, 0.1, 0.3, 1.0)
_DRAINING = "it drains (it was told to stop) and admits no worker"
# Messages handled before housekeeping: under load, messages come in bursts.
_BATCH = 256


def _recv(socket: zmq.Socket) -> List[zmq.Frame]:
    """One message's frames, without copies. Each frame's own `more` flag ends the loop:
    recv_multipart asks the socket (getsockopt) after every frame, twice the cost."""
    frame = socket.recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = socket.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


class Reducer:
    """One reducer: admission, membership, rounds and the outbox over one ROUTER socket."""

    def __init__(
        self,
        socket: zmq.Socket,
        *,
        index: int = 0,
        address: str = "",
        world_size: Optional[int] = None,
        job_token: str = "",
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_accumulator_bytes: int = DEFAULT_MAX_ACCUMULATOR_BYTES,
        max_peer_bytes: int = DEFAULT_MAX_PEER_BYTES,
        max_rounds: int = DEFAULT_MAX_ROUNDS,
        round_timeout: float = DEFAULT_TIMEOUT,
        max_ungreeted: int = DEFAULT_MAX_UNGREETED,
        hello_timeout: float = DEFAULT_HELLO_TIMEOUT,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        deterministic: bool = False,
        encrypt: bool = False,
        integrity: bool = False,
        shared: bool = False,
        shard: int = 0,
        shards: int = 1,
        send_buffers: Optional[AcceptedBuffers] = None,
        monitor: Optional[zmq.Socket] = None,
    ) -> None:
        self.socket = socket
        self.index = index
        self.name = (
            f"reducer {index}" + (f" shard {shard}" if shards > 1 else "") + (f" ({address})" if address else "")
        )
        self.round_timeout = round_timeout
        self.heartbeat_interval = heartbeat_interval
        self.clock = Clock()
        self.clock.now = self.started = time.monotonic()
        self.pool = AccumulatorPool(max_accumulator_bytes, max_peer_bytes)
        self.outbox = Outbox(
            socket, index, self.name, on_gone=self._gone, throttle=Throttle(log, lambda: self.clock.now)
        )
        self.members = Membership(
            self.outbox,
            self.clock,
            index,
            world_size,
            liveness_timeout,
            loss_memory=round_timeout,
            on_lost=self._rank_lost,
        )
        # ranks on this host read results written once for all of them from these (shared memory)
        self.results = SharedResults(min(max_chunk_bytes, MAX_OFFERED_SLOT_BYTES)) if shared else None
        self.rounds = Rounds(
            self.outbox,
            self.members,
            self.pool,
            self.clock,
            index=index,
            name=self.name,
            max_chunk_bytes=max_chunk_bytes,
            max_rounds=max_rounds,
            round_timeout=round_timeout,
            deterministic=deterministic,
            results=self.results,
        )
        self.drain = Drain(
            self.outbox,
            self.members,
            self.rounds,
            self.clock,
            index=index,
            name=self.name,
            timeout=drain_timeout,
            fields={"shard": shard} if shards > 1 else None,
        )
        self.admission = Admission(
            self.outbox,
            self.members,
            self.rounds,
            self.clock,
            job_token=job_token,
            encrypt=encrypt,
            integrity=integrity,
            shared=shared,
            results=self.results,
            shard=shard,
            shards=shards,
            read_events=self._read_events,
        )
        if integrity:  # every message to a peer past its HELLO is tagged, and every one from it (integrity.py)
            self.outbox.tagged = self.members.peers
        self.integrity = integrity
        self.events = SocketEvents(
            socket,
            self.clock,
            index=index,
            encrypt=encrypt,
            gated=gate.applies(job_token, encrypt),
            arrivals=Arrivals(self.outbox.throttle, index=index, cap=max_ungreeted, timeout=hello_timeout),
            send_buffers=send_buffers,
            throttle=self.outbox.throttle,
            monitor=monitor,
        )
        self.probes: List[float] = []  # times to probe heartbeat peers (after a disconnect)
        self.bytes_in = 0
        self.bytes_shared_in = 0  # of bytes_in, those that came through shared memory

    # -- what the metrics, the stop summary and the tests read ------------------------------
    @property
    def now(self) -> float:
        return self.clock.now

    @now.setter
    def now(self, value: float) -> None:
        self.clock.now = value

    @property
    def metrics(self) -> Optional["ReducerMetrics"]:
        return self.rounds.metrics

    @metrics.setter
    def metrics(self, value: Optional["ReducerMetrics"]) -> None:
        self.rounds.metrics = value

    @property
    def peers(self) -> Dict[bytes, Peer]:
        return self.members.peers

    @property
    def strikes(self) -> dict:
        return self.admission.strikes

    @property
    def bytes_shared(self) -> int:
        """Bytes in and out that went through shared memory."""
        return self.bytes_shared_in + self.rounds.bytes_shared_out

    # -- the loop ------------------------------------------------------------------------
    def run(self, should_stop: Callable[[], bool]) -> None:
        """Serve until should_stop() says so (it is asked at least every 100 ms), or until a
        drain (`drain.request()`, drain.py) is over."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        monitor = self.events.open()
        poller.register(monitor, zmq.POLLIN)
        tick = max(0.01, min(1.0, self.round_timeout / 4, self.heartbeat_interval / 2))
        next_tick = time.monotonic() + tick
        next_heartbeat = time.monotonic() + self.heartbeat_interval
        members, send_buffers, drain = self.members, self.events.send_buffers, self.drain
        try:
            while not should_stop():
                if drain.requested and not drain.draining:
                    drain.start()
                if drain.draining and drain.over():
                    break
                wait = 100 if not self.probes else max(0, min(100, (self.probes[0] - time.monotonic()) * 1000))
                events = dict(poller.poll(10 if members.gone else wait))
                self.clock.now = time.monotonic()
                if self.socket in events:
                    for _ in range(_BATCH):
                        try:
                            frames = _recv(self.socket)
                        except zmq.Again:
                            break
                        self.handle(frames)
                if members.gone:
                    # After a batch: a worker that closed its connection sent BYE first, and libzmq
                    # may fail a send to it before that BYE is read. Read, then judge.
                    members.check_unreachable()
                if monitor in events:
                    self._read_events()
                self.pool.reap()
                now = self.clock.now = time.monotonic()
                if self.probes and now >= self.probes[0]:
                    while self.probes and now >= self.probes[0]:
                        self.probes.pop(0)
                    members.ping_peers()
                if now >= next_heartbeat:
                    members.ping_peers()
                    next_heartbeat = now + self.heartbeat_interval
                if now >= next_tick:
                    self.rounds.check_skipped()
                    self.rounds.expire(now)
                    self.admission.forget_strangers(now)
                    self.events.arrivals.expire(now)
                    self.outbox.throttle.flush()
                    if send_buffers is not None:
                        send_buffers.measure()
                    next_tick = now + tick
        finally:
            self.events.close()
            self.outbox.throttle.flush(everything=True)  # the counts left out, before the stop line

    def _read_events(self) -> None:
        """The socket monitor's news (socket_events.py); a closed connection that may be a
        worker's has the heartbeat peers probed."""
        if self.events.read():
            self.probes = [self.clock.now + d for d in PROBE_DELAYS]

    def _gone(self, identity: bytes) -> None:
        """A send found identity's connection closed: forget its strikes now, judge its rank after the batch."""
        self.admission.strikes.pop(identity, None)
        if identity in self.members.peers:
            self.members.gone.append(identity)

    def _rank_lost(self, rank: int, text: str) -> Dict[str, int]:
        return self.rounds.rank_lost(rank, text)

    # -- one message ---------------------------------------------------------------------
    def handle(self, frames: List[zmq.Frame]) -> None:
        """Dispatch one message; never raises."""
        identity = frames[0].bytes
        if self.admission.ignored(identity):
            return  # a peer that keeps sending garbage is dropped
        try:
            self._dispatch(identity, frames)
        except Exception:  # a bug must not take the reducer down; report it to the sender
            text = traceback.format_exc()
            log.error("internal error handling a message from %s:\n%s", identity.hex(), text)
            self.outbox.error(identity, ErrorCode.INTERNAL, f"{self.name}: internal error: {text.splitlines()[-1]}")

    def _dispatch(self, identity: bytes, frames: List[zmq.Frame]) -> None:
        if self.integrity:
            frames = self.admission.untag(identity, frames)
            if frames is None:
                return
        if len(frames) not in (2, 3):
            return self.admission.malformed(
                identity, f"expected a header and at most one payload frame, got {len(frames) - 1} frames"
            )
        try:
            h = protocol.unpack(frames[1].buffer)
        except ProtocolError as exc:
            return self.admission.malformed(identity, str(exc))
        payload = frames[2] if len(frames) == 3 else None
        if h.type is MSG_DATA_SHM:
            return self._shared_data(identity, h, payload)
        size = len(payload) if payload is not None else 0
        if size != h.nbytes:
            reason = f"header announces {h.nbytes} payload bytes but {size} arrived"
            peer = self.members.admitted(identity) if h.type in _CONTRIBUTIONS else None
            if peer is not None:
                # Through _data: a claim of another rank or job, or of a chunk over the size cap,
                # is answered as such (to the sender) before the payload is looked at.
                return self._data(identity, peer, h, payload, bad_payload=reason)
            return self.admission.malformed(identity, reason)
        if h.type in _CONTRIBUTIONS:  # nearly every message: tested first
            self.bytes_in += size
            self._data(identity, self.members.admitted(identity), h, payload)
        elif h.type is MsgType.HELLO:
            self._read_events()  # its connection's acceptance first: the monitor may not have been read since
            self.events.arrivals.greeted(frames[1])  # the id frame is the ROUTER's own, of no connection
            if self.drain.requested:
                return self.outbox.reject(identity, _DRAINING)
            self.admission.hello(identity, h, payload)
        elif h.type is MsgType.AUTH:
            if self.drain.requested:  # one admitted now would never hear the DRAIN
                return self.outbox.reject(identity, _DRAINING)
            self.admission.auth(identity, payload)
        elif h.type in (MsgType.GROUP, MsgType.PROGRESS):
            self._member_news(identity, h, payload)
        elif h.type is MsgType.BYE:
            self.members.leave(identity)
        elif h.type is MsgType.PING:
            self.admission.ping(identity)
        else:
            self.admission.malformed(identity, f"a worker does not send {h.type.name} messages")

    def _member_news(self, identity: bytes, h: Header, payload: Optional[zmq.Frame]) -> None:
        """A GROUP (the ranks of one of the job's groups) or a PROGRESS (where a member that lost
        this reducer and came back is, rejoin.py): from an admitted member only; a payload that
        does not parse is malformed, one the job's state refuses is answered MISMATCH."""
        peer = self.members.holder(identity)
        if peer is None:
            return self.outbox.error(
                identity,
                ErrorCode.NOT_ADMITTED,
                (f"{self.name}: {h.type.name} from a peer that has not completed the handshake"),
                about=h,
            )
        data = payload.bytes if payload is not None else b""
        try:
            if h.type is MsgType.GROUP:
                refused = self.members.announce(peer, h.group, protocol.group_ranks(data, peer.world))
            else:
                refused = self.members.progress(peer, protocol.seq_pairs(data))
        except ProtocolError as exc:
            return self.admission.malformed(identity, str(exc))
        if refused is not None:
            self.outbox.error(identity, ErrorCode.MISMATCH, f"{self.name}: {refused}", about=h)

    def _shared_data(self, identity: bytes, h: Header, frame: Optional[zmq.Frame]) -> None:
        """A DATA_SHM: the contribution is in slot h.aux of the sender's segment."""
        peer = self.members.admitted(identity)
        slot, h.type, h.aux = h.aux, MsgType.DATA, 0  # from here on it is a DATA like any other
        view, bad = None, None
        if peer is None:
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
            self.bytes_shared_in += h.nbytes
        self._data(identity, peer, h, view, bad_payload=bad, slot=slot)

    def _data(
        self,
        identity: bytes,
        peer: Optional[Peer],
        h: Header,
        payload: Payload,
        bad_payload: Optional[str] = None,
        slot: Optional[int] = None,
    ) -> None:
        """A contribution from `peer` (the admitted peer at identity, or None)."""
        if peer is None:
            return self.outbox.error(
                identity,
                ErrorCode.NOT_ADMITTED,
                f"{self.name}: DATA for {h.describe()} from a peer that has not completed the handshake",
                about=h,
            )
        if (h.rank, h.job, h.generation) != (peer.rank, peer.job, peer.generation):
            return self.outbox.error(
                identity,
                ErrorCode.STALE,
                (
                    f"{self.name}: rank {peer.rank} of job {peer.job:#x} generation {peer.generation} sent "
                    f"{h.describe()} claiming rank {h.rank}"
                ),
                about=h,
            )
        if h.world != peer.world:  # the round's ranks, and an average's divisor, are the job's
            return self.outbox.error(
                identity,
                ErrorCode.MISMATCH,
                (
                    f"{self.name}: rank {peer.rank} of a job of {peer.world} ranks sent {h.describe()} saying the "
                    f"world size is {h.world}"
                ),
                about=h,
            )
        if self.drain.boundaries is not None and self.drain.refuses(identity, h):
            return
        self.rounds.contribute(peer, h, payload, bad_payload, slot)
