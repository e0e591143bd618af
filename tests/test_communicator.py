"""The Communicator against real reducer processes, with ranks as threads of this process.

One pair of reducers serves the whole module (once per transport). They learn the world size from the first HELLO of
each job, and every test runs its own job (a fresh job id), so tests with different world sizes
follow one another on the same reducers.
"""
import array
import os
import secrets
import socket
import threading
import time

import ml_dtypes
import numpy as np
import pytest

import reduction_server
import reduction_server.client as rs
import cluster
from reduction_server.client.chunking import plan_chunks
from cluster import reducers
from reduction_server.discovery import job_id_from

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-token"
OPTIONS = {"job_token": TOKEN, "timeout": 5, "connect_timeout": 5}


@pytest.fixture(scope="module", params=["shared-memory", "frames"])
def group(request):
    """Every test runs twice: with chunks in shared-memory slots (the reducers share this host),
    and with RS_SHM=0 on the reducers, through the sockets as between hosts."""
    with reducers(2, extra_env={"RS_SHM": "0"} if request.param == "frames" else None) as g:
        yield g
        assert g.alive(), "a reducer died during the tests"


def new_job() -> int:
    return secrets.randbits(63)


def connect(group, rank, world, job, **options):
    return rs.Communicator(group.addresses, rank, world, job_id=job, **{**OPTIONS, **options})


def run_ranks(world, body, *, make=None, group=None, limit=20.0, **options):
    """body(comm, rank) on every rank, each a thread with its own Communicator of a fresh job."""
    job = new_job()
    make = make or (lambda rank: connect(group, rank, world, job, **options))
    return cluster.run_ranks(world, make, body, limit)


@pytest.fixture
def solo(group):
    """A one-rank communicator: enough for argument checks and for single-rank results."""
    with connect(group, 0, 1, new_job()) as comm:
        yield comm


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


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

    for result in run_ranks(2, body, make=make):
        assert result.tolist() == [3.0]


def test_from_env_without_reducers_is_a_config_error():
    with pytest.raises(rs.ConfigError, match="RS_REDUCERS"):
        rs.Communicator.from_env({"RS_RANK": "0", "RS_WORLD_SIZE": "1"})
    with pytest.raises(rs.ConfigError, match="RS_RANK"):
        rs.Communicator.from_env({"RS_REDUCERS": "127.0.0.1:5555", "RS_RANK": "2", "RS_WORLD_SIZE": "2"})


@pytest.mark.parametrize("rank,world,match", [
    (2, 2, "rank 2"), (-1, 2, "rank -1"), (0, 0, "world_size"), (0, -3, "world_size"),
    ("0", 2, "rank"), (0, "2", "world_size"), (0.0, 2, "rank"),
])
def test_rank_and_world_validation(rank, world, match):
    with pytest.raises(rs.ConfigError, match=match) as info:
        rs.Communicator(["127.0.0.1:5555"], rank, world, timeout=1, connect_timeout=1)
    assert isinstance(info.value, ValueError) and isinstance(info.value, reduction_server.ReductionServerError)


@pytest.mark.parametrize("reducers,match", [
    ([], "no reducers"), ("", "no reducers"), (["127.0.0.1"], "port"), (["127.0.0.1:0"], "port"),
    (["host:abc"], "port"), (["127.0.0.1:5555", "127.0.0.1:5555"], "twice"),
    (["Host.example:5555", "host.example:5555"], "twice"),
])
def test_reducer_list_validation(reducers, match):
    with pytest.raises(rs.ConfigError, match=match):
        rs.Communicator(reducers, 0, 1, timeout=1, connect_timeout=1)


@pytest.mark.parametrize("variable,value,match", [
    ("RS_PIPELINE_DEPTH", "0", "RS_PIPELINE_DEPTH"), ("RS_PIPELINE_DEPTH", "deep", "RS_PIPELINE_DEPTH"),
    ("RS_PIPELINE_DEPTH", "1025", "RS_PIPELINE_DEPTH"), ("RS_WINDOW", "257", "RS_WINDOW"),
    ("RS_SNDBUF", "100", "RS_SNDBUF=100 must be 0"), ("RS_SNDBUF", "-1", "RS_SNDBUF"), ("RS_SNDBUF", "16k", "RS_SNDBUF"),
])
def test_tuning_variables_are_validated(monkeypatch, variable, value, match):
    monkeypatch.setenv(variable, value)
    with pytest.raises(rs.ConfigError, match=match):
        rs.Communicator(["127.0.0.1:5555"], 0, 1, timeout=1, connect_timeout=1)


