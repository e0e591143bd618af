"""Compressed all-reduce through real reducers (docs/protocol.md, "Formats"): each format up and
down and each op against a NumPy reference of decode-sum-encode, exact where the spec makes it so
(group mode: rank order; or two ranks, whose sum has one order), block tails, zeros,
non-finite values, mixed formats between ranks refused by name, and bitwise equal reruns."""

from __future__ import annotations

import signal

import ml_dtypes
import numpy as np
import pytest

import reduction_server.client as rs
from helpers import int8_blocks as ref
from helpers.cluster import ONE_PROCESS, TOKEN, reducers
from helpers.jobs import new_job, run_job, until
from helpers.peers import JOB, Peer, data
from helpers.training import FAST
from reduction_server.client.error_feedback import ErrorFeedback
from reduction_server.errors import CollectiveError
from reduction_server.wire.formats import INT8_BLOCK
from reduction_server.wire.protocol import ErrorCode, MsgType

pytestmark = pytest.mark.timeout(120)

WORLD = 3
CHUNK = 64 * 1024  # a 100,003-element collective is several chunks over both reducers
B = 256
F32 = np.float32
BF16 = ml_dtypes.bfloat16
#: compression= -> (the format up, the format down), as the reference names them
FORMATS = {
    "int8": ("int8", "int8"),
    ("int8", "none"): ("int8", "float32"),
    ("int8", "bf16"): ("int8", "bfloat16"),
    ("int8", "fp16"): ("int8", "float16"),
    "bf16": ("bfloat16", "bfloat16"),
    "fp16": ("float16", "float16"),
}


@pytest.fixture(scope="module")
def group():
    """The module's reducers (in place of conftest's): deterministic, so that every sum has one order."""
    with reducers(2, extra_env={"RS_DETERMINISTIC": "1"}) as group:
        yield group
        assert group.alive(), "a reducer died during the tests"


def inputs(count: int, seed: int, world: int = WORLD):
    rng = np.random.default_rng([seed, count])
    return [(rng.standard_normal(count) * 10.0 ** rng.integers(-2, 3, count)).astype(F32) for _ in range(world)]


def expected(xs, compression, op: str) -> np.ndarray:
    """What every rank gets: each contribution encoded, decoded, summed in rank order in float32,
    averaged, encoded once in the format down, decoded into float32."""
    up, down = FORMATS[compression]
    if up == "int8":
        acc = ref.reduced([ref.encode(x, B) for x in xs], xs[0].size, B, average=op == "avg")
    else:
        acc = xs[0].astype(up).astype(F32)
        for x in xs[1:]:
            acc = acc + x.astype(up).astype(F32)
        acc = acc / F32(len(xs)) if op == "avg" else acc
    if down == "int8":
        return ref.decode(ref.encode(acc, B), acc.size, B)
    return acc.astype(BF16 if down == "bfloat16" else down).astype(F32)


def reduce(group, xs, compression, op="sum", **options):
    return run_job(
        len(xs),
        lambda comm, r: comm.all_reduce(xs[r], op, compression=compression),
        group=group,
        chunk_bytes=CHUNK,
        **options,
    )


CASES = [(count, op) for count in (1, 300, 100_003) for op in ("sum", "avg")]  # one element, a tail, chunks


@pytest.mark.parametrize("compression", list(FORMATS), ids=str)
def test_every_format_and_op_is_the_rank_ordered_decode_sum_encode(group, compression):
    cases = [(inputs(count, 1), op) for count, op in CASES]
    results = run_job(
        WORLD,
        lambda comm, r: [comm.all_reduce(xs[r], op, compression=compression) for xs, op in cases],
        group=group,
        chunk_bytes=CHUNK,
    )
    for (xs, op), *ys in zip(cases, *results):
        want = expected(xs, compression, op)
        for y in ys:
            assert y.dtype == F32 and y.shape == xs[0].shape
            assert y.tobytes() == want.tobytes(), (op, xs[0].size)


