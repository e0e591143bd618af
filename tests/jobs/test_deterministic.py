"""Deterministic mode (RS_DETERMINISTIC=1): a reducer folds contributions in rank order whatever
their arrival order, so results are bitwise identical from run to run and across reducer counts.

The inputs are float32 of mixed magnitudes (1e-4 .. 1e4): for them the order of the additions
changes the rounding of many elements, which each test checks on the inputs themselves, so a
pass cannot come from inputs that happen to be order-insensitive.

Across reducer counts: the chunk plan depends on R (client/chunking.py), so R=1 and R=2 cut the
buffer at different places. That does not matter for the result: the reduction is elementwise,
and each element's value depends only on the order of its W contributions, which deterministic
mode fixes (rank 0, 1, 2, ...) whatever the chunk boundaries are.
"""

from __future__ import annotations

import itertools
import random
import signal
import subprocess
import sys
import time
from typing import List

import ml_dtypes
import numpy as np
import pytest
import zmq

import reduction_server.client as rs
from helpers.capture import CapturingSocket
from helpers.cluster import TOKEN, child_env, reducers, run_ranks
from helpers.handshake import hello_payload
from helpers.jobs import new_job, run_job
from helpers.peers import Peer, data
from reduction_server.reducer import Reducer
from reduction_server.wire import protocol
from reduction_server.wire.protocol import MsgType

pytestmark = pytest.mark.timeout(120)

WORLD = 4
CHUNK = 64 * 1024  # several chunks per collective, spread over the reducers
SIZES = [1, 999, 100_003]  # one element, one chunk, many chunks
DETERMINISTIC = {"RS_DETERMINISTIC": "1"}


def mixed(count: int, seed: int, rank: int, dtype=np.float32) -> np.ndarray:
    """Values of mixed magnitudes and signs: their sum's rounding depends on the order."""
    rng = np.random.default_rng([seed, rank])
    return (rng.standard_normal(count) * 10.0 ** rng.integers(-4, 5, count)).astype(dtype)


def ordered_sum(inputs: List[np.ndarray], order) -> np.ndarray:
    """Sequential adds in `order`, in float32 (16-bit inputs widened, rounded once at the end)."""
    acc = inputs[order[0]].astype(np.float32)
    for r in order[1:]:
        acc += inputs[r].astype(np.float32)
    return acc.astype(inputs[0].dtype)


def bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32 if x.itemsize == 4 else np.uint16)


def order_sensitive(inputs: List[np.ndarray]) -> int:
    """How many elements the reversed order rounds differently: the inputs must make it > 0."""
    return int(
        np.count_nonzero(bits(ordered_sum(inputs, range(WORLD))) != bits(ordered_sum(inputs, range(WORLD)[::-1])))
    )


def shuffled_job(addresses: List[str], passes: int, seed: int) -> List[List[List[np.ndarray]]]:
    """W ranks (threads) all-reduce every size `passes` times; before each collective every rank
    sleeps a random 0-20 ms, so the contributions reach the reducers in a different order each
    time. Returns results[rank][pass][size]."""
    job = new_job()
    delays = random.Random(seed)
    schedule = [[[delays.uniform(0, 0.02) for _ in SIZES] for _ in range(passes)] for _ in range(WORLD)]

    def make(rank: int) -> rs.Communicator:
        return rs.Communicator(
            addresses, rank, WORLD, job_token=TOKEN, job_id=job, chunk_bytes=CHUNK, timeout=30, connect_timeout=30
        )

    def body(comm: rs.Communicator, rank: int) -> List[List[np.ndarray]]:
        out = []
        for p in range(passes):
            row = []
            for i, count in enumerate(SIZES):
                time.sleep(schedule[rank][p][i])
                row.append(comm.all_reduce(mixed(count, i, rank)))
            out.append(row)
        return out

    return run_ranks(WORLD, make, body, limit=90)


