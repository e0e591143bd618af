"""Shared-memory slots between workers and reducers on one host (reduction_server/wire/shared_memory.py).

The segment: what a reducer accepts and what it refuses (another boot, namespace, nonce, an
unsealed or foreign descriptor), and that a worker cannot shrink it under the reducer. Then real
reducer processes and Communicators in threads: sums through the slots equal NumPy's for every
dtype and op, ranks with and without slots mix in one job, a reducer with RS_SHM=0 gets frames,
and slots come back after a failed collective.
"""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np
import pytest

import reduction_server.client as rs
from helpers import cluster
from helpers.cluster import TOKEN, reducers
from helpers.jobs import connect, new_job, run_job
from reduction_server import CollectiveError
from reduction_server.client.chunking import plan_chunks
from reduction_server.client.engine import Engine
from reduction_server.client.engine.options import EngineOptions
from reduction_server.wire import protocol, shared_memory
from reduction_server.wire.protocol import ErrorCode, Header, MsgType
from reduction_server.wire.shared_memory import Segment, Unavailable

pytestmark = pytest.mark.timeout(60)

OPTIONS = {"job_token": TOKEN, "timeout": 5, "connect_timeout": 5, "chunk_bytes": 1 << 16}


# -- the segment ---------------------------------------------------------------------------
def attach(offer):
    """What a reducer with RS_WINDOW <= 4 and RS_MAX_CHUNK_BYTES=4096 does with an offer."""
    return Segment.attach(offer, max_slots=4, max_slot_bytes=4096)


@pytest.fixture
def segment():
    seg = Segment.create(3, 1000)
    yield seg
    seg.close()


def test_a_segment_attached_elsewhere_shares_its_slots(segment):
    other = attach(segment.offer)
    segment.slot(2, 1000)[:] = bytes(range(200)) * 5
    assert bytes(other.slot(2, 1000)) == bytes(range(200)) * 5
    other.slot(0, 4)[:] = b"sums"
    assert bytes(segment.slot(0, 4)) == b"sums"
    other.close()


def test_another_process_attaches_through_proc(segment):
    """What a reducer process does: open /proc/<pid>/fd/<fd> of the worker and check the nonce."""
    segment.slot(1, 5)[:] = b"hello"
    code = (
        "import json, sys; from reduction_server.wire.shared_memory import Segment; "
        "s = Segment.attach(json.loads(sys.argv[1]), max_slots=4, max_slot_bytes=1 << 20); "
        "print(bytes(s.slot(1, 5)).decode()); "
        "s.slot(1, 5)[:] = b'world'"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(segment.offer)], capture_output=True, text=True, timeout=30, cwd="/"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hello"
    assert bytes(segment.slot(1, 5)) == b"world"


def test_the_worker_cannot_resize_its_segment(segment):
    """Shrinking it under a reducer's mapping would kill the reducer with SIGBUS: it is sealed."""
    fd = segment.offer["fd"]
    size = os.fstat(fd).st_size
    for new in (0, size // 2, size * 2):
        with pytest.raises(PermissionError):
            os.ftruncate(fd, new)
    assert os.fstat(fd).st_size == size


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda o: o.update(boot_id="0" * 36), "boot id differs"),
        (lambda o: o.update(net_namespace=[0, 1]), "net namespace differs"),
        (lambda o: o.update(pid_namespace=[0, 1]), "pid namespace differs"),
        (lambda o: o.update(nonce="00" * 16), "nonce does not match"),
        (lambda o: o.update(slots=4), "bytes, expected"),
        (lambda o: o.update(fd=o["fd"] + 1000), "cannot open the worker's segment"),
        (lambda o: o.update(pid=0x3FFFFFFF), "cannot open the worker's segment"),
        (lambda o: o.pop("nonce"), "malformed offer"),
        (lambda o: o.update(slots="many"), "malformed offer"),
        (lambda o: o.update(slots=0), "out of range"),
        (lambda o: o.update(slots=5), "offer of 5 slots of 1000 bytes is out of range"),
        (lambda o: o.update(slot_bytes=1 << 40), "out of range .at most 4 slots of 4096 bytes, RS_MAX_CHUNK_BYTES"),
    ],
)
def test_an_offer_that_does_not_check_out_is_declined_saying_why(segment, change, words):
    offer = dict(segment.offer)
    change(offer)
    with pytest.raises(Unavailable, match=words):
        attach(offer)


