"""What a rank asks for in a named collective: the Request every rank learns of it, the
Submission this rank keeps (its buffers and Future), and whether the ranks' requests agree."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from reduction_server.wire.protocol import DType, ReduceOp

from ..buffers import WireBuffer

ALLREDUCE, ALLGATHER, BROADCAST = "allreduce", "allgather", "broadcast"
REDUCESCATTER, ALLTOALL, BARRIER = "reducescatter", "alltoall", "barrier"
#: every barrier's name: a rank has one barrier at a time, and a rank that skipped one (a failed
#: step) still meets the others at the next, where numbered names would never match again
BARRIER_NAME = "barrier"
#: kinds whose data is summed (fused together when consecutive, of one dtype and op)
REDUCING = (ALLREDUCE, REDUCESCATTER)
#: kinds whose first dimension may differ across ranks
RAGGED = (ALLGATHER, ALLTOALL)


@dataclass(frozen=True)
class Request:
    """What every rank learns about one rank's submission."""

    name: str
    kind: str
    dtype: DType
    shape: Tuple[int, ...]
    op: ReduceOp = ReduceOp.SUM
    root: int = 0
    type_name: str = ""  # the framework's name for the dtype (torch.bool travels as uint8)
    splits: Tuple[int, ...] = ()  # alltoall: rows of the first dimension for each rank, in rank order
    compression: str = ""  # an allreduce's format on the wire ("int8"), "" for the tensor's own

    def encode(self) -> list:
        """The request as a JSON-able list, as it travels in the negotiation (decode() reverses it)."""
        return [
            self.name,
            self.kind,
            int(self.dtype),
            list(self.shape),
            int(self.op),
            self.root,
            self.type_name,
            list(self.splits),
            self.compression,
        ]

    @classmethod
    def decode(cls, item: list) -> "Request":
        """The Request an encode() list describes."""
        name, kind, dtype, shape, op, root, type_name, splits, compression = item
        return cls(name, kind, DType(dtype), tuple(shape), ReduceOp(op), root, type_name, tuple(splits), compression)

    @property
    def rows(self) -> int:
        """The length of its first dimension (1 for a scalar)."""
        return self.shape[0] if self.shape else 1

    @property
    def count(self) -> int:
        """Its number of elements (the product of its shape)."""
        return math.prod(self.shape)

    def describe(self) -> str:
        """The request in words for error messages, e.g. "allreduce of [2, 3] float32 op sum"."""
        text = f"{self.kind} of {list(self.shape)} {self.type_name or self.dtype.name.lower()}"
        if self.kind in REDUCING:
            text += f" op {self.op.name.lower()}"
        if self.kind == BROADCAST:
            text += f" from root {self.root}"
        return text


@dataclass
class Submission:
    """This rank's side of a submission: its buffers and the Future its caller waits on."""

    request: Request
    send: Optional[WireBuffer]
    out: Optional[WireBuffer]
    residual: Optional[np.ndarray] = None  # float32: gets what compressing `send` lost (error feedback)
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)


def disagreement(name: str, requests: Mapping[int, Request]) -> Optional[str]:
    """None when every rank's request for `name` is compatible, else the message naming them."""
    first = requests[min(requests)]
    for what, key in (
        ("kind", lambda r: r.kind),
        ("dtype", lambda r: r.type_name or r.dtype.name.lower()),
        ("op", lambda r: r.op.name.lower() if r.kind in REDUCING else ""),
        ("compression", lambda r: r.compression or "none"),
        ("root", lambda r: r.root if r.kind == BROADCAST else 0),
        ("shape", lambda r: list(r.shape[1:]) if r.kind in RAGGED else list(r.shape)),
        ("rank", lambda r: len(r.shape) if r.kind in RAGGED else 0),
    ):
        values: Dict[str, List[int]] = {}
        for rank in sorted(requests):
            values.setdefault(str(key(requests[rank])), []).append(rank)
        if len(values) > 1:
            shown = "; ".join(f"ranks {ranks}: {value}" for value, ranks in values.items())
            what = "shape (beyond the first dimension)" if what == "shape" and first.kind in RAGGED else what
            what = "number of dimensions" if what == "rank" else what
            return f"tensor {name!r}: ranks disagree on its {what}: {shown}"
    return None


def name_counter(prefix: str) -> Callable[[], str]:
    """Horovod's automatic names ("allreduce.noname.7"): the same sequence on every rank that
    makes the same unnamed calls in the same order."""
    counter = iter(range(1 << 62))
    lock = threading.Lock()

    def next_name() -> str:
        with lock:
            return f"{prefix}.noname.{next(counter)}"

    return next_name
