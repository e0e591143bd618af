"""Horovod's PyTorch API over the reduction server.

    import reduction_server.client.horovod.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())       # where there are GPUs
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Modules, as Horovod's own: mpi_ops (the collectives), functions (parameters and optimizer state
from the root), optimizer (DistributedOptimizer).
"""
from ..basics import (allgather_object, broadcast_object, cross_rank, cross_size, init, is_initialized, local_rank,
                      local_size, rank, shutdown, size)
from ..compression import Compression
from ..ops import Adasum, Average, Max, Min, Product, Sum
from .functions import broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (allgather, allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_, broadcast,
                      broadcast_, broadcast_async, broadcast_async_, grouped_allreduce, grouped_allreduce_,
                      grouped_allreduce_async, grouped_allreduce_async_, poll, synchronize)
from .optimizer import DistributedOptimizer

__all__ = ["Adasum", "Average", "Compression", "DistributedOptimizer", "Max", "Min", "Product", "Sum",
           "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
           "allreduce_async_", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
           "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "cross_rank", "cross_size",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "init", "is_initialized", "local_rank", "local_size", "poll", "rank", "shutdown", "size",
           "synchronize"]
