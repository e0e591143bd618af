"""reduction_server.client.nccl: CuPy's NCCL API over host memory, against real reducers.

Ranks are threads of this process, each with its own NcclCommunicator; buffers are passed by
address (arr.ctypes.data), as CuPy code passes device pointers.
"""

import json

import ml_dtypes
import numpy as np
import pytest

import reduction_server.client as rs
from helpers import cluster
from helpers.cluster import TOKEN
from helpers.reference import check, make_input, np_dtype
from reduction_server.client import nccl
from reduction_server.client.nccl import NcclCommunicator, get_unique_id, parse_unique_id

pytestmark = pytest.mark.timeout(60)


DATATYPES = {  # NCCL constant -> dtype name in reference.py
    nccl.ncclInt8: "int8",
    nccl.ncclUint8: "uint8",
    nccl.ncclInt32: "int32",
    nccl.ncclUint32: "uint32",
    nccl.ncclInt64: "int64",
    nccl.ncclUint64: "uint64",
    nccl.ncclFloat16: "float16",
    nccl.ncclFloat32: "float32",
    nccl.ncclFloat64: "float64",
    nccl.ncclBfloat16: "bfloat16",
}
OPS = {nccl.ncclSum: "sum", nccl.ncclProd: "prod", nccl.ncclMax: "max", nccl.ncclMin: "min", nccl.ncclAvg: "avg"}


@pytest.fixture
def uid(group, monkeypatch):
    # NcclCommunicator takes no options: its timeouts come from the environment.
    monkeypatch.setenv("RS_TIMEOUT", "10")
    monkeypatch.setenv("RS_CONNECT_TIMEOUT", "5")
    monkeypatch.setenv("RS_CHUNK_BYTES", "4096")  # several chunks on both reducers for modest counts
    return get_unique_id({"RS_REDUCERS": group.spec, "RS_JOB_TOKEN": TOKEN})


def run_ranks(world, uid, body, limit=30.0):
    """body(comm, rank) on every rank, each a thread with its own NcclCommunicator."""
    return cluster.run_ranks(world, lambda rank: NcclCommunicator(world, uid, rank), body, limit)


# -- constants and unique ids --------------------------------------------------------------------
def test_constants_have_nccls_values():
    assert (
        nccl.ncclInt8,
        nccl.ncclChar,
        nccl.ncclUint8,
        nccl.ncclInt32,
        nccl.ncclInt,
        nccl.ncclUint32,
        nccl.ncclInt64,
        nccl.ncclUint64,
        nccl.ncclFloat16,
        nccl.ncclHalf,
        nccl.ncclFloat32,
        nccl.ncclFloat,
        nccl.ncclFloat64,
        nccl.ncclDouble,
        nccl.ncclBfloat16,
    ) == (0, 0, 1, 2, 2, 3, 4, 5, 6, 6, 7, 7, 8, 8, 9)
    assert (nccl.ncclSum, nccl.ncclProd, nccl.ncclMax, nccl.ncclMin, nccl.ncclAvg) == (0, 1, 2, 3, 4)
    assert all(type(v) is int for v in [*DATATYPES, *OPS])


def test_unique_id_carries_reducers_token_and_a_fresh_job():
    spec = "127.0.0.1:5555,[::1]:6000"
    uid = get_unique_id({"RS_REDUCERS": spec, "RS_JOB_TOKEN": TOKEN})
    assert isinstance(uid, bytes)
    parsed = parse_unique_id(uid)
    assert parsed["reducers"] == ["127.0.0.1:5555", "[::1]:6000"]
    assert parsed["token"] == TOKEN
    assert 0 <= parsed["job"] < 1 << 64
    assert parse_unique_id(uid.decode()) == parsed  # a str copy of the id works too
    assert parse_unique_id(bytearray(uid)) == parsed
    other = parse_unique_id(get_unique_id({"RS_REDUCERS": spec, "RS_JOB_TOKEN": TOKEN}))
    assert other["job"] != parsed["job"]  # every call starts a new job
    assert parse_unique_id(get_unique_id({"RS_REDUCERS": spec}))["token"] == ""