def test_descriptors_that_are_not_sealed_memfds_are_declined(segment):
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    read, write = os.pipe()
    with tempfile.TemporaryFile() as plain:
        try:
            for fd, words in [
                (unsealed, "not sealed against resizing"),
                (plain.fileno(), "not a sealable memfd"),
                (read, "not a regular file"),
            ]:  # a pipe could block the reducer's open
                if fd != read:
                    os.ftruncate(fd, os.fstat(segment.offer["fd"]).st_size)
                with pytest.raises(Unavailable, match=words):
                    attach({**segment.offer, "fd": fd})
        finally:
            for fd in (unsealed, read, write):
                os.close(fd)
    with pytest.raises(Unavailable, match="not a JSON object"):
        attach(["not", "a", "dict"])


def test_a_segment_that_cannot_be_mapped_is_declined_not_raised(segment, monkeypatch):
    """An OSError while mapping (address space or map count used up) means frames, never an
    exception out of the reducer's handshake."""

    def no_room(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(shared_memory.mmap, "mmap", no_room)
    with pytest.raises(Unavailable, match="cannot map the worker's segment: .*Cannot allocate memory"):
        attach(segment.offer)


def test_slot_bounds_are_checked(segment):
    assert len(segment.slot(2, 1000)) == 1000
    with pytest.raises(ValueError, match="slot 3 out of range"):
        segment.slot(3, 1)
    with pytest.raises(ValueError, match="slot -1 out of range"):
        segment.slot(-1, 1)
    with pytest.raises(ValueError, match="1001 bytes do not fit"):
        segment.slot(0, 1001)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 to make a network namespace"
)
def test_a_process_in_another_network_namespace_declines(segment):
    """Emulated hosts (bench netem) are namespaces of one machine: they must use their links."""
    name = f"rs-shm-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        code = (
            "import json, sys\nfrom reduction_server.wire.shared_memory import Segment, Unavailable\n"
            "try:\n    Segment.attach(json.loads(sys.argv[1]), max_slots=4, max_slot_bytes=1 << 20)\n"
            "except Unavailable as e:\n    print(e)"
        )
        out = subprocess.run(
            ["ip", "netns", "exec", name, sys.executable, "-c", code, json.dumps(segment.offer)],
            capture_output=True,
            text=True,
            timeout=30,
            cwd="/",
        )
        assert out.returncode == 0, out.stderr
        assert "net namespace differs" in out.stdout
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=True)


def test_an_answer_about_no_chunk_frees_no_slot():
    """An ERROR about a frame rather than a key has job, generation, seq and chunk all 0: it must
    not free the slot of job 0's first chunk, which a reducer may still write its result into."""
    engine = Engine(
        EngineOptions.resolve(
            ("127.0.0.1:1",),
            0,
            1,
            job_token="",
            job_id=0,
            window=2,
            timeout=1,
            connect_timeout=1,
            io_threads=1,
            shared_memory=True,
        )
    )
    try:
        slots = engine.slots
        slots.free[0], slots.slot_of[0] = [1], {(0, 0, 0): 0}  # slot 0 holds (group 0, seq 0, chunk 0)
        keyless = protocol.unpack(protocol.error_header(ErrorCode.INTERNAL, b"internal error"))
        assert slots.release(0, keyless) is None
        assert slots.slot_of[0] == {(0, 0, 0): 0} and slots.free[0] == [1]
        answer = Header(MsgType.RESULT_SHM, dtype=7, world=1, nchunks=1, count=1, total=1, nbytes=4)
        assert slots.release(0, answer) == 0
        assert slots.slot_of[0] == {} and sorted(slots.free[0]) == [0, 1]
    finally:
        engine.close()  # never started: this only closes its wake-up pipe


