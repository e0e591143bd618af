"""Horovod's Keras callbacks (hvd.callbacks.*): broadcast the starting state, average the
epoch's metrics, warm the learning rate up."""
from __future__ import annotations

from typing import Optional

import keras

from .. import tensorflow as rstf
from . import basics

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateWarmupCallback", "MetricAverageCallback"]


class BroadcastGlobalVariablesCallback(rstf.BroadcastVariablesCallback):
    """At the start of training, every rank takes `root_rank`'s model weights and optimizer state."""


class MetricAverageCallback(rstf.MetricAverageCallback):
    """At each epoch's end, the logged metrics become their average over all ranks."""


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate from initial_lr / size to initial_lr over the first `warmup_epochs`
    epochs, batch by batch (the gradual warm-up of Goyal et al., "Accurate, Large Minibatch SGD",
    as Horovod's callback does): large effective batches train stably from the first step.

    initial_lr is the target, usually the single-worker rate times hvd.size()."""

    def __init__(self, initial_lr: float, warmup_epochs: float = 5, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0) -> None:
        super().__init__()
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs must be positive, got {warmup_epochs}")
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0

    def _learning_rate(self, epoch: float) -> float:
        world = basics.size()
        progress = min(epoch / self.warmup_epochs, 1.0)
        return self.initial_lr * (1.0 + progress * (world - 1)) / world

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        """Keras hook: take steps_per_epoch from model.fit's params when it was not given; raises
        ValueError if neither tells it."""
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps")
        if not self.steps_per_epoch:
            raise ValueError("LearningRateWarmupCallback needs steps_per_epoch (model.fit could not tell it)")

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Keras hook: remember the epoch that starts, for the per-batch learning rate."""
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        """Keras hook: during the warm-up epochs, set the optimizer's learning rate for the
        progress made by the end of this batch."""
        epoch = self._epoch + (batch + 1) / self.steps_per_epoch  # whole epochs land on round numbers
        if self._epoch < self.warmup_epochs:
            self.model.optimizer.learning_rate.assign(self._learning_rate(epoch))

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Keras hook: print the warm-up learning rate when verbose, and log the current one as logs["lr"]."""
        if self.verbose and epoch < self.warmup_epochs:
            print(f"Epoch {epoch + 1}: learning rate warm-up at "
                  f"{float(self.model.optimizer.learning_rate.numpy()):.6g}")
        if logs is not None:
            logs["lr"] = float(self.model.optimizer.learning_rate.numpy())
