"""Horovod's collectives on torch tensors (its mpi_ops), the forms that return handles:
allreduce, broadcast, allgather, reducescatter and alltoall (each alone or grouped, in place or
not), join and barrier. The differentiable forms that return tensors are in autograd.py.

Collectives are matched across ranks by name (coordinator.py), fused up to
HOROVOD_FUSION_THRESHOLD, and negotiated every HOROVOD_CYCLE_TIME ms; `process_set=` runs one
among a process set's ranks (process_sets.py). CPU tensors go to the wire without a copy; CUDA
tensors through pinned host buffers (client/torch/tensors.py).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch  # the real torch: absolute import

from reduction_server.wire.protocol import ReduceOp

from ...torch.tensors import Staged
from .. import shares
from ..basics import coordinator, rank, submit
from ..compression import wire_format
from ..coordinator import ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, REDUCESCATTER
from ..exceptions import as_horovod_errors
from ..ops import Adasum, Average, resolve_op
from ..process_sets import ProcessSet
from ..requests import BARRIER_NAME
from .handles import new_handle, poll, synchronize, take

__all__ = [
    "allgather_async",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall_async",
    "barrier",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather_async",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter_async",
    "synchronize",
]


def _type_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _bytes(host: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor as its bytes, one trailing dimension of itemsize per element
    (flattened first: a contiguous tensor's size-1 dimensions may have any stride)."""
    return host.reshape(-1).view(torch.uint8).reshape(*(host.shape or (1,)), host.element_size())


def _scale(tensor: torch.Tensor, factor: float) -> None:
    """tensor *= factor in place, as Horovod scales: integers in float64 (truncated back),
    16-bit floats in float32."""
    if factor == 1.0:
        return
    with torch.no_grad():
        if not tensor.is_floating_point() and not tensor.is_complex():
            tensor.copy_(tensor.double() * factor)
        elif tensor.dtype in (torch.float16, torch.bfloat16):
            tensor.copy_(tensor.float() * factor)
        else:
            tensor.mul_(factor)


def _submit(
    kind: str,
    name: str,
    wire_tensor: torch.Tensor,
    tensor: torch.Tensor,
    process_set: Optional[ProcessSet],
    op: ReduceOp = ReduceOp.SUM,
    root: int = 0,
    splits: Sequence[int] = (),
    compression: str = "",
    residual: Optional[torch.Tensor] = None,
) -> Any:
    """Submit one named collective of `wire_tensor` (the wire's view of `tensor`) in place; its
    Future. `root` is a global rank; `compression` and `residual` as for basics.submit."""
    return submit(
        kind,
        name,
        wire_tensor,
        wire_tensor,
        op=op,
        root=root,
        process_set=process_set,
        splits=splits,
        type_name=_type_name(tensor),
        compression=compression,
        residual=None if residual is None else residual.numpy(),
    )


# -- allreduce ---------------------------------------------------------------------------------


def _reduce(
    tensor: torch.Tensor,
    name: str,
    op: Optional[int],
    average: Optional[bool],
    prescale: float,
    postscale: float,
    process_set: Optional[ProcessSet],
    kind: str = ALLREDUCE,
    compression: Any = None,
    residual: Optional[torch.Tensor] = None,
) -> tuple:
    """Start reducing `tensor` in place: (its Future, the finishing step that scales it). Under
    Compression.int8 a float tensor goes as int8 blocks; `residual` (float32, on the host, of
    tensor's size) is added to it after the prescale and gets what compressing that lost."""
    integer = not tensor.is_floating_point() and not tensor.is_complex()
    rop, postscale = shares.reduction(resolve_op(op, average), integer, postscale, coordinator(process_set).size)
    wire = wire_format(compression, tensor)
    if residual is not None and not (wire and tensor.dtype == torch.float32):
        raise ValueError(f"{kind} of {name!r}: residual= is for float32 tensors under Compression.int8")
    _scale(tensor, prescale)
    staged = Staged(tensor, f"{kind} tensor {name!r}")
    if residual is not None:
        staged.host.add_(residual.view(staged.host.shape))
    future = _submit(kind, name, staged.wire(rop), tensor, process_set, rop, compression=wire, residual=residual)

    def finish() -> torch.Tensor:
        staged.finish()
        _scale(tensor, postscale)
        return tensor

    return future, finish


