"""Who belongs to the job a reducer serves: its admitted ranks, their liveness, and their loss.

A rank is admitted by the handshake (admission.py) and lost when its connection closes (a send
to it fails: outbox.py), when it says BYE, or when it is dropped for malformed messages. A lost
rank stays lost, and the rounds that need it fail at once, until it is admitted again or a new
job or generation replaces the one served.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from .. import protocol, shared_memory
from ..log import event, get_logger
from ..protocol import MsgType
from .outbox import Outbox

log = get_logger("reducer")


@dataclass
class Peer:
    """One connection that said HELLO, and what the reducer knows of it."""

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


class Membership:
    """The peers of the job served, by identity and by rank."""

    def __init__(self, outbox: Outbox, index: int, fixed_world: Optional[int], liveness_timeout: float,
                 on_lost: Callable[[int, str], Dict[str, int]]) -> None:
        self.outbox = outbox
        self.index = index
        self.fixed_world = fixed_world  # from --workers / the cluster spec; None: learn it
        self.world: Optional[int] = fixed_world
        self.job: Optional[Tuple[int, int]] = None  # (job id, generation) now served
        self.liveness_timeout = liveness_timeout
        self.on_lost = on_lost  # fails the rounds a lost rank leaves incomplete; returns what to log
        self.peers: Dict[bytes, Peer] = {}
        self.rank_identity: Dict[int, bytes] = {}
        self.lost: Dict[int, str] = {}  # rank -> why it is gone (until it is admitted again)
        self.gone: List[bytes] = []  # identities a send found gone, judged after the batch (check_unreachable)

    def admitted(self, identity: bytes) -> Optional[Peer]:
        """The peer at `identity` if it is admitted, else None."""
        peer = self.peers.get(identity)
        return peer if peer is not None and peer.admitted else None

    def holder(self, identity: bytes) -> Optional[Peer]:
        """The admitted peer at `identity` if it still holds its rank (no newer connection took it), else None."""
        peer = self.admitted(identity)
        return peer if peer is not None and self.rank_identity.get(peer.rank) == identity else None

    def start_job(self, job: Tuple[int, int], world: int) -> None:
        """A new job or generation replaces the one served: its ranks and its losses are dropped."""
        self.rank_identity.clear()
        self.lost.clear()
        self.peers = {i: p for i, p in self.peers.items() if (p.job, p.generation) == job}
        self.job = job
        self.world = self.fixed_world or world

    def admit(self, peer: Peer) -> None:
        old = self.rank_identity.get(peer.rank)
        if old is not None and old != peer.identity:
            event(log, logging.INFO, "rank_reconnected", reducer=self.index, rank=peer.rank)
            self.peers.pop(old, None)
        peer.admitted = True
        self.rank_identity[peer.rank] = peer.identity
        if self.lost.pop(peer.rank, None) is not None:
            event(log, logging.INFO, "rank_readmitted", reducer=self.index, rank=peer.rank)

    def leave(self, identity: bytes) -> None:
        """A BYE: the peer leaves on purpose."""
        peer = self.holder(identity)
        if peer is not None:
            event(log, logging.INFO, "bye", reducer=self.index, rank=peer.rank)
            self.lose_rank(peer.rank, "it closed its communicator (BYE)", quiet=True)
        self.peers.pop(identity, None)

    def lose_rank(self, rank: int, reason: str, quiet: bool = False) -> None:
        """A rank is gone: every open round it has not contributed to can never complete, so it
        fails now for every other rank; rounds created later that need it fail at once, until
        the rank is admitted again (a new connection, or a new generation of the job)."""
        identity = self.rank_identity.pop(rank, None)
        peer = self.peers.pop(identity, None) if identity is not None else None
        who = peer.describe() if peer is not None else f"rank {rank}"
        text = f"{who} was lost: {reason}"
        self.lost[rank] = text
        effects = self.on_lost(rank, text)
        event(log, logging.INFO if quiet else logging.WARNING, "rank_lost", reducer=self.index, rank=rank,
              reason=reason, **effects)
        if not self.rank_identity:
            # Every rank has gone: the job is over (or all of it failed). Ranks that connect
            # again with the same job and generation (a second communicator) start afresh.
            self.lost.clear()

    def ping_peers(self) -> None:
        """Send a PING to every worker that heartbeats; a send to one whose connection is gone
        fails at once (EHOSTUNREACH), which is how a closed connection is tied to its rank."""
        for identity, peer in list(self.peers.items()):
            if peer.admitted and peer.heartbeats:
                self.outbox.send(identity, [protocol.text_header(MsgType.PING, b"", rank=self.index, world=peer.world,
                                                                 job=peer.job, generation=peer.generation)])

    def check_unreachable(self) -> None:
        """Judge the connections sends found gone: an admitted rank's is a loss."""
        gone, self.gone = self.gone, []
        for identity in gone:
            peer = self.holder(identity)
            if peer is not None:
                self.lose_rank(peer.rank, (
                    "its connection closed (the process exited, stopped answering heartbeats for "
                    f"RS_LIVENESS_TIMEOUT={self.liveness_timeout:g} s, or the network dropped it)"))
            else:  # one that never completed the handshake, or a connection its rank replaced
                self.peers.pop(identity, None)

    def seq_of(self, rank: int) -> int:
        """The highest seq `rank` contributed to (-1: none, or not connected)."""
        identity = self.rank_identity.get(rank)
        peer = self.peers.get(identity) if identity is not None else None
        return peer.max_seq if peer is not None else -1