def test_results_are_bitwise_identical_over_runs_reducer_counts_and_transports_and_equal_the_rank_ordered_sum():
    inputs = [[mixed(count, i, r) for r in range(WORLD)] for i, count in enumerate(SIZES)]
    expected = [ordered_sum(xs, range(WORLD)) for xs in inputs]
    assert order_sensitive(inputs[2]) > 1000  # the order really shows in these inputs
    runs = []
    with reducers(2, extra_env=DETERMINISTIC) as group:
        runs += [res for rank_results in shuffled_job(group.addresses, passes=3, seed=1) for res in rank_results]
        assert group.alive()
    # ... and over both transports: R=2 sums from shared-memory slots, R=1 (RS_SHM=0) from frames
    with reducers(1, extra_env={**DETERMINISTIC, "RS_SHM": "0"}) as group:
        runs += [res for rank_results in shuffled_job(group.addresses, passes=1, seed=2) for res in rank_results]
        assert group.alive()
    assert len(runs) == WORLD * 4  # every rank of 3 passes on R=2 and 1 pass on R=1
    for run in runs:
        for i, y in enumerate(run):
            assert y.dtype == np.float32 and y.shape == (SIZES[i],)
            differ = np.count_nonzero(bits(y) != bits(expected[i]))
            assert differ == 0, f"size {SIZES[i]}: {differ} elements differ from the rank-ordered sum"


def test_a_result_every_rank_reads_from_a_result_slot_is_the_rank_ordered_sum():
    """Chunks of 600 KB, large enough for the reducers' result slots: the last rank's fold, once
    the last to arrive has let every held contribution be folded in rank order, writes the sum
    into a result slot, and every rank that reads it there gets the rank-ordered sum's bits."""
    count, passes = 300_000, 4
    inputs = [mixed(count, 7, r) for r in range(WORLD)]
    expected = ordered_sum(inputs, range(WORLD))
    assert order_sensitive(inputs) > 1000
    delays = random.Random(3)
    schedule = [[delays.uniform(0, 0.02) for _ in range(passes)] for _ in range(WORLD)]
    with reducers(2, extra_env=DETERMINISTIC) as group:
        job = new_job()

        def make(rank: int) -> rs.Communicator:
            return rs.Communicator(
                group.addresses,
                rank,
                WORLD,
                job_token=TOKEN,
                job_id=job,
                chunk_bytes=1 << 20,
                pipeline_depth=1,
                timeout=30,
                connect_timeout=30,
            )

        def body(comm: rs.Communicator, rank: int):
            for p in range(passes):
                time.sleep(schedule[rank][p])
                y = comm.all_reduce(inputs[rank])
                assert np.count_nonzero(bits(y) != bits(expected)) == 0, f"pass {p}: not the rank-ordered sum"
            return comm._engine.slots.results_read

        reads = run_ranks(WORLD, make, body, limit=60)
        assert group.alive()
    assert sum(reads) >= passes * 2 * (WORLD - 1)  # 2 chunks a pass, read by every rank but at most the owner


def test_16_bit_floats_are_summed_in_rank_order_in_float32_and_rounded_once():
    inputs = [mixed(50_000, 7, r, np.float16) for r in range(WORLD)]
    inputs += [mixed(50_000, 8, r, ml_dtypes.bfloat16) for r in range(WORLD)]
    expected = [ordered_sum(inputs[:WORLD], range(WORLD)), ordered_sum(inputs[WORLD:], range(WORLD))]
    with reducers(2, extra_env=DETERMINISTIC) as group:

        def body(comm, rank):
            out = []
            for k in range(2):
                time.sleep(0.005 * ((rank + k) % WORLD))  # another arrival order for each dtype
                out.append(comm.all_reduce(inputs[k * WORLD + rank]))
            return out

        results = run_job(WORLD, body, group=group, chunk_bytes=CHUNK, timeout=30, connect_timeout=30, limit=60)
    for out in results:
        for y, want in zip(out, expected):
            assert y.dtype == want.dtype
            assert np.array_equal(bits(y), bits(want))


