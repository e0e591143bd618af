"""The worker-side library: an NCCL-style Communicator over the reducers.

import reduction_server.client as rs
with rs.Communicator.from_env() as comm:
    y = comm.all_reduce(x, op="sum")
"""

from reduction_server.errors import CollectiveError, ConfigError, ReductionServerError
from reduction_server.wire.protocol import DType, ReduceOp

from .communicator import Communicator, Handle
from .nccl import communicator_from_unique_id, get_unique_id

__all__ = [
    "CollectiveError",
    "Communicator",
    "ConfigError",
    "DType",
    "Handle",
    "ReduceOp",
    "ReductionServerError",
    "communicator_from_unique_id",
    "get_unique_id",
]
