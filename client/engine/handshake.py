"""The handshake with each reducer: its proof of the job token first, then this worker's.

HELLO carries a nonce; the reducer's CHALLENGE must prove the token over it, bound to the
reducer's index (its position in RS_REDUCERS), the job and the generation (auth.py). A reducer
that cannot is refused, naming it and RS_JOB_TOKEN, and is sent nothing more: no AUTH, no
shared-memory offer, no data. Only then does the AUTH go out, with this worker's proof and, to a
reducer on this host, the shared-memory offer. At start the engine waits for every endpoint's
WELCOME (each shard of each reducer, endpoints.py), saying every WAITING_REPORT_S what it still waits for.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, Iterable, Optional

from reduction_server.config.settings import MAX_SHARDS
from reduction_server.errors import CollectiveError, ProtocolError
from reduction_server.log import NOTICE, event, get_logger
from reduction_server.wire import auth, protocol
from reduction_server.wire.protocol import MsgType

from .connections import Connections
from .identity import Identity
from .slots import Slots
from .watch import CHALLENGED, PROGRESS

log = get_logger("client")

#: seconds between the lines a worker logs while it waits for reducers to admit it
WAITING_REPORT_S = 5.0
#: how a reducer folds contributions, by its WELCOME's "deterministic"
_ORDERS = {True: "in rank order (RS_DETERMINISTIC=1)", False: "in arrival order (RS_DETERMINISTIC=0)"}


class Handshake:
    """Proofs both ways with every endpoint, and the first wait for them all."""

    def __init__(
        self, me: Identity, connections: Connections, slots: Slots, job_token: str, connect_timeout: float
    ) -> None:
        self.me = me
        self.connections = connections
        self.slots = slots
        self.job_token = job_token
        self.connect_timeout = connect_timeout
        #: the smallest accumulator chunk any reducer accepts (from WELCOME): it caps the chunk size
        self.max_chunk_bytes = 1 << 62
        #: how many shards each endpoint's reducer runs, as its WELCOME said (endpoints.py)
        self.shards = [1] * len(connections.endpoints)
        #: whether the job's reducers fold in rank order (RS_DETERMINISTIC), and the first endpoint
        #: whose WELCOME said so: every reducer of a job must fold alike (invariant 5)
        self.deterministic: Optional[bool] = None
        self.deterministic_from = 0

    def answer_challenge(self, e: int, h: protocol.Header, payload: bytes) -> Optional[str]:
        """Check endpoint e's proof of the job token and, if it holds, send AUTH: this worker's
        proof and, to an endpoint on this host, the shared-memory offer. Returns why endpoint e is
        refused instead (then nothing at all is sent to it), or None."""
        conn = self.connections
        try:
            nonce, proof = auth.parse_challenge(payload)
        except ProtocolError as exc:
            return f"{conn.name(e)} answered HELLO with a malformed CHALLENGE: {exc}"
        end = conn.endpoints[e]
        if h.rank != end.reducer:
            return (
                f"{conn.name(e)} says it is reducer {h.rank}, but RS_REDUCERS lists it as reducer {end.reducer}: "
                "each reducer's --index (RS_REDUCER_INDEX) must be its position in RS_REDUCERS"
            )
        if h.chunk != end.shard:
            return (
                f"{conn.name(e)} says it is shard {h.chunk} of its reducer, but its port makes it shard "
                f"{end.shard}: RS_REDUCERS must list each reducer's own port (its shard 0), and no other "
                "reducer may listen on the ports after it (its shards')"
            )
        if not auth.verify_reducer(
            self.job_token,
            conn.nonces[e],
            proof,
            index=end.reducer,
            job=self.me.job,
            generation=self.me.generation,
            shard=end.shard,
        ):
            if not self.job_token:
                why = "it requires a job token and this worker has none: set RS_JOB_TOKEN to the job's token"
            elif not h.aux:
                why = "it has no job token (it was started without RS_JOB_TOKEN)"
            else:
                why = "its RS_JOB_TOKEN is not this worker's (another job's reducer, or a mistyped token)"
            return f"{conn.name(e)} did not prove the job token (RS_JOB_TOKEN): {why}; nothing was sent to it"
        conn.progress[e] = CHALLENGED
        conn.start_tags(e, nonce)
        facts: Dict[str, Any] = {}
        offer = self.slots.offer(e)
        if offer is not None:
            facts["shared_memory"] = offer
        proof = auth.worker_proof(
            self.job_token,
            nonce,
            job=self.me.job,
            generation=self.me.generation,
            rank=self.me.rank,
            world=self.me.world,
        )
        conn.send_text(e, MsgType.AUTH, proof + (json.dumps(facts).encode() if facts else b""))
        return None

    def unproved_welcome(self, e: int) -> str:
        """Why endpoint e is refused when it sent WELCOME before its CHALLENGE proved the job token."""
        return (
            f"{self.connections.name(e)} sent WELCOME without proving the job token (RS_JOB_TOKEN) first; "
            "nothing was sent to it"
        )

    def wait_for_all(self) -> None:
        """Wait until every endpoint has proved the token and admitted this worker; one whose
        connection fails is tried again on a new one. Raises CollectiveError naming what failed."""
        conn = self.connections
        waiting = set(range(len(conn.sockets)))
        started = time.monotonic()
        deadline, report = started + self.connect_timeout, started + WAITING_REPORT_S
        while waiting:
            now = time.monotonic()
            if now >= deadline:
                sharded = any(conn.endpoints[e].shard for e in waiting)
                raise CollectiveError(
                    f"rank {self.me.rank}: no reducer admitted this worker within "
                    f"{self.connect_timeout:g} s (RS_CONNECT_TIMEOUT): {self._waiting(waiting)}"
                    + (
                        "; a reducer's shards listen on the ports after its own, and each must "
                        "be reachable from the workers (RS_SHARDS=1 runs one)"
                        if sharded
                        else ""
                    )
                )
            if now >= report:  # a worker that waits says for what, rather than look hung
                event(
                    log,
                    NOTICE,
                    "waiting_for_reducers",
                    rank=self.me.rank,
                    waited_s=f"{now - started:.0f}",
                    connect_timeout_s=f"{self.connect_timeout:g}",
                    waiting=self._waiting(waiting),
                )
                report = max(report + WAITING_REPORT_S, now + 1.0)
            conn.reopen_due(now, rejoin=False)
            until = min(deadline, report, *conn.reopen_at.values())
            for item, _ in conn.poller.poll(max(0.01, until - now) * 1000):
                kind, e = conn.index.get(item, ("", -1))
                if kind == "monitor":
                    closed, refused = conn.monitor_events(e)
                    if refused:
                        raise CollectiveError(f"rank {self.me.rank}: {conn.name(e)} refused this worker: {refused}")
                    if closed:  # not there yet, or gone meanwhile: a new connection, a new handshake
                        waiting.add(e)
                        conn.retry_later(e)
                elif kind == "data" and self._welcomed(e):
                    waiting.discard(e)

    def _welcomed(self, e: int) -> bool:
        """Handle one handshake message from endpoint e; whether it was its WELCOME."""
        frames = self.connections.sockets[e].recv_multipart()
        name = self.connections.name(e)
        try:
            h = protocol.unpack(frames[0])
        except ProtocolError as exc:
            raise CollectiveError(
                f"rank {self.me.rank}: {name} answered the handshake with a malformed frame: {exc}"
            ) from None
        altered = self.connections.untag(e, h, frames)
        if altered:
            raise CollectiveError(f"rank {self.me.rank}: {altered}")
        text = frames[1] if len(frames) > 1 else b""
        if h.type is MsgType.CHALLENGE:
            refused = self.answer_challenge(e, h, text)
            if refused:
                raise CollectiveError(f"rank {self.me.rank}: {refused}")
        elif h.type is MsgType.WELCOME and self.connections.progress[e] != CHALLENGED:
            raise CollectiveError(f"rank {self.me.rank}: {self.unproved_welcome(e)}")
        elif h.type is MsgType.WELCOME:
            welcome = json.loads(text)
            other = self.folds_otherwise(e, welcome)
            if other:
                raise CollectiveError(f"rank {self.me.rank}: {other}")
            self.max_chunk_bytes = min(self.max_chunk_bytes, int(welcome.get("max_chunk_bytes", self.max_chunk_bytes)))
            self.shards[e] = self._shard_count(e, welcome)
            self.connections.admitted(e, welcome)
            return True
        elif h.type in (MsgType.REJECT, MsgType.ERROR):
            raise CollectiveError(f"rank {self.me.rank}: {name} refused this worker: {text.decode(errors='replace')}")
        return False

    def folds_otherwise(self, e: int, welcome: dict) -> Optional[str]:
        """Why endpoint e's WELCOME cannot be the job's: it folds in another order than the
        reducers that welcomed this worker before (one in rank order, RS_DETERMINISTIC=1, and one
        not), so that results would no longer be bitwise reproducible; None when it folds alike
        (the first WELCOME sets the job's mode)."""
        deterministic = welcome.get("deterministic") is True
        if self.deterministic is None:
            self.deterministic, self.deterministic_from = deterministic, e
            return None
        if deterministic == self.deterministic:
            return None
        first = e == self.deterministic_from  # it came back folding otherwise than it did
        others = "the job's reducers" if first else self.connections.name(self.deterministic_from)
        return (
            f"{self.connections.name(e)} sums {_ORDERS[deterministic]}, and {others} {_ORDERS[self.deterministic]}: "
            "start every reducer of a job with --deterministic (RS_DETERMINISTIC=1), or none"
        )

    def came_back_otherwise(self, e: int, welcome: dict) -> Optional[str]:
        """Why endpoint e, lost and now admitting this worker again, cannot be used again: its
        WELCOME no longer agrees with what the ranks' chunk plans and results rest on (a smaller
        chunk limit, or another folding order); None when it can."""
        limit = int(welcome.get("max_chunk_bytes", self.max_chunk_bytes))
        if limit < self.max_chunk_bytes:  # the ranks' chunk plans would no longer agree
            return (
                f"{self.connections.name(e)} came back with a smaller chunk limit ({limit} < "
                f"{self.max_chunk_bytes} bytes, RS_MAX_CHUNK_BYTES); restart the job"
            )
        other = self.folds_otherwise(e, welcome)
        return f"{other} (when it came back)" if other else None

    def _shard_count(self, e: int, welcome: dict) -> int:
        """How many shards endpoint e's WELCOME says its reducer runs; CollectiveError unless a
        count whose ports all exist."""
        shards = welcome.get("shards", 1)
        port = int(self.connections.addresses[e].rsplit(":", 1)[1]) - self.connections.endpoints[e].shard
        if not (isinstance(shards, int) and 1 <= shards <= MAX_SHARDS and port + shards - 1 <= 65535):
            raise CollectiveError(
                f"rank {self.me.rank}: {self.connections.name(e)} says it runs {shards!r} shards, "
                f"not a count of 1..{MAX_SHARDS} ports from {port}"
            )
        return shards

    def _waiting(self, waiting: Iterable[int]) -> str:
        """The endpoints in `waiting` and how far each one's handshake got, in words."""
        conn = self.connections
        return "; ".join(f"{conn.name(e)}: {PROGRESS[conn.progress[e]]}" for e in sorted(waiting))
