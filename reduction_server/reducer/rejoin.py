"""When the workers use this reducer again after they lost it: a collective boundary per group
that every member agrees on (docs/reliability.md, "A reducer that comes back").

A worker that readmits a reducer it had lost sends PROGRESS: for each group, the seq of the next
collective it will start. It starts none beyond that seq plus REJOIN_LEAD until it hears back.
Once every member of a group has reported, the reducer answers them all (JOIN) with the
boundary: the furthest report plus REJOIN_LEAD, a collective no member has started. From that
seq on, every member sends the group's chunks that belong to this reducer here again. A rank
that reports again (it reconnected) hears the boundary already chosen, unless it reports a seq
past it: it used this reducer from the boundary and lost it again, so the group agrees anew.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

from ..wire import protocol
from ..wire.protocol import REJOIN_LEAD, MsgType
from .outbox import Outbox

_MAX_REPORTED_SEQ = (1 << 64) - 1 - REJOIN_LEAD


class Rejoin:
    """Each group's reports (rank -> next seq) and the boundaries chosen, for the job served."""

    def __init__(self, outbox: Outbox, index: int) -> None:
        self.outbox = outbox
        self.index = index
        self.reports: Dict[int, Dict[int, int]] = {}  # group -> rank -> the next seq it will start
        self.boundaries: Dict[int, int] = {}  # group -> the seq from which it uses this reducer

    def report(
        self,
        rank: int,
        progress: Dict[int, int],
        ranks_of: Callable[[int], Sequence[int]],
        identity_of: Callable[[int], Optional[bytes]],
        ident: dict,
    ) -> Optional[str]:
        """A PROGRESS from `rank`; JOINs to every member of each group whose boundary is now
        known (to `rank` alone for a group decided before). Why it cannot count, if it cannot."""
        for group, seq in progress.items():
            ranks = ranks_of(group)
            if rank not in ranks:
                return f"rank {rank} reported progress in group {group:#x}, which it is not a member of"
            if seq > _MAX_REPORTED_SEQ:  # its boundary (REJOIN_LEAD beyond) would not fit a JOIN
                return f"rank {rank} reported seq {seq} in group {group:#x}, beyond any collective's"
            if group in self.boundaries:
                if seq <= self.boundaries[group]:
                    self._join(identity_of(rank), group, ident)
                    continue
                # It started collectives past the boundary, here, and lost this reducer again
                # (a stopped reducer that went on, not a restarted one): a new boundary is agreed.
                del self.boundaries[group]
            reports = self.reports.setdefault(group, {})
            reports[rank] = seq
            if len(reports) == len(ranks):
                self.boundaries[group] = max(reports.values()) + REJOIN_LEAD
                del self.reports[group]
                for member in ranks:
                    self._join(identity_of(member), group, ident)
        return None

    def _join(self, identity: Optional[bytes], group: int, ident: dict) -> None:
        if identity is None:
            return  # gone since it reported: when it comes back, it reports again
        payload = protocol.seq_pairs_payload([(group, self.boundaries[group])])
        self.outbox.send(identity, [protocol.text_header(MsgType.JOIN, payload, rank=self.index, **ident), payload])

    def clear(self) -> None:
        """A new job or generation, or every rank has left: nothing reported holds any more."""
        self.reports.clear()
        self.boundaries.clear()
