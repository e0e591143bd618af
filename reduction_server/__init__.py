"""reduction-server: all-reduce through CPU-only reducer processes over ZeroMQ.

The core (the wire, configuration, the reducer, the launcher and tools) lives here; the
worker-side library is `reduction_server.client`. The core never imports the client. The map of
the tree and its layers: docs/design.md, "Where each concept lives".
"""

from ._version import __version__
from .errors import CollectiveError, ConfigError, ProtocolError, ReductionServerError
from .wire.protocol import DType, ReduceOp

__all__ = [
    "CollectiveError",
    "ConfigError",
    "DType",
    "ProtocolError",
    "ReduceOp",
    "ReductionServerError",
    "__version__",
]
