"""The Communicator against real reducer processes, with ranks as threads of this process.

One pair of reducers serves the whole module (once per transport). They learn the world size from the first HELLO of
each job, and every test runs its own job (a fresh job id), so tests with different world sizes
follow one another on the same reducers.
"""

import array
import time

import ml_dtypes
import numpy as np
import pytest

import reduction_server
import reduction_server.client as rs
from helpers.cluster import TOKEN
from helpers.jobs import OPTIONS, connect, new_job, run_job
from helpers.reference import TWO_RANKS
from reduction_server.client.chunking import plan_chunks
from reduction_server.config.discovery import job_id_from

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def group(transport_group):
    """Every test runs twice, once per transport (conftest.transport_group)."""
    return transport_group


# -- configuration -------------------------------------------------------------------------
def test_from_env_sets_rank_world_and_reducers(group):
    def make(rank):
        environ = {"RS_REDUCERS": group.spec, "RS_RANK": str(rank), "RS_WORLD_SIZE": "2", "RS_JOB_TOKEN": TOKEN}
        return rs.Communicator.from_env(environ, timeout=5, connect_timeout=5)

    def body(comm, rank):
        assert (comm.rank, comm.world_size) == (rank, 2)
        assert comm.reducers == tuple(group.addresses)
        assert comm.job_id == job_id_from(TOKEN)
        return comm.all_reduce(np.array([rank + 1.0], np.float32))

    for result in run_job(2, body, make=make):
        assert result.tolist() == [3.0]