def allreduce_async_(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Optional[ProcessSet] = None,
    *,
    compression: Any = None,
    residual: Optional[torch.Tensor] = None,
) -> int:
    """Start an in-place all-reduce of `tensor` (Average by default); a handle for synchronize()/poll().
    `compression`: Compression.int8 sends a float tensor as int8 blocks (other compressors cast,
    before this: autograd.py); `residual`: its error feedback (_reduce)."""
    name = name or coordinator(process_set).auto_name(ALLREDUCE)
    future, finish = _reduce(
        tensor,
        name,
        op,
        average,
        prescale_factor,
        postscale_factor,
        process_set,
        compression=compression,
        residual=residual,
    )
    return new_handle([future], finish)


def allreduce_async(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Optional[ProcessSet] = None,
    *,
    compression: Any = None,
) -> int:
    """Start an all-reduce into a new tensor; `tensor` is left as it is."""
    return allreduce_async_(
        _copy(tensor), average, name, op, prescale_factor, postscale_factor, process_set, compression=compression
    )


def allreduce_(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Optional[ProcessSet] = None,
) -> torch.Tensor:
    """Horovod's hvd.allreduce_: all-reduce `tensor` in place; returns it once done."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def _grouped(handles: List[int]) -> int:
    """One handle for several: synchronize() returns the list of their results."""
    parts = [take(h) for h in handles]
    return new_handle([f for futures, _ in parts for f in futures], lambda: [finish() for _, finish in parts])


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Optional[ProcessSet] = None,
    *,
    compression: Any = None,
) -> int:
    """Start in-place all-reduces of a list of tensors, submitted together (so fused together
    when they fit the fusion threshold); synchronize() returns the list."""
    name = name or coordinator(process_set).auto_name("grouped_allreduce")
    return _grouped(
        [
            allreduce_async_(
                t, average, f"{name}.{i}", op, prescale_factor, postscale_factor, process_set, compression=compression
            )
            for i, t in enumerate(tensors)
        ]
    )


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Optional[ProcessSet] = None,
    *,
    compression: Any = None,
) -> int:
    """Horovod's hvd.grouped_allreduce_async: start all-reducing copies of `tensors`, which are
    left as they are; synchronize() returns the list of results."""
    return grouped_allreduce_async_(
        [_copy(t) for t in tensors],
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        compression=compression,
    )


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Optional[ProcessSet] = None,
) -> List[torch.Tensor]:
    """Horovod's hvd.grouped_allreduce_: all-reduce `tensors` in place, submitted together; returns them once done."""
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


# -- broadcast ---------------------------------------------------------------------------------


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: Optional[ProcessSet] = None
) -> int:
    """Start overwriting `tensor` on every rank (of `process_set`) with root_rank's (a global rank)."""
    name = name or coordinator(process_set).auto_name(BROADCAST)
    staged = Staged(tensor, f"broadcast tensor {name!r}", load=rank() == root_rank)
    future = _submit(BROADCAST, name, staged.wire(None), tensor, process_set, root=root_rank)

    def finish() -> torch.Tensor:
        if rank() != root_rank:
            staged.finish()
        return tensor

    return new_handle([future], finish)


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: Optional[ProcessSet] = None
) -> int:
    """Horovod's hvd.broadcast_async: start broadcasting root_rank's `tensor` into a new tensor
    (`tensor` is left as it is); synchronize() returns it."""
    return broadcast_async_(_copy(tensor), root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: Optional[ProcessSet] = None
) -> torch.Tensor:
    """Horovod's hvd.broadcast_: overwrite `tensor` on every rank with root_rank's; returns it once done."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- allgather and alltoall --------------------------------------------------------------------


def _rows(
    kind: str, tensor: torch.Tensor, name: str, process_set: Optional[ProcessSet], splits: Sequence[int] = ()
) -> tuple:
    """Start a collective that moves rows of `tensor` between ranks: (Future, staging). The rows
    travel as bytes (every dtype, exactly)."""
    staged = Staged(tensor, f"{kind} tensor {name!r}")
    return _submit(kind, name, _bytes(staged.host), tensor, process_set, splits=splits), staged


def _from_bytes(raw: Any, like: torch.Tensor) -> torch.Tensor:
    result = torch.from_numpy(raw).view(like.dtype).squeeze(-1)
    return result.to(like.device) if like.device.type != "cpu" else result


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> int:
    """Start concatenating every rank's `tensor` along the first dimension (which may differ
    across ranks; the others must match)."""
    future, _ = _rows(ALLGATHER, tensor, name or coordinator(process_set).auto_name(ALLGATHER), process_set)

    def finish() -> torch.Tensor:
        gathered = _from_bytes(future.result(), tensor)
        return gathered.reshape(-1) if tensor.dim() == 0 else gathered

    return new_handle([future], finish)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: Optional[str] = None, process_set: Optional[ProcessSet] = None
) -> int:
    """Horovod's hvd.grouped_allgather_async: allgathers of a list of tensors, submitted together."""
    name = name or coordinator(process_set).auto_name("grouped_allgather")
    return _grouped([allgather_async(t, f"{name}.{i}", process_set) for i, t in enumerate(tensors)])


