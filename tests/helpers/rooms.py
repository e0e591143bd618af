"""Rooms driven in process (tests/unit/), as torchft drives its Manager: a reducer's rooms
(Rounds, Admission, and the Membership between them) wired as reducer/core.py wires them, but
with a clock a test sets and an outbox that records what would be sent instead of a socket; and
a worker engine's Ledger and Failover with collectives made by hand, their chunks "sent" and
"answered" as the pump and the inbox would (no sockets).

Every room is built here and only here: the tests call the rooms' public methods, so a change of
a constructor's parameters is one change in this file."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import zmq

from reduction_server.client.chunking import Chunk
from reduction_server.client.engine.collective import SENT, Collective
from reduction_server.client.engine.failover import Failover
from reduction_server.client.engine.identity import Identity
from reduction_server.client.engine.ledger import Ledger
from reduction_server.log import Throttle, get_logger
from reduction_server.reducer.accumulator import AccumulatorPool
from reduction_server.reducer.admission import Admission
from reduction_server.reducer.clock import Clock
from reduction_server.reducer.membership import Membership, Peer
from reduction_server.reducer.outbox import Outbox
from reduction_server.reducer.rounds import Rounds
from reduction_server.wire import auth, protocol
from reduction_server.wire.protocol import DType, ErrorCode, Header, MsgType, ReduceOp

from .peers import data

TOKEN = "rooms-token"
JOB = 0x7E57
NAME = "reducer 0"


# -- the reducer's side ------------------------------------------------------------------------
class FakeClock(Clock):
    """The reducer loop's `now`, moved only by the test. It starts at time.monotonic() unless
    told otherwise: Rounds stamps a round's start from time.monotonic() (test_rounds_room.py's
    xfail), so a clock far from it would never time a round out."""

    def __init__(self, now: Optional[float] = None) -> None:
        self.now = time.monotonic() if now is None else now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@dataclass
class Sent:
    """One message the reducer would have sent: to whom, its header (parsed: a header the
    reducer sends must parse) and its payload."""

    to: bytes
    header: Header
    payload: bytes

    @property
    def type(self) -> MsgType:
        return self.header.type

    @property
    def code(self) -> Optional[ErrorCode]:
        """An ERROR's code (None for any other message)."""
        return ErrorCode(self.header.aux) if self.header.type is MsgType.ERROR else None

    @property
    def text(self) -> str:
        return self.payload.decode()

    def array(self, dtype: DType) -> np.ndarray:
        """A RESULT's payload as elements of dtype."""
        return np.frombuffer(self.payload, dtype.storage)


def _bytes(frame) -> bytes:
    if isinstance(frame, zmq.Frame):
        return frame.bytes
    return bytes(memoryview(frame).cast("B"))


class RecordingOutbox(Outbox):
    """The reducer's Outbox with its socket replaced by a list: error() and reject() are the real
    ones (their texts, their headers), and so is send() (tags, with RS_INTEGRITY); what would go to
    the socket is recorded. A send to an identity in `gone` fails as one
    to a closed connection does, and tells on_gone."""

    def __init__(self, index: int = 0, name: str = NAME, clock: Optional[Clock] = None) -> None:
        # no socket: nothing of Outbox's own
        self.throttle = Throttle(get_logger("reducer"), (lambda: clock.now) if clock is not None else time.monotonic)
        self.index = index
        self.name = name
        self.on_gone = lambda identity: None
        self.unsent: Dict[bytes, int] = {}
        self.sent: List[Sent] = []
        self.gone: set = set()
        self.tagged = None

    def _send(self, identity: bytes, frames: list) -> bool:
        if identity in self.gone:
            self.on_gone(identity)
            return False
        assert 1 <= len(frames) <= 2, f"a reducer sends a header and at most one payload, not {len(frames)} frames"
        header = protocol.unpack(_bytes(frames[0]))
        payload = _bytes(frames[1]) if len(frames) == 2 else b""
        self.sent.append(Sent(identity, header, payload))
        return True

    def take(self) -> List[Sent]:
        """What was sent since the last take()."""
        sent, self.sent = self.sent, []
        return sent

    def errors(self) -> Dict[bytes, List[Sent]]:
        """The ERRORs sent since the last take(), by identity (taken)."""
        by: Dict[bytes, List[Sent]] = {}
        for message in self.take():
            assert message.type is MsgType.ERROR, f"expected only ERRORs, got {message.type.name}: {message.payload!r}"
            by.setdefault(message.to, []).append(message)
        return by


def identity_of(rank: int) -> bytes:
    return b"rank-%d" % rank