@pytest.mark.parametrize("option,value", [("pipeline_depth", 0), ("window", 0), ("window", 257), ("send_buffer", 100),
                                          ("send_buffer", (1 << 30) + 1), ("send_buffer", "16384")])
def test_tuning_arguments_are_validated(option, value):
    with pytest.raises(rs.ConfigError, match=option):
        rs.Communicator(["127.0.0.1:5555"], 0, 1, timeout=1, connect_timeout=1, **{option: value})


def test_pipeline_depth_sets_the_chunks_and_ranks_that_disagree_fail_naming_the_mismatch(group, monkeypatch):
    """Deeper pipelines cut the same buffer into more chunks, summed exactly; a rank configured
    with another depth than the others is caught by the reducers, on every rank, not summed."""
    x = np.arange(1 << 20, dtype=np.float32)  # 4 MiB over 2 reducers: 16 chunks at depth 8, 64 at 32
    assert len(plan_chunks(x.size, 4, 2, 4 << 20, 8)) == 16 and len(plan_chunks(x.size, 4, 2, 4 << 20, 32)) == 64
    for depth in (8, 32):
        for y in run_ranks(2, lambda comm, rank: comm.all_reduce(x * (rank + 1)), group=group, pipeline_depth=depth):
            np.testing.assert_array_equal(y, x * 3)
    monkeypatch.setenv("RS_PIPELINE_DEPTH", "24")  # not the default: the variable is what sets it
    with connect(group, 0, 1, new_job()) as comm:
        assert comm.pipeline_depth == 24

    def body(comm, rank):
        with pytest.raises(rs.CollectiveError, match="disagree") as info:
            comm.all_reduce(x)
        return str(info.value)

    job = new_job()
    errors = run_ranks(2, body, make=lambda rank: connect(group, rank, 2, job, pipeline_depth=32 if rank else 8))
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
    ("sum", "sum"), ("SUM", "sum"), (" Sum ", "sum"), ("avg", "avg"), ("AVG", "avg"), ("mean", "avg"),
    ("min", "min"), ("Min", "min"), ("max", "max"), ("MAX", "max"), ("prod", "prod"), ("Prod", "prod"),
    (rs.ReduceOp.SUM, "sum"), (rs.ReduceOp.PROD, "prod"), (rs.ReduceOp.MAX, "max"), (rs.ReduceOp.MIN, "min"),
    (rs.ReduceOp.AVG, "avg"), (0, "sum"), (1, "prod"), (2, "max"), (3, "min"), (4, "avg"), (np.int64(2), "max"),
]
REFERENCE = {"sum": lambda a, b: a + b, "prod": lambda a, b: a * b, "min": np.minimum, "max": np.maximum,
             "avg": lambda a, b: (a + b) / 2}


def rank_input(rank, dtype=np.float64):
    return np.array([[1.0, -2.0, 3.5], [4.0, 0.5, -6.0]], dtype) * (rank + 1) + rank


def test_every_op_spelling(group):
    def body(comm, rank):
        return [comm.all_reduce(rank_input(rank), op=op) for op, _ in OP_SPELLINGS]

    results = run_ranks(2, body, group=group)
    for i, (op, name) in enumerate(OP_SPELLINGS):
        expected = REFERENCE[name](rank_input(0), rank_input(1))
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
    for result in run_ranks(2, body, group=group):
        assert result["sum"].tolist() == (a + b).tolist()  # wraps like int32 does
        assert result["prod"].tolist() == (a * b).tolist()
        assert result["min"].tolist() == np.minimum(a, b).tolist()
        assert result["max"].tolist() == np.maximum(a, b).tolist()
        assert result["avg"].tolist() == [4, -2, -(2**30), -2]  # (a + b) / 2 truncated toward zero (-5 / 2 is -2)
        assert all(r.dtype == np.int32 for r in result.values())


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16,
                                   np.float32, np.float64, ml_dtypes.bfloat16])
