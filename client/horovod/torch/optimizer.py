"""Horovod's DistributedOptimizer for torch: gradients all-reduced (fused, named after their
parameters) as backward produces them, and waited for before the wrapped optimizer steps."""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch  # the real torch: absolute import


from ..basics import size
from ..compression import Compression
from ..ops import Average, Sum, check_process_set, resolve_op

from .mpi_ops import allreduce_async_, synchronize


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
        resolve_op(op)  # refuses Adasum and unknown ops here, not at the first step
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
