"""The adapter's collectives as TensorFlow ops: each a stateful tf.numpy_function, so that every
rank runs them in one order, eagerly, inside tf.function and in model.fit."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np
import tensorflow as tf  # the real tensorflow: absolute import

from reduction_server.wire.protocol import ReduceOp

from .collectives import Compressor, collectives, size
from .graph import as_list, dense, refuse_xla


def reduce_arrays(
    arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp, compression: Optional[Compressor]
) -> List[np.ndarray]:
    """All-reduce NumPy arrays through the current Collectives, compressed on the wire if asked;
    the results have the inputs' dtypes and shapes."""
    if compression is None:
        return collectives().reduce([np.require(a, requirements="C") for a in arrays], names, op)
    wires, contexts = [], []
    for array in arrays:
        wire, ctx = compression.compress(array)
        wires.append(np.require(wire, requirements="C"))  # (ascontiguousarray would make 0-d arrays 1-d)
        contexts.append(ctx)
    results = []
    for name, array, out, ctx in zip(names, arrays, collectives().reduce(wires, names, op), contexts):
        out = compression.decompress(out, ctx)
        if out.dtype != array.dtype:
            raise TypeError(
                f"compression {getattr(compression, '__name__', type(compression).__name__)}"
                f".decompress returned {out.dtype} for tensor {name!r}, which was {array.dtype}"
            )
        results.append(out)
    return results


def grouped_allreduce(
    tensors: Sequence[Any],
    op: Any = "average",
    compression: Optional[Compressor] = None,
    names: Optional[Sequence[str]] = None,
    name: str = "tensor",
) -> List[Optional[tf.Tensor]]:
    """All-reduce a list of tensors as one fused collective (one tf.numpy_function call).

    `op`: "average" (default), "sum", "min", "max", "product". `None` entries stay `None`;
    IndexedSlices are made dense. `names` (default: `name`.0, `name`.1, ...) identify the tensors
    in the fusion plan, which every rank must build alike: a rank whose tensors differ in count,
    shape, dtype or name gets a CollectiveError naming the ranks (inside tf.function it surfaces
    as a tf.errors error carrying that message). Works eagerly and inside tf.function, not
    under XLA."""
    reduce_op = ReduceOp.parse(op)
    tensors = list(tensors)
    if names is not None and len(names) != len(tensors):
        raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
    names = [f"{name}.{i}" for i in range(len(tensors))] if names is None else [str(n) for n in names]
    present = [i for i, t in enumerate(tensors) if t is not None]
    if not present:
        return list(tensors)
    refuse_xla("the reduction_server all-reduce")
    values = [dense(tensors[i], names[i]) for i in present]
    kept = [names[i] for i in present]

    def run(*arrays: np.ndarray) -> List[np.ndarray]:
        return reduce_arrays(arrays, kept, reduce_op, compression)

    with tf.name_scope("ReductionServerAllreduce"):
        outputs = as_list(tf.numpy_function(run, values, [t.dtype for t in values], stateful=True))
    results: List[Optional[tf.Tensor]] = [None] * len(tensors)
    for i, src, out in zip(present, values, outputs):
        out.set_shape(src.shape)
        results[i] = out
    return results


def allreduce(
    tensor: Any, op: Any = "average", compression: Optional[Compressor] = None, name: str = "tensor"
) -> tf.Tensor:
    """All-reduce one tensor (see grouped_allreduce)."""
    if tensor is None:
        raise ValueError(f"allreduce: {name} is None")
    return grouped_allreduce([tensor], op, compression, names=[name])[0]


# -- broadcast --------------------------------------------------------------------------------


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0) -> None:
    """Overwrite every variable (tf.Variable or keras.Variable) with root_rank's value, as one
    collective. Every rank must pass the same variables in the same order (same shapes and
    dtypes; a difference is a CollectiveError naming the ranks). Eager or inside tf.function."""
    variables = list(variables)
    if not variables:
        return
    world = size()
    if not (isinstance(root_rank, int) and 0 <= root_rank < world):
        raise ValueError(f"broadcast_variables: root_rank {root_rank!r} is out of range for world size {world}")
    refuse_xla("broadcast_variables")
    values = [tf.convert_to_tensor(v) for v in variables]
    names = [f"variable.{i}" for i in range(len(values))]

    def run(*arrays: np.ndarray) -> List[np.ndarray]:
        return collectives().broadcast(arrays, names, root_rank)

    with tf.name_scope("ReductionServerBroadcast"):
        outputs = as_list(tf.numpy_function(run, values, [v.dtype for v in values], stateful=True))
    for variable, value, out in zip(variables, values, outputs):
        out.set_shape(value.shape)
        variable.assign(out)
