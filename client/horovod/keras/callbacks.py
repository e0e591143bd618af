"""Horovod's Keras callbacks (hvd.callbacks.*): broadcast the starting state, average the
epoch's metrics, schedule the learning rate (a warm-up among the schedules), with Horovod's
signatures."""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import keras
import tensorflow as tf

from ... import tensorflow as rstf
from .. import basics

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]


class BroadcastGlobalVariablesCallback(rstf.BroadcastVariablesCallback):
    """At the start of training, every rank takes `root_rank`'s model weights and optimizer
    state, except `local_variables` (a variable or a list of them), which each rank keeps.
    `device` is accepted as Horovod's is: the broadcast goes through the host here."""

    def __init__(self, root_rank: int, device: str = "", local_variables: Optional[Iterable] = None) -> None:
        super().__init__(root_rank)
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        else:
            local_variables = list(local_variables)
            if not all(_is_variable(v) for v in local_variables):
                raise ValueError("All local variables must be of tf.Variable type.")  # Horovod's words
        self.local_variables = local_variables


def _is_variable(value: object) -> bool:
    return isinstance(value, (tf.Variable, keras.Variable))


class MetricAverageCallback(rstf.MetricAverageCallback):
    """At each epoch's end, the logged metrics become their average over all ranks. `device` is
    accepted as Horovod's is (the averaging goes through the host here)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's learning-rate schedule: from `start_epoch` until `end_epoch` (None: the end),
    the rate is initial_lr * multiplier(epoch). With `staircase` it is set at each epoch's first
    batch, for that whole epoch; otherwise at every batch, for the fraction of the epoch done
    (steps_per_epoch from model.fit when not given). A number as `multiplier` is the decay
    multiplier ** (epoch - start_epoch). The rate of the last batch is logged as logs["lr"].

    `momentum_correction` (Goyal et al.): while the rate changes, an optimizer's momentum is
    scaled by new rate / old rate for that batch, where the momentum is a variable (Keras 2's
    optimizers). Keras 3's SGD keeps it as a number read once when its step is compiled, so it
    is left as it is there."""

    def __init__(
        self,
        initial_lr: float,
        multiplier: Union[float, Callable[[float], float]],
        start_epoch: int = 0,
        end_epoch: Optional[int] = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: Optional[int] = None,
    ) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")  # Horovod's words
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch))
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0
        self._restore_momentum: Optional[float] = None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        """Keras hook: take steps_per_epoch from model.fit's params when a per-batch schedule
        needs it and it was not given; raises ValueError if they do not tell it either."""
        if self.staircase or self.steps_per_epoch:
            return
        params = self.params or {}
        if params.get("steps"):
            self.steps_per_epoch = params["steps"]
        elif params.get("samples") and params.get("batch_size"):
            self.steps_per_epoch = params["samples"] // params["batch_size"]
        else:
            raise ValueError(f"{type(self).__name__} needs steps_per_epoch (model.fit could not tell it)")

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Keras hook: remember the epoch that starts."""
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        """Keras hook: set the rate for this batch, within the schedule's epochs."""
        if self._epoch < self.start_epoch or (self.end_epoch is not None and self._epoch >= self.end_epoch):
            return
        if not self.staircase:
            self._set_rate(self._epoch + batch / self.steps_per_epoch)
        elif batch == 0:
            self._set_rate(self._epoch)

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        """Keras hook: the momentum corrected for one batch goes back to its value."""
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Keras hook: log the current rate as logs["lr"]."""
        if logs is not None:
            logs["lr"] = float(self.model.optimizer.learning_rate.numpy())

    def _set_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        new = self.initial_lr * self.multiplier(epoch)
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign"):
            old = float(optimizer.learning_rate.numpy())
            if old:
                self._restore_momentum = float(momentum.numpy())
                momentum.assign(self._restore_momentum * new / old)
        optimizer.learning_rate.assign(new)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from initial_lr / size to initial_lr over the first `warmup_epochs`
    epochs, batch by batch (the gradual warm-up of Goyal et al., "Accurate, Large Minibatch SGD",
    as Horovod's callback does): large effective batches train stably from the first step.

    initial_lr is the target, usually the single-worker rate times hvd.size(). With `verbose`,
    rank 0 prints the rate at the end of each warm-up epoch."""

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: float = 5,
        momentum_correction: bool = True,
        steps_per_epoch: Optional[int] = None,
        verbose: int = 0,
    ) -> None:
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs must be positive, got {warmup_epochs}")
        super().__init__(
            initial_lr,
            self._warmup,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def _warmup(self, epoch: float) -> float:
        epoch += 1.0 / self.steps_per_epoch  # the end of this batch: whole epochs land on round numbers
        world = basics.size()
        return (1.0 + min(epoch / self.warmup_epochs, 1.0) * (world - 1)) / world

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Keras hook: log the rate, and print it at the end of a warm-up epoch when verbose."""
        super().on_epoch_end(epoch, logs)
        if self.verbose and epoch < self.warmup_epochs and basics.rank() == 0:
            print(
                f"Epoch {epoch + 1}: learning rate warm-up at {float(self.model.optimizer.learning_rate.numpy()):.6g}"
            )
