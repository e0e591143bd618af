"""reduction-server: all-reduce through CPU-only reducer processes over ZeroMQ.

The core (protocol, reducer, discovery, launcher) lives here; the worker-side library is
`reduction_server.client`. The core never imports the client.
"""
from .errors import CollectiveError, ConfigError, ProtocolError, ReductionServerError
from ._version import __version__
from .wire.protocol import DType, ReduceOp

__all__ = ["CollectiveError", "ConfigError", "DType", "ProtocolError", "ReduceOp",
           "ReductionServerError", "__version__"]
