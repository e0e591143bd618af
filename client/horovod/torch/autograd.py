"""Horovod's differentiable collectives: allreduce, allgather, broadcast, alltoall and
reducescatter (alone and grouped) return new tensors and carry gradients back through the
collective, with the backward passes Horovod defines:

- allreduce: the gradient all-reduced with the same op and scale factors;
- allgather: the gradient averaged over the ranks, each rank's own rows of it;
- broadcast: the gradient averaged over the ranks on the root, zero elsewhere;
- alltoall: the gradient sent back where its rows came from;
- reducescatter: the gradient (scaled as the forward was) gathered from every rank.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch  # the real torch: absolute import

from ..compression import Compression, cast_only
from ..ops import Average, Sum
from ..process_sets import ProcessSet, global_process_set
from .mpi_ops import (
    allgather_async,
    allreduce_async,
    alltoall_async,
    broadcast_async,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_reducescatter_async,
    reducescatter_async,
    synchronize,
)


def _own_rows(grads: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    """This rank's rows of an allgather's gradient (every rank's row counts gathered first)."""
    counts = allgather(torch.tensor([rows], dtype=torch.int64, device="cpu"), process_set=process_set)
    offset = int(counts[: process_set.rank()].sum())
    return grads.narrow(0, offset, rows)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        average: Optional[bool],
        name: Optional[str],
        op: Optional[int],
        prescale: float,
        postscale: float,
        process_set: ProcessSet,
        compression: Any,
    ) -> torch.Tensor:
        ctx.args = (average, op, prescale, postscale, process_set)
        return synchronize(
            allreduce_async(tensor, average, name, op, prescale, postscale, process_set, compression=compression)
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        average, op, prescale, postscale, process_set = ctx.args
        return (
            allreduce(
                grad, average, op=op, prescale_factor=prescale, postscale_factor=postscale, process_set=process_set
            ),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def allreduce(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """The reduction of `tensor` over all ranks (Average by default), as a new tensor
    (compressed on the wire); differentiable."""
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(
        compressed, average, name, op, prescale_factor, postscale_factor, process_set, compression
    )
    return compression.decompress(reduced, ctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        average: Optional[bool],
        name: Optional[str],
        op: Optional[int],
        prescale: float,
        postscale: float,
        process_set: ProcessSet,
        compression: Any,
        *tensors: torch.Tensor,
    ) -> tuple:
        ctx.args = (average, op, prescale, postscale, process_set)
        return tuple(
            synchronize(
                grouped_allreduce_async(
                    tensors, average, name, op, prescale, postscale, process_set, compression=compression
                )
            )
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        average, op, prescale, postscale, process_set = ctx.args
        return (None,) * 7 + tuple(
            grouped_allreduce(
                list(grads),
                average,
                op=op,
                prescale_factor=prescale,
                postscale_factor=postscale,
                process_set=process_set,
            )
        )


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> List[torch.Tensor]:
    """Horovod's hvd.grouped_allreduce: the reductions of `tensors` as new tensors, submitted
    together (compressed on the wire); differentiable."""
    compressed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(
        average, name, op, prescale_factor, postscale_factor, process_set, compression, *[c for c, _ in compressed]
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], process_set: ProcessSet) -> torch.Tensor:
        ctx.rows, ctx.process_set = (tensor.shape[0] if tensor.dim() else 1), process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        averaged = allreduce(grad, op=Average, process_set=ctx.process_set)
        return _own_rows(averaged, ctx.rows, ctx.process_set), None, None


def allgather(
    tensor: torch.Tensor, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Horovod's hvd.allgather: every rank's `tensor` concatenated along the first dimension, in
    rank order, as a new tensor; differentiable."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Optional[str], process_set: ProcessSet, *tensors: torch.Tensor) -> tuple:
        ctx.rows, ctx.process_set = [t.shape[0] if t.dim() else 1 for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        averaged = grouped_allreduce(list(grads), op=Average, process_set=ctx.process_set)
        return (None, None) + tuple(_own_rows(g, n, ctx.process_set) for g, n in zip(averaged, ctx.rows))


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> List[torch.Tensor]:
    """Horovod's hvd.grouped_allgather: allgathers of a list of tensors, submitted together; differentiable."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str], process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        from ..basics import rank

        averaged = allreduce(grad, op=Average, process_set=ctx.process_set)
        return (averaged if rank() == ctx.root_rank else averaged * 0), None, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """root_rank's `tensor`, as a new tensor on every rank; differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Optional[str], process_set: ProcessSet) -> Any:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple:
        back, _ = alltoall(grad, splits=ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def alltoall(
    tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Horovod's hvd.alltoall: splits[i] rows of `tensor` go to rank i (equal shares without
    splits); returns the rows received in rank order, and with `splits` also how many came
    from each rank; differentiable."""
    return _Alltoall.apply(tensor, splits, name, process_set)


def _scaled_back(grad: torch.Tensor, op: int, prescale: float, postscale: float, size: int) -> torch.Tensor:
    """A reducescatter's gradient before it is gathered: scaled as the forward scaled."""
    if op == Sum:
        grad = grad * size
    return grad * (prescale * postscale) if prescale * postscale != 1.0 else grad


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: Optional[str],
        op: int,
        process_set: ProcessSet,
        prescale: float,
        postscale: float,
    ) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale, postscale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, prescale, postscale, process_set = ctx.args
        scaled = _scaled_back(grad, op, prescale, postscale, process_set.size())
        return allgather(scaled, process_set=process_set), None, None, None, None, None


def reducescatter(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Horovod's hvd.reducescatter: `tensor` reduced over the ranks (Average by default), each
    rank keeping its share of the first dimension; differentiable."""
    cast_only(compression, "reducescatter")
    compressed, ctx = compression.compress(tensor)
    reduced = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        name: Optional[str],
        op: int,
        process_set: ProcessSet,
        prescale: float,
        postscale: float,
        *tensors: torch.Tensor,
    ) -> tuple:
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale, postscale)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, prescale, postscale, process_set = ctx.args
        scaled = [_scaled_back(g, op, prescale, postscale, process_set.size()) for g in grads]
        return (None,) * 5 + tuple(grouped_allgather(scaled, process_set=process_set))


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> List[torch.Tensor]:
    """Horovod's hvd.grouped_reducescatter: reducescatters of a list of tensors, submitted together; differentiable."""
    cast_only(compression, "grouped_reducescatter")
    compressed = [compression.compress(t) for t in tensors]
    reduced = _GroupedReducescatter.apply(
        name, op, process_set, prescale_factor, postscale_factor, *[c for c, _ in compressed]
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]