def test_every_dtype_round_trips(group, dtype):
    def body(comm, rank):
        return comm.all_reduce(np.arange(1, 11).astype(dtype) * (rank + 1), op="sum")

    for result in run_ranks(2, body, group=group):
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

    for y in run_ranks(2, body, group=group):
        assert isinstance(y, np.ndarray) and y.shape == shape and y.dtype == np.float32
        np.testing.assert_array_equal(y, (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1) * 3)


def test_in_place_returns_x(group):
    def body(comm, rank):
        x = np.full((4, 5), rank + 1, np.int64)
        assert comm.all_reduce(x, op="sum", out=x) is x
        out = np.empty((20,), np.int64)  # any shape with the same dtype and element count
        assert comm.all_reduce(x, op="max", out=out) is out
        return x, out

    for x, out in run_ranks(2, body, group=group):
        assert (x == 3).all() and x.shape == (4, 5)
        assert (out == 3).all()


def test_out_of_wrong_dtype_or_size_names_both(solo):
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"5 x float32.*4 x float32"):
        solo.all_reduce(x, out=np.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"4 x float64.*4 x float32"):
        solo.all_reduce(x, out=np.zeros(4, np.float64))


@pytest.mark.parametrize("make", [lambda: np.arange(10.0)[::2], lambda: np.zeros((4, 3), order="F"),
                                  lambda: np.arange(12.0).reshape(3, 4)[:, :2]])
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


@pytest.mark.parametrize("dtype", [np.bool_, np.complex64, np.complex128, np.float128 if hasattr(np, "float128") else np.object_,
                                   np.dtype(">f4"), np.dtype("U3")])
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

    for b, out_b, in_place, out_mv, arr, out_bytes in run_ranks(2, body, group=group):
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

    for first, second in run_ranks(2, body, group=group):
        assert first.tolist() == [3] and second.tolist() == [10]


# -- async ------------------------------------------------------------------------------------
def test_async_handle_is_pending_until_the_other_rank_joins(group):
    joined = threading.Event()

    def body(comm, rank):
        x = np.full(1000, rank + 1.0)
        if rank == 0:
            h = comm.all_reduce_async(x, op="sum")
            time.sleep(0.3)
            assert not h.done(), "done before the other rank contributed"
            joined.set()
            result = h.wait(timeout=10)
            assert h.done()
            assert h.wait() is result
            np.testing.assert_array_equal(x, np.full(1000, 1.0))
            return result
        assert joined.wait(10)
        return comm.all_reduce(x)

    for result in run_ranks(2, body, group=group):
        np.testing.assert_array_equal(result, np.full(1000, 3.0))


def test_many_handles_in_flight(group):
    """Many collectives, some of many chunks, in flight at once with a small window."""
    sizes = [1, 1000, 5, 4097, 3, 20000, 7, 64]
    ops = ["sum", "max", "avg", "min", "prod", "sum", "max", "sum"]

    def value(i, rank, n):
        return (np.arange(n, dtype=np.float64) % 7 + 1) * (rank + 1) + i

    def body(comm, rank):
        handles = [comm.all_reduce_async(value(i, rank, n), op=op) for i, (n, op) in enumerate(zip(sizes, ops))]
        results = []
        for h in handles:
            results.append(h.wait(timeout=10))
            assert h.done()
        return results

    runs = run_ranks(2, body, group=group, chunk_bytes=256, window=2)
    for results in runs:
        for i, (n, op) in enumerate(zip(sizes, ops)):
            np.testing.assert_allclose(results[i], REFERENCE[op](value(i, 0, n), value(i, 1, n)),
                                       err_msg=f"collective {i} ({op} of {n})")


def test_queued_collectives_do_not_time_out_behind_a_long_one(group):
    """A collective waiting for window slots behind a long collective is not stalled itself: its
    clock starts when its chunks go out (it used to start at submission and expire spuriously)."""
    with connect(group, 0, 1, new_job(), timeout=0.5, chunk_bytes=8192, window=1) as comm:
        big = np.ones(8 << 20, np.float32)  # 4096 chunks, one round trip at a time
        start = time.monotonic()
        first = comm.all_reduce_async(big)
        second = comm.all_reduce_async(np.arange(4, dtype=np.float32))
        assert first.wait(timeout=30)[-1] == 1.0
        elapsed = time.monotonic() - start
        assert second.wait(timeout=10).tolist() == [0.0, 1.0, 2.0, 3.0]
    if elapsed < 0.6:
        pytest.skip(f"the long collective took only {elapsed:.2f} s, too fast to show the problem")


