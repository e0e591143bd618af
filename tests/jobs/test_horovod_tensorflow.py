"""The Horovod-style TensorFlow/Keras API (reduction_server.client.horovod.tensorflow and .keras)
through real reducers and real rank processes: a custom loop with hvd.DistributedGradientTape and
model.fit with hvd.DistributedOptimizer and hvd.callbacks, each against a single process on the
concatenated batch, the collectives (reducescatter, alltoall, grouped allgather, join, barrier,
process sets, IndexedSlices, integer scaling, Compression.int8) against NumPy references, the
gradients Horovod's test_tensorflow.py asserts, int8 training with error feedback, and the
errors. One job per world size runs every check (horovod_tf_worker.py, horovod_tf_checks.py)."""

import json
import os
import sys

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip(
    "tensorflow", reason="tensorflow is not installed (pip install tensorflow-cpu) - the adapter needs it"
)

from helpers import int8_blocks as ref  # noqa: E402
from helpers.cluster import ROOT, SCRIPTS, once, reducers, run_workers  # noqa: E402
from helpers.reference import assert_close  # noqa: E402
from reduction_server.config import settings  # noqa: E402

sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(SCRIPTS))
import horovod_tf_checks  # noqa: E402
import keras_fit  # noqa: E402
import tf_custom_loop  # noqa: E402

PER = 4
SPEC = {
    "loop": {"steps": 4, "per": PER, "lr": 0.1, "predivide": 2.0},
    "fit": {"steps": 4, "per": PER, "lr": 0.05, "epochs": 2},
    "warmup": {"steps": 2, "per": PER, "lr": 0.08, "epochs": 3, "warmup": 2},
    "schedule": {
        "steps": 2,
        "per": PER,
        "lr": 0.08,
        "epochs": 4,
        "schedule": {"multiplier": 0.5, "start_epoch": 1, "end_epoch": 3},
    },
}
_results = {}
_references = {}


def run_job(world):
    def run():
        with reducers(world - 1, workers=world) as group:
            return run_workers(world, group, "horovod_tf_worker.py", [json.dumps(SPEC)], timeout=240)

    return once(_results, world, run)


@pytest.fixture(params=[2, 3], ids=lambda w: f"W{w}")
def job(request):
    return request.param, run_job(request.param)


def single_process_loop(world):
    """The custom loop's model, rank 0's, trained by one process on the whole batches (once per world size)."""

    def train():
        loop = SPEC["loop"]
        model = tf_custom_loop.make_model(seed=0)
        tf_custom_loop.train(model, loop["steps"], world * PER, rank=0, world=1, lr=loop["lr"], distributed=False)
        return model

    return once(_references, world, train)


def test_custom_loop_matches_a_single_process(job):
    world, results = job
    reference = single_process_loop(world)
    start = tf_custom_loop.weights(tf_custom_loop.make_model(seed=0))
    for r in results:
        assert_close(r["loop"]["initial"], start, f"rank {r['rank']} after broadcast_variables")
        assert r["loop"]["final"] == results[0]["loop"]["final"], "ranks differ"
    assert_close(results[0]["loop"]["final"], tf_custom_loop.weights(reference), "custom loop vs one process")


def test_fit_matches_a_single_process_and_averages_metrics(job):
    world, results = job
    fit = SPEC["fit"]
    reference = keras_fit.make_model(seed=0)
    history = keras_fit.fit(
        reference, fit["steps"], world * PER, rank=0, world=1, lr=fit["lr"], epochs=fit["epochs"], distributed=False
    )
    for r in results:
        assert r["fit"]["final"] == results[0]["fit"]["final"], "ranks differ"
        assert r["fit"]["history"]["loss"] == results[0]["fit"]["history"]["loss"], "metrics were not averaged"
    assert_close(results[0]["fit"]["final"], keras_fit.weights(reference), "model.fit vs one process")
    # The mean of the ranks' losses over equal shards is the whole batch's loss (before each step).
    assert_close(results[0]["fit"]["history"]["loss"], history["loss"], "averaged loss", rtol=1e-4)


def test_learning_rate_warmup(job):
    world, results = job
    warm = SPEC["warmup"]
    lr = warm["lr"]
    # The rate at the last batch of epoch e: epoch fraction (e + 1) of warmup, then the target.
    expected = [lr * (1 + min((e + 1) / warm["warmup"], 1.0) * (world - 1)) / world for e in range(warm["epochs"])]
    for r in results:
        assert r["warmup"]["lr"] == pytest.approx(expected, rel=1e-6)