def test_a_result_that_failover_keeps_is_lent_its_slot_until_it_is_kept_no_longer():
    """A segment has a window of slots for chunks in flight and a window and one more to lend.
    A lent slot holds its result and takes no chunk; ending the lease frees it; a lease of a
    segment that a new connection replaced frees nothing in the new one, and its result stays
    readable."""
    from reduction_server.client.engine.identity import Identity
    from reduction_server.client.engine.slots import Slots

    slots = Slots(Identity(rank=0, world=1, job=0, generation=0), [True], window=2, slot_bytes=64)
    try:
        slots.offer(0)
        slots.welcomed(0, {"shared_memory": True})
        assert slots.segments[0].slots == 5

        def answered(seq):
            slot = slots.take(0, 64)
            slots.put(0, slot, 0, seq, 0)
            slots.view(0, slot, 64)[:] = bytes([seq]) * 64  # the reducer's result
            answer = Header(
                MsgType.RESULT_SHM, dtype=7, world=1, seq=seq, nchunks=1, count=16, total=16, nbytes=64, aux=slot
            )
            assert slots.release(0, answer) == slot
            return slot

        leases = [slots.lease(0, answered(seq), 64) for seq in range(3)]
        assert all(lease is not None for lease in leases)
        assert slots.lease(0, answered(3), 64) is None  # the last two slots stay for chunks in flight
        assert sorted(slots.free[0]) == sorted(set(range(5)) - {lease.slot for lease in leases})
        assert [bytes(lease.view) for lease in leases] == [bytes([seq]) * 64 for seq in range(3)]
        leases[0].end()
        assert leases[0].slot in slots.free[0] and slots.lent[0] == 2
        slots.offer(0)  # a new connection: a new segment
        slots.welcomed(0, {"shared_memory": True})
        leases[1].end()
        assert sorted(slots.free[0]) == list(range(5)) and slots.lent[0] == 0
        assert bytes(leases[2].view) == bytes([2]) * 64
    finally:
        slots.close()


# -- real reducers ---------------------------------------------------------------------------
def run_ranks(group, world, body, shared=(True,), **options):
    """body(comm, rank) on every rank (threads); rank r uses slots when shared[r % len(shared)]."""
    job = new_job()

    def make(rank):
        return connect(group, rank, world, job, **{**OPTIONS, **options}, shared_memory=shared[rank % len(shared)])

    return run_job(world, body, make=make, limit=30)


DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.uint8, np.int32, np.int64]


def _inputs(dtype, rank, count=40_000):
    rng = np.random.default_rng([rank, count])
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 5, count).astype(dtype)
    return (rng.integers(-64, 64, count) / 4).astype(dtype)  # exact in every float type


@pytest.mark.parametrize("shared", [(True,), (False, True, True)], ids=["every-rank", "mixed"])
def test_sums_through_the_slots_equal_numpys_for_every_dtype_and_op(group, shared):
    world = 4  # avg divides by a power of two: exact in every float type

    def body(comm, rank):
        for dtype in DTYPES:
            for op in ("sum", "max", "min", "avg"):
                x = _inputs(dtype, rank)
                y = comm.all_reduce(x, op)
                xs = [_inputs(dtype, r).astype(np.float64) for r in range(world)]
                want = {"sum": np.sum, "max": np.max, "min": np.min}.get(op, np.mean)(xs, axis=0)
                if op == "avg" and np.dtype(dtype).kind in "iu":
                    want = np.trunc(want)
                np.testing.assert_array_equal(y.astype(np.float64), want, err_msg=f"{dtype} {op}")
        x = np.full(1000, rank, np.float32)
        comm.broadcast(x, root=2)  # broadcasts travel as frames, beside the slots
        np.testing.assert_array_equal(x, 2)
        return comm._engine.chunks_shared

    shared_chunks = run_ranks(group, world, body, shared=shared)
    # every chunk of every reduction, out and back, went through the slots (the broadcast did not)
    chunks = sum(len(plan_chunks(40_000, np.dtype(d).itemsize, 2, OPTIONS["chunk_bytes"])) for d in DTYPES)
    assert shared_chunks == [2 * 4 * chunks if shared[r % len(shared)] else 0 for r in range(world)]


@pytest.mark.parametrize("shared", [(True,), (True, False, True)], ids=["every-rank", "mixed"])
def test_a_result_of_many_blocks_goes_into_every_slot_as_the_last_rank_is_folded(group, shared):
    """W=3, chunks of up to 1 MiB (many 64 KiB blocks and a tail each): the fold of each chunk's
    last rank writes the result into the other ranks' slots block by block (accumulate_copies),
    for every op, integers and floats (16-bit ones rounded into every slot), and an average over
    3 divided exactly once, also where a rank's result goes as a frame."""
    world, count = 3, 600_007

    def body(comm, rank):
        for dtype in (np.int32, np.uint32, np.uint64, np.int8, np.float64, np.float16, ml_dtypes.bfloat16):
            half = np.dtype(dtype).itemsize == 2  # exact sums; no product (it would round)
            for op in ("sum", "max", "min", "avg") if half else ("sum", "prod", "max", "min", "avg"):
                y = comm.all_reduce(_inputs(dtype, rank, count), op)
                xs = [_inputs(dtype, r, count).astype(np.float64) for r in range(world)]
                want = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}.get(op, np.mean)(xs, axis=0)
                if op == "avg" and half:  # divided in float32, then rounded, as the reducer does
                    want = (np.sum(xs, axis=0).astype(np.float32) / np.float32(world)).astype(dtype)
                elif op == "avg":
                    want = np.trunc(want) if np.dtype(dtype).kind in "iu" else want.astype(dtype)
                np.testing.assert_array_equal(y.astype(np.float64), want, err_msg=f"{dtype} {op}")
        return comm._engine.chunks_shared, comm._engine.slots.results_read

    counts = run_ranks(group, world, body, shared=shared, chunk_bytes=1 << 20, pipeline_depth=1)
    assert [bool(chunks) for chunks, _ in counts] == [shared[r % len(shared)] for r in range(world)]
    if all(shared):  # 16-bit results, at least, every rank read from the reducers' result slots
        assert all(read > 0 for _, read in counts)


