"""Who gets in: the handshake (HELLO, CHALLENGE, AUTH, WELCOME), the job token both ways, the
job a reducer serves, and strangers (peers that are not admitted, and their malformed frames).

A HELLO is answered by a CHALLENGE that carries this reducer's proof of the job token over the
worker's nonce (auth.py) and a nonce for the worker's own proof; the AUTH that answers it admits
the worker (WELCOME) when its proof holds, and may offer shared-memory slots. A HELLO for a
newer generation, or for another job, replaces the job served once it authenticates; one for an
older generation is refused, and a reconnecting worker never takes the reducer from the job it
serves now; a rank of another run of the same job and generation (its HELLO's run id) starts it
afresh once none of the run before is connected, and is refused while some are (membership.py).
A peer that sends MAX_STRIKES malformed frames or failed handshakes is ignored from then on; a
HELLO costs the reducer a few hundred bytes until AUTH follows, and at most MAX_PENDING_HELLOS of
them are kept, whatever the rate of new connections.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import zmq

from ..config.settings import MAX_WINDOW
from ..log import event, get_logger
from ..wire import auth, integrity, protocol, shared_memory
from ..wire.protocol import ErrorCode, Header, MsgType
from .clock import Clock
from .membership import Membership, Peer
from .outbox import Outbox
from .rounds import Rounds
from .shared_results import SharedResults

log = get_logger("reducer")

# Frames from one peer that could not be parsed before it is ignored for good.
MAX_STRIKES = 16
# What the reducer knows of a peer that is not admitted (its malformed-frame count, a HELLO it did
# not follow with AUTH) is dropped once the peer has been silent this long, or at once when a send
# finds its connection gone; at most MAX_STRIKE_ENTRIES strike counts are kept (the oldest go).
FORGET_AFTER_S = 60.0
MAX_STRIKE_ENTRIES = 65536
#: HELLOs not (yet) followed by AUTH that are kept, the oldest dropped first
MAX_PENDING_HELLOS = 65536
#: what is kept of a HELLO's JSON, for log lines, to tell a restarted worker process from the
#: same one (Peer.process) and a new run of the job from the last (Peer.run_id): a stranger's
#: HELLO may carry 64 KiB, and none of it is kept but these
_KEPT_FACTS = ("host", "pid", "run_id")
_MAX_FACT_CHARS = 256


def _facts(info: object) -> dict:
    """The worker's host, pid and run id as its HELLO said them, short; nothing else of it."""
    kept: dict = {}
    for key in _KEPT_FACTS:
        value = info.get(key) if isinstance(info, dict) else None
        if isinstance(value, str):
            kept[key] = value[:_MAX_FACT_CHARS]
        elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63:
            kept[key] = value
    return kept