@dataclass
class ReducerRooms:
    """A reducer's rooms without its socket and loop (reducer/core.py wires them the same way)."""

    clock: FakeClock
    outbox: RecordingOutbox
    pool: AccumulatorPool
    members: Membership
    rounds: Rounds
    admission: Admission

    def admit(self, rank: int, world: int, *, job: int = JOB, generation: int = 0) -> Peer:
        """rank joins the job served as if its handshake had passed (Membership's own steps: a
        test of Rounds needs admitted peers, not a handshake)."""
        if self.members.job != (job, generation):
            self.members.start_job((job, generation), world)
        peer = Peer(identity_of(rank), rank, world, job, generation)
        self.members.peers[peer.identity] = peer
        self.members.admit(peer)
        return peer

    def admit_all(self, world: int, **kw) -> List[Peer]:
        return [self.admit(rank, world, **kw) for rank in range(world)]

    def hello(
        self, identity: bytes, rank: int, world: int, *, job: int = JOB, generation: int = 0, **facts
    ) -> Tuple[List[Sent], bytes]:
        """A HELLO from `identity`; what the reducer answered (taken), and the HELLO's nonce."""
        payload, nonce = hello_frame(**facts)
        self.admission.hello(identity, hello_header(rank, world, job=job, generation=generation), payload)
        return self.outbox.take(), nonce

    def auth(
        self,
        identity: bytes,
        challenge: bytes,
        rank: int,
        world: int,
        *,
        token: str = TOKEN,
        job: int = JOB,
        generation: int = 0,
        extra: Optional[dict] = None,
    ) -> List[Sent]:
        """The AUTH answering `challenge`, its proof made with `token`; what the reducer answered (taken)."""
        self.admission.auth(
            identity,
            auth_frame(challenge, token=token, rank=rank, world=world, job=job, generation=generation, extra=extra),
        )
        return self.outbox.take()

    def handshake(self, identity: bytes, rank: int, world: int, *, job: int = JOB, generation: int = 0) -> Sent:
        """HELLO and AUTH with the job token: the WELCOME (asserted)."""
        (challenge,), _ = self.hello(identity, rank, world, job=job, generation=generation)
        assert challenge.type is MsgType.CHALLENGE, (challenge.type.name, challenge.payload)
        (welcome,) = self.auth(identity, challenge.payload, rank, world, job=job, generation=generation)
        assert welcome.type is MsgType.WELCOME, (welcome.type.name, welcome.payload)
        return welcome

    def contribute(
        self,
        peer: Peer,
        values: Sequence,
        *,
        seq: int = 0,
        dtype: DType = DType.FLOAT32,
        bad_payload: Optional[str] = None,
        **fields,
    ) -> Header:
        """peer's chunk of collective `seq`, holding `values`, handed to Rounds as the core would."""
        data = np.asarray(values, dtype.storage).tobytes()
        count = len(values)
        h = header(
            peer.rank,
            peer.world,
            seq=seq,
            dtype=dtype,
            job=peer.job,
            generation=peer.generation,
            **{"count": count, "total": count, "nbytes": len(data), **fields},
        )
        self.rounds.contribute(peer, h, zmq.Frame(data), bad_payload)
        return h


def reducer_rooms(
    world: Optional[int] = None,
    *,
    token: str = TOKEN,
    round_timeout: float = 30.0,
    max_rounds: int = 1024,
    max_chunk_bytes: int = 1 << 20,
    max_accumulator_bytes: int = 64 << 20,
    liveness_timeout: float = 10.0,
    deterministic: bool = False,
    now: Optional[float] = None,
) -> ReducerRooms:
    """A reducer's rooms for a job of `world` ranks (None: learnt from the first admitted)."""
    clock = FakeClock(now)
    outbox = RecordingOutbox(clock=clock)
    pool = AccumulatorPool(max_accumulator_bytes, max_accumulator_bytes)
    rooms: dict = {}
    members = Membership(
        outbox,
        clock,
        0,
        world,
        liveness_timeout,
        loss_memory=round_timeout,
        on_lost=lambda rank, text: rooms["rounds"].rank_lost(rank, text),
    )
    rounds = rooms["rounds"] = Rounds(
        outbox,
        members,
        pool,
        clock,
        index=0,
        name=NAME,
        max_chunk_bytes=max_chunk_bytes,
        max_rounds=max_rounds,
        round_timeout=round_timeout,
        deterministic=deterministic,
    )
    admission = Admission(outbox, members, rounds, clock, job_token=token, encrypt=False, shared=False)
    outbox.on_gone = lambda identity: admission.strikes.pop(identity, None)
    return ReducerRooms(clock, outbox, pool, members, rounds, admission)


def header(
    rank: int,
    world: int,
    *,
    seq: int = 0,
    chunk: int = 0,
    nchunks: int = 1,
    offset: int = 0,
    count: int = 4,
    total: Optional[int] = None,
    dtype: DType = DType.FLOAT32,
    op: ReduceOp = ReduceOp.SUM,
    nbytes: Optional[int] = None,
    job: int = JOB,
    generation: int = 0,
    group: int = 0,
    aux: int = 0,
    mtype: MsgType = MsgType.DATA,
) -> Header:
    """A worker's DATA header, parsed as the core parses it."""
    return protocol.unpack(
        data(
            rank,
            world,
            job=job,
            generation=generation,
            seq=seq,
            chunk=chunk,
            nchunks=nchunks,
            offset=offset,
            count=count,
            total=total,
            dtype=dtype,
            op=op,
            nbytes=nbytes,
            aux=aux,
            mtype=mtype,
            group=group,
        )
    )


