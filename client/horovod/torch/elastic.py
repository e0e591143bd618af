"""Horovod's `hvd.elastic` for PyTorch: `run`, `TorchState` (a model, an optimizer and plain
values, each saved at commit, restored after a lost worker, synchronized from rank 0), and
the shared `State` and `ObjectState` (client/horovod/elastic.py)."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict

import torch

from ..basics import broadcast_object, init, rank, shutdown
from ..elastic import ObjectState, State, run_fn
from .functions import broadcast_optimizer_state, broadcast_parameters


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function `func(state, ...)`: it is run again, after a reset, each
    time a worker is lost (from the last commit) or added (the newcomer syncs from rank 0)."""
    return run_fn(func, _reset)


def _reset() -> None:
    shutdown()
    init()


class _Handler:
    """Saves, restores and synchronizes one model's or optimizer's state_dict."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        if isinstance(self.value, torch.nn.Module):
            broadcast_parameters(self.value.state_dict(), root_rank=0)
        else:
            broadcast_optimizer_state(self.value, root_rank=0)


class TorchState(ObjectState):
    """State of a PyTorch training process, as Horovod's: `model` and `optimizer` (and any
    keyword argument that is a Module or an Optimizer) by their state_dicts, every other
    keyword argument as a plain attribute."""

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handled = {k: v for k, v in kwargs.items() if isinstance(v, (torch.nn.Module, torch.optim.Optimizer))}
        self._handlers: Dict[str, _Handler] = {name: _Handler(value) for name, value in handled.items()}
        for name, value in handled.items():
            setattr(self, name, value)
        super().__init__(
            bcast_object=broadcast_object, get_rank=rank, **{k: v for k, v in kwargs.items() if k not in handled}
        )

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:  # a new model or optimizer object: saved from now on
            handlers[name].value = value
            handlers[name].save()
        super().__setattr__(name, value)


__all__ = ["ObjectState", "State", "TorchState", "run"]
