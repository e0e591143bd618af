"""The reducer's state for one key (one chunk of one collective): who has contributed, what
they agreed on, the accumulator, and whether the round has failed.

A round is created by the first contribution to its key. Every later contribution must agree
with the first on dtype, op, element count, offset, collective size, chunk count and root;
a disagreement fails the round for every rank. A failed round still answers each rank once
(with an ERROR), so that no rank waits forever and the key is forgotten when all have been
answered.

In deterministic mode (RS_DETERMINISTIC=1) contributions are folded in rank order whatever
their arrival order: rank k is folded once ranks 0..k have arrived, and a contribution that
arrives before its turn is held (a view of its received frame or of its shared-memory slot, or
a copy of a small frame, which may share libzmq's receive buffer) until then.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from ..config.settings import DEFAULT_PIPELINE_DEPTH, ONE_HOST_PIPELINE_DEPTH
from ..wire.formats import COMPRESSED, INT8_BLOCK, WireFormat, block_bytes
from ..wire.protocol import (
    DTYPES,
    ITEMSIZE,
    MOVED_TYPES,
    MSG_FINAL,
    OPS,
    DType,
    ErrorCode,
    Header,
    ReduceOp,
    format_name,
)

if TYPE_CHECKING:
    from ..wire.shared_memory import Segment

# Header fields that every contribution to one key must agree on.
AGREED_FIELDS = ("dtype", "op", "count", "offset", "total", "nchunks", "aux", "world")
_agreed = operator.attrgetter(*AGREED_FIELDS)  # one C call per contribution, not a loop of getattr


def format_ranks(ranks, limit: int = 24) -> str:
    """Sorted ranks as a list; a long one with runs collapsed and its middle elided, so that a
    message about thousands of ranks stays short: "[0-511, 513, 515, ..., 1023] (1000 ranks)"."""
    ranks = sorted(ranks)
    if len(ranks) <= 16:
        return str(ranks)
    parts, start = [], 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or ranks[i] != ranks[i - 1] + 1:
            first, last = ranks[start], ranks[i - 1]
            parts.append(str(first) if first == last else f"{first}-{last}")
            start = i
    if len(parts) > limit:
        parts = parts[: limit - 4] + ["..."] + parts[-3:]
    return "[" + ", ".join(parts) + f"] ({len(ranks)} ranks)"


def describe_fields(h: Header) -> str:
    parts = []
    for name in AGREED_FIELDS:
        value = getattr(h, name)
        if name == "dtype":
            value = format_name(value)
        elif name == "op":
            value = OPS[value].name.lower() if value in OPS else value
        elif name == "aux" and h.op != ReduceOp.BROADCAST:
            continue
        parts.append(f"{'root' if name == 'aux' else name}={value}")
    return " ".join(parts)


@dataclass
class Round:
    first: Header  # the first contribution's header: what the others must agree with
    ranks: Sequence[int]  # the ranks that contribute and receive the result: its group's, ascending
    accumulator: Optional[np.ndarray] = None
    contributed: Dict[int, Header] = field(default_factory=dict)  # rank -> header
    error: Optional[str] = None  # set once the round has failed
    answered: List[int] = field(default_factory=list)  # ranks sent an ERROR already
    adopted: Any = None  # a received frame that goes back out as the result: a broadcast root's, or the accumulator
    code: ErrorCode = ErrorCode.MISMATCH  # why the round failed, once it has
    started: float = 0.0  # monotonic time of its first contribution
    failed_at: float = 0.0  # monotonic time it failed
    held: Dict[int, Any] = field(
        default_factory=dict
    )  # deterministic mode: rank -> payload (a view of its frame or slot)
    slots: Dict[int, Tuple["Segment", int]] = field(default_factory=dict)  # rank -> (segment, slot) its result goes to
    next_position: int = 0  # deterministic mode: the position in `ranks` of the rank folded next
    owner: int = 0  # the rank whose contribution was loaded into the accumulator: it is charged for it
    in_slot: bool = False  # the accumulator is the owner's shared-memory slot, not pool memory
    #: ranks whose slots the last contribution's fold wrote the result into (an average divided first)
    copied: FrozenSet[int] = frozenset()
    #: the reducer's result slot that fold wrote the result into for `readers` (shared_results.py), if any
    result_slot: Optional[int] = None
    readers: FrozenSet[int] = frozenset()
    charged: int = 0  # accumulator bytes charged to owner's budget
    moved: bool = False  # its chunk was moved here from a lost reducer (MOVED, FINAL)
    final: Any = None  # a moved round's result as a rank brought it (FINAL): a frame, or bytes if small
    final_owner: int = 0  # the rank whose FINAL it is: its memory is charged to it

    @property
    def dtype(self) -> DType:
        return DTYPES[self.first.dtype]

    @property
    def compressed(self) -> Optional[WireFormat]:
        """Its compressed format (int8 blocks up), or None for an element type both ways."""
        return COMPRESSED.get(self.first.dtype)

    @property
    def result_nbytes(self) -> int:
        """The size of its result on the wire."""
        h, fmt = self.first, self.compressed
        if fmt is None:
            return h.count * DTYPES[h.dtype].itemsize
        return block_bytes(h.count, h.block) if fmt.down == INT8_BLOCK else h.count * ITEMSIZE[fmt.down]

    @property
    def op(self) -> ReduceOp:
        return OPS[self.first.op]

    def disagreement(self, h: Header) -> Optional[str]:
        """Why h cannot join this round, or None."""
        if h.rank in self.contributed:
            return f"rank {h.rank} contributed twice to {self.first.describe()}"
        if (h.type in MOVED_TYPES) != self.moved:
            return (
                f"rank {h.rank} sent {h.describe()} as {'not ' if self.moved else ''}moved from a lost reducer "
                f"and ranks {format_ranks(self.contributed)} did the opposite: the ranks disagree on which "
                "reducers are lost"
            )
        if _agreed(h) != _agreed(self.first):
            groups: Dict[str, List[int]] = {}
            for other in [*self.contributed.values(), h]:
                groups.setdefault(describe_fields(other), []).append(other.rank)
            detail = "; ".join(f"ranks {format_ranks(ranks)} sent {desc}" for desc, ranks in groups.items())
            first = self.first
            if (h.dtype, h.total) == (first.dtype, first.total) and (h.count, h.nchunks) != (
                first.count,
                first.nchunks,
            ):
                # The same buffer cut into other chunks: a setting differs between the ranks.
                detail += (
                    "; the ranks cut the same buffer differently: every rank must use the same "
                    "RS_CHUNK_BYTES and RS_PIPELINE_DEPTH (reduction-server run sets the depth to "
                    f"{ONE_HOST_PIPELINE_DEPTH} for its ranks, {DEFAULT_PIPELINE_DEPTH} is the default elsewhere)"
                )
            return f"contributions to {self.first.describe()} disagree: {detail}"
        if h.block != self.first.block and MSG_FINAL not in (h.type, self.first.type):
            return (
                f"contributions to {self.first.describe()} disagree: rank {h.rank} sent int8 blocks of {h.block} "
                f"elements, rank {self.first.rank} of {self.first.block}: every rank must use the same RS_INT8_BLOCK"
            )
        return None

    @property
    def world(self) -> int:
        """How many ranks contribute."""
        return len(self.ranks)

    @property
    def next_rank(self) -> int:
        """Deterministic mode: the rank folded next (-1 once all are)."""
        return self.ranks[self.next_position] if self.next_position < len(self.ranks) else -1

    def in_rank_order(self, rank: int, payload: Any) -> List[Tuple[int, Any]]:
        """Deterministic mode: the (rank, payload) pairs to fold now, in rank order (rank's own
        and the held ones after it); empty if rank's turn has not come, in which case it is held."""
        if rank != self.next_rank:
            self.held[rank] = payload
            return []
        ready = [(rank, payload)]
        self.next_position += 1
        while self.next_rank in self.held:
            ready.append((self.next_rank, self.held.pop(self.next_rank)))
            self.next_position += 1
        return ready

    @property
    def complete(self) -> bool:
        return len(self.contributed) == len(self.ranks)

    @property
    def missing(self) -> List[int]:
        return [r for r in self.ranks if r not in self.contributed]
