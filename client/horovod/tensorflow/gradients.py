"""Horovod's DistributedGradientTape and DistributedOptimizer: the TensorFlow adapter's tape and
Keras 3 optimizer (client/tensorflow/gradients.py), their gradients reduced as Horovod reduces
them: among a process set's ranks (left as they are on a rank outside the set, or in a set of
one), IndexedSlices gathered unless sparse_as_dense, gradient_predivide_factor split into a
prescale and a postscale, every gradient submitted together (one op per step). Under
Compression.int8 each float32 gradient carries its variable's error feedback residual (EF-SGD,
client/error_feedback.py): what compressing its last gradient lost, added to the next."""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf  # the real tensorflow: absolute import

from reduction_server.wire.protocol import ReduceOp

from ... import tensorflow as rstf
from ...tensorflow.gradients import Reduction
from ..compression import Compression, wire_format
from ..ops import Average, resolve_op
from ..process_sets import ProcessSet, global_process_set
from .reductions import reduce_any

_made = itertools.count()


class _Residuals:
    """Error feedback's residual of each variable (a float32 array on the host) for as long as the
    variable lives: a tape made anew every step, and each retrace of a tf.function, find the
    residual of the step before. The ops that use one hold the array itself."""

    def __init__(self) -> None:
        self._by_id: Dict[int, np.ndarray] = {}

    def get(self, variable: Any, size: int) -> np.ndarray:
        """`variable`'s residual of `size` elements (zeros at first, or when its size changed)."""
        key = id(variable)
        residual = self._by_id.get(key)
        if residual is None:
            weakref.finalize(variable, self._by_id.pop, key, None)
        if residual is None or residual.size != size:
            residual = self._by_id[key] = np.zeros(size, np.float32)
        return residual

    def of(self, variable: Any) -> Optional[np.ndarray]:
        """`variable`'s residual, None before its first compressed gradient."""
        return self._by_id.get(id(variable))


residuals = _Residuals()


def _residuals(compression: Any, grads: Sequence[Any], sources: Sequence[Any]) -> List[Optional[np.ndarray]]:
    """Each gradient's error feedback residual: its variable's, for a dense float32 gradient of
    known size sent as int8 blocks; None for the others."""
    found: List[Optional[np.ndarray]] = []
    for grad, source in itertools.zip_longest(grads, sources[: len(grads)]):
        dense = grad is not None and not isinstance(grad, tf.IndexedSlices) and source is not None
        size = tf.convert_to_tensor(grad).shape.num_elements() if dense else None
        float32 = dense and grad.dtype == tf.float32 and wire_format(compression, grad)
        found.append(residuals.get(source, size) if float32 and size is not None else None)
    return found


def _reduction(
    name: str,
    compression: Any,
    sparse_as_dense: bool,
    op: int,
    gradient_predivide_factor: float,
    num_groups: int,
    groups: Any,
    process_set: Optional[ProcessSet],
    error_feedback: bool,
) -> Reduction:
    """How Horovod reduces a step's gradients (its _make_allreduce_grads_fn), checked as Horovod
    checks its arguments. `groups` only sets how Horovod's ops are fused; here the negotiation
    fuses every gradient of the step that fits the threshold. `error_feedback`: under
    Compression.int8, each float32 gradient carries its variable's residual."""
    rop = resolve_op(op)
    if gradient_predivide_factor != 1.0 and rop is not ReduceOp.AVG:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=2,
        )
        groups = num_groups if groups is None else groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    process_set = global_process_set if process_set is None else process_set
    # Each tape or optimizer its own names: two in one step (a GAN's) may run side by side. Every
    # rank makes them in the same order, so the names agree.
    name = f"{name}.{next(_made)}"
    # Horovod's Average over the set, split: 1/f before the sum, f/size after it (keeps float16 sums in range).
    prescale, postscale = (
        (1.0 / gradient_predivide_factor, gradient_predivide_factor) if rop is ReduceOp.AVG else (1.0, 1.0)
    )

    def reduce(grads: List[Any], sources: List[Any]) -> List[Any]:
        if not (process_set.included() and process_set.size() > 1):
            return list(grads)
        if sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        return reduce_any(
            grads,
            [f"{name}.{i}" for i in range(len(grads))],
            rop,
            compression,
            prescale,
            postscale,
            process_set,
            _residuals(compression, grads, sources) if error_feedback else (),
        )

    return reduce


def DistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",  # noqa: N802 - Horovod's name
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    error_feedback: bool = True,
) -> rstf.DistributedGradientTape:
    """Horovod's hvd.DistributedGradientTape: `gradtape`, whose gradient() returns the gradients
    reduced (averaged) over the ranks of `process_set`. Under `compression=Compression.int8`,
    `error_feedback` adds to each float32 gradient of a variable what compressing its last one
    lost (EF-SGD; a float32 residual per variable on the host)."""
    return rstf.DistributedGradientTape(
        gradtape,
        reduce=_reduction(
            "DistributedGradientTape",
            compression,
            sparse_as_dense,
            op,
            gradient_predivide_factor,
            num_groups,
            groups,
            process_set,
            error_feedback,
        ),
    )


def _times(grad: Any, factor: float) -> Any:
    """A gradient (dense, IndexedSlices or None) times `factor`, in its own dtype."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def _summing(reduction: Reduction, passes: int) -> Reduction:
    """`reduction`, its gradients then multiplied by `passes`: Keras's gradient accumulation
    applies the mean of the `passes` micro-steps' gradients, so each contributes `passes` times
    its own for the update to be their sum."""

    def reduce(grads: List[Any], sources: List[Any]) -> List[Any]:
        return [_times(g, float(passes)) for g in reduction(grads, sources)]

    return reduce


def DistributedOptimizer(
    optimizer: Any,
    name: Optional[str] = None,
    device_dense: str = "",  # noqa: N802
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    error_feedback: bool = True,
) -> Any:
    """Horovod's hvd.DistributedOptimizer: a Keras 3 optimizer whose apply()/apply_gradients()
    (and so model.fit) reduce the gradients over the ranks of `process_set` first.
    `error_feedback`: as for DistributedGradientTape, under Compression.int8.

    backward_passes_per_step > 1 uses Keras's own gradient accumulation (gradient_accumulation_steps):
    the weights are updated once every that many steps, as in Horovod, with the (reduced)
    gradients of those steps summed, or averaged (divided by backward_passes_per_step) when
    average_aggregated_gradients is true. With backward_passes_per_step 1,
    average_aggregated_gradients changes nothing, as in Horovod."""
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}")
    reduction = _reduction(
        name or f"Distributed{type(optimizer).__name__}",
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        error_feedback,
    )
    if backward_passes_per_step > 1:
        config = optimizer.get_config()
        config["gradient_accumulation_steps"] = backward_passes_per_step
        optimizer = type(optimizer).from_config(config)
        if not average_aggregated_gradients:  # Keras averages the accumulated gradients; Horovod sums them by default
            reduction = _summing(reduction, backward_passes_per_step)
    return rstf.DistributedOptimizer(optimizer, reduce=reduction)