def fold_in_order(deterministic: bool, order, inputs: List[np.ndarray]) -> bytes:
    """The result an in-process Reducer sends when the W contributions arrive in `order`
    (exactly that order: no network in between)."""
    sock = CapturingSocket()
    reducer = Reducer(sock, world_size=WORLD, job_token="", deterministic=deterministic)
    info = hello_payload()
    for rank in range(WORLD):
        ident = dict(rank=rank, world=WORLD, job=9)
        reducer.handle(
            [zmq.Frame(b"r%d" % rank), zmq.Frame(protocol.text_header(MsgType.HELLO, info, **ident)), zmq.Frame(info)]
        )
        reducer.handle([zmq.Frame(b"r%d" % rank), zmq.Frame(protocol.text_header(MsgType.AUTH, b"", **ident))])
    count = len(inputs[0])
    for rank in order:
        reducer.handle(
            [
                zmq.Frame(b"r%d" % rank),
                zmq.Frame(data(rank, WORLD, job=9, seq=1, count=count)),
                zmq.Frame(inputs[rank].tobytes()),
            ]
        )
    results = [m[2] for m in sock.sent if protocol.unpack(m[1]).type is MsgType.RESULT]
    assert len(results) == WORLD, "every rank gets the result"
    assert len(set(results)) == 1
    assert reducer.pool.held_bytes == 0 and not reducer.rounds.rounds
    return results[0]


def test_every_arrival_order_gives_the_same_bits_only_in_deterministic_mode():
    """All 24 arrival orders of 4 contributions, delivered in exactly that order: deterministic
    mode gives one result, the rank-ordered sum; the default mode folds in arrival order, and
    its results differ between orders."""
    inputs = [mixed(4096, 3, r) for r in range(WORLD)]
    want = ordered_sum(inputs, range(WORLD)).tobytes()
    orders = list(itertools.permutations(range(WORLD)))
    assert {fold_in_order(True, order, inputs) for order in orders} == {want}
    default = {order: fold_in_order(False, order, inputs) for order in orders}
    for order, result in default.items():  # the default mode is the arrival-ordered sum
        assert result == ordered_sum(inputs, order).tobytes()
    assert len(set(default.values())) > 1


def test_the_reducer_announces_deterministic_mode_and_the_switch_is_validated():
    with reducers(1, workers=2, extra_env=DETERMINISTIC) as group:
        peer = Peer(group.addresses[0])
        assert peer.handshake(0, 2, job=0xDE)["deterministic"] is True
        peer.close()
    with reducers(1, workers=2) as group:
        peer = Peer(group.addresses[0])
        assert peer.handshake(0, 2, job=0xDE)["deterministic"] is False
        peer.close()
    serve = [sys.executable, "-m", "reduction_server", "serve", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen([*serve, "--deterministic"], env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert "deterministic=on" in proc.stdout.readline()
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
    bad = subprocess.run(
        serve, env=child_env({"RS_DETERMINISTIC": "sometimes"}), capture_output=True, text=True, timeout=30
    )
    assert bad.returncode == 2 and "RS_DETERMINISTIC='sometimes' is not a switch" in bad.stderr, bad.stderr


def test_a_worker_whose_reducers_disagree_on_deterministic_mode_fails_at_start_naming_both():
    """One reducer sums in rank order and the other in arrival order: the job's results would not
    be reproducible, in their last bits, without a word; the worker refuses to start instead."""
    from reduction_server import CollectiveError

    with reducers(2, extra_env=DETERMINISTIC) as group:
        group.signal(1, signal.SIGKILL)
        group.restart(1, env={**group.env, "RS_DETERMINISTIC": "0"})
        with pytest.raises(CollectiveError, match="RS_DETERMINISTIC") as failed:
            rs.Communicator(group.addresses, 0, 1, job_token=TOKEN, connect_timeout=10)
        text = str(failed.value)
        assert all(f"reducer {i} ({address})" in text for i, address in enumerate(group.addresses)), text
