"""DDP comm hooks over the reducers, for jobs that keep gloo or nccl as their process group::

state = ReductionServerHookState.from_env()
ddp.register_comm_hook(state, reduction_server_hook)          # or reduction_server_fp16_hook,
                                                               #    reduction_server_bf16_hook
"""

from typing import Any, Optional

import torch  # the real torch: imports are absolute
import torch.distributed as dist

from reduction_server.wire.protocol import ReduceOp

from ..communicator import Communicator
from .collectives import Collectives
from .pipeline import Pipeline


class ReductionServerHookState:
    """What the comm hooks need: a Communicator (default: from the environment) and the thread
    that completes their Futures. ``ddp.register_comm_hook(state, reduction_server_hook)``."""

    def __init__(
        self, communicator: Optional[Communicator] = None, *, owns_communicator: Optional[bool] = None
    ) -> None:
        self._pipeline = Pipeline.over(communicator, owns_communicator)
        self._collectives = Collectives(self._pipeline)
        self.communicator = self._pipeline.communicator

    @classmethod
    def from_env(cls, **options: Any) -> "ReductionServerHookState":
        """A state over Communicator.from_env(**options), which close() closes."""
        return cls(Communicator.from_env(**options), owns_communicator=True)

    def close(self) -> None:
        """Close the Communicator if the state created it (what is pending fails), and stop the
        completing thread after the queued Futures."""
        self._pipeline.close()


def reduction_server_hook(
    state: ReductionServerHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's allreduce hook through the reducers: the bucket's gradients averaged over the ranks
    (divided by the world size, then summed, as DDP's default does)."""
    tensor = bucket.buffer()
    tensor.div_(state.communicator.world_size)
    return state._collectives.all_reduce([tensor], ReduceOp.SUM, value=tensor)


def _compressed_hook(state: ReductionServerHookState, bucket: dist.GradBucket, dtype: torch.dtype):
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(state.communicator.world_size)

    def decompress(done: torch.futures.Future) -> torch.Tensor:
        done.value()  # the collective's error, if it failed
        with torch.no_grad():
            buffer.copy_(compressed)
        return buffer

    return state._collectives.all_reduce([compressed], ReduceOp.SUM).then(decompress)


def reduction_server_fp16_hook(
    state: ReductionServerHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """reduction_server_hook with the bucket sent as float16 (half the bytes; the reducers sum in
    float32 and round once)."""
    return _compressed_hook(state, bucket, torch.float16)


def reduction_server_bf16_hook(
    state: ReductionServerHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """reduction_server_hook with the bucket sent as bfloat16."""
    return _compressed_hook(state, bucket, torch.bfloat16)
