"""Horovod's `hvd.elastic` for Keras (horovod.tensorflow.keras.elastic): `KerasState`, `run`,
and the callbacks that keep `state.batch` and `state.epoch` current and commit the state as
model.fit goes."""

from __future__ import annotations

from typing import Any, Optional

import keras

from ..tensorflow.elastic import ObjectState, State, TensorFlowKerasState, run


class KerasState(TensorFlowKerasState):
    """State of a Keras model and its optimizer (or the one compiled into it)."""

    def __init__(self, model: Any, optimizer: Optional[Any] = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits `state` every `batches_per_commit` batches, and at the end of each epoch."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.batches_remaining = self.batches_per_commit  # the same on every rank after a reset

    def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch` at the batch just done (0 at each epoch's end); with steps_per_epoch,
    shortens the first epoch after a reset by the batches it had done."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: Optional[int] = None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps `state.epoch` the number of epochs done over every reset (Keras counts from 0 in
    each model.fit)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = [
    "CommitStateCallback",
    "KerasState",
    "ObjectState",
    "State",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]
