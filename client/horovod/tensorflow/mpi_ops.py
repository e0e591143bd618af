"""Horovod's TensorFlow ops (its mpi_ops): allreduce, allgather, broadcast, alltoall and
reducescatter (alone and grouped), join and barrier. Each is one stateful tf.numpy_function over
arrays.py, so that it runs eagerly, inside tf.function and in model.fit (not under XLA), and a
grouped op submits its tensors together. Each carries the gradient Horovod registers for its op:

- allreduce: the gradient all-reduced with the same op and scale factors;
- allgather: the gradient averaged over the ranks, each rank's own rows of it;
- broadcast: the gradient averaged over the ranks on the root, zero elsewhere;
- alltoall: the gradient sent back where its rows came from;
- reducescatter: the gradient scaled as the forward scaled (times the set's size for Sum), gathered.

Unnamed collectives are named in call order ("allreduce.noname.7"; inside tf.function when it
is traced), the same on every rank that makes the same calls in the same order.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf  # the real tensorflow: absolute import

from reduction_server.wire.protocol import ReduceOp

from ...tensorflow.graph import as_list, refuse_xla
from .. import shares
from ..basics import coordinator, rank, set_root
from ..coordinator import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER, name_counter
from ..process_sets import ProcessSet, global_process_set
from ..requests import BARRIER_NAME
from . import arrays
from .arrays import ArgumentError

__all__ = ["allgather", "alltoall", "barrier", "broadcast", "grouped_allgather", "join"]

_counters = {kind: name_counter(kind) for kind in (ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER)}


def name_list(kind: str, name: Optional[str], count: int, grouped: bool = True) -> List[str]:
    """The collectives' names: `name` (else the next automatic one) for one tensor, `name`.i for a group's."""
    base = name or _counters[kind]()
    return [f"{base}.{i}" for i in range(count)] if grouped else [base]


def process_set_of(process_set: Optional[ProcessSet]) -> ProcessSet:
    """`process_set` (None: the global one), checked before any op is built: ValueError when it
    is unknown or this rank is not one of its members."""
    process_set = global_process_set if process_set is None else process_set
    coordinator(process_set)
    return process_set


def _op(what: str, run: Callable[..., Any], inputs: Sequence[tf.Tensor], tout: Sequence[tf.DType]) -> List[tf.Tensor]:
    """`run` over the inputs' arrays as one stateful tf.numpy_function (never pruned or reordered
    against the other collectives)."""
    refuse_xla(f"hvd.{what}")
    return as_list(tf.numpy_function(run, list(inputs), list(tout), stateful=True, name=f"Horovod{what.title()}"))


def _rows_shape(x: tf.Tensor, rows: Optional[int] = None) -> tf.TensorShape:
    """x's static shape with `rows` (None: unknown) as its first dimension."""
    return tf.TensorShape([rows]).concatenate(x.shape[1:]) if x.shape.rank != 0 else tf.TensorShape([rows])


def _differentiable(
    what: str,
    run: Callable[..., Any],
    tensors: Sequence[Any],
    shape: Callable[[tf.Tensor], tf.TensorShape],
    backward: Callable[[Sequence[tf.Tensor], Sequence[tf.Tensor]], List[tf.Tensor]],
) -> List[tf.Tensor]:
    """`run` over the tensors' arrays as one op, each output of its input's dtype and of
    shape(input); its gradient backward(inputs, output gradients)."""

    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> tuple:
        outs = _op(what, run, xs, [x.dtype for x in xs])
        for out, x in zip(outs, xs):
            out.set_shape(shape(x))
        return outs, lambda *dys: backward(xs, dys)

    return forward(*[tf.convert_to_tensor(t) for t in tensors])


def _same_shape(x: tf.Tensor) -> tf.TensorShape:
    return x.shape


def reduce_tensors(
    tensors: Sequence[Any],
    names: Sequence[str],
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
    wires: Sequence[str] = (),
    residuals: Sequence[Optional[np.ndarray]] = (),
) -> List[tf.Tensor]:
    """Dense tensors all-reduced over the set's ranks, submitted together; differentiable (the
    gradient goes uncompressed). `wires` and `residuals`: as for arrays.reduce."""
    return _differentiable(
        "allreduce",
        lambda *a: arrays.reduce(ALLREDUCE, a, names, op, prescale, postscale, process_set, wires, residuals),
        tensors,
        _same_shape,
        lambda xs, dys: reduce_tensors(dys, name_list(ALLREDUCE, None, len(dys)), op, prescale, postscale, process_set),
    )


def _average(grads: Sequence[tf.Tensor], process_set: ProcessSet) -> List[tf.Tensor]:
    return reduce_tensors(grads, name_list(ALLREDUCE, None, len(grads)), ReduceOp.AVG, 1.0, 1.0, process_set)