def test_from_env_without_reducers_is_a_config_error():
    with pytest.raises(rs.ConfigError, match="RS_REDUCERS"):
        rs.Communicator.from_env({"RS_RANK": "0", "RS_WORLD_SIZE": "1"})
    with pytest.raises(rs.ConfigError, match="RS_RANK"):
        rs.Communicator.from_env({"RS_REDUCERS": "127.0.0.1:5555", "RS_RANK": "2", "RS_WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    "rank,world,match",
    [
        (2, 2, "rank 2"),
        (-1, 2, "rank -1"),
        (0, 0, "world_size"),
        (0, -3, "world_size"),
        ("0", 2, "rank"),
        (0, "2", "world_size"),
        (0.0, 2, "rank"),
    ],
)
def test_rank_and_world_validation(rank, world, match):
    with pytest.raises(rs.ConfigError, match=match) as info:
        rs.Communicator(["127.0.0.1:5555"], rank, world, timeout=1, connect_timeout=1)
    assert isinstance(info.value, ValueError) and isinstance(info.value, reduction_server.ReductionServerError)


@pytest.mark.parametrize(
    "reducers,match",
    [
        ([], "no reducers"),
        ("", "no reducers"),
        (["127.0.0.1"], "port"),
        (["127.0.0.1:0"], "port"),
        (["host:abc"], "port"),
        (["127.0.0.1:5555", "127.0.0.1:5555"], "twice"),
        (["Host.example:5555", "host.example:5555"], "twice"),
    ],
)
def test_reducer_list_validation(reducers, match):
    with pytest.raises(rs.ConfigError, match=match):
        rs.Communicator(reducers, 0, 1, timeout=1, connect_timeout=1)


@pytest.mark.parametrize(
    "variable,value,match",
    [
        ("RS_PIPELINE_DEPTH", "0", "RS_PIPELINE_DEPTH"),
        ("RS_PIPELINE_DEPTH", "deep", "RS_PIPELINE_DEPTH"),
        ("RS_PIPELINE_DEPTH", "1025", "RS_PIPELINE_DEPTH"),
        ("RS_WINDOW", "257", "RS_WINDOW"),
        ("RS_SNDBUF", "100", r"RS_SNDBUF=100 must be `auto`, 0 \(the kernel's autotuning\) or 4096"),
        ("RS_SNDBUF", "-1", "RS_SNDBUF"),
        ("RS_SNDBUF", "16k", "RS_SNDBUF"),
    ],
)
def test_tuning_variables_are_validated(monkeypatch, variable, value, match):
    monkeypatch.setenv(variable, value)
    with pytest.raises(rs.ConfigError, match=match):
        rs.Communicator(["127.0.0.1:5555"], 0, 1, timeout=1, connect_timeout=1)


@pytest.mark.parametrize(
    "option,value",
    [
        ("pipeline_depth", 0),
        ("window", 0),
        ("window", 257),
        ("send_buffer", 100),
        ("send_buffer", (1 << 30) + 1),
        ("send_buffer", "16384"),
    ],
)
def test_tuning_arguments_are_validated(option, value):
    with pytest.raises(rs.ConfigError, match=option):
        rs.Communicator(["127.0.0.1:5555"], 0, 1, timeout=1, connect_timeout=1, **{option: value})


def test_pipeline_depth_sets_the_chunks_and_ranks_that_disagree_fail_naming_the_mismatch(group, monkeypatch):
    """Deeper pipelines cut the same buffer into more chunks, summed exactly; a rank configured
    with another depth than the others is caught by the reducers, on every rank, not summed."""
    x = np.arange(1 << 20, dtype=np.float32)  # 4 MiB over 2 reducers: 16 chunks at depth 8, 64 at 32
    assert len(plan_chunks(x.size, 4, 2, 4 << 20, 8)) == 16 and len(plan_chunks(x.size, 4, 2, 4 << 20, 32)) == 64
    for depth in (8, 32):
        for y in run_job(2, lambda comm, rank: comm.all_reduce(x * (rank + 1)), group=group, pipeline_depth=depth):
            np.testing.assert_array_equal(y, x * 3)
    monkeypatch.setenv("RS_PIPELINE_DEPTH", "24")  # not the default: the variable is what sets it
    with connect(group, 0, 1, new_job()) as comm:
        assert comm.pipeline_depth == 24

    def body(comm, rank):
        with pytest.raises(rs.CollectiveError, match="disagree") as info:
            comm.all_reduce(x)
        return str(info.value)

    job = new_job()
    errors = run_job(2, body, make=lambda rank: connect(group, rank, 2, job, pipeline_depth=32 if rank else 8))
    for e in errors:  # each rank names both plans
        assert "ranks [0] sent" in e and "count=65536" in e and "nchunks=16" in e, e
        assert "ranks [1] sent" in e and "count=16384" in e and "nchunks=64" in e, e
        assert "cut the same buffer differently" in e and "RS_PIPELINE_DEPTH" in e, e


def test_numpy_integer_rank_and_world(group):
    with connect(group, np.int64(0), np.int32(1), new_job()) as comm:
        assert (comm.rank, comm.world_size) == (0, 1)
        assert type(comm.rank) is int and type(comm.world_size) is int
        assert comm.all_reduce(np.arange(3)).tolist() == [0, 1, 2]


def test_reducers_as_comma_separated_string(group):
    with rs.Communicator(group.spec, 0, 1, job_id=new_job(), **OPTIONS) as comm:
        assert comm.reducers == tuple(group.addresses)
        assert "rank=0" in repr(comm)


def test_wrong_token_is_refused(group):
    with pytest.raises(rs.CollectiveError, match=r"did not prove the job token \(RS_JOB_TOKEN\)"):
        rs.Communicator(group.addresses, 0, 1, job_id=new_job(), job_token="wrong", timeout=2, connect_timeout=2)


# -- all_reduce: ops and values --------------------------------------------------------------
OP_SPELLINGS = [
    ("sum", "sum"),
    ("SUM", "sum"),
    (" Sum ", "sum"),
    ("avg", "avg"),
    ("AVG", "avg"),
    ("mean", "avg"),
    ("min", "min"),
    ("Min", "min"),
    ("max", "max"),
    ("MAX", "max"),
    ("prod", "prod"),
    ("Prod", "prod"),
    (rs.ReduceOp.SUM, "sum"),
    (rs.ReduceOp.PROD, "prod"),
    (rs.ReduceOp.MAX, "max"),
    (rs.ReduceOp.MIN, "min"),
    (rs.ReduceOp.AVG, "avg"),
    (0, "sum"),
    (1, "prod"),
    (2, "max"),
    (3, "min"),
    (4, "avg"),
    (np.int64(2), "max"),
]


def rank_input(rank, dtype=np.float64):
    return np.array([[1.0, -2.0, 3.5], [4.0, 0.5, -6.0]], dtype) * (rank + 1) + rank


def test_every_op_spelling(group):
    def body(comm, rank):
        return [comm.all_reduce(rank_input(rank), op=op) for op, _ in OP_SPELLINGS]

    results = run_job(2, body, group=group)
    for i, (op, name) in enumerate(OP_SPELLINGS):
        expected = TWO_RANKS[name](rank_input(0), rank_input(1))
        for rank in range(2):
            np.testing.assert_allclose(results[rank][i], expected, err_msg=f"op {op!r}")


@pytest.mark.parametrize("op", ["median", "broadcast", rs.ReduceOp.BROADCAST, 5, 64, -1, None, object()])
def test_unknown_ops_are_refused(solo, op):
    with pytest.raises(ValueError):
        solo.all_reduce(np.ones(3), op=op)


def test_integer_ops_are_exact(group):
    inputs = [np.array([7, -7, 2**31 - 1, 5], np.int32), np.array([2, 2, 1, -9], np.int32)]

    def body(comm, rank):
        return {op: comm.all_reduce(inputs[rank], op=op) for op in ["sum", "prod", "min", "max", "avg"]}

    a, b = inputs
    for result in run_job(2, body, group=group):
        assert result["sum"].tolist() == (a + b).tolist()  # wraps like int32 does
        assert result["prod"].tolist() == (a * b).tolist()
        assert result["min"].tolist() == np.minimum(a, b).tolist()
        assert result["max"].tolist() == np.maximum(a, b).tolist()
        assert result["avg"].tolist() == [4, -2, -(2**30), -2]  # (a + b) / 2 truncated toward zero (-5 / 2 is -2)
        assert all(r.dtype == np.int32 for r in result.values())


@pytest.mark.parametrize(
    "dtype",
    [
        np.int8,
        np.uint8,
        np.int32,
        np.uint32,
        np.int64,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        ml_dtypes.bfloat16,
    ],
)
def test_every_dtype_round_trips(group, dtype):
    def body(comm, rank):
        return comm.all_reduce(np.arange(1, 11).astype(dtype) * (rank + 1), op="sum")

    for result in run_job(2, body, group=group):
        assert result.dtype == np.dtype(dtype)
        assert result.astype(np.float64).tolist() == [3.0 * v for v in range(1, 11)]


# -- all_reduce: buffers, shapes and out -----------------------------------------------------
@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 2), (), (1,)])
def test_out_of_place_returns_a_new_array_and_leaves_x_alone(group, shape):
    def body(comm, rank):
        x = (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1) * (rank + 1)
        before = x.copy()
        y = comm.all_reduce(x, op="sum")
        np.testing.assert_array_equal(x, before)
        assert y is not x and not np.shares_memory(x, y)
        return y

    for y in run_job(2, body, group=group):
        assert isinstance(y, np.ndarray) and y.shape == shape and y.dtype == np.float32
        np.testing.assert_array_equal(y, (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1) * 3)