def test_unique_id_needs_reducers():
    with pytest.raises(rs.ConfigError, match="RS_REDUCERS"):
        get_unique_id({"RS_JOB_TOKEN": TOKEN})
    with pytest.raises(rs.ConfigError, match="RS_REDUCERS"):
        get_unique_id({"RS_REDUCERS": "nonsense"})


def _uid(body) -> bytes:
    return b"RSUID1:" + (body if isinstance(body, bytes) else json.dumps(body).encode())


GOOD = {"reducers": ["127.0.0.1:5555"], "token": "t", "job": 1}
CORRUPT = {
    "empty": b"",
    "no-prefix": b"garbage",
    "other-prefix": b"RSUID0:{}",
    "no-body": b"RSUID1:",
    "bad-json": b"RSUID1:{",
    "not-utf8": b"RSUID1:\xff\xfe",
    "list": b"RSUID1:[]",
    "null": b"RSUID1:null",
    "no-reducers": _uid({"token": "t", "job": 1}),
    "no-token": _uid({"reducers": ["127.0.0.1:5555"], "job": 1}),
    "no-job": _uid({"reducers": ["127.0.0.1:5555"], "token": "t"}),
    "job-text": _uid({**GOOD, "job": "x"}),
    "job-negative": _uid({**GOOD, "job": -1}),
    "job-65-bits": _uid({**GOOD, "job": 1 << 64}),
    "job-float": _uid({**GOOD, "job": 1.5}),
    "job-bool": _uid({**GOOD, "job": True}),
    "reducers-string": _uid({**GOOD, "reducers": "127.0.0.1:5555"}),
    "reducers-empty": _uid({**GOOD, "reducers": []}),
    "reducers-int": _uid({**GOOD, "reducers": [5555]}),
    "token-null": _uid({**GOOD, "token": None}),
    "none": None,
    "int": 12345,
    "tuple": ("tuple",),
}


@pytest.mark.parametrize("bad", CORRUPT.values(), ids=CORRUPT.keys())
def test_corrupt_ids_raise_config_error(bad, monkeypatch):
    assert parse_unique_id(_uid(GOOD)) == GOOD
    monkeypatch.setenv("RS_CONNECT_TIMEOUT", "1")  # should one get through to connecting, fail fast
    with pytest.raises(rs.ConfigError):
        parse_unique_id(bad)
    with pytest.raises(rs.ConfigError):  # refused before any connection is tried
        NcclCommunicator(2, bad, 0)


# -- collectives ------------------------------------------------------------------------------------
def test_all_reduce_every_datatype_and_op(uid):
    count = 1500  # several 4 KiB chunks for the wide types, with a tail
    world = 2

    def inputs(name, op, rank):
        return make_input(name, op, count, seed=17 * list(DATATYPES.values()).index(name) + len(op), rank=rank)

    def body(comm, rank):
        results = {}
        for datatype, name in DATATYPES.items():
            for op, op_name in OPS.items():
                x = inputs(name, op_name, rank)
                send = x.view(np.uint16) if name == "bfloat16" else x  # bfloat16 travels as its bits
                recv = np.zeros_like(send)
                comm.allReduce(send.ctypes.data, recv.ctypes.data, count, datatype, op, 0)
                assert send.tobytes() == x.tobytes(), "the send buffer was modified"
                results[name, op_name] = recv.view(np_dtype(name)) if name == "bfloat16" else recv
        return results

    for results in run_ranks(world, uid, body):
        for (name, op_name), result in results.items():
            error = check(result, [inputs(name, op_name, r) for r in range(world)], name, op_name)
            assert error == "", f"{name} {op_name}: {error}"


def test_all_reduce_in_place(uid):
    def body(comm, rank):
        x = np.arange(3000, dtype=np.float32) * (rank + 1)
        comm.allReduce(x.ctypes.data, x.ctypes.data, x.size, nccl.ncclFloat32, nccl.ncclSum)
        b = (np.arange(100, dtype=np.float32) + rank).astype(ml_dtypes.bfloat16).view(np.uint16)
        comm.allReduce(b.ctypes.data, b.ctypes.data, b.size, nccl.ncclBfloat16, nccl.ncclAvg, 0)
        i = np.full(10, rank + 5, np.int64)
        comm.allReduce(i.ctypes.data, i.ctypes.data, i.size, nccl.ncclInt64, nccl.ncclAvg)
        return x, b.view(ml_dtypes.bfloat16), i

    for x, b, i in run_ranks(2, uid, body):
        np.testing.assert_array_equal(x, np.arange(3000, dtype=np.float32) * 3)
        np.testing.assert_allclose(b.astype(np.float32), np.arange(100, dtype=np.float32) + 0.5, rtol=2**-7)
        assert i.tolist() == [5] * 10  # (5 + 6) / 2 truncated


