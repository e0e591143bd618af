"""Horovod's `hvd.elastic` for TensorFlow 2 (eager) and Keras: `run`, `TensorFlowKerasState` (a
built model and its optimizer, by their variables), `TensorFlowState` (a list of variables), and
the shared `State` and `ObjectState` (client/horovod/elastic.py)."""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf  # the real tensorflow: absolute import

from .. import basics
from ..elastic import ObjectState, State, run_fn
from ..exceptions import HorovodInternalError
from .arrays import init
from .functions import broadcast_object, broadcast_variables


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function `func(state, ...)`: it is run again, after a reset, each
    time a worker is lost (from the last commit) or added (the newcomer syncs from rank 0)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as error:
            # A collective that failed inside a graph (model.fit's train step) comes out as the
            # op's error, as Horovod's does: it is the same failure, and the state rolls back.
            if HorovodInternalError.__name__ in error.message:
                raise HorovodInternalError(error.message) from error
            raise

    return run_fn(wrapper, _reset)


def _reset() -> None:
    basics.shutdown()
    init()


def _variables(owner: Any) -> List[Any]:
    """A model's or optimizer's variables (Keras 3 has a property where Keras 2 had a method)."""
    variables = owner.variables
    return list(variables() if callable(variables) else variables)


class _Variables(ObjectState):
    """Plain values as attributes, and variables saved by value, restored by assignment and
    synchronized from rank 0."""

    def __init__(self, **kwargs: Any) -> None:
        self._save_variables()
        super().__init__(bcast_object=broadcast_object, get_rank=basics.rank, **kwargs)

    def _tracked(self) -> List[Any]:
        raise NotImplementedError

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        for variable, value in zip(self._tracked(), self._saved_values):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        tracked = self._tracked()
        if tracked:
            broadcast_variables(tracked, root_rank=0)
        self._save_variables()
        super().sync()

    def _save_variables(self) -> None:
        self._saved_values = [tf.identity(variable) for variable in self._tracked()]


class TensorFlowKerasState(_Variables):
    """State of a TensorFlow Keras model and its optimizer (or the one compiled into it), as
    Horovod's; `backend` is accepted for Horovod's signature (TensorFlow 1 sessions are not)."""

    def __init__(self, model: Any, optimizer: Optional[Any] = None, backend: Any = None, **kwargs: Any) -> None:
        if not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        self.backend = backend
        super().__init__(**kwargs)

    def _tracked(self) -> List[Any]:
        return [*_variables(self.model), *(_variables(self.optimizer) if self.optimizer is not None else ())]


class TensorFlowState(_Variables):
    """State of a list of variables (eager TensorFlow 2: they must be given)."""

    def __init__(self, variables: Sequence[Any], session: Any = None, **kwargs: Any) -> None:
        if session is not None:
            raise ValueError("TensorFlow 1 sessions are not supported: pass the variables of an eager program")
        self.variables = list(variables)
        super().__init__(**kwargs)

    def _tracked(self) -> List[Any]:
        return self.variables


__all__ = ["ObjectState", "State", "TensorFlowKerasState", "TensorFlowState", "run"]
