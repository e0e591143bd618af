"""Horovod's torch functions: a model's parameters and an optimizer's state from the root rank."""
from __future__ import annotations

import io
from typing import Iterable, Mapping, Tuple, Union

import torch  # the real torch: absolute import

from ..basics import broadcast_object, rank
from .mpi_ops import broadcast_async_, synchronize


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