def test_part_of_a_buffer_and_zero_count(uid):
    """count may cover only the start of the buffers; count 0 is a no-op (no rank sends)."""

    def body(comm, rank):
        comm.allReduce(0, 0, 0, nccl.ncclFloat32, nccl.ncclSum)
        send = np.full(10, rank + 1.0)
        recv = np.full(10, -1.0)
        comm.allReduce(send.ctypes.data, recv.ctypes.data, 4, nccl.ncclFloat64, nccl.ncclSum)
        return recv

    for recv in run_ranks(2, uid, body):
        assert recv.tolist() == [3.0] * 4 + [-1.0] * 6


def test_bcast_and_broadcast_from_every_root(uid):
    world = 3

    def body(comm, rank):
        out = []
        for root in range(world):
            buf = np.full((40, 30), 100 * rank + root, np.int32)  # a 2-D buffer of several chunks
            comm.bcast(buf.ctypes.data, buf.size, nccl.ncclInt32, root)
            send = np.arange(700, dtype=np.float64) + 1000 * rank
            recv = np.full(700, -1.0)
            comm.broadcast(send.ctypes.data, recv.ctypes.data, send.size, nccl.ncclFloat64, root, 0)
            assert send[0] == 1000 * rank, "broadcast wrote into the send buffer"
            same = np.full(5, rank, np.uint8)  # broadcast in place: sendbuf == recvbuf
            comm.broadcast(same.ctypes.data, same.ctypes.data, same.size, nccl.ncclUint8, root)
            out.append((buf, recv, same))
        return out

    for results in run_ranks(world, uid, body):
        for root, (buf, recv, same) in enumerate(results):
            assert (buf == 100 * root + root).all()
            np.testing.assert_array_equal(recv, np.arange(700, dtype=np.float64) + 1000 * root)
            assert same.tolist() == [root] * 5


def test_rank_id_size_and_argument_errors(uid):
    def body(comm, rank):
        assert comm.rank_id() == rank and comm.size() == 2
        x = np.zeros(4, np.float32)
        with pytest.raises(ValueError):
            comm.allReduce(x.ctypes.data, x.ctypes.data, 4, 10, nccl.ncclSum)  # no datatype 10
        with pytest.raises(ValueError):
            comm.allReduce(x.ctypes.data, x.ctypes.data, 4, nccl.ncclFloat32, 7)  # no op 7
        with pytest.raises(ValueError, match="broadcast"):  # the wire's broadcast code is not an NCCL op
            comm.allReduce(x.ctypes.data, x.ctypes.data, 4, nccl.ncclFloat32, int(rs.ReduceOp.BROADCAST))
        with pytest.raises(ValueError, match="NULL"):
            comm.allReduce(0, x.ctypes.data, 4, nccl.ncclFloat32, nccl.ncclSum)
        with pytest.raises(ValueError, match="root"):
            comm.bcast(x.ctypes.data, 4, nccl.ncclFloat32, 2)
        # The refused calls started nothing: the ranks are still in step.
        x[:] = rank + 1
        comm.allReduce(x.ctypes.data, x.ctypes.data, 4, nccl.ncclFloat32, nccl.ncclMax)
        return x

    for x in run_ranks(2, uid, body):
        assert x.tolist() == [2.0] * 4


def test_destroy_then_collective_raises(uid):
    comm = NcclCommunicator(1, uid, 0)
    x = np.ones(3, np.float32)
    comm.allReduce(x.ctypes.data, x.ctypes.data, 3, nccl.ncclFloat32, nccl.ncclSum)
    assert x.tolist() == [1.0] * 3
    comm.destroy()
    with pytest.raises(rs.CollectiveError, match="closed"):
        comm.allReduce(x.ctypes.data, x.ctypes.data, 3, nccl.ncclFloat32, nccl.ncclSum)
    comm.abort()  # harmless after destroy
