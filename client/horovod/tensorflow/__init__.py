"""Horovod's TensorFlow 2 API over the reduction server.

    import reduction_server.client.horovod.tensorflow as hvd

    hvd.init()
    tape = hvd.DistributedGradientTape(tape)                  # in a custom loop
    hvd.broadcast_variables(model.variables, root_rank=0)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))   # model.fit

Every collective is one stateful tf.numpy_function (eager, inside tf.function and in model.fit;
not under XLA), matched across ranks by name (coordinator.py) as Horovod's are: ranks may call
them in their own order, and a name whose kind, shape, dtype or op differs across ranks fails
on every rank naming the ranks. `process_set=` runs one among a process set's ranks. A failed
collective raises HorovodInternalError, and one the ranks disagree on PreconditionError, which
is also tf.errors.FailedPreconditionError as Horovod's ops raise (inside tf.function, a
tf.errors.UnknownError carrying its message); a bad argument ArgumentError, which is both
ValueError and tf.errors.InvalidArgumentError.

Its modules, named as Horovod's own: docs/design.md, "Where each concept lives".
"""

from __future__ import annotations

from ..basics import (
    add_process_set,
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from ..build import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from ..compression import Compression
from ..exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ..ops import Adasum, Average, Max, Min, Product, Sum
from ..process_sets import ProcessSet, global_process_set
from .arrays import ArgumentError, init
from .functions import allgather_object, broadcast_object, broadcast_variables
from .gradients import DistributedGradientTape, DistributedOptimizer
from .mpi_ops import allgather, alltoall, barrier, broadcast, grouped_allgather, join
from .reductions import allreduce, grouped_allreduce, grouped_reducescatter, reducescatter

__all__ = [
    "Adasum",
    "ArgumentError",
    "Average",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "elastic",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "Product",
    "ProcessSet",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]


from . import elastic  # noqa: E402 - hvd.elastic, as Horovod's; it imports the modules above
