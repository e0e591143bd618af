"""Tensor fusion: small tensors are packed into buckets of up to the fusion threshold, and each
bucket is all-reduced as one collective as soon as all its tensors are ready.

The plan depends only on the list of tensors (names, shapes, dtypes, in order) and the
threshold, never on timing, so every rank builds the same buckets. The first use of a plan
checks that every rank did, and names the ranks that did not.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from reduction_server.config import settings
from reduction_server.errors import CollectiveError, ConfigError
from reduction_server.wire.protocol import DType, ReduceOp

from .buffers import WireBuffer, wire_view
from .communicator import Communicator, Handle
from .timeline import Timeline, Trace


def fusion_threshold(environ: Optional[Mapping[str, str]] = None) -> int:
    """Bytes per bucket: RS_FUSION_THRESHOLD, else HOROVOD_FUSION_THRESHOLD, else 64 MiB.
    0 turns fusion off (one bucket per tensor), as in Horovod."""
    return settings.first_set(("RS_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"), environ)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a fusion plan: its name, shape and wire dtype."""

    name: str
    shape: Tuple[int, ...]
    dtype: DType

    @property
    def count(self) -> int:
        """Its number of elements (the product of its shape)."""
        return math.prod(self.shape)  # per tensor per step: np.prod costs ~10 us

    @property
    def nbytes(self) -> int:
        """Its size in bytes on the wire."""
        return self.count * self.dtype.itemsize

    def describe(self) -> str:
        """`name[shape]:dtype`, as error messages and the plan's fingerprint spell it."""
        return f"{self.name}{list(self.shape)}:{self.dtype.name.lower()}"


@dataclass
class Bucket:
    """One fused buffer of a plan: its tensors (all of one dtype), each one's element offset in
    it, and its total element count."""

    index: int
    dtype: DType
    specs: List[TensorSpec] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)  # element offset of each tensor
    count: int = 0


