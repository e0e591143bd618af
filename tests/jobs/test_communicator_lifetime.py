"""The Communicator against real reducer processes, ranks as threads of this process: async
handles, broadcast and barrier, closing and failures, torch tensors. Configuration and
all_reduce's results: test_communicator.py.
"""

import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import reduction_server
import reduction_server.client as rs
from helpers.cluster import TOKEN, reducers
from helpers.jobs import connect, new_job, run_job, until
from helpers.metrics import scrape
from helpers.ports import free_port_range, free_ports
from helpers.reference import TWO_RANKS
from reduction_server.client.group import Group
from reduction_server.config import settings

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def group(transport_group):
    """Every test runs twice, once per transport (conftest.transport_group)."""
    return transport_group


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

    for result in run_job(2, body, group=group):
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

    runs = run_job(2, body, group=group, chunk_bytes=256, window=2)
    for results in runs:
        for i, (n, op) in enumerate(zip(sizes, ops)):
            np.testing.assert_allclose(
                results[i], TWO_RANKS[op](value(i, 0, n), value(i, 1, n)), err_msg=f"collective {i} ({op} of {n})"
            )


def test_queued_collectives_do_not_time_out_behind_a_long_one(group):
    """A collective waiting for window slots behind others is not stalled itself: its clock
    starts when its chunks go out (it used to start at submission and expire spuriously). Rank 1
    joins each collective `pace` late, so every chunk in flight is answered well within the
    backstop while rank 0's last collectives wait in its queue for longer than the backstop."""
    timeout, pace, count = 0.5, 0.3, 10
    backstop = settings.client_backstop(timeout)
    assert (count - 2) * pace > 1.5 * backstop and pace < backstop / 3

    def body(comm, rank):
        handles = []
        for i in range(count):
            if rank == 1:
                time.sleep(pace)
            handles.append(comm.all_reduce_async(np.full(4, 10.0 * i + rank, np.float32)))
        submitted = time.monotonic()
        results = [h.wait(timeout=20).tolist() for h in handles]
        return results, time.monotonic() - submitted

    runs = run_job(2, body, group=group, timeout=timeout, window=1)
    for results, _ in runs:
        assert results == [[20.0 * i + 1] * 4 for i in range(count)]
    assert runs[0][1] > backstop, "rank 0's last collective did not wait in the queue longer than the backstop"


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

    for results in run_job(world, body, group=group, chunk_bytes=4096):
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

    run_job(2, body, group=group)
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
    with pytest.raises(rs.CollectiveError, match="rank 0: cannot serve a new group: the communicator (is|was) closed"):
        Group(comm, [0], "after-close")  # not a write to the engine's closed wake-up pipe
    comm.close()  # a second close is harmless


def test_close_fails_pending_collectives(group):
    comm = connect(group, 0, 2, new_job())  # rank 1 never comes
    h = comm.all_reduce_async(np.ones(3))
    comm.close()
    with pytest.raises(rs.CollectiveError, match="closed"):
        h.wait(timeout=5)


def _ranks_elsewhere(group, job: int, body: str) -> subprocess.CompletedProcess:
    """Run `body` in another Python process, which has `rs`, `addresses`, `job` and `token` of
    this job to make its ranks' Communicators with."""
    head = (
        "import sys\nimport reduction_server.client as rs\n"
        "addresses, job, token = sys.argv[1].split(','), int(sys.argv[2]), sys.argv[3]\n"
    )
    return subprocess.run(
        [sys.executable, "-c", head + body, ",".join(group.addresses), str(job), TOKEN],
        capture_output=True,
        text=True,
        timeout=40,
    )


# Rank 1 connects and dies before its engine sends a PING (they are switched off), so only its
# HELLO's "heartbeats" tells the reducer to probe it when its connection closes.
_VANISHING_RANK = """
import os, signal
from reduction_server.client.engine.connections import Connections
Connections.heartbeat_all = lambda self: None
comm = rs.Communicator(addresses, 1, 2, job_id=job, job_token=token, connect_timeout=10)  # held: no BYE
os.kill(os.getpid(), signal.SIGKILL)
"""