def test_result_slots_are_read_and_released_over_more_collectives_than_there_are_slots(group):
    """W=3 over 2 reducers, every chunk large enough for a result slot: the two ranks besides the
    accumulator's owner read each result from one result slot, kept for failover and released,
    so 150 collectives (on 64 slots per reducer) never run out of them."""
    from reduction_server.reducer.shared_results import RESULT_SLOTS, SHARED_RESULT_BYTES

    world, count, collectives = 3, 300_000, 150
    assert collectives > RESULT_SLOTS

    def body(comm, rank):
        for i in range(collectives):
            y = comm.all_reduce(np.full(count, rank + i, np.float32))
            np.testing.assert_array_equal(y, 3 * i + 3)
        assert comm._engine.failover.enabled
        return comm._engine.slots.results_read

    reads = run_ranks(group, world, body, chunk_bytes=1 << 20, pipeline_depth=1)
    large = [n for _, n in plan_chunks(count, 4, 2, 1 << 20, 1) if 4 * n >= SHARED_RESULT_BYTES]
    assert len(large) == 2
    assert sum(reads) == collectives * len(large) * (world - 1)  # read by every rank but the accumulator's owner


def test_a_rank_that_cannot_map_result_slots_gets_its_result_in_its_own_slot(group, monkeypatch):
    from reduction_server.client.engine.slots import Slots

    def map_results(self, r, offer, real=Slots._map_results):
        if self.me.rank != 1:
            real(self, r, offer)

    monkeypatch.setattr(Slots, "_map_results", map_results)

    def body(comm, rank):
        for i in range(20):
            np.testing.assert_array_equal(comm.all_reduce(np.full(300_000, rank + i, np.float32)), 3 * i + 3)
        return comm._engine.slots.results_read, comm._engine.chunks_shared

    counts = run_ranks(group, 3, body, chunk_bytes=1 << 20, pipeline_depth=1)
    chunks = len(plan_chunks(300_000, 4, 2, 1 << 20, 1))
    assert counts[1] == (0, 2 * 20 * chunks)  # every chunk through its own slot, both ways


def test_a_reducer_with_rs_shm_off_answers_with_frames():
    with reducers(1, extra_env={"RS_SHM": "0"}) as group:

        def body(comm, rank):
            y = comm.all_reduce(np.full(50_000, rank + 1, np.float32))
            np.testing.assert_array_equal(y, 3)
            return comm._engine.chunks_shared

        assert run_ranks(group, 2, body) == [0, 0]


def test_slots_come_back_after_a_failed_collective_and_are_used_again(group):
    """Ranks that disagree fail on every rank; every slot is freed by the reducers' answers
    (no failed chunk's result is kept in one), and the next collectives go through the slots again."""
    window = 4

    def body(comm, rank):
        engine = comm._engine
        slots = engine.slots.per_segment
        assert slots == 2 * window + 1
        with pytest.raises(CollectiveError, match="disagree"):
            comm.all_reduce(np.ones(100_000 + rank * 64, np.float32))
        deadline = time.monotonic() + 5
        while any(len(free) < slots for free in engine.slots.free) and time.monotonic() < deadline:
            time.sleep(0.01)  # late answers free the last slots on the engine thread
        assert [len(free) for free in engine.slots.free] == [slots] * len(engine.endpoints)
        before = engine.chunks_shared
        for _ in range(3):
            np.testing.assert_array_equal(comm.all_reduce(np.ones(100_000, np.float32)), 2)
        return engine.chunks_shared - before

    for used in run_ranks(group, 2, body, window=window):
        assert used >= 3 * 2 * 2  # at least two chunks per collective, out and back


