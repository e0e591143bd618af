"""Gradients averaged over the ranks: DistributedGradientTape for custom loops, and
DistributedOptimizer for model.fit (a Keras 3 optimizer whose apply() all-reduces first)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import keras
import tensorflow as tf  # the real tensorflow: absolute import

from reduction_server.wire.protocol import ReduceOp

from .collectives import Compressor, size
from .graph import dense
from .ops import grouped_allreduce


def scaled(tensor: Optional[tf.Tensor], factor: float) -> Optional[tf.Tensor]:
    """tensor x factor in its own dtype (None and a factor of 1 pass through)."""
    return tensor if tensor is None or factor == 1.0 else tensor * tf.cast(factor, tensor.dtype)


#: how a step's gradients are reduced: (the list, None entries included; the variables or other
#: sources they are the gradients of, in the same order) to the list reduced
Reduction = Callable[[List[Any], List[Any]], List[Any]]


class _GradientReduction:
    """How a step's gradients are reduced: as one fused collective with `op`, compressed on the
    wire if asked. Horovod's gradient_predivide_factor f (op average only) splits the averaging:
    gradients are scaled by 1/f before the sum and by f/size after it (keeps float16 sums in
    range)."""

    def __init__(self, op: Any, compression: Optional[Compressor], gradient_predivide_factor: float) -> None:
        self.op = ReduceOp.parse(op)
        self.compression = compression
        self.predivide = float(gradient_predivide_factor)
        if not self.predivide > 0:
            raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
        if self.predivide != 1.0 and self.op is not ReduceOp.AVG:
            raise ValueError(
                f"gradient_predivide_factor splits an average; it needs op average, not {self.op.name.lower()}"
            )

    def __call__(self, grads: Sequence[Any], sources: Sequence[Any] = ()) -> List[Optional[tf.Tensor]]:
        if self.predivide == 1.0:
            return grouped_allreduce(grads, self.op, self.compression, name="gradient")
        pre = [
            None if g is None else scaled(dense(g, f"gradient.{i}"), 1.0 / self.predivide) for i, g in enumerate(grads)
        ]
        post = self.predivide / size()
        return [
            None if g is None else scaled(g, post)
            for g in grouped_allreduce(pre, ReduceOp.SUM, self.compression, name="gradient")
        ]


class DistributedGradientTape:
    """Wraps a tf.GradientTape; ``gradient()`` returns the gradients all-reduced over every rank
    (averaged by default) as one fused collective. Everything else is the wrapped tape's::

        with tf.GradientTape() as tape:
            loss = ...
        tape = DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    `op`: "average" or "sum" (or min, max, product); `compression`: see Compressor;
    `gradient_predivide_factor`: see Horovod (op average only). `reduce`, if given, reduces the
    gradients instead (a Reduction; the Horovod layer passes its own, with process sets, sparse
    gradients and error feedback), and the three are not used.
    """

    def __init__(
        self,
        tape: tf.GradientTape,
        op: Any = "average",
        compression: Optional[Compressor] = None,
        gradient_predivide_factor: float = 1.0,
        reduce: Optional[Reduction] = None,
    ) -> None:
        if isinstance(tape, DistributedGradientTape):
            raise TypeError("this tape is already a DistributedGradientTape")
        self._tape = tape
        self._reduce = reduce or _GradientReduction(op, compression, gradient_predivide_factor)

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
    ) -> Any:
        """The wrapped tape's gradient(), all-reduced over every rank as one fused collective, in
        the same structure; None gradients stay None."""
        grads = self._tape.gradient(
            target, sources, output_gradients=output_gradients, unconnected_gradients=unconnected_gradients
        )
        flat = tf.nest.flatten(grads)  # None and IndexedSlices are leaves
        return tf.nest.pack_sequence_as(grads, self._reduce(flat, tf.nest.flatten(sources)))

    def __enter__(self) -> "DistributedGradientTape":
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._tape.__exit__(*exc)

    def __getattr__(self, attr: str) -> Any:  # watch, stop_recording, reset, jacobian, ...
        return getattr(self._tape, attr)


class _AllReducingOptimizer:
    """Mixed in before a Keras 3 optimizer class: ``apply`` (which ``apply_gradients`` and
    ``model.fit`` call) all-reduces the gradients, then applies them as the optimizer would.
    Reducing before anything else (loss-scale checks, clipping, weight decay, accumulation)
    makes those see the global gradient, identically on every rank."""

    _rs_reduce = None  # a _GradientReduction, set by DistributedOptimizer

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> Any:
        variables = self._trainable_variables if trainable_variables is None and self.built else trainable_variables
        return super().apply(self._rs_reduce(list(grads), list(variables or ())), trainable_variables)


_distributed_classes: Dict[type, type] = {}


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    op: Any = "average",  # noqa: N802 - Horovod's name
    compression: Optional[Compressor] = None,
    gradient_predivide_factor: float = 1.0,
    reduce: Optional[Reduction] = None,
) -> keras.optimizers.Optimizer:
    """A copy of `optimizer` (a Keras 3 optimizer, not yet built) whose ``apply`` /
    ``apply_gradients`` all-reduce the gradients first; use it with ``model.fit`` or a custom
    loop. `op`, `compression`, `gradient_predivide_factor`, `reduce`: as for DistributedGradientTape. The
    copy's class has the original's name and module, so a saved model loads with the plain
    optimizer. With Keras's gradient_accumulation_steps, every micro-step's gradients are
    all-reduced (the result is the same; the traffic is not saved)."""
    reduction = reduce or _GradientReduction(op, compression, gradient_predivide_factor)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"DistributedOptimizer takes a Keras 3 optimizer (keras.optimizers.Optimizer), "
            f"not {type(optimizer).__name__}"
        )
    if isinstance(optimizer, _AllReducingOptimizer):
        raise TypeError("this optimizer is already a DistributedOptimizer")
    if optimizer.built:
        raise ValueError(
            f"{type(optimizer).__name__} is already built (it holds state that a copy would lose); "
            "wrap the optimizer before the first training step"
        )
    base = type(optimizer)
    cls = _distributed_classes.get(base)
    if cls is None:
        cls = type(
            base.__name__, (_AllReducingOptimizer, base), {"__module__": base.__module__, "__doc__": base.__doc__}
        )
        _distributed_classes[base] = cls
    wrapped = cls.from_config(optimizer.get_config())
    wrapped._rs_reduce = reduction
    return wrapped
