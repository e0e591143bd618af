"""Horovod's torch functions: a model's parameters and an optimizer's state from the root rank."""

from __future__ import annotations

import io
from typing import Any, Iterable, Mapping, Tuple, Union

import torch  # the real torch: absolute import

from ..basics import broadcast_object, rank
from .mpi_ops import broadcast_async_, synchronize
from .optimizer import is_distributed


def broadcast_parameters(
    params: Union[Mapping[str, torch.Tensor], Iterable[Union[Tuple[str, torch.Tensor], torch.Tensor]]], root_rank: int
) -> None:
    """Overwrite every rank's parameters (a state_dict, named_parameters(), or a list of tensors
    such as list(model.parameters()), named by position) with root_rank's."""
    if isinstance(params, Mapping):
        items = sorted(params.items())
    else:
        items = [p if not isinstance(p, torch.Tensor) else (f"#{i}", p) for i, p in enumerate(params)]
    if any(not (isinstance(i, tuple) and len(i) == 2) for i in items):
        raise ValueError(
            "broadcast_parameters takes a state_dict, a sequence of (name, tensor) pairs such as "
            "model.named_parameters(), or a sequence of tensors"
        )
    handles = [
        broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank, f"broadcast.parameter.{name}")
        for name, p in items
        if isinstance(p, torch.Tensor)
    ]
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Overwrite every rank's optimizer state (moments, step counts, hyperparameters) with
    root_rank's: its state_dict travels serialized, so every kind of state does. A new optimizer
    gets its state first, as in Horovod: a step with zero gradients for the parameters that have
    none (sparse for a SparseAdam's, or `model`'s sparse embeddings under SGD)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state (as in Horovod)")
    if not optimizer.state_dict()["state"]:
        sparse = {
            id(p)
            for m in (model.modules() if model is not None else ())
            if isinstance(m, torch.nn.Embedding) and m.sparse
            for p in m.parameters()
        }
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
                    if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse
                    ):
                        p.grad = p.grad.to_sparse()
        # A DistributedOptimizer's own step() would all-reduce, which not every rank may call here.
        (super(type(optimizer), optimizer).step if is_distributed(optimizer) else optimizer.step)()
    data = None
    if rank() == root_rank:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        data = buf.getvalue()
    data = broadcast_object(data, root_rank, name="broadcast.optimizer_state")
    if rank() != root_rank:
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        optimizer.load_state_dict(torch.load(io.BytesIO(data), map_location=device, weights_only=False))
