"""Horovod's hvd.SyncBatchNorm: batch normalization whose batch statistics span every rank.

    bn = hvd.SyncBatchNorm(num_features=64)      # in place of torch.nn.BatchNorm1d/2d/3d

In training mode with more than one rank, each rank computes its batch's per-channel count, mean
and inverse standard deviation; the three are all-gathered and combined into the statistics of
the whole (concatenated) batch, which normalize every rank's slice and update the running
mean/var exactly as one torch BatchNorm over the whole batch would. The backward pass all-reduces
(sums) the two per-channel sums the input gradient needs, sum(dy) and sum(dy * (x - mean)). The
weight and bias gradients stay local, as in Horovod: DistributedOptimizer all-reduces them with
the other parameters' gradients.

In eval mode (with running stats) or on one rank it is plain torch BatchNorm. Every rank must call
forward (and backward) of its SyncBatchNorm layers in the same order: each call is a collective.

Horovod runs torch's fused kernels (torch.batch_norm_stats, batch_norm_gather_stats_with_counts,
batch_norm_elemt, batch_norm_backward_reduce, batch_norm_backward_elemt) and accepts CUDA tensors
only. Those kernels have no CPU implementation in torch (2.13 included), so CUDA tensors go
through them and CPU tensors through the same arithmetic in plain tensor ops.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch  # the real torch: absolute import
import torch.nn.functional as F
from torch.autograd.function import Function, FunctionCtx
from torch.nn.modules.batchnorm import _BatchNorm

from ..basics import size
from ..ops import Sum
from ..process_sets import ProcessSet, global_process_set
from .mpi_ops import allgather_async, allreduce_async, synchronize

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over (N, C, ...) inputs with statistics synchronized across ranks.

    Arguments are torch.nn.BatchNorm2d's:
        num_features: the number of channels C of the (N, C, ...) input.
        eps: added to the variance for numerical stability.
        momentum: the running stats' update factor; None for a cumulative moving average.
        affine: whether the layer has a learnable per-channel weight and bias.
        track_running_stats: whether to keep running mean/var (used in eval mode); without them
            the batch statistics are used in eval mode too (synchronized, as in Horovod).
        process_set: the ranks whose batches share statistics (each set's ranks call forward
            together); the global set, every rank, by default.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: Optional[ProcessSet] = global_process_set,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _set_size(self) -> int:
        """How many ranks share the statistics."""
        if self.process_set is None or self.process_set is global_process_set:
            return size()  # known from hvd.init(), whatever the global set holds yet
        members = self.process_set.size()
        if members is None:
            raise ValueError(f"{self.process_set} has not been added: call hvd.add_process_set() on every rank first")
        return members

    def _check_input_dim(self, input: torch.Tensor) -> None:
        # Any (N, C, ...) shape: one class serves for BatchNorm1d, 2d and 3d.
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        # The bookkeeping of torch's _BatchNorm.forward, so running stats move exactly as torch's.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        # Running stats are updated only when training and tracking; otherwise used (eval) or absent.
        running_mean = self.running_mean if not self.training or self.track_running_stats else None
        running_var = self.running_var if not self.training or self.track_running_stats else None
        if not use_batch_stats or self._set_size() == 1:
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, use_batch_stats, factor, self.eps
            )
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, self.process_set
        )


def _reduce_dims(x: torch.Tensor) -> List[int]:
    """Every dimension but the channels' (1)."""
    return [0] + list(range(2, x.dim()))


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A (C,) tensor shaped to broadcast against x's (N, C, ...)."""
    return v.view([1, -1] + [1] * (x.dim() - 2))


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    # Sums in float32 at least, as the CUDA kernels accumulate half and bfloat16 inputs.
    return torch.promote_types(x.dtype, torch.float32)


def _fused(x: torch.Tensor) -> bool:
    """Whether torch's fused kernels take `x`: CUDA only, and not an empty batch."""
    return x.is_cuda and x.numel() > 0


