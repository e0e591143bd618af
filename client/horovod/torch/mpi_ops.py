"""Horovod's collectives on torch tensors (its mpi_ops): allreduce, grouped_allreduce, broadcast
and allgather, in place or not, async with integer handles (``synchronize``, ``poll``).

Collectives are matched across ranks by name (coordinator.py), fused up to
HOROVOD_FUSION_THRESHOLD, and negotiated every HOROVOD_CYCLE_TIME ms. CPU tensors go to the wire
without a copy; CUDA tensors through pinned host buffers (client/torch/tensors.py).
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch  # the real torch: absolute import

from reduction_server.protocol import ReduceOp

from ...buffers import wire_view
from ...torch.tensors import Staged
from ..basics import coordinator, rank
from ..compression import Compression
from ..coordinator import ALLGATHER, ALLREDUCE, BROADCAST, Request, name_counter
from ..ops import check_process_set, resolve_op

_names = {kind: name_counter(kind) for kind in (ALLREDUCE, ALLGATHER, BROADCAST, "grouped_allreduce")}
_handles: Dict[int, Tuple[List[Any], Callable[[], Any]]] = {}
_handle_ids = itertools.count(1)
_handles_lock = threading.Lock()


def _handle(futures: List[Any], finish: Callable[[], Any]) -> int:
    with _handles_lock:
        handle = next(_handle_ids)
        _handles[handle] = (futures, finish)
    return handle


def poll(handle: int) -> bool:
    """True once the collective behind `handle` has finished (synchronize() will not block)."""
    with _handles_lock:
        if handle not in _handles:
            raise ValueError(f"unknown or already synchronized handle {handle!r}")
        futures, _ = _handles[handle]
    return all(f.done() for f in futures)


def synchronize(handle: int) -> Any:
    """Wait for the collective behind `handle` and return its result."""
    with _handles_lock:
        try:
            futures, finish = _handles.pop(handle)
        except KeyError:
            raise ValueError(f"unknown or already synchronized handle {handle!r}") from None
    for future in futures:
        future.result()
    return finish()


# -- tensors on the wire ---------------------------------------------------------------------

def _type_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


def _submit_reduce(tensor: torch.Tensor, name: str, op: ReduceOp) -> Tuple[Any, Staged]:
    """Start an in-place all-reduce of `tensor`: (future, staging to finish once it is done)."""
    staged = Staged(tensor, f"allreduce tensor {name!r}")
    wire = wire_view(staged.wire(op), writable=True, what=f"tensor {name!r}")
    request = Request(name, ALLREDUCE, wire.dtype, tuple(tensor.shape), op, type_name=_type_name(tensor))
    return coordinator().submit(request, wire, wire), staged


def _bytes(host: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor as its bytes, one trailing dimension of itemsize per element."""
    return host.reshape(*host.shape, 1).view(torch.uint8) if host.dim() else host.reshape(1, 1).view(torch.uint8)


# -- allreduce ---------------------------------------------------------------------------------

