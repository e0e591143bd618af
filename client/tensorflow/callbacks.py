"""Keras callbacks: start every rank from rank 0's variables, and log metrics averaged over the ranks."""

from __future__ import annotations

from typing import Optional

import keras
import numpy as np

from reduction_server.wire.protocol import ReduceOp

from .ops import broadcast_variables, reduce_arrays


class BroadcastVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's weights and the optimizer's variables from `root_rank` when
    training starts, so that every rank starts from root's state (Horovod's
    BroadcastGlobalVariablesCallback). The optimizer is built first if it is not yet, so that a
    restored optimizer state is broadcast too. A model not yet built when training starts (a
    Sequential without an Input: TensorFlow's Keras builds it, and the optimizer, in the first
    training step) is broadcast at the end of the first batch instead, as Horovod always does:
    every rank then continues from root's state after that step. Random-seed state (Dropout's)
    is not broadcast: ranks keep drawing different masks."""

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.local_variables: list = []  # kept by each rank (Horovod's callback names them)
        self._pending = False

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        """Keras hook: overwrite the model's weights and the optimizer's variables (building it
        first if needed) with root_rank's; if the model is not built yet, wait for the first batch's end."""
        self._pending = not self.model.built
        if not self._pending:
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        """Keras hook: the broadcast on_train_begin left for the first step to build the model."""
        if self._pending:
            self._pending = False
            self._broadcast()

    def _broadcast(self) -> None:
        model = self.model
        variables = list(model.weights)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            variables += list(optimizer.variables)
        local = {id(v) for v in self.local_variables}
        variables = [v for v in variables if id(v) not in local and id(getattr(v, "value", None)) not in local]
        broadcast_variables(variables, self.root_rank)


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's logged metrics (loss, metrics, validation metrics) over every rank at
    the end of each epoch, in place: put it before callbacks that read them (checkpoints, early
    stopping, logging). Every rank must log the same metric names."""

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Keras hook: replace every numeric scalar in `logs` with its average over all ranks (one collective)."""
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        if not keys:
            return
        values = [np.asarray(float(logs[k]), np.float64) for k in keys]
        for key, value in zip(keys, reduce_arrays(values, [f"metric/{k}" for k in keys], ReduceOp.AVG, None)):
            logs[key] = float(value)