def test_learning_rate_schedule(job):
    """Horovod's LearningRateScheduleCallback, staircase: untouched before start_epoch, then
    lr * 0.5 ** (epoch - start_epoch) at each epoch's start until end_epoch, where it stays."""
    _, results = job
    lr = SPEC["schedule"]["lr"]
    for r in results:
        assert r["schedule"]["lr"] == pytest.approx([lr, lr, lr / 2, lr / 2], rel=1e-6)


def test_local_variables_are_not_broadcast(job):
    _, results = job
    first = results[0]["local"]
    for r in results[1:]:
        assert r["local"][1:] == first[1:], "a variable that is not local was not broadcast"
        assert r["local"][0] != first[0], "the local variable was broadcast"


def test_collectives(job):
    world, results = job
    ranks = range(world)
    for r in results:
        c = r["collectives"]
        scale = [k + 1 for k in ranks]
        assert c["sum"] == [sum(scale) * 1.0, sum(scale) * 2.0]
        assert c["average"] == pytest.approx([sum(scale) / world, 2 * sum(scale) / world])
        assert c["min"] == [1.0, 2.0] and c["max"] == [world * 1.0, world * 2.0]
        assert c["product"] == pytest.approx([float(np.prod(scale)), float(np.prod([2.0 * s for s in scale]))])
        assert c["scaled"] == [world * 2 * 0.5] * 2
        assert c["fp16"] == ["float32", [sum(0.5 + k for k in ranks)] * 3]
        assert c["grouped"] == [[float(sum(ranks))] * 2, [float(world)] * 3]
        assert c["broadcast"] == [float(world - 1)] * 2
        assert c["allgather"] == [[k, k] for k in ranks for _ in range(k + 1)]
        total = float(sum(ranks))
        assert c["keras_positional"] == [
            [2.0 * world, 4.0 * total],
            [total / world] * 2,
            [[total] * 2],
            [total / world],
        ]
        assert c["in_graph"] == [[float(sum(ranks))], [float(k) for k in ranks]]
        assert c["object"] == {"from": 1}
        assert c["objects"] == [10 * k for k in ranks]
        shapes = "; ".join(f"ranks [{k}]: [{k + 1}]" for k in ranks)
        assert c["mismatch"] == [
            f"PreconditionError: rank {r['rank']}: tensor 'mismatch': ranks disagree on its shape: {shapes}",
            True,
            True,
        ]
        assert "XLA" in c["xla"] and "jit_compile=False" in c["xla"], c["xla"]


def rows(rank, count):
    """horovod_tf_checks.rows_tensor's values: row k of rank r holds [100 r + k, 100 r + k + 0.5]."""
    return np.arange(count, dtype=np.float64)[:, None] + 100 * rank + np.array([0.0, 0.5])