def test_in_place_returns_x(group):
    def body(comm, rank):
        x = np.full((4, 5), rank + 1, np.int64)
        assert comm.all_reduce(x, op="sum", out=x) is x
        out = np.empty((20,), np.int64)  # any shape with the same dtype and element count
        assert comm.all_reduce(x, op="max", out=out) is out
        return x, out

    for x, out in run_job(2, body, group=group):
        assert (x == 3).all() and x.shape == (4, 5)
        assert (out == 3).all()


def test_out_of_wrong_dtype_or_size_names_both(solo):
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"5 x float32.*4 x float32"):
        solo.all_reduce(x, out=np.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"4 x float64.*4 x float32"):
        solo.all_reduce(x, out=np.zeros(4, np.float64))


@pytest.mark.parametrize(
    "make",
    [lambda: np.arange(10.0)[::2], lambda: np.zeros((4, 3), order="F"), lambda: np.arange(12.0).reshape(3, 4)[:, :2]],
)
def test_non_contiguous_input_is_refused(solo, make):
    with pytest.raises(ValueError, match="C-contiguous"):
        solo.all_reduce(make())
    with pytest.raises(ValueError, match="C-contiguous"):
        x = make()
        solo.all_reduce(np.ascontiguousarray(x), out=x)


def test_read_only_out_is_refused_but_read_only_input_is_fine(solo):
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        solo.all_reduce(np.ones(3), out=ro)
    with pytest.raises(ValueError, match="read-only"):
        solo.all_reduce(ro, out=ro)
    with pytest.raises(ValueError, match="read-only"):
        solo.broadcast(ro)
    with pytest.raises(ValueError, match="read-only"):
        solo.all_reduce(np.ones(3, np.uint8), out=b"abc")
    assert solo.all_reduce(ro).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "dtype",
    [
        np.bool_,
        np.complex64,
        np.complex128,
        np.float128 if hasattr(np, "float128") else np.object_,
        np.dtype(">f4"),
        np.dtype("U3"),
    ],
)
def test_unsupported_dtype_names_it(solo, dtype):
    x = np.zeros(3, dtype)
    with pytest.raises(TypeError, match=str(np.dtype(dtype)).replace("<", "").replace(">", "")):
        solo.all_reduce(x)