def test_runs_are_bitwise_equal_in_deterministic_mode(group):
    """Two jobs, each three collectives of the same tensor in flight at once (the later ones reuse
    the buffers of those before, as a training step would)."""
    xs = inputs(100_003, 3)

    def body(comm, rank):
        handles = [comm.all_reduce_async(xs[rank], compression=c) for c in ("int8", ("int8", "bf16"), "int8")]
        first = [h.wait() for h in handles]
        return first + [comm.all_reduce(xs[rank], compression="int8")]

    runs = [run_job(WORLD, body, group=group, chunk_bytes=CHUNK) for _ in range(2)]
    want = expected(xs, "int8", "sum").tobytes()
    assert all(y[i].tobytes() == want for ys in runs for y in ys for i in (0, 2, 3))
    assert all(y[1].tobytes() == runs[0][0][1].tobytes() for ys in runs for y in ys)


def test_other_float_types_and_out_take_the_result_in_their_own_type(group):
    xs = [x.astype(BF16) for x in inputs(1000, 4)]
    widened = [x.astype(F32) for x in xs]
    outs = run_job(
        WORLD,
        lambda comm, r: comm.all_reduce(xs[r], "sum", out=np.empty(1000, BF16), compression=("int8", "none")),
        group=group,
    )
    want = expected(widened, ("int8", "none"), "sum").astype(BF16)
    for y in outs:
        assert y.dtype == BF16 and y.tobytes() == want.tobytes()


def test_zeros_stay_zeros(group):
    for y in reduce(group, [np.zeros(777, F32)] * WORLD, "int8"):
        assert y.tobytes() == np.zeros(777, F32).tobytes()


def test_a_nan_or_an_infinity_makes_its_block_nan_on_every_rank(group):
    xs = inputs(1000, 5)
    xs[1][5] = np.inf  # block 0
    xs[2][600] = np.nan  # block 2
    xs[0][999] = -np.inf  # the tail block, 3
    for compression in ["int8", ("int8", "none")]:
        for y in reduce(group, xs, compression):
            assert np.isnan(y[:256]).all() and np.isnan(y[512:]).all()
            assert np.isfinite(y[256:512]).all()
            assert y[256:512].tobytes() == expected(xs, compression, "sum")[256:512].tobytes()


@pytest.mark.parametrize(
    "theirs,named",
    [("none", "float32"), (("int8", "none"), "int8 blocks up, float32 down"), ("bf16", "bfloat16")],
    ids=["float32", "int8-float32", "bf16"],
)
def test_ranks_that_send_different_formats_fail_naming_both(group, theirs, named):
    def body(comm, rank):
        try:
            comm.all_reduce(np.ones(1000, F32), compression="int8" if rank == 0 else theirs)
        except CollectiveError as exc:
            return str(exc)
        return "no error"

    for text in run_job(2, body, group=group):
        assert "disagree" in text and "dtype=int8 blocks up, int8 blocks down" in text and f"dtype={named}" in text


def test_ops_and_types_that_do_not_compress_are_refused_by_name(solo):
    with pytest.raises(ValueError, match="op max cannot be compressed"):
        solo.all_reduce(np.ones(10, F32), "max", compression="int8")
    with pytest.raises(TypeError, match="only float tensors compress; this one holds 10 x int32"):
        solo.all_reduce(np.ones(10, np.int32), compression="int8")
    with pytest.raises(ValueError, match="compression 'int4' is not known"):
        solo.all_reduce(np.ones(10, F32), compression="int4")
    with pytest.raises(ValueError, match="only int8 up may come back in another format"):
        solo.all_reduce(np.ones(10, F32), compression=("bf16", "none"))


