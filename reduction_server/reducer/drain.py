"""A reducer told to stop (SIGTERM) drains: its workers move its chunks from a collective
boundary per group, it answers every round it holds, then it exits (docs/reliability.md,
"Draining"). As a spare or a returning reducer joins at a boundary every rank agrees on
(rejoin.py), a draining one leaves at one.

The boundary of a group is the seq after the furthest this reducer has seen of it (a rank's
contribution, or an open round); a group it has not seen has boundary 0. Every round before the
boundary stays its own: a rank sends a group's chunks to it in order, so the rank that sent the
furthest has sent every earlier one here already, and each other rank sends its own here as
planned. From the boundary on, no rank sends it the group's chunks: every admitted worker hears
DRAIN with the boundaries at once, and a chunk at or past its group's boundary that comes anyway
(sent before the DRAIN reached its rank) is answered DRAINING, not summed: its rank moves it.
Once no round is open, every worker hears DRAINED, says BYE, and the reducer exits once all have.
RS_DRAIN_TIMEOUT after the signal it exits whatever it holds, and its workers fail over as from a
lost reducer.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional

from ..log import NOTICE, event, get_logger
from ..wire import protocol
from ..wire.protocol import ErrorCode, Header, MsgType
from .clock import Clock
from .membership import Membership
from .outbox import Outbox
from .rounds import Rounds

log = get_logger("reducer")


class Drain:
    """Whether this reducer drains, its boundaries, and when it is done."""

    def __init__(
        self,
        outbox: Outbox,
        members: Membership,
        rounds: Rounds,
        clock: Clock,
        *,
        index: int,
        name: str,
        timeout: float,
        fields: Optional[Dict[str, int]] = None,
    ) -> None:
        self.outbox = outbox
        self.members = members
        self.rounds = rounds
        self.clock = clock
        self.index = index
        self.name = name
        self.timeout = timeout
        self.fields = fields or {}  # its log lines' shard, where it is one
        self.requested = False  # set by the signal handler: a flag, read by the loop
        self.started_at: Optional[float] = None
        self.boundaries: Optional[Dict[int, int]] = None  # group -> the first seq it is not sent
        self.told = False  # every round answered, every worker told DRAINED
        self.outcome = "none"  # how it ended, for the stop summary: none, drained or drain_timed_out

    def request(self) -> None:
        """SIGTERM: drain from the loop's next turn (safe in a signal handler: it sets a flag)."""
        self.requested = True

    @property
    def draining(self) -> bool:
        return self.boundaries is not None

    def start(self) -> None:
        """Choose each group's boundary and tell every admitted worker (DRAIN)."""
        job = self.members.job
        furthest: Dict[int, int] = {}
        for peer in self.members.peers.values():
            if peer.admitted and (peer.job, peer.generation) == job:
                for group, seq in peer.max_seq.items():
                    furthest[group] = max(seq, furthest.get(group, -1))
        for key, rnd in self.rounds.rounds.items():
            if key[:2] == job and rnd.error is None:
                furthest[key[2]] = max(key[3], furthest.get(key[2], -1))
        self.boundaries = {group: seq + 1 for group, seq in furthest.items()}
        self.started_at = self.clock.now
        payload = protocol.seq_pairs_payload(self.boundaries.items())
        header = protocol.text_header(MsgType.DRAIN, payload, rank=self.index)
        workers = self._tell(header, payload)
        event(
            log,
            NOTICE if workers else logging.INFO,  # with no worker, the stop line says it all
            "draining",
            reducer=self.index,
            **self.fields,
            workers=workers,
            groups=len(self.boundaries),
            open_rounds=self.rounds.open_count,
            timeout_s=f"{self.timeout:g}",
        )

    def refuses(self, identity: bytes, h: Header) -> bool:
        """Whether contribution h is at or past its group's boundary: answered DRAINING, not summed."""
        if h.seq < self.boundaries.get(h.group, 0):
            return False
        reason = (
            f"{self.name} drains (it was told to stop) and sums no chunk of group {h.group:#x} from seq "
            f"{self.boundaries.get(h.group, 0)} on; {h.describe()} goes to another reducer"
        )
        self.outbox.error(identity, ErrorCode.DRAINING, reason, about=h)
        return True

    def over(self) -> bool:
        """Whether the reducer may exit: every round it holds is answered, its workers heard
        DRAINED and said BYE (a connection it closed first could drop the DRAINED unread), or
        RS_DRAIN_TIMEOUT has passed since the signal."""
        if self.boundaries is None:
            return False
        open_rounds = self.rounds.open_count
        if open_rounds == 0 and not self.told:
            self._tell(protocol.text_header(MsgType.DRAINED, b"", rank=self.index), b"")
            self.told = True
        if self.told and not any(p.admitted for p in self.members.peers.values()):
            self.outcome = "drained"
        elif self.clock.now - self.started_at >= self.timeout:
            # Told: every result is out, a worker that said no BYE has them or fails over.
            self.outcome = "drained" if self.told else "drain_timed_out"
        else:
            return False
        event(
            log,
            logging.INFO if self.outcome == "drained" else logging.WARNING,  # the stop line says drain=drained
            self.outcome,
            reducer=self.index,
            **self.fields,
            open_rounds=open_rounds,
            seconds=f"{self.clock.now - self.started_at:.3f}",
        )
        return True

    def _tell(self, header: bytes, payload: bytes) -> int:
        """The message to every admitted worker of the job served; how many."""
        peers = [p for p in self.members.peers.values() if p.admitted]
        for peer in peers:
            self.outbox.send(peer.identity, [header, payload])
        return len(peers)