# -- broadcast and barrier -------------------------------------------------------------------
def test_broadcast_from_every_root(group):
    world = 3

    def body(comm, rank):
        out = []
        for root in range(world):
            x = np.full((4, 5), 10 * rank + root, np.int32)
            assert comm.broadcast(x, root=root) is x
            long = np.arange(3000, dtype=np.float64) * (rank + 1)
            comm.broadcast(long, root=root)
            out.append((x.copy(), long.copy()))
        return out

    for results in run_ranks(world, body, group=group, chunk_bytes=4096):
        for root, (x, long) in enumerate(results):
            assert x.shape == (4, 5) and (x == 10 * root + root).all()
            np.testing.assert_array_equal(long, np.arange(3000, dtype=np.float64) * (root + 1))


def test_broadcast_root_out_of_range(solo):
    for root in (1, -1, "0"):
        with pytest.raises(ValueError, match="root"):
            solo.broadcast(np.zeros(3), root=root)


def test_barrier_waits_for_every_rank(group):
    ready = threading.Barrier(2, timeout=10)
    times = {}

    def body(comm, rank):
        ready.wait()  # both connected: the delay below is all the barrier has to wait for
        if rank == 1:
            time.sleep(0.5)
            times["entered"] = time.monotonic()
            comm.barrier()
        else:
            start = time.monotonic()
            comm.barrier()
            times["left"] = time.monotonic()
            times["waited"] = times["left"] - start

    run_ranks(2, body, group=group)
    assert times["left"] >= times["entered"]
    assert times["waited"] >= 0.45


# -- lifetime and failures ---------------------------------------------------------------------
def test_context_manager_closes(group):
    with connect(group, 0, 1, new_job()) as comm:
        assert comm.all_reduce(np.ones(2)).tolist() == [1.0, 1.0]
    with pytest.raises(rs.CollectiveError, match="closed") as info:
        comm.all_reduce(np.ones(2))
    assert "rank 0" in str(info.value)
    with pytest.raises(rs.CollectiveError, match="closed"):
        comm.broadcast(np.ones(2))
    with pytest.raises(rs.CollectiveError, match="closed"):
        comm.barrier()
    comm.close()  # a second close is harmless


def test_close_fails_pending_collectives(group):
    comm = connect(group, 0, 2, new_job())  # rank 1 never comes
    h = comm.all_reduce_async(np.ones(3))
    comm.close()
    with pytest.raises(rs.CollectiveError, match="closed"):
        h.wait(timeout=5)


def test_timeout_names_rank_reducer_and_seq(group):
    with connect(group, 0, 2, new_job(), timeout=1) as comm:  # rank 1 never calls
        assert comm.all_reduce(np.zeros(0)).size == 0  # takes no seq
        start = time.monotonic()
        with pytest.raises(rs.CollectiveError) as info:
            comm.all_reduce(np.ones(3, np.float32))
        elapsed = time.monotonic() - start
    message = str(info.value)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, reduction_server.ReductionServerError)
    assert 0.9 <= elapsed < 4, elapsed
    assert "rank 0" in message and "seq=0" in message
    assert group.addresses[0] in message  # one 3-element chunk: collective 0 goes to reducer 0


def test_mismatched_collectives_fail_on_every_rank_and_the_next_one_works(group):
    def body(comm, rank):
        with pytest.raises(rs.CollectiveError) as info:
            comm.all_reduce(np.ones(4 + rank, np.float32))  # the ranks disagree on the size
        message = str(info.value)
        assert f"rank {rank}" in message and "seq=0" in message and group.addresses[0] in message
        return comm.all_reduce(np.full(2, rank + 1, np.float32))

    for result in run_ranks(2, body, group=group):
        assert result.tolist() == [3.0, 3.0]


def test_ranks_disagreeing_on_the_world_size_are_refused(group):
    job = new_job()
    with connect(group, 0, 2, job):
        with pytest.raises(rs.CollectiveError, match="world size") as info:
            connect(group, 1, 3, job, connect_timeout=2)
    assert "rank 1" in str(info.value) and any(a in str(info.value) for a in group.addresses)


