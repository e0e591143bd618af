"""Horovod's PyTorch API over the reduction server.

    import reduction_server.client.horovod.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())       # where there are GPUs
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Collectives are matched across ranks by name (coordinator.py), fused up to
HOROVOD_FUSION_THRESHOLD, and negotiated every HOROVOD_CYCLE_TIME ms. Handles are integers, as in
Horovod: ``synchronize(handle)`` waits and returns the result, ``poll(handle)`` tests it. CPU
tensors go to the wire without a copy; CUDA tensors through pinned host buffers
(reduction_server.client.torch.tensors.Staged).
"""
from __future__ import annotations

import io
import itertools
import threading
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch  # the real torch: absolute import

from reduction_server.protocol import ReduceOp

from ..buffers import wire_view
from ..torch.tensors import Staged
from .basics import (allgather_object, broadcast_object, coordinator, cross_rank, cross_size, init,
                     is_initialized, local_rank, local_size, rank, shutdown, size)
from .compression import Compression
from .coordinator import ALLGATHER, ALLREDUCE, BROADCAST, Request, name_counter
from .ops import Adasum, Average, Max, Min, Product, Sum, check_process_set, resolve_op

__all__ = ["Adasum", "Average", "Compression", "DistributedOptimizer", "Max", "Min", "Product", "Sum",
           "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
           "allreduce_async_", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
           "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "cross_rank", "cross_size",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "init", "is_initialized", "local_rank", "local_size", "poll", "rank", "shutdown", "size",
           "synchronize"]

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
    copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[int] = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: Any = None) -> List[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = None) -> List[torch.Tensor]:
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
    return broadcast_async_(tensor.detach().clone(memory_format=torch.contiguous_format), root_rank, name,
                            process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Any = None) -> torch.Tensor:
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
    return synchronize(allgather_async(tensor, name, process_set))


# -- model and optimizer state ---------------------------------------------------------------------

def broadcast_parameters(params: Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]],
                         root_rank: int) -> None:
    """Overwrite every rank's parameters (a state_dict or named_parameters()) with root_rank's."""
    items = sorted(params.items()) if isinstance(params, Mapping) else list(params)
    if any(not (isinstance(i, tuple) and len(i) == 2) for i in items):
        raise ValueError("broadcast_parameters takes a state_dict or a sequence of (name, tensor) pairs, "
                         "e.g. model.named_parameters()")
    handles = [broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank,
                                f"broadcast.parameter.{name}")
               for name, p in items if isinstance(p, torch.Tensor)]
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Overwrite every rank's optimizer state (moments, step counts, hyperparameters) with
    root_rank's: its state_dict travels serialized, so every kind of state does."""
    data = None
    if rank() == root_rank:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        data = buf.getvalue()
    data = broadcast_object(data, root_rank, name="broadcast.optimizer_state")
    if rank() != root_rank:
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        optimizer.load_state_dict(torch.load(io.BytesIO(data), map_location=device, weights_only=False))


# -- DistributedOptimizer ------------------------------------------------------------------------------

class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class: each gradient's all-reduce starts the moment
    backward has accumulated it, and step() waits for them all before updating."""

    def __init__(self, params: Any, named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]],
                 compression: Any, backward_passes_per_step: int, op: int,
                 gradient_predivide_factor: float) -> None:
        super(self.__class__, self).__init__(params)
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not (isinstance(p, tuple) and len(p) == 2) for p in named):
                raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, usually "
                                 "model.named_parameters()")
        else:
            named = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(self.param_groups)
                     for j, p in enumerate(group["params"])]
        names = [n for n, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"parameter names in named_parameters must be unique; repeated: {dups}")
        ours = {id(p) for g in self.param_groups for p in g["params"]}
        unnamed = ours - {id(p) for _, p in named}
        if unnamed:
            raise ValueError(f"named_parameters was given but {len(unnamed)} of the optimizer's parameters are "
                             "not in it; pass model.named_parameters() for the same model")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}")
        if op not in (Average, Sum) and gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor needs op=hvd.Average or hvd.Sum")
        self._compression = compression
        self._names = {p: n for n, p in named if id(p) in ours}
        self._op = op
        self._rop = resolve_op(op)
        self._predivide = gradient_predivide_factor
        self.backward_passes_per_step = backward_passes_per_step
        self._delay = {p: backward_passes_per_step for p in self._names}
        self._handles: Dict[torch.Tensor, Tuple[Optional[int], Any]] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = []
        if size() > 1:
            for p in self._names:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._ready))

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def _ready(self, p: torch.Tensor) -> None:
        if p in self._handles and self._handles[p][0] is not None and self._delay[p] <= 0:
            raise AssertionError("gradients were computed more than backward_passes_per_step times before "
                                 "step(); increase backward_passes_per_step to accumulate them locally")
        self._delay[p] -= 1
        self._handles[p] = self._start(p) if self._delay[p] == 0 else (None, None)

    def _start(self, p: torch.Tensor) -> Tuple[int, Any]:
        compressed, ctx = self._compression.compress(p.grad)
        prescale, postscale = 1.0, 1.0
        if self._predivide != 1.0:  # average as (sum of g / f) * f / size: smaller partial sums
            prescale, postscale = 1.0 / self._predivide, self._predivide
        handle = allreduce_async_(compressed, name=self._names[p], op=self._op, prescale_factor=prescale,
                                  postscale_factor=postscale)
        return handle, (compressed, ctx)

    def synchronize(self) -> None:
        """Wait for every gradient's all-reduce (starting those backward did not reach)."""
        for p in self._names:
            if p.requires_grad and p.grad is not None and self._handles.get(p, (None,))[0] is None:
                self._handles[p] = self._start(p)
        for p, (handle, (compressed, ctx)) in list(self._handles.items()):
            reduced = synchronize(handle)
            self._delay[p] = self.backward_passes_per_step
            result = self._compression.decompress(reduced, ctx)
            if result is not p.grad:
                with torch.no_grad():
                    p.grad.copy_(result)
        self._handles.clear()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """step() without synchronizing (after an explicit synchronize(), e.g. to clip gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(): the gradients are all-reduced twice", stacklevel=2)
            if size() > 1:
                self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(): the all-reduces still write "
                                 "to those gradients")
        return super(self.__class__, self).zero_grad(set_to_none)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - Horovod's name
                         named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = None) -> torch.optim.Optimizer:
    """`optimizer`, whose step() first averages (op) the gradients over all ranks. Each
    gradient's all-reduce starts as soon as backward has produced it, fused with its neighbours
    up to HOROVOD_FUSION_THRESHOLD."""
    check_process_set(process_set)
    if num_groups or groups:
        warnings.warn("num_groups/groups are ignored: the reduction server fuses by the fusion threshold",
                      stacklevel=2)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor)