class FusionPlan:
    """Buckets for a list of tensors: consecutive tensors of one dtype, up to `threshold` bytes
    each (a tensor larger than the threshold gets a bucket of its own)."""

    def __init__(self, specs: Sequence[TensorSpec], threshold: Optional[int] = None) -> None:
        self.threshold = fusion_threshold() if threshold is None else threshold
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"tensor names must be unique within a fusion plan; repeated: {dupes}")
        self.specs = list(specs)
        self.buckets: List[Bucket] = []
        self._where: Dict[str, Tuple[int, int]] = {}  # name -> (bucket, position in it)
        for spec in self.specs:
            last = self.buckets[-1] if self.buckets else None
            if (
                last is None
                or last.dtype is not spec.dtype
                or (last.count + spec.count) * spec.dtype.itemsize > self.threshold
            ):
                last = Bucket(len(self.buckets), spec.dtype)
                self.buckets.append(last)
            self._where[spec.name] = (last.index, len(last.specs))
            last.specs.append(spec)
            last.offsets.append(last.count)
            last.count += spec.count
        text = f"{self.threshold}|" + "|".join(s.describe() for s in self.specs)
        self.fingerprint = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1

    def locate(self, name: str) -> Tuple[Bucket, int]:
        """The bucket holding `name` and the tensor's position in it."""
        try:
            b, i = self._where[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in this fusion plan") from None
        return self.buckets[b], i

    def summary(self) -> str:
        """The plan in one line (tensors, bytes, buckets, threshold), for error messages."""
        return (
            f"{len(self.specs)} tensors, {sum(s.nbytes for s in self.specs)} bytes, "
            f"{len(self.buckets)} buckets, threshold {self.threshold}"
        )


class FusedAllReduce:
    """One step of fused all-reduces over a plan: feed tensors with `ready()` in any order; a
    bucket starts as soon as its last tensor arrives; `wait()` returns the reduced tensors."""

    def __init__(self, comm: Communicator, plan: FusionPlan, op: Any = "sum", verified: bool = False) -> None:
        self.comm = comm
        self.plan = plan
        self.op = ReduceOp.parse(op)
        if not verified:
            verify_plan(comm, plan)
        # Bucket memory in the wire dtype's storage (bfloat16 as its uint16 bits).
        self._buffers = [np.empty(b.count, b.dtype.storage) for b in plan.buckets]
        self._bytes = [memoryview(buf.view(np.uint8)) for buf in self._buffers]
        self._missing = [len(b.specs) for b in plan.buckets]
        self._handles: List[Optional[Handle]] = [None] * len(plan.buckets)
        self._seen: set = set()
        self._traces: List[Optional[Trace]] = [None] * len(plan.buckets)

    def ready(self, name: str, tensor: Any) -> None:
        """Copy `tensor` (an array, buffer or CPU tensor of the planned size and dtype) into its
        bucket; the bucket's all-reduce starts when this was its last tensor."""
        bucket, i = self.plan.locate(name)
        spec = bucket.specs[i]
        if name in self._seen:
            raise ValueError(f"tensor {name!r} was already given in this step")
        src = wire_view(tensor, what=f"tensor {name!r}")
        if (src.dtype, src.count) != (spec.dtype, spec.count):
            raise ValueError(f"tensor {name!r} holds {src.describe()}, the plan says {spec.describe()}")
        size = spec.dtype.itemsize
        start = bucket.offsets[i] * size
        timeline = self.comm._engine.timeline  # read once: hvd.stop_timeline() may clear it meanwhile
        trace = self._bucket_trace(bucket, timeline) if timeline is not None else None
        copy_started = time.perf_counter() if trace is not None else 0.0
        self._bytes[bucket.index][start : start + len(src.data)] = src.data
        if trace is not None:
            trace.copied(copy_started)
        self._seen.add(name)
        self._missing[bucket.index] -= 1
        if self._missing[bucket.index] == 0:
            wire = WireBuffer(bucket.dtype, bucket.count, self._bytes[bucket.index])
            self._handles[bucket.index] = self.comm._start(
                wire, wire, self.op, 0, None, trace=self._traces[bucket.index]
            )

    def _bucket_trace(self, bucket: Bucket, timeline: Timeline) -> Trace:
        """The bucket's timeline record, begun at its first tensor: named after its tensors."""
        trace = self._traces[bucket.index]
        if trace is None:
            trace = self._traces[bucket.index] = timeline.begin_tensors(
                f"bucket {bucket.index}: ", [s.name for s in bucket.specs], {"bucket": bucket.index}
            )
        return trace

    def started(self) -> List[int]:
        """Indices of the buckets whose all-reduce has been launched."""
        return [i for i, h in enumerate(self._handles) if h is not None]

    def wait(self) -> Dict[str, np.ndarray]:
        """Every tensor's reduced value, as views of the bucket buffers, by name (bfloat16 as
        its uint16 bits)."""
        missing = [s.name for s in self.plan.specs if s.name not in self._seen]
        if missing:
            raise ValueError(
                f"wait() before every tensor was given; missing: {missing[:8]}"
                + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            )
        out = {}
        for bucket, handle, buf in zip(self.plan.buckets, self._handles, self._buffers):
            handle.wait()
            for spec, start in zip(bucket.specs, bucket.offsets):
                out[spec.name] = buf[start : start + spec.count].reshape(spec.shape)
        return out


def verify_plan(comm: Communicator, plan: FusionPlan) -> None:
    """Check that every rank built the same plan; the error names the ranks that differ.

    Each rank puts its plan's fingerprint and size at its own row of a zero table and the table
    is summed: every rank then holds every rank's row (exact, for integers)."""
    table = np.zeros((comm.world_size, 3), np.int64)
    table[comm.rank] = (plan.fingerprint, len(plan.specs), sum(s.nbytes for s in plan.specs))
    comm.all_reduce(table, op="sum", out=table)
    differ = [r for r in range(comm.world_size) if table[r, 0] != table[0, 0]]
    if differ:
        rows = "; ".join(f"rank {r}: {table[r, 1]} tensors, {table[r, 2]} bytes" for r in [0, *differ])
        raise CollectiveError(
            f"rank {comm.rank}: ranks {differ} built a different fusion plan than rank 0 (their tensor "
            f"lists or fusion thresholds differ: names, shapes, dtypes and order must match on every "
            f"rank). {rows}. This rank's plan: {plan.summary()}"
        )
