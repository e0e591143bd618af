"""A training step: the gradient's buckets all-reduced as the backward pass makes them, and the
optimizer after the last one.

The backward pass takes BACKWARD_SHARE of the step's compute (backward costs about twice the
forward's FLOPs) and makes the gradient at an even rate, last layers first; a bucket (DDP's
`bucket_cap_mb`, its first bucket smaller; Horovod's fusion threshold) is ready once its last
element is. Buckets go out in that order, one after another:

- through the pool they follow each other into the engine's one pipeline: a bucket's transfer
  starts when it is ready and the previous transfer is done, and its lag (pool_model.Timing)
  overlaps what follows, so a step pays the lag once, not once a bucket (bench/RESULTS.md,
  "DDP training");
- through a ring (Gloo runs one collective at a time) each bucket takes its whole time.

The step ends when the compute and the last bucket's all-reduce are both done, plus the
optimizer's time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Tuple

from ..errors import ConfigError
from .pool_model import Timing

#: the backward pass's share of forward + backward compute (2 of 3 FLOPs)
BACKWARD_SHARE = 2 / 3
#: DDP's default bucket_cap_mb (25 MiB) and its first bucket (torch.distributed's 1 MiB)
DDP_BUCKET_BYTES = 25 * (1 << 20)
DDP_FIRST_BUCKET_BYTES = 1 << 20


@dataclass(frozen=True)
class StepShape:
    """A step's compute and its gradient's buckets, in float32 bytes of gradient."""

    compute_s: float
    gradient_bytes: float
    bucket_bytes: float = DDP_BUCKET_BYTES
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES
    optimizer_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in (("--step-compute-ms", self.compute_s), ("--optimizer-ms", self.optimizer_s)):
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be 0 or more, got {value * 1e3:g}")
        if not self.bucket_bytes > 0 or not self.first_bucket_bytes > 0:
            raise ConfigError(f"--bucket-mib must be positive, got {self.bucket_bytes / (1 << 20):g}")

    def buckets(self) -> List[Tuple[float, int]]:
        """(bucket bytes, how many in a row), in the order they are ready."""
        first = min(self.first_bucket_bytes, self.gradient_bytes)
        full, tail = divmod(self.gradient_bytes - first, self.bucket_bytes)
        runs = [(first, 1), (self.bucket_bytes, int(full)), (tail, 1 if tail > 0 else 0)]
        return [(size, count) for size, count in runs if count]


def step_time(shape: StepShape, allreduce: Callable[[float], Timing], pipelined: bool) -> float:
    """The step's seconds with each bucket all-reduced by `allreduce(bytes)`; `pipelined`: the
    pool's (lags overlap), else one collective at a time (a ring)."""
    forward = shape.compute_s * (1 - BACKWARD_SHARE)
    per_byte = shape.compute_s * BACKWARD_SHARE / shape.gradient_bytes  # backward seconds a byte
    free = 0.0  # when the pipeline (the ring: the last collective) is free again
    finished = 0.0  # when the last all-reduce so far is complete
    made = 0.0
    for size, count in shape.buckets():
        timing = allreduce(size)
        busy = timing.transfer_s if pipelined else timing.seconds
        first_ready = forward + (made + size) * per_byte
        made += size * count
        # k buckets ready every `size x per_byte` from first_ready, each busy `busy` after the
        # later of its readiness and the one before: the last ends at the latest of the three
        # (the pipeline's backlog, the first's readiness, the last's readiness), each plus the
        # busy time of the buckets from there on
        last_ready = first_ready + (count - 1) * size * per_byte
        free = max(free + count * busy, first_ready + count * busy, last_ready + busy)
        finished = max(finished, free + (timing.lag_s if pipelined else 0.0))
    return max(shape.compute_s, finished) + shape.optimizer_s