def gather_tensors(tensors: Sequence[Any], names: Sequence[str], process_set: ProcessSet) -> List[tf.Tensor]:
    """Every rank's tensors concatenated along the first dimension, in rank order; differentiable."""

    def backward(xs: Sequence[tf.Tensor], dys: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        averaged = _average(dys, process_set)
        # Every rank's row counts, to find this rank's rows in the gathered gradient.
        rows = tf.stack([tf.shape(x)[0] if x.shape.rank != 0 else 1 for x in xs])
        counts = gather_tensors([rows], name_list(ALLGATHER, None, 1, False), process_set)[0]
        offsets = tf.reduce_sum(tf.reshape(counts, [-1, len(xs)])[: process_set.rank()], axis=0)
        return [
            tf.reshape(g[offsets[i] : offsets[i] + rows[i]], tf.shape(x)) for i, (g, x) in enumerate(zip(averaged, xs))
        ]

    return _differentiable("allgather", lambda *a: arrays.gather(a, names, process_set), tensors, _rows_shape, backward)


def broadcast_tensors(
    tensors: Sequence[Any], names: Sequence[str], root_rank: int, process_set: ProcessSet
) -> List[tf.Tensor]:
    """root_rank's tensors on every rank of the set, submitted together; differentiable."""

    def backward(xs: Sequence[tf.Tensor], dys: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        averaged = _average(dys, process_set)
        return averaged if rank() == root_rank else [g * 0 for g in averaged]

    return _differentiable(
        "broadcast", lambda *a: arrays.broadcast(a, names, root_rank, process_set), tensors, _same_shape, backward
    )


def reducescatter_tensors(
    tensors: Sequence[Any],
    names: Sequence[str],
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
) -> List[tf.Tensor]:
    """Each tensor reduced over the set's ranks, each rank keeping its share of the first
    dimension (the first rows % size ranks one row more); differentiable."""
    values = [tf.convert_to_tensor(t) for t in tensors]
    if any(v.shape.rank == 0 for v in values):
        raise ArgumentError(
            "reducescatter needs tensors of at least one dimension (it divides the first); got a scalar"
        )
    coord = coordinator(process_set)

    def share(x: tf.Tensor) -> tf.TensorShape:
        rows = x.shape[0] if x.shape.rank else None
        return _rows_shape(x, None if rows is None else shares.piece(rows, coord.rank, coord.size)[1])

    def backward(xs: Sequence[tf.Tensor], dys: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        factor = (coord.size if op is ReduceOp.SUM else 1) * prescale * postscale
        scaled = [dy if factor == 1.0 else dy * tf.cast(factor, dy.dtype) for dy in dys]
        return gather_tensors(scaled, name_list(ALLGATHER, None, len(dys)), process_set)

    return _differentiable(
        "reducescatter",
        lambda *a: arrays.reducescatter(a, names, op, prescale, postscale, process_set),
        values,
        share,
        backward,
    )


def allgather(
    tensor: Any,
    name: Optional[str] = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Horovod's hvd.allgather: every rank's `tensor` (of the set) concatenated along the first
    dimension, which may differ across ranks (the others may not), in rank order; differentiable."""
    process_set = process_set_of(process_set)  # checked before a name is taken: every rank takes the same
    return gather_tensors([tensor], name_list(ALLGATHER, name, 1, False), process_set)[0]


def grouped_allgather(
    tensors: Sequence[Any],
    name: Optional[str] = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> List[tf.Tensor]:
    """Horovod's hvd.grouped_allgather: allgathers of a list of tensors, submitted together; differentiable."""
    process_set = process_set_of(process_set)
    return gather_tensors(tensors, name_list(ALLGATHER, name, len(tensors)), process_set)


def broadcast(
    tensor: Any,
    root_rank: int,
    name: Optional[str] = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Horovod's hvd.broadcast: root_rank's `tensor` (a global rank, a member of the set) on every
    rank of the set; differentiable."""
    process_set = process_set_of(process_set)
    set_root(process_set, root_rank)  # a root outside the set fails here, before the op is built
    return broadcast_tensors([tensor], name_list(BROADCAST, name, 1, False), root_rank, process_set)[0]


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: Optional[str] = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Horovod's hvd.alltoall: splits[i] rows of `tensor` (along the first dimension, in order)
    go to rank i of the set; without splits, equal shares. Returns the rows received, in rank
    order, and, when `splits` was given, also how many came from each rank (int32), as Horovod's
    returns; differentiable."""
    process_set = process_set_of(process_set)
    value = tf.convert_to_tensor(tensor)
    if value.shape.rank == 0:
        raise ArgumentError("alltoall needs a tensor of at least one dimension; got a scalar")
    given = tf.constant([], tf.int32) if splits is None else tf.convert_to_tensor(splits)
    if not given.dtype.is_integer:
        raise ArgumentError(f"alltoall's splits must be integers, got {given.dtype.name}")
    [name] = name_list(ALLTOALL, name, 1, False)

    @tf.custom_gradient
    def forward(x: tf.Tensor, counts: tf.Tensor) -> tuple:
        out, received = _op(
            "alltoall", lambda a, s: arrays.alltoall(a, s, name, process_set), [x, counts], [x.dtype, tf.int32]
        )
        out.set_shape(_rows_shape(x))
        received.set_shape([process_set.size()])

        def grad(dy: tf.Tensor, _: Any) -> tuple:
            return alltoall(dy, received, process_set=process_set)[0], None

        return (out, received), grad

    output, received = forward(value, tf.cast(given, tf.int32))
    return output if splits is None else (output, received)


def join() -> tf.Tensor:
    """Horovod's hvd.join: this rank has no more data; until every rank has joined it takes part
    in the others' collectives with zeros (an all-reduce's Average still divides by every rank).
    Returns the rank that joined last (an int32 scalar), the same on every rank."""
    last = _op("join", arrays.join, [], [tf.int32])[0]
    last.set_shape([])
    return last


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the set has reached its barrier (inside tf.function, when the op runs)."""
    process_set = process_set_of(process_set)
    _op("barrier", lambda: arrays.barrier(BARRIER_NAME, process_set), [], [])