#: the variables a run id comes from (discovery.run_id): unset around the tests that set one
_RUN_VARIABLES = ("RS_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "CLOUD_ML_JOB_ID")


def _name_the_run(monkeypatch, variable, run):
    """This process's ranks (and the processes it starts) say run `run` by `variable` (None: none)."""
    for name in _RUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if variable is not None:
        monkeypatch.setenv(variable, run)


@pytest.mark.parametrize("run_id", [None, "TORCHELASTIC_RUN_ID"])
@pytest.mark.parametrize("how", ["closed", "vanished"])
def test_a_rank_gone_before_the_others_come_fails_them_when_they_come(how, run_id, monkeypatch):
    """Rank 1 connects and is gone before rank 0 connects: rank 0's collective fails at once
    with rank 1's loss, not at its timeout (a reducer used to forget the loss as its last
    admitted rank went). Ranks that say one run id (torchrun's) are one run the same way."""
    _name_the_run(monkeypatch, run_id, "rdzv-1")
    port = free_port_range(1)
    with reducers(1, token=TOKEN, extra_env={"RS_METRICS_PORT": str(port)}) as group:
        job = new_job()
        if how == "closed":
            connect(group, 1, 2, job).close()  # BYE
        else:  # no goodbye: its process dies
            died = _ranks_elsewhere(group, job, _VANISHING_RANK)
            assert died.returncode == -signal.SIGKILL, died.stderr
        until(lambda: _connected(port) == 0, "the reducer to see rank 1 gone")
        with connect(group, 0, 2, job, timeout=30) as comm:
            with pytest.raises(rs.CollectiveError) as info:
                comm.all_reduce(np.ones(3, np.float32))
    message = str(info.value)
    assert "rank 1" in message and "was lost" in message and "timed out" not in message, message
    assert ("(BYE)" in message) == (how == "closed"), message  # a process that died said no goodbye


# Ranks 1 and 2 of a world of 3 connect; rank 2 leaves, rank 1's collective fails with that loss,
# and rank 1 exits. Rank 0 never came, so the reducer keeps both losses for it.
_PARTIAL_RUN = """
import numpy as np
ranks = [rs.Communicator(addresses, r, 3, job_id=job, job_token=token, timeout=10, connect_timeout=10) for r in (1, 2)]
ranks[1].close()
try:
    ranks[0].all_reduce(np.ones(3, np.float32))
except rs.CollectiveError as exc:
    print(exc)
"""


def _connected(port: int) -> float:
    """Admitted ranks of a reducer, summed over its shards (one sample each)."""
    return sum(v for (name, _), v in scrape(port).items() if name == "reduction_server_peers_connected")


# how the old run ended, the new run's world size and the rank of it that comes first: each case
# leaves the reducer one reason only to take the new run for a new one
_STARTED_AGAIN = {
    "a lost rank from another process": ("partial", 3, 1),
    "after RS_TIMEOUT": ("partial", 3, 0),  # rank 0 never came before
    "another world size after a whole run": ("whole", 2, 0),
}


@pytest.mark.parametrize("how", list(_STARTED_AGAIN))
def test_a_job_started_again_is_not_failed_by_what_its_last_run_lost(how):
    """A job is started again under the same id and generation (a long-lived reducer pool, the
    same token) after a run that failed before every rank came, or after a whole run with another
    world size: the new run works. Its last rank comes after the others' collective started,
    which would fail at once if an old loss still counted (the other cases)."""
    ended, world, first_rank = _STARTED_AGAIN[how]
    port = free_port_range(1)
    timeout = 6  # RS_TIMEOUT: the new run's collective takes well under it
    env = {"RS_METRICS_PORT": str(port), "RS_TIMEOUT": str(timeout)}
    with reducers(1, token=TOKEN, extra_env=env) as group:
        job = new_job()
        if ended == "partial":
            before = _ranks_elsewhere(group, job, _PARTIAL_RUN)
            assert "rank 2" in before.stdout and "was lost" in before.stdout, before.stdout + before.stderr
        else:
            run_job(3, lambda comm, rank: comm.all_reduce(np.ones(2)), make=lambda rank: connect(group, rank, 3, job))
        until(lambda: _connected(port) == 0, "the reducer to see the first run gone")
        if how == "after RS_TIMEOUT":
            time.sleep(timeout)
        first = connect(group, first_rank, world, job, timeout=20)
        last = world - 1
        started = threading.Event()

        def make(rank):
            if rank == first_rank:
                return first
            if rank == last:
                assert started.wait(10)
                time.sleep(0.3)
            return connect(group, rank, world, job, timeout=20)

        def body(comm, rank):
            handle = comm.all_reduce_async(np.full(5, rank + 1.0, np.float32))
            started.set()
            return handle.wait(20)

        results = run_job(world, body, make=make, limit=40)
    total = sum(range(1, world + 1))
    for result in results:
        np.testing.assert_array_equal(result, np.full(5, total, np.float32))


# how each run names itself (as torchrun does, as `reduction-server run` does, or not at all),
# and how many times the rerun is tried (the same reducer path each time: a few, in seconds)
_RERUN_NAMES = {
    "torchrun": ("TORCHELASTIC_RUN_ID", lambda attempt, run: f"rdzv-{attempt}-{run}", 3),
    "reduction-server run": ("RS_RUN_ID", lambda attempt, run: secrets.token_hex(8), 1),
    "no run id": (None, None, 1),
}


@pytest.mark.parametrize("named", list(_RERUN_NAMES))
def test_a_rerun_after_a_run_that_timed_out_is_not_failed_by_its_error(named, monkeypatch):
    """Issue 37, item 8: run 1 times out because rank 1 never came; run 2, with the same job and
    generation within RS_TIMEOUT, starts with rank 1 (a collective in flight before rank 0
    connects). With run ids it sums exactly, every time; without, the reducer takes run 2's rank
    1 for run 1's late one, and its collective completes the round run 1's rank 0 left open with
    run 1's contribution (docs/reliability.md, "Limits")."""
    variable, name, attempts = _RERUN_NAMES[named]
    port = free_port_range(1)
    with reducers(1, token=TOKEN, extra_env={"RS_METRICS_PORT": str(port), "RS_TIMEOUT": "30"}) as group:
        job = new_job()
        for attempt in range(attempts):
            _name_the_run(monkeypatch, variable, name and name(attempt, 1))
            with connect(group, 0, 2, job, timeout=0.1) as alone:  # rank 1 never comes
                with pytest.raises(rs.CollectiveError):
                    alone.all_reduce(np.full(3, 100.0, np.float32))
            until(lambda: _connected(port) == 0, "the reducer to see run 1 gone")
            _name_the_run(monkeypatch, variable, name and name(attempt, 2))
            first = connect(group, 1, 2, job, timeout=20)
            started = threading.Event()

            def make(rank, first=first, started=started):
                if rank == 1:
                    return first
                assert started.wait(10)
                time.sleep(0.3)
                # without a run id, its collective waits for rank 1, gone by then: not for long
                return connect(group, 0, 2, job, timeout=20 if variable else 0.1)

            def body(comm, rank, started=started):
                handle = comm.all_reduce_async(np.full(3, rank + 1.0, np.float32))
                if rank == 1:
                    started.set()
                try:
                    return handle.wait(20)
                except rs.CollectiveError as exc:
                    return exc

            results = run_job(2, body, make=make, limit=40)
            if variable is None:
                np.testing.assert_array_equal(results[1], np.full(3, 102.0, np.float32))  # 100: run 1's
            else:
                for result in results:
                    np.testing.assert_array_equal(result, np.full(3, 3.0, np.float32), err_msg=f"attempt {attempt}")
            until(lambda: _connected(port) == 0, "the reducer to see run 2 gone")


def test_a_rank_of_another_run_is_refused_while_the_run_before_is_connected(monkeypatch):
    """Two runs of one job and generation at once: a run id is not ordered, so the reducer
    refuses the newcomer, naming both runs and RS_GENERATION, and the connected run goes on."""
    with reducers(1, token=TOKEN) as group:
        job = new_job()
        _name_the_run(monkeypatch, "RS_RUN_ID", "run-a")
        with connect(group, 0, 2, job) as held:
            _name_the_run(monkeypatch, "RS_RUN_ID", "run-b")
            with pytest.raises(rs.CollectiveError) as info:
                connect(group, 1, 2, job, connect_timeout=10)
            _name_the_run(monkeypatch, "RS_RUN_ID", "run-a")
            with connect(group, 1, 2, job) as other:
                results = run_job(2, lambda comm, rank: comm.all_reduce(np.ones(3)), make=[held, other].__getitem__)
    message = str(info.value)
    assert "'run-b'" in message and "'run-a'" in message and "still connected" in message, message
    assert "RS_GENERATION" in message, message
    for result in results:
        np.testing.assert_array_equal(result, np.full(3, 2.0))


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

    for result in run_job(2, body, group=group):
        assert result.tolist() == [3.0, 3.0]


def test_ranks_disagreeing_on_the_world_size_are_refused(group):
    job = new_job()
    with connect(group, 0, 2, job):
        with pytest.raises(rs.CollectiveError, match="world size") as info:
            connect(group, 1, 3, job, connect_timeout=2)
    assert "rank 1" in str(info.value) and any(a in str(info.value) for a in group.addresses)


def test_no_reducer_listening(group):
    address = f"127.0.0.1:{free_ports(1)[0]}"
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for _ in range(2):
        start = time.monotonic()
        with pytest.raises(rs.CollectiveError) as info:
            rs.Communicator(
                [group.addresses[0], address], 0, 1, job_id=new_job(), job_token=TOKEN, timeout=1, connect_timeout=1
            )
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

    for out in run_job(2, body, group=group):
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

        for y16, y32 in run_job(2, body, group=small, chunk_bytes=8 << 20):
            assert y16.dtype == np.float16 and np.all(y16 == 3)
            assert np.all(y32 == 3)
        assert small.alive()
