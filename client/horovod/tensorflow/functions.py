"""Horovod's TensorFlow functions: variables and picklable objects from the root rank, and
objects gathered from every rank, among the ranks of a process set."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import tensorflow as tf  # the real tensorflow: absolute import

from .. import basics
from ..coordinator import BROADCAST
from ..process_sets import ProcessSet, global_process_set
from .mpi_ops import broadcast_tensors, name_list, process_set_of


def broadcast_variables(
    variables: Sequence[Any], root_rank: int, process_set: ProcessSet = global_process_set, inplace: bool = False
) -> None:
    """Horovod's hvd.broadcast_variables: every variable (tf.Variable or keras.Variable) takes
    root_rank's value (a global rank, in the set) on every rank of the set, as one op (its
    broadcasts submitted together). Every rank passes the same variables in the same order.
    `inplace` is accepted for Horovod's signature: the values are assigned in place either way."""
    variables = list(variables)
    if not variables:
        return
    process_set = process_set_of(process_set)
    basics.set_root(process_set, root_rank)  # a root outside the set fails here, before the op is built
    values = broadcast_tensors(
        [tf.convert_to_tensor(v) for v in variables], name_list(BROADCAST, None, len(variables)), root_rank, process_set
    )
    for variable, value in zip(variables, values):
        variable.assign(value)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Horovod's hvd.broadcast_object: root_rank's `obj` (pickled) on every rank of the set.
    `session` (TensorFlow 1) is accepted for Horovod's signature."""
    return basics.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(
    obj: Any, session: Any = None, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> List[Any]:
    """Horovod's hvd.allgather_object: every rank's `obj` (pickled), in the set's rank order.
    `session` (TensorFlow 1) is accepted for Horovod's signature."""
    return basics.allgather_object(obj, name, process_set)
