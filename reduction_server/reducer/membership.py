"""Who belongs to the job a reducer serves: its admitted ranks, their liveness, and their loss.

A rank is admitted by the handshake (admission.py) and lost when its connection closes (a send
to it fails: outbox.py), when it says BYE, or when it is dropped for malformed messages. A lost
rank stays lost, and the rounds that need it fail at once, until it is admitted again or a new
job or generation replaces the one served. Losses are forgotten when the run they belong to is
over, not before: a rank that dies before the others connect still fails their rounds when they
come. A run is over when every rank of the world has come and all are gone (the job, or one
communicator of it, ended: a next run may then say another world size); and, while none of its
ranks is connected, when a lost rank comes back from another process (the job was started again
under the same id and generation), when a rank says another run id than the run's (its
launcher's name for the run: a rerun), or when none has been connected for the round timeout.
Each reducer (each shard) judges this from the ranks that reach it, in the order they come.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from ..log import event, get_logger
from ..wire import integrity, protocol, shared_memory
from ..wire.protocol import MsgType
from .clock import Clock
from .outbox import Outbox
from .rejoin import Rejoin
from .round import format_ranks

log = get_logger("reducer")

#: groups one job may announce to a reducer, and their ranks in all (each costs its list of ranks)
MAX_GROUPS = 65536
MAX_GROUP_RANKS = 1 << 22


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
    heartbeats: bool = False  # it PINGs (or said in HELLO it will): probed for a closed connection
    max_seq: Dict[int, int] = field(default_factory=dict)  # group -> highest seq it contributed to there
    hello_at: float = 0.0  # when its HELLO arrived (a peer that never completes the handshake is dropped)
    segment: Optional[shared_memory.Segment] = None  # its shared-memory slots, when it shares this host
    # RS_INTEGRITY (wire/integrity.py): what it sends, and what it is sent, past its HELLO
    up: Optional[integrity.Channel] = None
    down: Optional[integrity.Channel] = None

    def process(self) -> Optional[Tuple[object, object]]:
        """(host, pid) of the worker process, as its HELLO said; None when it said neither."""
        info = self.info if isinstance(self.info, dict) else {}
        return None if "host" not in info and "pid" not in info else (info.get("host"), info.get("pid"))

    def run_id(self) -> Optional[str]:
        """The run of the job this worker belongs to, as its launcher named it; None when unnamed."""
        run = (self.info or {}).get("run_id")
        return run if isinstance(run, str) else None

    def describe(self) -> str:
        info = self.info if isinstance(self.info, dict) else {}
        where = ", ".join(f"{k} {info[k]}" for k in ("host", "pid") if k in info)
        return f"rank {self.rank}" + (f" ({where})" if where else "")


class Membership:
    """The peers of the job served, by identity and by rank."""

    def __init__(
        self,
        outbox: Outbox,
        clock: Clock,
        index: int,
        fixed_world: Optional[int],
        liveness_timeout: float,
        loss_memory: float,
        on_lost: Callable[[int, str], Dict[str, int]],
    ) -> None:
        self.outbox = outbox
        self.clock = clock
        self.index = index
        self.fixed_world = fixed_world  # from --workers / the cluster spec; None: learn it
        self.world: Optional[int] = fixed_world
        self.job: Optional[Tuple[int, int]] = None  # (job id, generation) now served
        self.liveness_timeout = liveness_timeout
        self.loss_memory = loss_memory  # how long losses outlive the last connected rank of an incomplete run
        self.on_lost = on_lost  # fails the rounds a lost rank leaves incomplete; returns what to log
        self.peers: Dict[bytes, Peer] = {}
        self.rank_identity: Dict[int, bytes] = {}
        self.lost: Dict[int, str] = {}  # rank -> why it is gone (until it is admitted again)
        self.came: Set[int] = set()  # ranks admitted since the losses were last forgotten
        self.lost_process: Dict[int, Optional[Tuple[object, object]]] = {}  # rank -> Peer.process() of the one lost
        self.run: Optional[str] = None  # the run id of the ranks that came (None: the first said none)
        self.empty_since = 0.0  # when the last connected rank was lost
        self.gone: List[bytes] = []  # identities a send found gone, judged after the batch (check_unreachable)
        # Groups of the job's ranks other than all of them (0): id -> ranks, as their members announce them.
        self.groups: Dict[int, Tuple[int, ...]] = {}
        self.group_errors: Dict[int, str] = {}  # a group announced two ways: why its rounds fail
        self.group_ranks = 0  # ranks kept over all groups (bounded: MAX_GROUP_RANKS)
        self.rejoin = Rejoin(outbox, index)  # workers that lost this reducer and use it again

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
        self.forget_losses()
        for identity in [i for i, p in self.peers.items() if (p.job, p.generation) != job]:
            del self.peers[identity]  # in place: the outbox looks up the peers it tags for here
        self.job = job
        self.world = self.fixed_world or world

    def admit(self, peer: Peer) -> None:
        old = self.rank_identity.get(peer.rank)
        if old is not None and old != peer.identity:
            event(log, logging.INFO, "rank_reconnected", reducer=self.index, rank=peer.rank)
            self.peers.pop(old, None)
        peer.admitted = True
        self.rank_identity[peer.rank] = peer.identity
        if not self.came:
            self.run = peer.run_id()
        self.came.add(peer.rank)
        self.lost_process.pop(peer.rank, None)
        if self.lost.pop(peer.rank, None) is not None:
            event(log, logging.INFO, "rank_readmitted", reducer=self.index, rank=peer.rank)

    def run_over(self, peer: Peer) -> Optional[str]:
        """Why the run of this job that the reducer remembers is over, as `peer` of the same job
        and generation is admitted (None: peer may be one of its ranks). Only while none of its
        ranks is connected: when the last run ended whole, a peer that says another world size
        starts the job afresh; when ranks were lost before every rank came, a lost rank that comes
        back from another process does, and any rank once none has been connected for the round
        timeout; and any rank whose run id (its launcher's: discovery.run_id) is not the one the
        run before said. (A reducer told the world refused another world size at HELLO.)"""
        if self.rank_identity:
            return None
        if self._runs_differ(peer):
            return f"rank {peer.rank} belongs to run {peer.run_id()!r}, the run before was {self.run!r}"
        if not self.lost:
            if self.world != peer.world:
                return f"rank {peer.rank} says the world size is {peer.world}, the run before said {self.world}"
            return None
        if self.clock.now - self.empty_since >= self.loss_memory:
            return f"no rank was connected for {self.loss_memory:g} s"
        before = self.lost_process.get(peer.rank)
        if before is not None and before != peer.process():
            return f"rank {peer.rank}, lost before, came back from another process"
        return None

    def other_run(self, peer: Peer) -> Optional[str]:
        """Why `peer` is refused while ranks of another run of its job and generation are connected
        (None: it is not). A run id is not ordered, so neither run can be told to be the newer."""
        if not self._runs_differ(peer):
            return None
        return (
            f"rank {peer.rank} belongs to run {peer.run_id()!r} of job {peer.job:#x} generation {peer.generation}, "
            f"but ranks {format_ranks(self.rank_identity)} of run {self.run!r} are still connected: "
            "a new run is served once they are gone, or at once with a higher RS_GENERATION"
        )

    def _runs_differ(self, peer: Peer) -> bool:
        """Whether `peer` and the ranks that came say different runs (both saying one)."""
        run = peer.run_id()
        return bool(self.came) and self.run is not None and run is not None and run != self.run

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
        self.lost_process[rank] = peer.process() if peer is not None else None
        effects = self.on_lost(rank, text)
        event(
            log,
            logging.INFO if quiet else logging.WARNING,
            "rank_lost",
            reducer=self.index,
            rank=rank,
            reason=reason,
            **effects,
        )
        if not self.rank_identity and self.world is not None and len(self.came) >= self.world:
            # Every rank came and all have gone: the job is over (or all of it failed). Ranks that
            # connect again with the same job and generation (a second communicator) start afresh.
            # Until every rank has come, a loss is kept for those still on their way (run_over).
            self.forget_losses()
        elif not self.rank_identity:
            self.empty_since = self.clock.now

    def forget_losses(self) -> None:
        """Start afresh: no rank lost, none come yet, no groups announced."""
        self.lost.clear()
        self.lost_process.clear()
        self.came.clear()
        self.run = None
        self.forget_groups()

    def ping_peers(self) -> None:
        """Send a PING to every worker that heartbeats; a send to one whose connection is gone
        fails at once (EHOSTUNREACH), which is how a closed connection is tied to its rank."""
        for identity, peer in list(self.peers.items()):
            if peer.admitted and peer.heartbeats:
                self.outbox.send(
                    identity,
                    [
                        protocol.text_header(
                            MsgType.PING,
                            b"",
                            rank=self.index,
                            world=peer.world,
                            job=peer.job,
                            generation=peer.generation,
                        )
                    ],
                )

    def check_unreachable(self) -> None:
        """Judge the connections sends found gone: an admitted rank's is a loss."""
        gone, self.gone = self.gone, []
        for identity in gone:
            peer = self.holder(identity)
            if peer is not None:
                self.lose_rank(
                    peer.rank,
                    (
                        "its connection closed (the process exited, stopped answering heartbeats for "
                        f"RS_LIVENESS_TIMEOUT={self.liveness_timeout:g} s, or the network dropped it)"
                    ),
                )
            else:  # one that never completed the handshake, or a connection its rank replaced
                self.peers.pop(identity, None)

    def seq_of(self, rank: int, group: int) -> int:
        """The highest seq `rank` contributed to in `group` (-1: none, or not connected)."""
        identity = self.rank_identity.get(rank)
        peer = self.peers.get(identity) if identity is not None else None
        return peer.max_seq.get(group, -1) if peer is not None else -1

    # -- groups ------------------------------------------------------------------------------
    def announce(self, peer: Peer, group: int, ranks: Tuple[int, ...]) -> Optional[str]:
        """A member's GROUP: the first announcement of a group defines it; one that disagrees
        makes its rounds fail with both versions named, on every member. Returns why the
        announcement itself is refused (its sender alone hears it), else None."""
        if group == 0:
            return "group 0 is all of the job's ranks: it is never announced"
        if peer.rank not in ranks:
            return f"rank {peer.rank} announced group {group:#x} as ranks {format_ranks(ranks)}, which it is not one of"
        known = self.groups.get(group)
        if known is None:
            if len(self.groups) >= MAX_GROUPS or self.group_ranks + len(ranks) > MAX_GROUP_RANKS:
                return (
                    f"rank {peer.rank} announced group {group:#x}, but this reducer keeps at most {MAX_GROUPS} "
                    f"groups and {MAX_GROUP_RANKS} of their ranks per job"
                )
            self.groups[group] = ranks
            self.group_ranks += len(ranks)
        elif known != ranks and group not in self.group_errors:
            self.group_errors[group] = (
                f"rank {peer.rank} announced group {group:#x} as ranks {format_ranks(ranks)}, "
                f"another member as ranks {format_ranks(known)}"
            )
        return None

    def forget_groups(self) -> None:
        """Drop every group (a new job or generation, or every rank has left), and what their
        ranks reported on coming back (rejoin.py)."""
        self.groups.clear()
        self.group_errors.clear()
        self.group_ranks = 0
        self.rejoin.clear()

    def progress(self, peer: Peer, progress: Dict[int, int]) -> Optional[str]:
        """A PROGRESS from an admitted member (rejoin.py); why it cannot count, if it cannot."""

        def ranks_of(group: int) -> Sequence[int]:
            return range(self.world or 0) if group == 0 else self.groups.get(group, ())

        return self.rejoin.report(
            peer.rank,
            progress,
            ranks_of,
            self.rank_identity.get,
            {"world": self.world or 0, "job": peer.job, "generation": peer.generation},
        )

    def ranks_of(self, h: protocol.Header) -> Tuple[Sequence[int], Optional[str]]:
        """The ranks of h's group, and why h cannot be one of its contributions (None: it can)."""
        if h.group == 0:
            return range(self.world or 0), None
        ranks = self.groups.get(h.group, ())
        problem = self.group_errors.get(h.group)
        if problem is None and not ranks:
            problem = f"rank {h.rank} sent {h.describe()}, a group none of its ranks announced (GROUP) to this reducer"
        elif problem is None and h.rank not in ranks:
            problem = f"rank {h.rank} sent {h.describe()} but is not one of its ranks {format_ranks(ranks)}"
        elif problem is None and h.op == protocol.OP_BROADCAST and h.aux not in ranks:
            problem = f"{h.describe()} names root {h.aux}, which is not one of its ranks {format_ranks(ranks)}"
        return ranks, problem