@pytest.mark.parametrize("thing", [[1.0, 2.0], "abc", 3.0, None, object(), {"a": 1}])
def test_non_buffer_input_is_a_type_error(solo, thing):
    with pytest.raises(TypeError, match=type(thing).__name__):
        solo.all_reduce(thing)


def test_bytearray_memoryview_and_array_buffers(group):
    def body(comm, rank):
        b = bytearray([1, 2, 3 + rank])
        out_b = comm.all_reduce(b)
        in_place = bytearray([10, 20, 30])
        assert comm.all_reduce(in_place, out=in_place) is in_place
        mv = memoryview(np.arange(4, dtype=np.float32) * (rank + 1))
        out_mv = comm.all_reduce(mv, op="max")
        arr = array.array("d", [0.5, rank])
        assert comm.all_reduce(arr, out=arr) is arr
        out_bytes = comm.all_reduce(bytes([5, 6]), op="min")  # read-only input, out-of-place
        return b, out_b, in_place, out_mv, arr, out_bytes

    for b, out_b, in_place, out_mv, arr, out_bytes in run_job(2, body, group=group):
        assert out_b.dtype == np.uint8 and out_b.tolist() == [2, 4, 7]
        assert list(b) in ([1, 2, 3], [1, 2, 4])  # untouched
        assert list(in_place) == [20, 40, 60]
        assert out_mv.dtype == np.float32 and out_mv.tolist() == [0.0, 2.0, 4.0, 6.0]
        assert list(arr) == [1.0, 1.0]
        assert out_bytes.tolist() == [5, 6]


def test_zero_size_arrays_return_at_once_and_keep_ranks_in_step(group):
    """Only rank 0 issues the zero-size collectives: they must not use up a sequence number."""

    def body(comm, rank):
        if rank == 0:
            start = time.monotonic()
            for shape in [(0,), (3, 0), (0, 0, 2)]:
                y = comm.all_reduce(np.zeros(shape, np.float32))
                assert y.shape == shape and y.dtype == np.float32
                x = np.zeros(shape, np.int8)
                assert comm.all_reduce(x, out=x) is x
                assert comm.broadcast(x, root=1) is x
                h = comm.all_reduce_async(np.zeros(shape))
                assert h.done() and h.wait().shape == shape
            assert time.monotonic() - start < 0.5
        return comm.all_reduce(np.array([rank + 1], np.int32)), comm.all_reduce(np.array([10 * rank], np.int32))

    for first, second in run_job(2, body, group=group):
        assert first.tolist() == [3] and second.tolist() == [10]


def test_a_collective_past_its_own_timeout_fails_at_that_timeout(group):
    """A barrier with timeout=1 that rank 1 never joins fails on rank 0 after about 1 s, in
    torch's words ("Timed out"), long before RS_TIMEOUT; rank 1's later collectives still run."""

    def body(comm, rank):
        if rank == 1:
            time.sleep(2.5)  # connected all along: the barrier fails by its timeout, not by a lost rank
            return None
        started = time.monotonic()
        with pytest.raises(reduction_server.CollectiveError, match=r"Timed out after 1 s \(the timeout it was given\)"):
            comm.barrier(timeout=1.0)
        return time.monotonic() - started

    waited = run_job(2, body, group=group)[0]
    assert 1.0 <= waited < 3.0, waited