class Admission:
    """The handshake and the strangers of one reducer."""

    def __init__(
        self,
        outbox: Outbox,
        members: Membership,
        rounds: Rounds,
        clock: Clock,
        *,
        job_token: str,
        encrypt: bool,
        shared: bool,
        integrity: bool = False,
        results: Optional[SharedResults] = None,
        shard: int = 0,
        shards: int = 1,
        read_events: Callable[[], None] = lambda: None,
    ) -> None:
        self.outbox = outbox
        self.members = members
        self.rounds = rounds
        self.clock = clock
        self.index = outbox.index
        self.name = outbox.name
        self.job_token = job_token
        self.encrypt = encrypt  # CurveZMQ on the socket (set up by serve(), before it binds)
        self.integrity = integrity  # RS_INTEGRITY: tags past HELLO both ways (integrity.py)
        self.shared = shared  # accept shared-memory slots from workers on this host (RS_SHM)
        self.results = results  # the result slots offered to those workers
        self.shard, self.shards = shard, shards  # this process is shard `shard` of `shards` (shards.py)
        self.read_events = read_events  # the socket monitor's news, read before a WELCOME
        self.strikes: Dict[bytes, Tuple[int, float]] = {}  # identity -> (malformed frames, last heard)
        self.pending: "OrderedDict[bytes, None]" = OrderedDict()  # HELLOs awaiting AUTH, the oldest first
        self.admissions = 0
        self.auth_failures = 0

    def ignored(self, identity: bytes) -> bool:
        """Whether `identity` sent too many malformed frames to be heard any more."""
        strikes = self.strikes.get(identity)
        if strikes is not None and strikes[0] >= MAX_STRIKES:
            self.strikes[identity] = (strikes[0], self.clock.now)  # still there: not forgotten while it keeps sending
            return True
        return False

    def hello(self, identity: bytes, h: Header, payload: Optional[zmq.Frame]) -> None:
        job = self.members.job
        if self.members.admitted(identity) is not None:
            # A worker greets each connection once: another rank (or job) on an admitted
            # connection would leave the rank it holds neither served nor lost.
            return self._refuse(identity, f"a second HELLO (rank {h.rank}) on a connection admitted already")
        # Refusals below strike as a malformed frame does: a peer cannot try (and be logged) for ever.
        if not 0 < h.world <= protocol.MAX_WORLD_SIZE or h.rank >= h.world:
            return self._refuse(identity, f"rank {h.rank} / world size {h.world} is out of range")
        if self.members.fixed_world is not None and h.world != self.members.fixed_world:
            return self._refuse(
                identity,
                (
                    f"{self.name} serves {self.members.fixed_world} workers (--workers / RS_WORLD_SIZE) "
                    f"but rank {h.rank} says the world size is {h.world}"
                ),
            )
        if job is not None and h.job == job[0] and h.generation < job[1]:
            return self._refuse(
                identity,
                (
                    f"rank {h.rank} belongs to generation {h.generation} of job {h.job:#x}, "
                    f"but {self.name} already serves generation {job[1]}"
                ),
            )
        payload_bytes = payload.bytes if payload is not None else b""
        try:
            info = json.loads(payload_bytes) if payload is not None else {}
        except ValueError as exc:
            return self._refuse(identity, f"HELLO payload is not valid JSON: {exc}")
        if isinstance(info, dict) and info.get("rejoin") and job is not None and (h.job, h.generation) != job:
            # A worker reconnecting after losing this reducer never replaces the job it serves now;
            # which job that is, is not told to a peer that has proved nothing.
            return self._refuse(
                identity,
                (
                    f"rank {h.rank} of job {h.job:#x} generation {h.generation} tried to rejoin, but "
                    f"{self.name} serves another job or generation now"
                ),
            )
        try:
            theirs = bytes.fromhex(info["nonce"]) if isinstance(info, dict) else b""
        except (KeyError, TypeError, ValueError):
            theirs = b""
        if len(theirs) != auth.NONCE_BYTES:
            return self._refuse(
                identity,
                f"rank {h.rank}: HELLO carries no {auth.NONCE_BYTES}-byte nonce "
                '("nonce", hex) for this reducer to prove the job token against',
            )
        if self.integrity != (isinstance(info, dict) and info.get("integrity") is True):
            return self._refuse(identity, integrity.mismatch(self.integrity, h.rank))
        # Proved before the worker proves anything: a worker sends no more to a reducer that cannot.
        proof = auth.reducer_proof(
            self.job_token, theirs, index=self.index, job=h.job, generation=h.generation, shard=self.shard
        )
        nonce = auth.new_nonce()
        self.members.peers[identity] = Peer(
            identity,
            h.rank,
            h.world,
            h.job,
            h.generation,
            nonce=nonce,
            info=_facts(info),
            hello_at=self.clock.now,
            heartbeats=isinstance(info, dict) and info.get("heartbeats") is True,
        )
        self._pend(identity)
        payload = auth.challenge(nonce, proof)
        self.outbox.send(
            identity,
            [
                protocol.text_header(
                    MsgType.CHALLENGE,
                    payload,
                    rank=self.index,
                    world=h.world,
                    job=h.job,
                    generation=h.generation,
                    aux=int(bool(self.job_token)),
                    chunk=self.shard,
                ),
                payload,
            ],
        )
        if self.integrity:  # from AUTH on, every message each way is tagged
            peer = self.members.peers[identity]
            peer.up, peer.down = integrity.channels(self.job_token, payload_bytes, nonce)

    def auth(self, identity: bytes, payload: Optional[zmq.Frame]) -> None:
        members = self.members
        peer = members.peers.get(identity)
        if peer is None or peer.admitted:
            return self.malformed(identity, "AUTH without a HELLO before it")
        self.pending.pop(identity, None)
        claimed, rest = auth.split_auth(payload.bytes if payload is not None else b"")
        if self.job_token and not auth.verify_worker(
            self.job_token,
            peer.nonce,
            claimed,
            job=peer.job,
            generation=peer.generation,
            rank=peer.rank,
            world=peer.world,
        ):
            del members.peers[identity]
            self.auth_failures += 1
            self.outbox.throttle.event(
                logging.WARNING,
                "auth_failed",
                reducer=self.index,
                rank=peer.rank,
                job=hex(peer.job),
                reason="proof does not match RS_JOB_TOKEN",
                failures=self.auth_failures,
            )
            return self._refuse(
                identity,
                f"rank {peer.rank}: authentication failed: wrong or missing job token (RS_JOB_TOKEN)",
                logged=False,
            )
        try:
            facts = json.loads(rest) if rest else {}
        except ValueError as exc:
            del members.peers[identity]
            return self._refuse(identity, f"rank {peer.rank}: AUTH payload after the proof is not valid JSON: {exc}")
        if members.job != (peer.job, peer.generation):
            self._start_job(peer)
        elif over := members.run_over(peer):
            self._start_job(peer, over)
        elif busy := members.other_run(peer):
            del members.peers[identity]
            return self.outbox.reject(identity, busy)
        elif members.world != peer.world:
            del members.peers[identity]
            return self.outbox.reject(
                identity,
                (
                    f"rank {peer.rank} says the world size is {peer.world} but the other ranks of job "
                    f"{peer.job:#x} said {members.world}"
                ),
            )
        members.admit(peer)
        if self.results is not None:
            self.results.forget(peer.rank)
        self.admissions += 1
        offer = facts.get("shared_memory") if isinstance(facts, dict) else None
        if offer is not None and self.shared:
            try:
                peer.segment = shared_memory.Segment.attach(
                    offer, max_slots=MAX_WINDOW, max_slot_bytes=self.rounds.max_chunk_bytes
                )
            except shared_memory.Unavailable as exc:
                event(log, logging.INFO, "shared_memory_declined", reducer=self.index, rank=peer.rank, reason=exc)
        # The monitor named this worker's connection as it was accepted, before its HELLO: reading
        # it now sets the connection's send buffer (RS_SNDBUF=auto) before the worker sends a chunk.
        self.read_events()
        said = {
            "index": self.index,
            "shard": self.shard,
            "shards": self.shards,
            "world_size": members.world,
            "max_chunk_bytes": self.rounds.max_chunk_bytes,
            "deterministic": self.rounds.folder.deterministic,
            "encrypted": self.encrypt,
            "shared_memory": peer.segment is not None,
        }
        if peer.segment is not None and self.results is not None and self.results.offer is not None:
            said["shared_results"] = self.results.offer
        welcome = json.dumps(said).encode()
        self.outbox.send(
            identity,
            [
                protocol.text_header(
                    MsgType.WELCOME, welcome, world=members.world or 0, job=peer.job, generation=peer.generation
                ),
                welcome,
            ],
        )
        event(
            log,
            logging.INFO,
            "admitted",
            reducer=self.index,
            rank=peer.rank,
            world=peer.world,
            job=hex(peer.job),
            generation=peer.generation,
        )

    def _start_job(self, peer: Peer, run_over: Optional[str] = None) -> None:
        """A new job or generation replaces the old one, or a new run of the job replaces the one
        that is over (`run_over` says why): the old one's rounds, losses and peers are dropped."""
        old = self.members.job
        dropped = self.rounds.drop_all()
        if self.results is not None:
            self.results.renew()
        if run_over is not None:
            event(
                log,
                logging.INFO,
                "run_over",
                reducer=self.index,
                job=hex(peer.job),
                generation=peer.generation,
                reason=run_over,
                dropped_rounds=dropped,
            )
        elif old is not None:
            event(
                log,
                logging.WARNING,
                "job_replaced",
                reducer=self.index,
                old_job=hex(old[0]),
                old_generation=old[1],
                job=hex(peer.job),
                generation=peer.generation,
                dropped_rounds=dropped,
            )
        self.members.start_job((peer.job, peer.generation), peer.world)

    def ping(self, identity: bytes) -> None:
        """A worker's heartbeat. From then on it is expected to keep sending them."""
        peer = self.members.peers.get(identity)
        if peer is not None and peer.admitted:
            peer.heartbeats = True
        elif peer is None:  # a worker this reducer dropped (its job was replaced, or it was lost)
            self.outbox.error(identity, ErrorCode.NOT_ADMITTED, f"{self.name}: this worker is not admitted (any more)")

    def untag(self, identity: bytes, frames: List[zmq.Frame]) -> Optional[List[zmq.Frame]]:
        """With RS_INTEGRITY: a message's frames without its tag frame, once the tag proves them
        (a peer past its HELLO tags every message); None when it does not, and the peer is refused
        (before AUTH) or dropped, its rank lost (after), naming why."""
        peer = self.members.peers.get(identity)
        channel = peer.up if peer is not None else None
        if channel is None:
            return frames  # a HELLO, or a stranger's message: refused as it would be without tags
        parts = frames[1:-1]
        why = channel.open([parts[0].bytes, *(f.buffer for f in parts[1:])] if parts else [], frames[-1].bytes)
        if why is None:
            return [frames[0], *parts]
        if not peer.admitted:
            del self.members.peers[identity]
            self.pending.pop(identity, None)
            self._refuse(identity, f"rank {peer.rank}: {why}")
            return None
        self.outbox.throttle.event(
            logging.WARNING, "integrity_failed", reducer=self.index, rank=peer.rank, peer=identity.hex(), reason=why
        )
        # told while its channel still tags what it is sent; then nothing more of it is heard
        self.outbox.error(identity, ErrorCode.NOT_ADMITTED, f"{self.name}: rank {peer.rank} is dropped: {why}")
        self._expel(identity, f"a message of its failed the integrity check: {why}")
        return None

    def malformed(self, identity: bytes, reason: str) -> None:
        """A frame that could not be used: answered, counted, and the peer dropped at MAX_STRIKES."""
        strikes = self._strike(identity)
        self.outbox.throttle.event(
            logging.WARNING, "malformed_frame", reducer=self.index, peer=identity.hex(), reason=reason, strikes=strikes
        )
        self.outbox.error(identity, ErrorCode.MALFORMED, f"{self.name}: malformed message: {reason}")

    def _refuse(self, identity: bytes, reason: str, logged: bool = True) -> None:
        """A handshake no worker of a job sends (malformed, or its proof fails): REJECTed, and
        counted as a malformed frame is, so that one connection cannot try forever."""
        self._strike(identity)
        self.outbox.reject(identity, reason, logged=logged)

    def _strike(self, identity: bytes) -> int:
        """Count a bad message of `identity`'s; at MAX_STRIKES it is ignored from then on (and the
        rank it holds lost). Its count."""
        strikes = self.strikes.get(identity, (0, 0.0))[0] + 1
        self.strikes[identity] = (strikes, self.clock.now)
        if strikes >= MAX_STRIKES:
            self.outbox.throttle.event(
                logging.WARNING,
                "peer_dropped",
                reducer=self.index,
                peer=identity.hex(),
                reason=f"{MAX_STRIKES} malformed messages or failed handshakes",
            )
            self._expel(identity, f"it sent {MAX_STRIKES} malformed messages")
        return strikes

    def _expel(self, identity: bytes, why: str) -> None:
        """Ignore `identity` from now on; the rank it holds is lost (`why`): the other ranks must
        not wait for its contributions."""
        self.strikes[identity] = (MAX_STRIKES, self.clock.now)
        peer = self.members.holder(identity)
        if peer is not None:
            self.members.lose_rank(peer.rank, f"{why} and is ignored from now on")
        self.members.peers.pop(identity, None)

    def _pend(self, identity: bytes) -> None:
        """identity said HELLO: kept until its AUTH, FORGET_AFTER_S, or MAX_PENDING_HELLOS newer ones."""
        self.pending.pop(identity, None)
        self.pending[identity] = None
        while len(self.pending) > MAX_PENDING_HELLOS:
            self._forget_hello(next(iter(self.pending)))

    def _forget_hello(self, identity: bytes) -> None:
        """Drop the oldest pending HELLO, `identity`'s, and its peer unless it was admitted since."""
        del self.pending[identity]
        peer = self.members.peers.get(identity)
        if peer is not None and not peer.admitted:
            del self.members.peers[identity]

    def forget_strangers(self, now: float) -> None:
        """Drop what is kept about peers that are not admitted and went silent (FORGET_AFTER_S):
        their strike counts and unanswered HELLOs. Bounded even under a flood of identities."""
        cutoff = now - FORGET_AFTER_S
        for identity in [i for i, (_, heard) in self.strikes.items() if heard < cutoff]:
            del self.strikes[identity]
        if len(self.strikes) > MAX_STRIKE_ENTRIES:
            oldest = sorted(self.strikes, key=lambda i: self.strikes[i][1])
            for identity in oldest[: len(self.strikes) - MAX_STRIKE_ENTRIES]:
                del self.strikes[identity]
        while self.pending:
            identity = next(iter(self.pending))
            peer = self.members.peers.get(identity)
            if peer is not None and not peer.admitted and peer.hello_at >= cutoff:
                break  # the rest came later
            self._forget_hello(identity)