_Stats = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _gather_stats(x: torch.Tensor, eps: float, process_set: Optional[ProcessSet]) -> _Stats:
    """This rank's per-channel mean and invstd gathered with its element count per channel from
    every rank: (counts (W,), means (W, C), invstds (W, C)), ranks whose batch is empty left out."""
    count = torch.tensor(
        [[x.numel() // x.size(1)]], dtype=torch.int64, device="cpu"
    )  # int64: no rounding of big batches
    if x.numel() == 0:  # no statistics of its own; its count of 0 has it left out below
        mean = torch.zeros(x.size(1), dtype=_acc_dtype(x), device=x.device)
        invstd = torch.ones_like(mean)
    elif x.is_cuda:
        mean, invstd = torch.batch_norm_stats(x, eps)
    else:
        xf = x.to(_acc_dtype(x))
        var, mean = torch.var_mean(xf, dim=_reduce_dims(x), correction=0)
        invstd = torch.rsqrt(var + eps)
    # Started together so that one negotiation cycle can carry all three.
    handles = [
        allgather_async(count, name="sync_batch_norm.count", process_set=process_set),
        allgather_async(mean.unsqueeze(0), name="sync_batch_norm.mean", process_set=process_set),
        allgather_async(invstd.unsqueeze(0), name="sync_batch_norm.invstd", process_set=process_set),
    ]
    counts, means, invstds = (synchronize(h) for h in handles)
    counts = counts.view(-1).to(x.device)
    keep = counts > 0  # an empty batch's mean and invstd are placeholders
    return counts[keep], means[keep], invstds[keep]


def _combine_stats(
    x: torch.Tensor,
    counts: torch.Tensor,
    means: torch.Tensor,
    invstds: torch.Tensor,
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    factor: float,
    eps: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The whole batch's mean and invstd from every rank's; running stats updated in place (the
    unbiased variance, as torch's BatchNorm)."""
    total = int(counts.sum())
    if total <= 1:  # torch's BatchNorm refuses it too; every rank sees the same total and raises
        raise ValueError(f"Expected more than 1 value per channel when training, got {total} over all ranks")
    if x.is_cuda:
        weights = counts.to(means.dtype if running_mean is None else running_mean.dtype)  # as torch's SyncBatchNorm
        return torch.batch_norm_gather_stats_with_counts(
            x, means, invstds, running_mean, running_var, factor, eps, weights
        )
    w = counts.to(means.dtype).unsqueeze(1)  # (W, 1)
    mean = (w * means).sum(0) / total
    # Each rank's biased variance from its invstd, then the parallel-variance formula.
    var = (w * (invstds.pow(-2) - eps + (means - mean).pow(2))).sum(0) / total
    if running_mean is not None:
        running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
    if running_var is not None:
        running_var.mul_(1 - factor).add_((var * total / (total - 1)).to(running_var.dtype), alpha=factor)
    return mean, torch.rsqrt(var + eps)


class _SyncBatchNormFunction(Function):
    """Forward: normalize with the statistics of all ranks' batches. Backward: the input
    gradient with sum(dy) and sum(dy * (x - mean)) summed over all ranks."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        input: torch.Tensor,
        weight: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
        running_mean: Optional[torch.Tensor],
        running_var: Optional[torch.Tensor],
        eps: float,
        factor: float,
        process_set: Optional[ProcessSet],
    ) -> torch.Tensor:
        x = input.contiguous()
        counts, means, invstds = _gather_stats(x, eps, process_set)
        mean, invstd = _combine_stats(x, counts, means, invstds, running_mean, running_var, factor, eps)
        ctx.save_for_backward(x, weight, mean, invstd, counts)
        ctx.process_set = process_set
        if _fused(x):
            return torch.batch_norm_elemt(x, weight, bias, mean, invstd, eps)
        scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
        shift = -mean * scale if bias is None else bias.to(invstd.dtype) - mean * scale
        return (x * _per_channel(scale, x) + _per_channel(shift, x)).to(x.dtype)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        x, weight, mean, invstd, counts = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        dy = grad_output.contiguous()
        fused = _fused(x)
        # This rank's sums; grad_weight and grad_bias are this rank's share (summed by the optimizer).
        if fused:
            sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
                dy, x, mean, invstd, weight, need_input, need_weight, need_bias
            )
        else:
            dims = _reduce_dims(x)
            dyf = dy.to(invstd.dtype)
            xmu = x.to(invstd.dtype) - _per_channel(mean, x)
            sum_dy, sum_dy_xmu = dyf.sum(dims), (dyf * xmu).sum(dims)
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None and need_weight else None
            grad_bias = sum_dy.to(weight.dtype) if weight is not None and need_bias else None
        grad_input = None
        if need_input:
            # x's gradient depends on every element of the whole batch through its mean and
            # variance: these two per-channel sums over all ranks are all it needs of the others.
            handles = [
                allreduce_async(sum_dy, name="sync_batch_norm.sum_dy", op=Sum, process_set=ctx.process_set),
                allreduce_async(sum_dy_xmu, name="sync_batch_norm.sum_dy_xmu", op=Sum, process_set=ctx.process_set),
            ]
            sum_dy, sum_dy_xmu = (synchronize(h) for h in handles)
            if fused:
                # This kernel takes the weight in the statistics' dtype (as torch's SyncBatchNorm casts it).
                w = weight if weight is None else weight.to(mean.dtype)
                grad_input = torch.batch_norm_backward_elemt(
                    dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, counts.to(torch.int32)
                )
            else:
                total = float(counts.sum())
                scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
                grad_input = (
                    (dyf - _per_channel(sum_dy / total, x) - xmu * _per_channel(invstd.pow(2) * sum_dy_xmu / total, x))
                    * _per_channel(scale, x)
                ).to(x.dtype)
        if weight is None or not need_weight:
            grad_weight = None
        if weight is None or not need_bias:
            grad_bias = None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