def share(array, rank, size):
    """rank's rows of `array` as Horovod's reducescatter divides them: the first len % size ranks take one more."""
    counts = [len(array) // size + (r < len(array) % size) for r in range(size)]
    start = sum(counts[:rank])
    return array[start : start + counts[rank]]


def is_argument_error(error, words):
    """Horovod's InvalidArgumentError that is also a ValueError, saying `words`."""
    return error[0].startswith("ArgumentError: ") and words in error[0] and error[1:] == [True, True]


def test_exports():
    import reduction_server.client.horovod.keras as hvd_keras
    import reduction_server.client.horovod.tensorflow as hvd

    for name in (
        "ProcessSet",
        "global_process_set",
        "add_process_set",
        "remove_process_set",
        "HorovodInternalError",
        "HostsUpdatedInterrupt",
        "start_timeline",
        "stop_timeline",
        "join",
        "barrier",
        "reducescatter",
        "grouped_reducescatter",
        "alltoall",
        "grouped_allgather",
        "broadcast_object",
        "allgather_object",
    ):
        assert name in hvd.__all__ and name in hvd_keras.__all__ and hasattr(hvd_keras, name), name
    assert [
        hvd.mpi_built(),
        hvd.mpi_enabled(),
        hvd.gloo_built(),
        hvd.gloo_enabled(),
        hvd.nccl_built(),
        hvd.ddl_built(),
        hvd.ccl_built(),
        hvd.cuda_built(),
        hvd.rocm_built(),
    ] == [False] * 4 + [0] + [False] * 4
    with pytest.raises(ValueError):
        hvd.mpi_threads_supported()


def test_reducescatter_against_numpy(job):
    world, results = job
    count = 2 * world + 1
    total = sum(rows(k, count) for k in range(world))
    for r in results:
        o, rank = r["ops"], r["rank"]
        np.testing.assert_array_equal(o["reducescatter_sum"], share(total, rank, world))
        np.testing.assert_allclose(o["reducescatter_avg"], share(total / world, rank, world), rtol=1e-6)
        np.testing.assert_allclose(o["reducescatter_scaled"], share(total * 1.5, rank, world), rtol=1e-6)
        assert o["grouped_reducescatter"] == [
            share(total, rank, world).tolist(),
            share(total[:world], rank, world).tolist(),
        ]
        assert is_argument_error(o["reducescatter_scalar"], "at least one dimension"), o["reducescatter_scalar"]
        # In tf.function: the same reducescatter, and an alltoall of the first `world` rows (one to each rank).
        assert o["in_graph"] == [o["reducescatter_sum"], [rows(k, world)[rank].tolist() for k in range(world)]]


def test_integer_and_half_scaling(job):
    """Horovod scales integers in float64 (truncating back) and float16 in float32."""
    world, results = job
    ints = [np.array([7, -7, 5, 100], np.int32) * (k + 1) for k in range(world)]
    total = sum(ints)
    big = [(np.arange(world * 2) * (k + 3)).reshape(-1, 1).astype(np.int64) for k in range(world)]
    halves = [np.array([1.5, 3.0], np.float16) * np.float16(k + 1) for k in range(world)]
    half_sum = sum((h.astype(np.float32) * np.float32(0.1)).astype(np.float16).astype(np.float32) for h in halves)
    for r in results:
        o = r["ops"]
        assert o["int_prescale"] == sum((x * 0.35).astype(np.int32) for x in ints).tolist()
        assert o["int_postscale"] == (total * 0.35).astype(np.int32).tolist()
        assert o["int_average"] == (total * (1.0 / world)).astype(np.int32).tolist()
        assert (
            o["int64_reducescatter_prescale"]
            == share(sum((b * 0.7).astype(np.int64) for b in big), r["rank"], world).tolist()
        )
        np.testing.assert_allclose(o["half_prescale"], half_sum.astype(np.float16), rtol=1e-3)


def test_alltoall_against_numpy(job):
    world, results = job
    for r in results:
        o, me = r["ops"], r["rank"]
        # Rank k sends (k + i) % 3 rows to rank i, each [100 k + i] * 2.
        got, received, dtype = o["alltoall"]
        assert received == [(k + me) % 3 for k in range(world)] and dtype == "int32"
        assert got == [[100.0 * k + me] * 2 for k in range(world) for _ in range((k + me) % 3)]
        # Without splits: a tensor alone (as Horovod's), equal shares; int16 travels exactly.
        assert o["alltoall_equal"] == ["EagerTensor", "int16", [me + 10 * k for k in range(world) for _ in range(2)]]
        assert is_argument_error(o["alltoall_indivisible"], "does not divide"), o["alltoall_indivisible"]
        assert is_argument_error(o["alltoall_too_many"], "at most the first dimension"), o["alltoall_too_many"]
        assert is_argument_error(o["alltoall_length"], f"each of the {world} ranks"), o["alltoall_length"]


def test_grouped_allgather_and_bool_broadcast(job):
    world, results = job
    for r in results:
        assert r["ops"]["grouped_allgather"] == [
            ["float32", [[float(k)] * 2 for k in range(world) for _ in range(k + 1)]],
            ["int64", list(range(world))],
            ["bool", [k % 2 == 0 for k in range(world)]],
        ]
        assert r["ops"]["broadcast_bool"] == [True, True]


def test_gradients_as_horovod_asserts(job):
    """Horovod's test_horovod_*_grad_cpu: each result is (shape, distinct values) of the gradient."""
    world, results = job
    sizes = [3, 2, 7][:world]
    for r in results:
        g, rank = r["gradients"], r["rank"]
        assert g["allreduce_sum"] == [[5, 5], [world]]
        assert g["allreduce_average"] == [[5, 5], [1.0]]
        assert g["allreduce_scaled"] == [[5, 5], [world * 2.0 * 0.25]]
        assert g["grouped_allreduce"] == [[[5, 5], [world]]] * 2
        assert g["allgather"] == [[sizes[rank], 4], [rank]]
        assert g["grouped_allgather"] == [[[sizes[rank], 4], [rank]]] * 2
        assert g["broadcast"] == [[[5, 5], [1.0 if rank == root else 0.0]] for root in range(world)]
        assert g["alltoall"] == [[world * (rank + 1), 3], [1.0]]
        assert g["alltoall_equal"] == [[2 * world, 3], [1.0]]
        assert g["reducescatter_sum"] == [[4 * world, 3], [world]]
        assert g["reducescatter_average"] == [[4 * world, 3], [1.0]]
        assert g["grouped_reducescatter"] == [[[4 * world, 3], [world]]] * 2
        # In tf.function: allgather's gradient (this rank's rows of grad_ys, ones x rank) plus, through a
        # reducescatter of the first `world` gathered rows (all rank 0's), world x ones on those rows.
        expected = np.full([sizes[rank], 4], float(rank))
        if rank == 0:
            expected[:world] += world
        assert g["in_graph"] == expected.tolist()


def test_indexed_slices_are_gathered(job):
    """Horovod's test_horovod_allreduce_indexed_slices_cpu: values and indices gathered, duplicates summed."""
    world, results = job
    values = np.arange(6, dtype=np.float32).reshape(3, 2)
    reference = np.stack([values] + [2 * values] * (world - 1) + [values])
    for r in results:
        s = r["sparse"]
        assert s["sum"] == ["IndexedSlices", reference.tolist()]
        np.testing.assert_allclose(s["average"], reference / world, rtol=1e-6)
        assert s["grouped"] == [reference.tolist(), [float(sum(range(world)))] * 2]
        assert s["min"] == [
            "NotImplementedError: Only Sum and Average ops are supported with tf.IndexedSlices",
            False,
            False,
        ]
        assert s["prescale"][0] == "NotImplementedError: Pre/postscale_factor are not supported with tf.IndexedSlices"
        # An embedding's gradient: rank k adds 2 (k + 1) to row k; averaged over the ranks.
        dense = [[2.0 * (k + 1) / world] * 2 for k in range(world)]
        kind, got = s["tape_as_dense_False"]
        assert kind == "IndexedSlices"
        np.testing.assert_allclose(got, dense, rtol=1e-6)
        kind, got = s["tape_as_dense_True"]
        assert kind != "IndexedSlices"
        np.testing.assert_allclose(got, dense, rtol=1e-6)


def test_process_sets(job):
    """Even and odd ranks (hvd.init(process_sets=...)): every op among its set's ranks; the tape and
    optimizer reduce over the even set's ranks and leave the others' gradients as they are."""
    world, results = job
    even, odd = list(range(0, world, 2)), list(range(1, world, 2))
    for r in results:
        p, rank = r["process_sets"], r["rank"]
        mine = even if rank % 2 == 0 else odd
        assert [p["ranks"], p["size"], p["rank"]] == [mine, len(mine), mine.index(rank)]
        assert p["allreduce"] == [float(sum(k + 1 for k in mine))] * 2
        assert p["grouped"] == [[float(sum(mine))] * 2, [sum(mine)]]
        assert p["broadcast"] == [float(mine[-1])] * 2
        assert p["allgather"] == [k for k in mine for _ in range(k + 1)]
        assert p["reducescatter"] == share(sum(rows(k, 3) for k in mine), mine.index(rank), len(mine)).tolist()
        assert p["alltoall"] == mine
        assert p["broadcast_variables"] == [mine[0]]
        assert p["object"] == {"from": mine[0]} and p["objects"] == [10 * k for k in mine]
        assert p["gradient"] == [float(len(mine))] * 3
        assert p["outsider"][0].startswith(f"ValueError: rank {rank} is not in process set") and p["outsider"][1]
        value = rank * rank + 1
        if rank in even and len(even) > 1:
            value = sum(k * k + 1 for k in even) / len(even)
        assert p["tape"] == pytest.approx(2 * value)
        assert p["optimizer"] == pytest.approx([-value])


def test_join_and_barrier(job):
    """Rank 0 joins first: the others' allreduce gets zeros from it (Average still divides by
    every rank), their allgather fails naming the join (as Horovod's); join returns the last
    rank to join, everywhere."""
    world, results = job
    others = range(1, world)
    lasts = {r["join"]["last"][0] for r in results}
    assert len(lasts) == 1 and lasts != {0}
    for r in results:
        j = r["join"]
        assert j["last"][1] == "int32" and j["last_everywhere"] == [j["last"][0]] * world
        if r["rank"] != 0:
            assert j["sum"] == [float(sum(others))] * 3
            assert j["average"] == pytest.approx([sum(others) / world] * 3)
            assert j["allgather"] == (
                f"rank {r['rank']}: tensor 'join.allgather': allgather is not supported with "
                "join (ranks [0] have joined and wait for the others): only allreduce and "
                "barrier are, as in Horovod"
            ), j["allgather"]
            assert j["barrier_wait"] > 0.3, "the barrier did not wait for rank 0"


def test_failed_collectives_raise_horovod_internal_error(job):
    world, results = job
    even, odd = list(range(0, world, 2)), list(range(1, world, 2))
    shapes = "; ".join(f"ranks [{k}]: [{k + 1}]" for k in range(world))
    for r in results:
        e, rank = r["errors"], r["rank"]
        assert e["dtype"] == (
            f"rank {rank}: tensor 'dtype_mismatch': ranks disagree on its dtype: ranks {even}: float32;"
            f" ranks {odd}: int32"
        )
        # Inside tf.function a Python error becomes a tf.errors one that carries it (as Horovod's ops raise tf.errors).
        assert e["in_graph"].startswith("UnknownError: ")
        assert (
            f"PreconditionError: rank {rank}: tensor 'graph_mismatch': ranks disagree on its shape: {shapes}"
            in e["in_graph"]
        ), e["in_graph"]
        assert e["after"] == [float(world)]  # a mismatch fails that tensor, not the job


def test_int8_collectives_are_the_decode_sum_encode_and_refuse_what_they_cannot_do(job):
    """Compression.int8, eager and in tf.function: each rank's blocks decoded, summed (averaged)
    and encoded once, as the NumPy reference does; an int64 tensor goes as it is; ranks that
    disagree, op Min and reducescatter fail, each saying why."""
    world, results = job
    block = settings.read("RS_INT8_BLOCK")
    inputs = [horovod_tf_checks.int8_inputs(k) for k in range(world)]
    summed = ref.allreduced([one for one, _ in inputs], block)
    grouped = ref.allreduced([two for _, two in inputs], block, average=True)
    for r in results:
        c = r["int8"]
        assert ref.matches(c["sum"], summed, world, block) and ref.matches(c["in_graph"], summed, world, block)
        assert ref.matches(c["grouped"], grouped, world, block)  # 256 | 512: fused or not, the same blocks
        assert c["int64"] == ["int64", [sum(i + k for k in range(world)) for i in range(3)]]
        disagree = c["disagree"][0]
        assert disagree.startswith("PreconditionError") and "ranks disagree on its compression" in disagree
        assert "int8" in disagree and "none" in disagree, disagree
        assert c["min"][0] == "ValueError: compressed all_reduce sums or averages; op min cannot be compressed"
        assert "reducescatter cannot send Compression.int8" in c["reducescatter"][0]


def test_int8_training_keeps_a_residual_per_variable_unless_told_not_to(job):
    """DistributedGradientTape under Compression.int8 (the custom loop, in tf.function): a
    nonzero residual of each variable's size, and weights close to a float32 single process's.
    DistributedOptimizer: values under half a quantum of their block are never sent without
    error feedback; with it, the residual carried over the steps sends them, and the updates
    plus the residual are the gradients' sum."""
    world, results = job
    reference = single_process_loop(world)
    sizes = [int(np.prod(v.shape)) for v in reference.trainable_variables]
    grad, steps = np.array([1.0, 0.002, 0.002, 0.002]), 10
    for r in results:
        loop, optimizer = r["loop_int8"], r["int8"]["optimizer"]
        assert r["loop"]["residuals"] == [None] * len(sizes)  # float32: none kept
        assert [size for size, _ in loop["residuals"]] == sizes
        assert all(largest > 0 for _, largest in loop["residuals"]), loop["residuals"]
        assert loop["final"] == results[0]["loop_int8"]["final"], "ranks differ"
        weight, residual = optimizer["feedback_False"]
        assert weight == pytest.approx([-steps * 1.0, 0.0, 0.0, 0.0], abs=1e-5) and residual is None
        weight, residual = optimizer["feedback_True"]
        sent = -np.array(weight)
        assert np.all(sent[1:] > 0.01), sent  # 0.02 over the steps, a quantum (1/127) at a time
        assert np.abs(sent - steps * grad).max() <= 1 / 127, sent
        np.testing.assert_allclose(sent + residual, steps * grad, atol=1e-5)
    error = float(np.abs(np.array(results[0]["loop_int8"]["final"]) - tf_custom_loop.weights(reference)).max())
    assert 0 < error < 1e-3, error