def test_a_closed_communicator_keeps_nothing_of_its_segments_mapped(group):
    """Results kept for failover stay in their shared-memory slots while a communicator is open;
    once it is closed, none of its segments is mapped or open any longer, though its caller (or a
    traceback) still holds it, and without waiting for a garbage collection."""
    import gc

    def segments():
        with open("/proc/self/maps") as f:  # one inode per segment
            mapped = {line.split()[4] for line in f if "memfd:reduction-server" in line}
        opened = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                opened += "memfd:reduction-server" in os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass  # the directory's own descriptor, closed by now
        return len(mapped), opened

    gc.collect()
    before = segments()
    gc.disable()
    try:
        comm = connect(group, 0, 1, new_job(), **OPTIONS, shared_memory=True)
        for _ in range(3):
            np.testing.assert_array_equal(comm.all_reduce(np.ones(100_000, np.float32)), 1)
        engine = comm._engine
        assert sum(engine.slots.lent) > 0 and segments() != before  # kept in the slots, mapped
        comm.close()
        assert segments() == before
    finally:
        gc.enable()


def test_ranks_offer_no_segment_with_rs_shm_off(group, monkeypatch):
    monkeypatch.setenv("RS_SHM", "0")

    def body(comm, rank):
        np.testing.assert_array_equal(comm.all_reduce(np.ones(10, np.int32)), 2)
        return comm._engine.chunks_shared, comm._engine.slots.segments, len(comm._engine.endpoints)

    results = run_job(2, body, group=group, **OPTIONS, limit=30)
    assert [(shared, segments) for shared, segments, _ in results] == [(0, [None] * results[0][2])] * 2


def test_only_this_hosts_addresses_are_local():
    for address in ("127.0.0.1:5555", "localhost:1", "[::1]:80", f"{socket.gethostname()}:1"):
        assert shared_memory.is_local(address), address
    for address in ("198.18.255.254:5555", "[2001:db8::1]:1"):  # assigned nowhere here
        assert not shared_memory.is_local(address), address


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 to make a network namespace"
)
def test_a_reducer_across_a_link_is_offered_no_segment():
    """Only a reducer at one of this host's addresses is offered a segment: one across a link
    (a network namespace behind a veth pair here) never learns the worker's pid, fd or boot id."""
    tag = secrets.token_hex(3)
    ns, here, there = f"rs-shm-{tag}", f"rsa{tag}", f"rsb{tag}"
    subnet = f"198.19.{secrets.randbelow(250)}"
    reducer = None
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for command in (
            ["link", "add", here, "type", "veth", "peer", "name", there],
            ["link", "set", there, "netns", ns],
            ["addr", "add", f"{subnet}.1/30", "dev", here],
            ["link", "set", here, "up"],
            ["-n", ns, "addr", "add", f"{subnet}.2/30", "dev", there],
            ["-n", ns, "link", "set", there, "up"],
            ["-n", ns, "link", "set", "lo", "up"],
        ):
            subprocess.run(["ip", *command], check=True, capture_output=True)
        reducer = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-m",
                "reduction_server",
                "serve",
                "--host",
                f"{subnet}.2",
                "--port",
                "5555",
                "--workers",
                "1",
            ],
            cwd="/",
            env=cluster.child_env({"RS_LOG_LEVEL": "INFO", "RS_ALLOW_NO_TOKEN": "1"}),  # the worker has none either
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        said = [reducer.stdout.readline()]  # a sharded reducer's shards may log their start first
        while said[-1] and "listening on" not in said[-1]:
            said.append(reducer.stdout.readline())
        assert "listening on" in said[-1], said
        comm = rs.Communicator([f"{subnet}.2:5555"], 0, 1, timeout=10, connect_timeout=10)
        try:
            x = np.arange(1 << 16, dtype=np.float32)
            np.testing.assert_array_equal(comm.all_reduce(x), x)
            assert comm._engine.slots.segments == [None] * len(comm._engine.endpoints)
            assert comm._engine.chunks_shared == 0
        finally:
            comm.close()
        reducer.terminate()
        log = reducer.communicate(timeout=20)[0]
        assert "admitted" in log and "shared_memory_declined" not in log, log
    finally:
        if reducer is not None and reducer.poll() is None:
            reducer.kill()
            reducer.wait()
        subprocess.run(["ip", "link", "delete", here], capture_output=True)  # gone with the namespace, if not before
        subprocess.run(["ip", "netns", "delete", ns], check=True)
