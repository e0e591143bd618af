"""NCCL's API for host memory, in the shape CuPy exposes it (cupy.cuda.nccl).

Rank 0 calls get_unique_id() and passes the bytes to every rank out of band (as with NCCL);
they carry the reducers' addresses, the job token and a fresh job id. Buffers are raw host
addresses (integers), counts are elements, datatypes and ops are NCCL's constants. Streams mean
nothing for host memory: the call returns when the collective is complete.
"""

from __future__ import annotations

import json
import secrets
from typing import Mapping, Optional

from reduction_server.config import settings
from reduction_server.config.discovery import discover_reducers
from reduction_server.errors import ConfigError
from reduction_server.wire.protocol import DType, ReduceOp

from .buffers import raw_view
from .communicator import Communicator

# ncclDataType_t
ncclInt8 = ncclChar = int(DType.INT8)
ncclUint8 = int(DType.UINT8)
ncclInt32 = ncclInt = int(DType.INT32)
ncclUint32 = int(DType.UINT32)
ncclInt64 = int(DType.INT64)
ncclUint64 = int(DType.UINT64)
ncclFloat16 = ncclHalf = int(DType.FLOAT16)
ncclFloat32 = ncclFloat = int(DType.FLOAT32)
ncclFloat64 = ncclDouble = int(DType.FLOAT64)
ncclBfloat16 = int(DType.BFLOAT16)
# ncclRedOp_t
ncclSum = int(ReduceOp.SUM)
ncclProd = int(ReduceOp.PROD)
ncclMax = int(ReduceOp.MAX)
ncclMin = int(ReduceOp.MIN)
ncclAvg = int(ReduceOp.AVG)

_PREFIX = b"RSUID1:"


def get_unique_id(environ: Optional[Mapping[str, str]] = None) -> bytes:
    """An id for a new job: the reducers (from the environment), the job token, a fresh job id."""
    body = {
        "reducers": list(discover_reducers(environ)),
        "token": settings.read("RS_JOB_TOKEN", environ),
        "job": secrets.randbits(64),
    }
    return _PREFIX + json.dumps(body, separators=(",", ":")).encode()


def parse_unique_id(unique_id: bytes) -> dict:
    """The reducers, token and job id in a get_unique_id() id (bytes or str); raises ConfigError
    if it is not one or is corrupt."""
    if isinstance(unique_id, str):
        unique_id = unique_id.encode()
    if not isinstance(unique_id, (bytes, bytearray)) or not unique_id.startswith(_PREFIX):
        raise ConfigError("not a reduction-server unique id (make one with get_unique_id() on one rank)")
    try:
        body = json.loads(unique_id[len(_PREFIX) :])
        reducers, token, job = body["reducers"], body["token"], body["job"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"corrupt reduction-server unique id: {exc}") from None
    # A job id that does not fit the header's 64 bits would only fail later, inside the handshake.
    if not (
        isinstance(reducers, list)
        and reducers
        and all(isinstance(a, str) for a in reducers)
        and isinstance(token, str)
        and type(job) is int
        and 0 <= job < 1 << 64
    ):
        raise ConfigError(
            "corrupt reduction-server unique id: expected a non-empty list of reducer "
            "addresses, a token string and a 64-bit unsigned job id"
        )
    return {"reducers": reducers, "token": token, "job": job}


def communicator_from_unique_id(unique_id: bytes, rank: int, world_size: int, **options) -> Communicator:
    """A Communicator for `rank` of `world_size` in the job a unique id describes; `options` go to Communicator."""
    uid = parse_unique_id(unique_id)
    return Communicator(uid["reducers"], rank, world_size, job_token=uid["token"], job_id=uid["job"], **options)


class NcclCommunicator:
    """cupy.cuda.nccl.NcclCommunicator(ndev, commId, rank) for host buffers."""

    def __init__(self, ndev: int, commId: bytes, rank: int) -> None:
        self._comm = communicator_from_unique_id(commId, rank, ndev)

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int = 0) -> None:
        """ncclAllReduce: reduce `count` elements at host address sendbuf over all ranks into
        recvbuf (which may be sendbuf); returns when done. ValueError for an op that is not
        NCCL's."""
        dtype, op = DType(datatype), ReduceOp.parse(op)
        if op is ReduceOp.BROADCAST:  # the wire's code for broadcast, not an NCCL op
            raise ValueError(f"op {int(op)} is not an NCCL reduction op; use bcast() or broadcast()")
        src, dst = raw_view(sendbuf, count, dtype), raw_view(recvbuf, count, dtype)
        if count:
            self._comm._start(src, dst, op, 0, None).wait()

    def broadcast(self, sendbuf: int, recvbuf: int, count: int, datatype: int, root: int, stream: int = 0) -> None:
        """ncclBroadcast: root's `count` elements at sendbuf into recvbuf on every rank; returns when done."""
        dtype = DType(datatype)
        if self._comm.rank == root and sendbuf != recvbuf and count:
            raw_view(recvbuf, count, dtype).data[:] = raw_view(sendbuf, count, dtype).data
        self.bcast(recvbuf, count, datatype, root, stream)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int = 0) -> None:
        """ncclBcast: overwrite `count` elements at buff on every rank with root's, in place;
        returns when done. ValueError for a root out of range."""
        if not 0 <= root < self._comm.world_size:
            raise ValueError(f"broadcast root {root} is out of range for {self._comm.world_size} ranks")
        buf = raw_view(buff, count, DType(datatype))
        if count:
            src = buf if self._comm.rank == root else None
            self._comm._start(src, buf, ReduceOp.BROADCAST, root, None).wait()

    def rank_id(self) -> int:
        """This communicator's rank (ncclCommUserRank)."""
        return self._comm.rank

    def size(self) -> int:
        """The number of ranks (ncclCommCount)."""
        return self._comm.world_size

    def destroy(self) -> None:
        """Close the underlying Communicator (ncclCommDestroy; abort() is the same)."""
        self._comm.close()

    abort = destroy
