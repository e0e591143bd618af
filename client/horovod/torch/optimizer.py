"""Horovod's DistributedOptimizer for torch: gradients all-reduced (fused, named after their
parameters) as backward produces them, and waited for before the wrapped optimizer steps."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch  # the real torch: absolute import

from .. import elastic
from ..compression import Compression, wire_format
from ..ops import Average, resolve_op
from ..process_sets import ProcessSet, global_process_set
from .mpi_ops import allreduce_async_, synchronize
from .sparse import sparse_allreduce_async


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class: each gradient's all-reduce starts the moment
    backward has accumulated it, and step() waits for them all before updating."""

    def __init__(
        self,
        params: Any,
        named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]],
        compression: Any,
        backward_passes_per_step: int,
        op: int,
        gradient_predivide_factor: float,
        sparse_as_dense: bool,
        process_set: ProcessSet,
        error_feedback: bool = True,
    ) -> None:
        super(self.__class__, self).__init__(params)
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not (isinstance(p, tuple) and len(p) == 2) for p in named):
                raise ValueError(
                    "named_parameters should be a sequence of (name, parameter) tuples, usually "
                    "model.named_parameters()"
                )
        else:
            named = [
                (f"allreduce.noname.{i}.{j}", p)
                for i, group in enumerate(self.param_groups)
                for j, p in enumerate(group["params"])
            ]
        names = [n for n, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"parameter names in named_parameters must be unique; repeated: {dups}")
        ours = {id(p) for g in self.param_groups for p in g["params"]}
        unnamed = ours - {id(p) for _, p in named}
        if unnamed:
            raise ValueError(
                f"named_parameters was given but {len(unnamed)} of the optimizer's parameters are "
                "not in it; pass model.named_parameters() for the same model"
            )
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}")
        if op != Average and gradient_predivide_factor != 1.0:  # Horovod's rule, and its words
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        self._compression = compression
        self._error_feedback = error_feedback
        #: parameter -> what compressing its last gradient lost (float32, host), for Compression.int8
        self._residuals: Dict[torch.Tensor, torch.Tensor] = {}
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        self._parameter_names = {p: n for n, p in named if id(p) in ours}
        self._op = op
        resolve_op(op)  # refuses Adasum and unknown ops here, not at the first step
        self._predivide = gradient_predivide_factor
        self.backward_passes_per_step = backward_passes_per_step
        self._delay = {p: backward_passes_per_step for p in self._parameter_names}
        self._handles: Dict[torch.Tensor, Tuple[Optional[int], Any]] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = []
        # In an elastic job (hvd.elastic) the world may grow from one rank: hooks even then, as Horovod's.
        if process_set.included() and (process_set.size() > 1 or elastic.enabled()):
            for p in self._parameter_names:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._ready))

    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """The wrapped optimizer's, and what was pending is dropped: an elastic job restores the
        last commit after a failed step, whose all-reduces will never complete (as Horovod)."""
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        super(self.__class__, self).load_state_dict(*args, **kwargs)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def _ready(self, p: torch.Tensor) -> None:
        if p in self._handles and self._handles[p][0] is not None and self._delay[p] <= 0:
            raise AssertionError(
                "gradients were computed more than backward_passes_per_step times before "
                "step(); increase backward_passes_per_step to accumulate them locally"
            )
        self._delay[p] -= 1
        self._handles[p] = self._start(p) if self._delay[p] == 0 else (None, None)

    def _start(self, p: torch.Tensor) -> Tuple[Any, Any]:
        if p.grad is None:  # not computed on this rank, but maybe on others: every rank reduces every parameter
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            if not self._sparse_as_dense:
                return sparse_allreduce_async(grad, self._parameter_names[p], self._op, self._process_set), None
            grad = grad.to_dense()
        compressed, ctx = self._compression.compress(grad)
        prescale, postscale = 1.0, 1.0
        if self._predivide != 1.0:  # average as (sum of g / f) * f / size: smaller partial sums
            prescale, postscale = 1.0 / self._predivide, self._predivide
        handle = allreduce_async_(
            compressed,
            name=self._parameter_names[p],
            op=self._op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=self._process_set,
            compression=self._compression,
            residual=self._residual(p, compressed),
        )
        return handle, (compressed, ctx)

    def _residual(self, p: torch.Tensor, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """p's error feedback residual when its gradient goes as int8 blocks (float32 ones only)."""
        if not (self._error_feedback and wire_format(self._compression, grad) and grad.dtype == torch.float32):
            return None
        residual = self._residuals.get(p)
        if residual is None or residual.numel() != grad.numel():
            residual = self._residuals[p] = torch.zeros(grad.numel(), dtype=torch.float32)
        return residual

    def synchronize(self) -> None:
        """Wait for every gradient's all-reduce, starting those backward did not reach (a
        parameter without a gradient on this rank contributes zeros, as in Horovod)."""
        if not self._process_set.included():
            self._synchronized = True
            return
        for p in self._parameter_names:
            if p.requires_grad and self._handles.get(p, (None,))[0] is None:
                self._handles[p] = self._start(p)
        for p, (handle, context) in list(self._handles.items()):
            self._delay[p] = self.backward_passes_per_step
            if context is None:  # a sparse gradient, gathered
                p.grad = handle()
                continue
            compressed, ctx = context
            result = self._compression.decompress(synchronize(handle), ctx)
            if result.layout != p.grad.layout:  # sparse_as_dense: the dense sum, back to sparse
                p.grad = result.to_sparse()
            elif result is not p.grad:
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
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(): the gradients are all-reduced twice; use "
                    "`with optimizer.skip_synchronize(): optimizer.step()`",
                    stacklevel=2,
                )
            if self._process_set.size() > 1 or elastic.enabled():
                self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the all-reduces still write "
                "to those gradients"
            )
        return super(self.__class__, self).zero_grad(set_to_none)


def is_distributed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is one DistributedOptimizer() made (its step() all-reduces)."""
    return type(optimizer).__dict__.get("synchronize") is _DistributedOptimizer.__dict__["synchronize"]


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,  # noqa: N802 - Horovod's name
    named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
    error_feedback: bool = True,
) -> torch.optim.Optimizer:
    """`optimizer`, whose step() first averages (op) the gradients over all ranks (of
    `process_set`). Each gradient's all-reduce starts as soon as backward has produced it, fused
    with its neighbours up to HOROVOD_FUSION_THRESHOLD; sparse gradients are gathered (or
    densified and all-reduced with `sparse_as_dense`). Under `compression=Compression.int8`,
    `error_feedback` adds to each float32 gradient what compressing its last one lost (EF-SGD;
    a float32 residual per parameter on the host)."""
    if num_groups or groups:
        warnings.warn("num_groups/groups are ignored: the reduction server fuses by the fusion threshold", stacklevel=2)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        sparse_as_dense,
        process_set,
        error_feedback,
    )