def test_a_reducer_refuses_a_format_it_does_not_know_and_blocks_of_another_size_by_name(group):
    peers = [Peer(group.addresses[0]) for _ in range(2)]
    try:
        for rank, peer in enumerate(peers):
            peer.handshake(rank, 2, job=JOB + 1)
        peers[0].send(data(0, job=JOB + 1, count=10, dtype=13, nbytes=14), bytes(14))
        peers[0].expect_error(ErrorCode.MALFORMED, "unknown dtype (format) code 13 (up 13, down 0)")
        for rank, block in enumerate([256, 64]):  # ranks whose RS_INT8_BLOCK differ
            payload = ref.encode(np.ones(1000, F32), block).tobytes()
            peers[rank].send(data(rank, job=JOB + 1, count=1000, dtype=INT8_BLOCK, nbytes=len(payload)), payload)
        for peer in peers:
            peer.expect_error(ErrorCode.MISMATCH, "int8 blocks of 64", "of 256", "RS_INT8_BLOCK")
    finally:
        for peer in peers:
            peer.close()


def test_a_result_brought_to_a_substitute_is_the_encoded_one_rank_0_got():
    """Reducer 0 answers an int8 chunk and dies; rank 1 (a hand-driven peer) resends its
    contribution to the substitute as MOVED and gets, bit for bit, the int8 blocks that rank 0 got
    and brought there as a FINAL, not a new sum."""
    code, job = INT8_BLOCK, new_job()
    with reducers(2, extra_env={**FAST, **ONE_PROCESS}) as pair:
        peers = [Peer(address) for address in pair.addresses]
        for peer in peers:
            peer.handshake(1, 2, job=job)
        comm = rs.Communicator(pair.addresses, 0, 2, job_token=TOKEN, job_id=job, timeout=20, connect_timeout=10)
        try:
            mine, theirs = inputs(1000, 6, world=2)
            handle = comm.all_reduce_async(mine, compression="int8")  # seq 0: reducer 0's
            blocks = ref.encode(theirs, B).tobytes()
            peers[0].send(data(1, 2, job=job, seq=0, count=1000, dtype=code, nbytes=len(blocks)), blocks)
            got = handle.wait(5)
            header, answer = peers[0].recv(5)
            assert header.type is MsgType.RESULT and header.dtype == code
            assert got.tobytes() == ref.decode(np.frombuffer(answer, np.uint8), 1000, B).tobytes()
            pair.signal(0, signal.SIGKILL)
            other = ref.encode(np.zeros(1000, F32), B).tobytes()  # what a new sum would take instead
            moved = data(1, 2, job=job, seq=0, count=1000, dtype=code, nbytes=len(other), mtype=MsgType.MOVED)
            peers[1].send(moved, other)
            header, brought = peers[1].recv(10)
            assert header.type is MsgType.RESULT and brought == answer
            # counted by rank 0's engine thread once its send returns, maybe after rank 1's answer
            until(lambda: comm._engine.failover.finals == 1, "rank 0 to count the FINAL it brought", 10)
        finally:
            comm.close()
            for peer in peers:
                peer.close()


def test_error_feedback_sends_the_sum_of_the_gradients_within_one_quantum(solo):
    """Gradients under half a quantum of their block are never sent by int8 alone; with error
    feedback their residual grows until it goes out, so the sum sent over the steps tracks the
    sum of the gradients within a quantum (here one rank: the result is what it sent)."""
    grad = np.full(300, 0.001, F32)
    grad[0] = 1.0  # block 0's quantum is 1/127: 0.001 rounds to 0
    assert not solo.all_reduce(grad, compression=("int8", "none"))[1:256].any()
    feedback = ErrorFeedback(solo, compression=("int8", "none"))
    sent = np.zeros(300, np.float64)
    for _ in range(50):
        sent += feedback.all_reduce("w", grad, op="sum")
    assert np.abs(sent - 50 * grad.astype(np.float64)).max() <= 1 / 127
    assert sent[1:256].min() > 0.04  # 0.05 of gradient in 50 steps, sent a quantum at a time
    np.testing.assert_allclose(sent + feedback.residual("w"), 50 * grad.astype(np.float64), atol=1e-5)
    with pytest.raises(ValueError, match="residual= is what compression loses"):
        solo.all_reduce(grad, residual=np.zeros(300, F32))
    with pytest.raises(ValueError, match="residual holds 10 x float32, not 300 x float32"):
        solo.all_reduce(grad, compression="int8", residual=np.zeros(10, F32))
