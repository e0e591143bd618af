"""DDP comm hooks over the reducers, for jobs that keep gloo or nccl as their process group::

state = ReductionServerHookState.from_env()
ddp.register_comm_hook(state, reduction_server_hook)          # or reduction_server_fp16_hook,
                                                               #    reduction_server_bf16_hook

and the int8 hook, with error feedback, on any process group (on the reduction_server backend,
over the group's own Communicator)::

state = ReductionServerInt8HookState.for_process_group()      # or .from_env()
ddp.register_comm_hook(state, reduction_server_int8_hook)
"""

from typing import Any, Dict, List, Optional, Tuple

import torch  # the real torch: imports are absolute
import torch.distributed as dist

from reduction_server.wire.protocol import ReduceOp

from ..communicator import Communicator
from ..compression import CompressionLike, parse
from .collectives import Collectives
from .pipeline import Pipeline, Started
from .process_group import ReductionServerProcessGroup
from .tensors import Staged


class ReductionServerHookState:
    """What the comm hooks need: a Communicator (default: from the environment) and the thread
    that completes their Futures. ``ddp.register_comm_hook(state, reduction_server_hook)``."""

    def __init__(
        self,
        communicator: Optional[Communicator] = None,
        *,
        owns_communicator: Optional[bool] = None,
        _pipeline: Optional[Pipeline] = None,
    ) -> None:
        self._pipeline = _pipeline or Pipeline.over(communicator, owns_communicator)
        self._shared = _pipeline is not None  # a process group's: it closes it
        self._collectives = Collectives(self._pipeline)
        self.communicator = self._pipeline.communicator

    @classmethod
    def from_env(cls, **options: Any) -> "ReductionServerHookState":
        """A state over Communicator.from_env(**options), which close() closes."""
        return cls(Communicator.from_env(**options), owns_communicator=True)

    @classmethod
    def for_process_group(cls, group: Any = None, **options: Any) -> "ReductionServerHookState":
        """A state over a reduction_server process group's Communicator and completing threads
        (default: the default group), so that the hook's collectives keep their place among the
        group's; the group closes them. ValueError for a group of another backend."""
        pg = dist.distributed_c10d._get_default_group() if group is None else group
        if not isinstance(pg, ReductionServerProcessGroup):  # a ProcessGroup wrapping backends
            try:
                pg = pg._get_backend(torch.device("cpu"))
            except (AttributeError, RuntimeError):
                pass
        if not isinstance(pg, ReductionServerProcessGroup):
            raise ValueError(
                f"for_process_group needs a reduction_server process group, not a {type(pg).__name__}: "
                "over another backend, use from_env()"
            )
        return cls(_pipeline=pg._pipeline, **options)

    def close(self) -> None:
        """Close the Communicator if the state created it (what is pending fails), and stop the
        completing threads after the queued Futures; nothing for a process group's."""
        if not self._shared:
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


#: a bucket's layout: its parameters (by identity, which DDP's bucket rebuild keeps) and sizes
_Layout = Tuple[Tuple[int, ...], Tuple[int, ...]]


class ReductionServerInt8HookState(ReductionServerHookState):
    """The int8 hook's state: the Communicator, the compression (`"int8"` both ways, or a pair
    such as `("int8", "bf16")`, as for Communicator.all_reduce) and, with error feedback, each
    bucket's float32 residual (4 bytes per gradient element, on the host).

    Residuals are kept by the bucket's parameters, not by GradBucket.index(), which means other
    buckets after DDP rebuilds them (after its first iteration): a bucket of a new layout takes
    each parameter's residual from the bucket that held it before, so none is lost."""

    def __init__(
        self,
        communicator: Optional[Communicator] = None,
        *,
        compression: CompressionLike = "int8",
        error_feedback: bool = True,
        **options: Any,
    ) -> None:
        how = parse(compression)
        if how is None:
            raise ValueError("the int8 hook compresses: compression='none' is reduction_server_hook")
        super().__init__(communicator, **options)
        self.compression = compression
        self.error_feedback = error_feedback
        self._residuals: Dict[_Layout, torch.Tensor] = {}

    def residual(self, bucket: dist.GradBucket) -> Optional[torch.Tensor]:
        """What compressing the bucket's last contribution lost (None before its first, or
        without error feedback), laid out as its buffer."""
        return self._residuals.get(_layout(bucket))

    def _residual_for(self, bucket: dist.GradBucket) -> torch.Tensor:
        layout = _layout(bucket)
        residual = self._residuals.get(layout)
        if residual is None:
            residual = self._residuals[layout] = self._carried(layout)
        return residual

    def _carried(self, layout: _Layout) -> torch.Tensor:
        """A new layout's residual: each parameter's part taken from the old layout that held it,
        and an old layout dropped once all its parameters have moved (zeros for the first)."""
        residual = torch.zeros(sum(layout[1]), dtype=torch.float32)
        pieces = dict(zip(layout[0], torch.split(residual, list(layout[1]))))
        for old in [k for k in self._residuals if not set(k[0]).isdisjoint(pieces)]:
            kept = False
            for param, part in zip(old[0], torch.split(self._residuals[old], list(old[1]))):
                if param in pieces:
                    pieces[param].copy_(part)
                else:
                    kept = True
            if not kept:
                del self._residuals[old]
        return residual


def _layout(bucket: dist.GradBucket) -> _Layout:
    params: List[torch.Tensor] = bucket.parameters()
    return tuple(id(p) for p in params), tuple(p.numel() for p in params)


def reduction_server_int8_hook(
    state: ReductionServerInt8HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's allreduce hook with the bucket sent as int8 blocks (about a quarter of the bytes;
    the reducers decode each rank's into float32, average, and encode the result once), each
    rank's residual added to its next contribution (error feedback, EF-SGD)."""
    buffer = bucket.buffer()
    residual = state._residual_for(bucket) if state.error_feedback else None
    return compressed_all_reduce(state, buffer, ReduceOp.AVG, state.compression, residual, "DDP bucket")


def compressed_all_reduce(
    state: ReductionServerHookState,
    tensor: torch.Tensor,
    op: ReduceOp,
    compression: CompressionLike,
    residual: Optional[torch.Tensor],
    what: str,
) -> torch.futures.Future[torch.Tensor]:
    """`tensor` all-reduced in place (SUM or AVG) in its place among the state's collectives, sent
    compressed, with `residual` (float32, laid out as `tensor`, or None) added first and then set
    to what compressing this rank's values lost (error feedback); the Future's value is `tensor`."""

    def start() -> Started:
        staged = Staged(tensor, what)
        host = staged.host
        # corrected in float32: in place when the tensor is float32 (its result overwrites it)
        values = host if residual is None or host.dtype == torch.float32 else host.float()
        if residual is not None:
            values.add_(residual)
        comm = state._collectives.comm
        handle = comm.all_reduce_async(values, op, values, compression=compression, residual=residual)

        def finish() -> torch.Tensor:
            if values is not host:
                host.copy_(values)
            staged.finish()
            return tensor

        return [handle], finish

    return state._collectives.submit(start, [tensor])