def test_no_reducer_listening(group):
    address = f"127.0.0.1:{free_port()}"
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for _ in range(2):
        start = time.monotonic()
        with pytest.raises(rs.CollectiveError) as info:
            rs.Communicator([group.addresses[0], address], 0, 1, job_id=new_job(), job_token=TOKEN,
                            timeout=1, connect_timeout=1)
        elapsed = time.monotonic() - start
        assert 0.9 <= elapsed < 1.8, f"took {elapsed:.2f} s with connect_timeout=1"
        message = str(info.value)
        assert address in message and "rank 0" in message and group.addresses[0] not in message
    if fds is not None:  # a failed constructor leaves no file descriptors behind
        assert len(os.listdir("/proc/self/fd")) == fds


# -- torch ----------------------------------------------------------------------------------------
TORCH_DTYPES = ["float32", "float16", "bfloat16", "int64"]


def test_torch_cpu_tensors(group):
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

    def make(dtype, rank):
        return (torch.arange(12).reshape(3, 4) % 5 + rank + 1).to(getattr(torch, dtype))

    def body(comm, rank):
        out = {}
        for dtype in TORCH_DTYPES:
            x = make(dtype, rank)
            before = x.clone()
            y = comm.all_reduce(x, op="sum")
            assert torch.equal(x, before)
            z = make(dtype, rank)
            assert comm.all_reduce(z, op="max", out=z) is z
            out[dtype] = (y, z)
        g = torch.full((5,), rank + 1.0, requires_grad=True)
        out["grad"] = comm.all_reduce(g, op="avg")
        g.grad = torch.full((5,), 2.0 * rank)
        comm.all_reduce(g.grad, out=g.grad)
        out["grad_in_place"] = g.grad
        out["scalar"] = comm.all_reduce(torch.tensor(rank + 0.5))
        p = torch.nn.Parameter(torch.ones(3))
        out["param"] = comm.all_reduce(p)
        return out

    for out in run_ranks(2, body, group=group):
        for dtype in TORCH_DTYPES:
            y, z = out[dtype]
            assert isinstance(y, torch.Tensor) and y.dtype == getattr(torch, dtype) and y.shape == (3, 4)
            assert torch.equal(y, make(dtype, 0) + make(dtype, 1)), dtype
            assert torch.equal(z, make(dtype, 1))
        assert isinstance(out["grad"], torch.Tensor) and out["grad"].tolist() == [1.5] * 5
        assert out["grad_in_place"].tolist() == [2.0] * 5
        assert out["scalar"].shape == () and out["scalar"].item() == 2.0
        assert out["param"].tolist() == [2.0, 2.0, 2.0]


def test_torch_argument_errors(solo):
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
    with pytest.raises(ValueError, match="C-contiguous"):
        solo.all_reduce(torch.zeros(3, 4).t())
    with pytest.raises(TypeError, match="bool"):
        solo.all_reduce(torch.zeros(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="complex"):
        solo.all_reduce(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="float64"):
        solo.all_reduce(torch.zeros(3), out=torch.zeros(3, dtype=torch.float64))


def test_torch_cuda_tensor_is_refused(solo):
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: a device tensor cannot be made")
    with pytest.raises(TypeError, match="cuda"):
        solo.all_reduce(torch.zeros(3, device="cuda"))


def test_chunks_are_capped_by_what_the_reducers_accept():
    """A chunk size over the reducers' RS_MAX_CHUNK_BYTES is cut down to fit, on every rank alike;
    float16 chunks are cut to half, since the reducer accumulates them in float32."""
    with reducers(1, extra_env={"RS_MAX_CHUNK_BYTES": str(1 << 20)}) as small:
        count = 3 * (1 << 20) + 11

        def body(comm, rank):
            assert comm._engine.max_chunk_bytes == 1 << 20
            x16 = np.full(count, rank + 1, np.float16)
            x32 = np.full(count, rank + 1, np.float32)
            return comm.all_reduce(x16), comm.all_reduce(x32)

        for y16, y32 in run_ranks(2, body, group=small, chunk_bytes=8 << 20):
            assert y16.dtype == np.float16 and np.all(y16 == 3)
            assert np.all(y32 == 3)
        assert small.alive()
