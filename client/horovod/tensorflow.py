"""Horovod's TensorFlow 2 API over the reduction server.

    import reduction_server.client.horovod.tensorflow as hvd

    hvd.init()
    tape = hvd.DistributedGradientTape(tape)                  # in a custom loop
    hvd.broadcast_variables(model.variables, root_rank=0)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))   # model.fit

Built on the TensorFlow adapter (reduction_server.client.tensorflow: one tf.numpy_function per
step, stateful, refused under XLA), with its collectives matched across ranks by name
(coordinator.py) instead of by order, as Horovod's are: every rank may call them in its own
order, and a name whose shape, dtype or op differs across ranks fails naming the ranks.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np
import tensorflow as tf  # the real tensorflow: absolute import

from reduction_server.protocol import ReduceOp

from .. import tensorflow as rstf
from . import basics
from .basics import (allgather_object, broadcast_object, cross_rank, cross_size, is_initialized, local_rank,
                     local_size, rank, shutdown, size)
from .compression import Compression
from .coordinator import ALLGATHER, ALLREDUCE, BROADCAST, name_counter
from .ops import Adasum, Average, Max, Min, Product, Sum, check_process_set, resolve_op

__all__ = ["Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer", "Max", "Min",
           "Product", "Sum", "allgather", "allgather_object", "allreduce", "broadcast", "broadcast_object",
           "broadcast_variables", "cross_rank", "cross_size", "grouped_allreduce", "init", "is_initialized",
           "local_rank", "local_size", "rank", "shutdown", "size"]

_names = {kind: name_counter(kind) for kind in (ALLREDUCE, ALLGATHER, BROADCAST)}


class NegotiatedCollectives:
    """The TensorFlow adapter's collectives, negotiated by name (installed by init())."""

    @property
    def rank(self) -> int:
        """This process's rank (hvd.rank())."""
        return basics.rank()

    @property
    def size(self) -> int:
        """The number of ranks (hvd.size())."""
        return basics.size()

    def reduce(self, arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp) -> List[np.ndarray]:
        """Collectives.reduce: all-reduce the arrays with `op`, matched across ranks by `names`
        and fused together; the results in new arrays."""
        return _negotiate(ALLREDUCE, arrays, names, op=op)

    def broadcast(self, arrays: Sequence[np.ndarray], names: Sequence[str], root: int) -> List[np.ndarray]:
        """Collectives.broadcast: root's arrays on every rank, matched across ranks by `names`;
        the results in new arrays."""
        return _negotiate(BROADCAST, arrays, names, root=root)


def _negotiate(kind: str, arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp = ReduceOp.SUM,
               root: int = 0) -> List[np.ndarray]:
    """Submit every array at once (so they are negotiated, and fused, together), then wait. The
    inputs (numpy_function's read-only views of the tensors) are sent as they are; the results
    land in new arrays."""
    if len(set(names)) != len(names):
        raise ValueError(f"tensor names repeat within one call: {sorted({n for n in names if names.count(n) > 1})}")
    sends = [np.require(a, requirements="C") for a in arrays]
    outs = [np.empty(s.shape, s.dtype) for s in sends]
    futures = [basics.submit(kind, name, s, out, op=op, root=root) for name, s, out in zip(names, sends, outs)]
    for future in futures:
        future.result()
    return outs


def init(comm: Any = None) -> None:
    """Join the job (basics.init) and route the TensorFlow adapter's collectives through the
    name-matching negotiation."""
    basics.init(comm)
    rstf.use_collectives(NegotiatedCollectives())


def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None, device_dense: str = "",
                      device_sparse: str = "", compression: Any = Compression.none, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: Optional[str] = None,
                      process_set: Any = None) -> List[Any]:
    """The reductions of `tensors` over all ranks, negotiated and fused together. IndexedSlices
    are made dense first (Horovod's sparse_as_dense)."""
    check_process_set(process_set)
    rop = resolve_op(op, average)
    name = name or _names[ALLREDUCE]()
    tensors = [rstf.scaled(rstf.dense(t, f"{name}.{i}"), prescale_factor) for i, t in enumerate(tensors)]
    reduced = rstf.grouped_allreduce(tensors, rop, compression, name=name)
    return [rstf.scaled(t, postscale_factor) for t in reduced]


def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "", device_sparse: str = "",
              compression: Any = Compression.none, op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None, process_set: Any = None) -> Any:
    """The reduction of `tensor` over all ranks (Average by default)."""
    name = name or _names[ALLREDUCE]()
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op, prescale_factor,
                             postscale_factor, name, process_set)[0]


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, process_set: Any = None) -> tf.Tensor:
    """root_rank's `tensor` on every rank."""
    check_process_set(process_set)
    name = name or _names[BROADCAST]()
    value = tf.convert_to_tensor(tensor)
    rstf.refuse_xla("broadcast")

    def run(array: np.ndarray) -> np.ndarray:
        return _negotiate(BROADCAST, [array], [name], root=root_rank)[0]

    out = tf.numpy_function(run, [value], value.dtype, stateful=True, name="ReductionServerBroadcast")
    out.set_shape(value.shape)
    return out


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, process_set: Any = None) -> None:
    """Overwrite every variable with root_rank's value."""
    check_process_set(process_set)
    rstf.broadcast_variables(variables, root_rank)


def allgather(tensor: Any, name: Optional[str] = None, process_set: Any = None) -> tf.Tensor:
    """Every rank's `tensor` concatenated along the first dimension (which may differ by rank)."""
    check_process_set(process_set)
    name = name or _names[ALLGATHER]()
    value = tf.convert_to_tensor(tensor)
    rstf.refuse_xla("allgather")

    def run(array: np.ndarray) -> np.ndarray:
        return basics.run(ALLGATHER, name, np.require(array, requirements="C"))

    out = tf.numpy_function(run, [value], value.dtype, stateful=True, name="ReductionServerAllgather")
    out.set_shape(tf.TensorShape([None]).concatenate(value.shape[1:]) if value.shape.rank else [None])
    return out


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",  # noqa: N802 - Horovod's name
                            device_sparse: str = "", compression: Any = Compression.none,
                            sparse_as_dense: bool = False, op: int = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                            process_set: Any = None) -> rstf.DistributedGradientTape:
    """`gradtape`, whose gradient() returns the gradients reduced (averaged) over all ranks."""
    check_process_set(process_set)
    return rstf.DistributedGradientTape(gradtape, resolve_op(op), compression,
                                        gradient_predivide_factor=gradient_predivide_factor)


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",  # noqa: N802
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                         process_set: Any = None) -> Any:
    """A Keras 3 optimizer whose apply()/apply_gradients() (and so model.fit) average the
    gradients over all ranks first. backward_passes_per_step > 1 uses Keras's own gradient
    accumulation (gradient_accumulation_steps)."""
    check_process_set(process_set)
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}")
    if backward_passes_per_step > 1:
        config = optimizer.get_config()
        config["gradient_accumulation_steps"] = backward_passes_per_step
        optimizer = type(optimizer).from_config(config)
    return rstf.DistributedOptimizer(optimizer, resolve_op(op), compression,
                                     gradient_predivide_factor=gradient_predivide_factor)
