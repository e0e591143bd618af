"""Horovod's reductions of TensorFlow tensors: allreduce and reducescatter (alone and grouped),
compressed on the wire if asked (a cast; for an allreduce's float tensors also int8 blocks). An
allreduce of tf.IndexedSlices (an embedding's sparse gradient) gathers their values and indices
from every rank instead, as Horovod does: duplicate indices add up when the result is applied or
made dense."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np
import tensorflow as tf  # the real tensorflow: absolute import

from reduction_server.wire.protocol import ReduceOp

from ..compression import Compression, cast_only, wire_format
from ..coordinator import ALLREDUCE, REDUCESCATTER
from ..ops import Average, resolve_op
from ..process_sets import ProcessSet, global_process_set
from .mpi_ops import gather_tensors, name_list, process_set_of, reduce_tensors, reducescatter_tensors


def reduce_any(
    tensors: Sequence[Any],
    names: Sequence[str],
    op: ReduceOp,
    compression: Any,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
    residuals: Sequence[Optional[np.ndarray]] = (),
) -> List[Any]:
    """Dense tensors all-reduced together (compressed: cast, or, under Compression.int8, float
    ones sent as int8 blocks); IndexedSlices gathered together (op Average divides their values
    by the set's size); None stays None. residuals[i], if given and not None: tensor i's error
    feedback (arrays.reduce), for a float32 tensor under Compression.int8."""
    results = list(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if t is not None and i not in sparse]
    if sparse:
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
        if prescale != 1.0 or postscale != 1.0:
            raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
        slices = [tensors[i] for i in sparse]
        gathered = gather_tensors(
            [s.values for s in slices] + [s.indices for s in slices],
            [f"{names[i]}.values" for i in sparse] + [f"{names[i]}.indices" for i in sparse],
            process_set,
        )
        for i, s, values, indices in zip(sparse, slices, gathered, gathered[len(sparse) :]):
            if op is ReduceOp.AVG:
                values = values / tf.cast(process_set.size(), values.dtype)
            results[i] = tf.IndexedSlices(values, indices, dense_shape=s.dense_shape)
    if dense:
        compressed = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
        reduced = reduce_tensors(
            [c for c, _ in compressed],
            [names[i] for i in dense],
            op,
            prescale,
            postscale,
            process_set,
            [wire_format(compression, c) for c, _ in compressed],
            [residuals[i] for i in dense] if residuals else (),
        )
        for i, out, (_, ctx) in zip(dense, reduced, compressed):
            results[i] = compression.decompress(out, ctx)
    return results


def allreduce(
    tensor: Any,
    average: Optional[bool] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """Horovod's hvd.allreduce: `tensor` reduced over the ranks of the set (Average by default),
    scaled before and after (integers in float64); a tf.IndexedSlices is gathered instead.
    Compression.int8 sends a float tensor as int8 blocks (op Sum or Average; other tensors go as
    they are). Differentiable."""
    process_set = process_set_of(process_set)  # checked before a name is taken: every rank takes the same
    return reduce_any(
        [tensor],
        name_list(ALLREDUCE, name, 1, False),
        resolve_op(op, average),
        compression,
        prescale_factor,
        postscale_factor,
        process_set,
    )[0]


def grouped_allreduce(
    tensors: Sequence[Any],
    average: Optional[bool] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    name: Optional[str] = None,
) -> List[Any]:
    """Horovod's hvd.grouped_allreduce: the reductions of `tensors`, submitted together (fused up
    to the fusion threshold); IndexedSlices are gathered. Differentiable."""
    tensors, process_set = list(tensors), process_set_of(process_set)
    if not tensors:
        return tensors
    return reduce_any(
        tensors,
        name_list(ALLREDUCE, name, len(tensors)),
        resolve_op(op, average),
        compression,
        prescale_factor,
        postscale_factor,
        process_set,
    )


def _scatter(
    tensors: Sequence[Any],
    name: Optional[str],
    grouped: bool,
    compression: Any,
    op: int,
    process_set: ProcessSet,
    prescale: float,
    postscale: float,
) -> List[Any]:
    cast_only(compression, "TensorFlow's reducescatter")
    process_set = process_set_of(process_set)  # checked before a name is taken: every rank takes the same
    names = name_list(REDUCESCATTER, name, len(tensors), grouped)
    compressed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    shares = reducescatter_tensors([c for c, _ in compressed], names, resolve_op(op), prescale, postscale, process_set)
    return [compression.decompress(s, ctx) for s, (_, ctx) in zip(shares, compressed)]


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: int = Average,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Horovod's hvd.reducescatter: `tensor` reduced over the set's ranks (Average by default),
    each rank keeping its share of the first dimension (the first rows % size ranks one row
    more); a scalar is an error. Differentiable."""
    return _scatter([tensor], name, False, compression, op, process_set, prescale_factor, postscale_factor)[0]


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: Any = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> List[Any]:
    """Horovod's hvd.grouped_reducescatter: reducescatters of `tensors`, submitted together; differentiable."""
    tensors = list(tensors)
    if not tensors:
        return tensors
    return _scatter(tensors, None, True, compression, op, process_set, prescale_factor, postscale_factor)
