"""FSDP2's gradient communication sent compressed through the reducers, where torch lets a
backend choose (issue 41): a reduce-scatter for ``FSDPModule.set_custom_reduce_scatter`` and a
hook for ``set_all_reduce_hook`` (the replicate all-reduce of an HSDP that the job does itself)::

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compress_reduce_scatter(model)            # every FSDP module: int8 blocks, error feedback

    # HSDP by hand: FSDP over the shard dimension, the replicas averaged by the hook
    fully_shard(model, mesh=mesh["shard"])
    model.set_all_reduce_hook(ReductionServerInt8AllReduce(mesh["replicate"].get_group()))

Both work on the reduction_server process groups FSDP is given. The reduce-scatter all-reduces
each rank's whole gradient input, as this backend's reduce_scatter_tensor does, and keeps the
rank's shard. Error feedback keeps a float32 residual of what it compresses per module (the
whole unsharded gradient for the reduce-scatter: 4 bytes a parameter on the host, more than the
shard FSDP keeps), so memory-bound jobs pass ``error_feedback=False``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from reduction_server.wire.protocol import ReduceOp

from ..compression import CompressionLike, parse
from .hooks import ReductionServerHookState, compressed_all_reduce
from .tensors import reduction


class _Compressed:
    """A compression and, with error feedback, the residual of what one caller compresses."""

    def __init__(self, compression: CompressionLike, error_feedback: bool) -> None:
        if parse(compression) is None:
            raise ValueError("compression='none' sends float32: use FSDP's own communication")
        self.compression = compression
        self.error_feedback = error_feedback
        self._residual: Optional[torch.Tensor] = None
        self._state: Optional[ReductionServerHookState] = None

    def residual(self) -> Optional[torch.Tensor]:
        """What compressing the last contribution lost (None before the first, or without error feedback)."""
        return self._residual

    def _all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup, op: Any, what: str) -> None:
        """`tensor` all-reduced in place over `group`, compressed; blocks until done."""
        if self._state is None:  # FSDP hands one module's communication the same group every time
            self._state = ReductionServerHookState.for_process_group(group)
        wire_op, factor = reduction(op)
        if wire_op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise ValueError(f"{what} sends {self.compression!r}: it sums or averages, not {wire_op.name}")
        if factor is not None:
            tensor.mul_(factor)
        residual = None
        if self.error_feedback:
            if self._residual is None or self._residual.numel() != tensor.numel():
                self._residual = torch.zeros(tensor.numel(), dtype=torch.float32)
            residual = self._residual
        compressed_all_reduce(self._state, tensor, wire_op, self.compression, residual, what).wait()


class ReductionServerInt8ReduceScatter(_Compressed):
    """FSDP2's reduce-scatter (torch's ReduceScatter interface: ``allocate`` and the call) with
    every rank's gradients sent as int8 blocks (or `compression`), error feedback on by default.
    One instance per FSDP module: ``compress_reduce_scatter`` sets them."""

    def __init__(self, compression: CompressionLike = "int8", *, error_feedback: bool = True) -> None:
        super().__init__(compression, error_feedback)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The reduce-scatter's output buffer: a plain tensor."""
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        """Reduce `input_tensor` over `group` and write this rank's shard into `output_tensor`
        (done when this returns, whatever `async_op` asks)."""
        flat = input_tensor.reshape(-1)
        self._all_reduce(flat, group, op, "FSDP's reduce-scatter")
        shard = output_tensor.numel()
        output_tensor.reshape(-1).copy_(flat.narrow(0, group.rank() * shard, shard))


class ReductionServerInt8AllReduce(_Compressed):
    """A hook for ``FSDPModule.set_all_reduce_hook``: the reduce-scatter's output averaged over
    `group` (the replicas of an HSDP that the job runs itself), sent as int8 blocks (or
    `compression`), error feedback on by default. One instance per FSDP module."""

    def __init__(
        self, group: dist.ProcessGroup, compression: CompressionLike = "int8", *, error_feedback: bool = True
    ) -> None:
        super().__init__(compression, error_feedback)
        self.group = group

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self._all_reduce(reduce_output.reshape(-1), self.group, dist.ReduceOp.AVG, "the replicas' all-reduce")


def compress_reduce_scatter(
    model: nn.Module, compression: CompressionLike = "int8", *, error_feedback: bool = True
) -> List[ReductionServerInt8ReduceScatter]:
    """Give every FSDP2 module in `model` (fully_shard) its own ReductionServerInt8ReduceScatter;
    those set, in the order of model.modules(). ValueError where there is no FSDP module, or where
    this torch has no custom reduce-scatter."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("no FSDP2 module (fully_shard) in the model: shard it first")
    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise ValueError(f"torch {torch.__version__} has no FSDPModule.set_custom_reduce_scatter")
    comms = [ReductionServerInt8ReduceScatter(compression, error_feedback=error_feedback) for _ in modules]
    for module, comm in zip(modules, comms):
        module.set_custom_reduce_scatter(comm)
    return comms