def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = None) -> int:
    """Start an in-place all-reduce of `tensor`; a handle for synchronize()/poll()."""
    check_process_set(process_set)
    rop = resolve_op(op, average)
    name = name or _names[ALLREDUCE]()
    if prescale_factor != 1.0:
        with torch.no_grad():
            tensor.mul_(prescale_factor)
    future, staged = _submit_reduce(tensor, name, rop)

    def finish() -> torch.Tensor:
        staged.finish()
        if postscale_factor != 1.0:
            with torch.no_grad():
                tensor.mul_(postscale_factor)
        return tensor
    return _handle([future], finish)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = None) -> int:
    """Start an all-reduce into a new tensor; `tensor` is left as it is."""
    return allreduce_async_(tensor.detach().clone(memory_format=torch.contiguous_format), average, name, op,
                            prescale_factor, postscale_factor, process_set)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None) -> torch.Tensor:
    """Horovod's hvd.allreduce_: all-reduce `tensor` in place (Average by default); returns it once done."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """The reduction of `tensor` over all ranks, as a new tensor (compressed on the wire)."""
    compressed, ctx = compression.compress(tensor)
    if compressed is tensor:
        compressed = tensor.detach().clone(memory_format=torch.contiguous_format)
    reduced = synchronize(allreduce_async_(compressed, average, name, op, prescale_factor, postscale_factor,
                                           process_set))
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None) -> int:
    """Start in-place all-reduces of a list of tensors, submitted together (so fused together
    when they fit the fusion threshold); synchronize() returns the list."""
    name = name or _names["grouped_allreduce"]()
    inner = [allreduce_async_(t, average, f"{name}.{i}", op, prescale_factor, postscale_factor, process_set)
             for i, t in enumerate(tensors)]
    with _handles_lock:
        parts = [_handles.pop(h) for h in inner]
    return _handle([f for futures, _ in parts for f in futures], lambda: [finish() for _, finish in parts])


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = None) -> int:
    """Horovod's hvd.grouped_allreduce_async: start all-reducing copies of `tensors`, which are
    left as they are; synchronize() returns the list of results."""
    copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[int] = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: Any = None) -> List[torch.Tensor]:
    """Horovod's hvd.grouped_allreduce_: all-reduce `tensors` in place, submitted together; returns them once done."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = None) -> List[torch.Tensor]:
    """Horovod's hvd.grouped_allreduce: the reductions of `tensors` over all ranks as new
    tensors, submitted together (compressed on the wire)."""
    compressed = [compression.compress(t) for t in tensors]
    wire = [c if c is not t else t.detach().clone(memory_format=torch.contiguous_format)
            for (c, _), t in zip(compressed, tensors)]
    reduced = synchronize(grouped_allreduce_async_(wire, average, name, op, prescale_factor, postscale_factor,
                                                   process_set))
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


# -- broadcast and allgather ---------------------------------------------------------------------

def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = None) -> int:
    """Start overwriting `tensor` on every rank with root_rank's."""
    check_process_set(process_set)
    name = name or _names[BROADCAST]()
    staged = Staged(tensor, f"broadcast tensor {name!r}", load=rank() == root_rank)
    wire = wire_view(staged.wire(None), writable=True, what=f"tensor {name!r}")
    request = Request(name, BROADCAST, wire.dtype, tuple(tensor.shape), root=root_rank,
                      type_name=_type_name(tensor))
    future = coordinator().submit(request, wire, wire)

    def finish() -> torch.Tensor:
        if rank() != root_rank:
            staged.finish()
        return tensor
    return _handle([future], finish)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Any = None) -> int:
    """Horovod's hvd.broadcast_async: start broadcasting root_rank's `tensor` into a new tensor
    (`tensor` is left as it is); synchronize() returns it."""
    return broadcast_async_(tensor.detach().clone(memory_format=torch.contiguous_format), root_rank, name,
                            process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Any = None) -> torch.Tensor:
    """Horovod's hvd.broadcast_: overwrite `tensor` on every rank with root_rank's; returns it once done."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Any = None) -> torch.Tensor:
    """root_rank's `tensor`, as a new tensor on every rank."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None, process_set: Any = None) -> int:
    """Start concatenating every rank's `tensor` along the first dimension (which may differ
    across ranks; the others must match)."""
    check_process_set(process_set)
    name = name or _names[ALLGATHER]()
    staged = Staged(tensor, f"allgather tensor {name!r}")
    raw = _bytes(staged.host)
    wire = wire_view(raw, what=f"tensor {name!r}")
    request = Request(name, ALLGATHER, wire.dtype, tuple(raw.shape), type_name=_type_name(tensor))
    future = coordinator().submit(request, wire, None)

    def finish() -> torch.Tensor:
        gathered = torch.from_numpy(future.result()).view(tensor.dtype).squeeze(-1)
        if tensor.dim() == 0:
            gathered = gathered.reshape(-1)
        return gathered.to(tensor.device) if tensor.device.type != "cpu" else gathered
    return _handle([future], finish)


def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_set: Any = None) -> torch.Tensor:
    """Horovod's hvd.allgather: every rank's `tensor` concatenated along the first dimension, in
    rank order, as a new tensor."""
    return synchronize(allgather_async(tensor, name, process_set))