# -- the worker's side of a handshake, as a reducer's Admission sees it -------------------------
def hello_frame(**facts) -> Tuple[zmq.Frame, bytes]:
    """A HELLO payload (a fresh nonce and `facts`) and its nonce, to check the reducer's proof over."""
    nonce = auth.new_nonce()
    return zmq.Frame(json.dumps({"nonce": nonce.hex(), **facts}).encode()), nonce


def hello_header(rank: int, world: int, *, job: int = JOB, generation: int = 0) -> Header:
    return protocol.unpack(
        protocol.text_header(MsgType.HELLO, b"", rank=rank, world=world, job=job, generation=generation)
    )


def auth_frame(
    challenge: bytes,
    *,
    token: str = TOKEN,
    rank: int,
    world: int,
    job: int = JOB,
    generation: int = 0,
    extra: Optional[dict] = None,
) -> zmq.Frame:
    """The AUTH answering a CHALLENGE payload, its proof made with `token`."""
    nonce, _ = auth.parse_challenge(challenge)
    proof = auth.worker_proof(token, nonce, job=job, generation=generation, rank=rank, world=world)
    return zmq.Frame(proof + (json.dumps(extra).encode() if extra else b""))


# -- the worker's side: a Ledger and a Failover -------------------------------------------------
ME = Identity(rank=0, world=2, job=JOB, generation=0)
COUNT = 4  # elements per chunk


def endpoint_of(chunk: Chunk) -> int:
    """The reducer (endpoint) a chunk goes to: its third field, whatever the field is called."""
    return chunk[2]


def names(num_reducers: int) -> List[str]:
    return [f"reducer {r} (127.0.0.1:{7000 + r})" for r in range(num_reducers)]


def collective(
    seq: int,
    reducers: Iterable[int],
    *,
    group: int = 0,
    time_limit: Optional[float] = None,
    dtype: DType = DType.FLOAT32,
) -> Collective:
    """An all-reduce sum of len(reducers) chunks of COUNT elements, chunk k on reducers[k]; its
    input is 0, 1, 2, ... and its result buffer zeros."""
    reducers = list(reducers)
    total = COUNT * len(reducers)
    send = np.arange(total, dtype=dtype.storage)
    recv = np.zeros(total, dtype.storage)
    chunks = [Chunk(COUNT * k, COUNT, r) for k, r in enumerate(reducers)]
    return Collective(
        seq,
        dtype,
        ReduceOp.SUM,
        0,
        memoryview(send.view(np.uint8)),
        memoryview(recv.view(np.uint8)),
        total,
        chunks,
        recv,
        group=group,
        time_limit=time_limit,
    )


def send_chunks(ledger: Ledger, coll: Collective, ks: Optional[Iterable[int]] = None) -> None:
    """Chunks `ks` (every one not sent yet by default) go out, as the pump sends them: SENT, and
    counted in their reducer's window of the collective's group."""
    window = ledger.window(coll.group)
    for k in range(len(coll.chunks)) if ks is None else ks:
        assert coll.state[k] != SENT
        coll.state[k] = SENT
        window[endpoint_of(coll.chunks[k])] += 1
        coll.next = max(coll.next, k + 1)


def result_header(
    coll: Collective, k: int, r: int, me: Identity = ME, *, mtype: MsgType = MsgType.RESULT, job: Optional[int] = None
) -> Header:
    """Reducer r's answer to chunk k of coll, as the inbox reads it."""
    offset, count, _ = coll.chunks[k]
    return protocol.unpack(
        protocol.data_header(
            mtype,
            dtype=coll.dtype,
            op=coll.op,
            rank=r,
            world=me.world,
            job=me.job if job is None else job,
            generation=me.generation,
            seq=coll.seq,
            chunk=k,
            nchunks=len(coll.chunks),
            offset=offset,
            count=count,
            total=coll.total,
            nbytes=count * coll.dtype.itemsize,
            group=coll.group,
        )
    )


def answer(
    ledger: Ledger, coll: Collective, k: int, r: Optional[int] = None, error: Optional[str] = None, me: Identity = ME
) -> bool:
    """Reducer r (chunk k's own by default) answers chunk k as the inbox hands an answer on:
    matched to its collective first (Ledger.pending_chunk), then done. False when the ledger
    took it as a late answer and dropped it."""
    r = endpoint_of(coll.chunks[k]) if r is None else r
    found = ledger.pending_chunk(result_header(coll, k, r, me), r)
    if found is None:
        return False
    assert found is coll
    ledger.chunk_done(coll, k, r, error)
    return True


def worker_rooms(num_reducers: int, *, window: int = 2, spares: int = 0, enabled: bool = True, me: Identity = ME):
    """A worker engine's Ledger and Failover, wired as the engine wires them (results kept as
    they come, settled as collectives end)."""
    ledger = Ledger(me, names(num_reducers))
    failover = Failover(me, num_reducers, window=window, enabled=enabled, spares=spares)
    if failover.enabled:
        ledger.on_result, ledger.on_end = failover.keep, failover.results.settle
    return ledger, failover