def _splits(tensor: torch.Tensor, splits: Any, size: int) -> List[int]:
    """alltoall's rows for each rank (shares.splits), from a tensor or list of integers."""
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor of at least one dimension; got a scalar")
    if splits is not None:
        values = splits if isinstance(splits, torch.Tensor) else torch.tensor(splits, device="cpu")
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise ValueError(f"alltoall's splits must be integers, got {values.dtype}")
        splits = values.reshape(-1).tolist()
    return shares.splits(tensor.shape[0], splits, size)


def alltoall_async(
    tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None, process_set: Optional[ProcessSet] = None
) -> int:
    """Start sending splits[i] rows of `tensor` (along its first dimension, in order) to rank i
    of the process set; synchronize() returns (the rows every rank sent here, in rank order;
    how many rows came from each rank, as an int32 tensor)."""
    size = coordinator(process_set).size
    counts = _splits(tensor, splits, size)
    future, _ = _rows(ALLTOALL, tensor, name or coordinator(process_set).auto_name(ALLTOALL), process_set, counts)

    def finish() -> tuple:
        rows, received = future.result()
        return _from_bytes(rows, tensor), torch.tensor(received, dtype=torch.int32, device="cpu")

    return new_handle([future], finish)


# -- reducescatter -----------------------------------------------------------------------------


def reducescatter_async(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: int = Average,
    process_set: Optional[ProcessSet] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducing `tensor` over the ranks and giving each its share of the first dimension
    (Horovod's division: the first rows % size ranks get one row more); `tensor` is left as it is."""
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension (it divides the first); got a scalar")
    if op == Adasum:
        raise NotImplementedError("reducescatter does not support hvd.Adasum (nor does Horovod's)")
    name = name or coordinator(process_set).auto_name(REDUCESCATTER)
    coord = coordinator(process_set)
    future, finish = _reduce(_copy(tensor), name, op, None, prescale_factor, 1.0, process_set, REDUCESCATTER)
    first, count = shares.piece(tensor.shape[0], coord.rank, coord.size)

    def mine() -> torch.Tensor:
        piece = finish().narrow(0, first, count).clone()
        _scale(piece, postscale_factor)
        return piece

    return new_handle([future], mine)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    op: int = Average,
    process_set: Optional[ProcessSet] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Horovod's hvd.grouped_reducescatter_async: reducescatters of a list of tensors, submitted
    together (fused when they fit the threshold)."""
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("reducescatter needs tensors of at least one dimension; the list holds a scalar")
    name = name or coordinator(process_set).auto_name("grouped_reducescatter")
    return _grouped(
        [
            reducescatter_async(t, f"{name}.{i}", op, process_set, prescale_factor, postscale_factor)
            for i, t in enumerate(tensors)
        ]
    )


# -- join and barrier --------------------------------------------------------------------------


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, it takes part in the others'
    collectives with zeros (an all-reduce's Average still divides by every rank). Returns the
    rank that joined last, the same on every rank. `device` is accepted for Horovod's signature."""
    with as_horovod_errors():
        return coordinator().join().result()


def barrier(process_set: Optional[ProcessSet] = None) -> None:
    """Wait until every rank (of `process_set`) has reached its barrier."""
    placeholder = torch.empty(0, dtype=torch.uint8, device="cpu")
    synchronize(new_handle([_submit(BARRIER, BARRIER_NAME, placeholder, placeholder, process_set)], lambda: None))
