"""The TensorFlow / Keras adapter (reduction_server.client.tensorflow) through real reducers and
real rank processes: both example styles (a custom loop with DistributedGradientTape, model.fit
with the DistributedOptimizer and the callbacks) against a single-process run on the
concatenated batch, the initial broadcast, None and IndexedSlices gradients, mixed dtypes,
compression, plan mismatches across ranks, and the XLA refusal.

A TensorFlow import costs seconds per process, so the rank processes are few: the examples
themselves under the launcher with 2 workers, and one 3-worker job (this file run as a script)
that runs both styles and every multi-rank check.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip(
    "tensorflow", reason="tensorflow is not installed (pip install tensorflow-cpu) - the adapter needs it"
)
keras = pytest.importorskip("keras", reason="keras 3 is not installed (it comes with tensorflow >= 2.16)")

if __name__ == "__main__":  # a rank's script: tests/, which holds helpers, is not on sys.path then
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import reduction_server.client.tensorflow as rstf  # noqa: E402
from helpers.cluster import ROOT, SCRIPTS, reducers, run_example, run_workers  # noqa: E402
from reduction_server.errors import ConfigError  # noqa: E402

sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(SCRIPTS))  # report, when this module runs as a rank's script
import keras_fit  # noqa: E402
import tf_custom_loop  # noqa: E402
from report import report  # noqa: E402

from helpers.reference import assert_close  # noqa: E402

PER = 4  # rows per rank per step
LOOP = dict(steps=6, lr=0.1)
FIT = dict(steps=5, epochs=2, lr=0.05)


def loop_reference(world):
    """Single process: rank 0's initial weights, the concatenated batches."""
    model = tf_custom_loop.make_model(seed=0)
    tf_custom_loop.train(model, LOOP["steps"], world * PER, rank=0, world=1, lr=LOOP["lr"], distributed=False)
    return tf_custom_loop.weights(model)


def fit_reference(world):
    model = keras_fit.make_model(seed=0)
    keras_fit.fit(
        model, FIT["steps"], world * PER, rank=0, world=1, lr=FIT["lr"], epochs=FIT["epochs"], distributed=False
    )
    return keras_fit.weights(model)


# -- the examples under the launcher, 2 workers -------------------------------------------------


def launch_example(tmp_path, script, *args):
    """Both ranks' JSON reports (written to files: the launcher caps its output lines)."""
    out = run_example(script, "--json", str(tmp_path / "rank{rank}.json"), *args, cwd=tmp_path, timeout=240)
    assert "identical on all ranks: True" in out, out
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_custom_loop_example_matches_single_process(tmp_path):
    results = launch_example(
        tmp_path, "tf_custom_loop.py", "--steps", str(LOOP["steps"]), "--batch", str(PER), "--lr", str(LOOP["lr"])
    )
    start = tf_custom_loop.weights(tf_custom_loop.make_model(seed=0))
    assert results[1]["before"] != results[0]["before"], "ranks were meant to start from different weights"
    for r in results:
        assert_close(r["initial"], start, f"rank {r['rank']} after the broadcast")
        assert r["final"] == results[0]["final"], "ranks ended with different weights"
    assert_close(results[0]["final"], loop_reference(2), "custom loop, 2 ranks vs one process")


def test_keras_fit_example_matches_single_process(tmp_path):
    results = launch_example(
        tmp_path,
        "keras_fit.py",
        "--steps",
        str(FIT["steps"]),
        "--epochs",
        str(FIT["epochs"]),
        "--batch",
        str(PER),
        "--lr",
        str(FIT["lr"]),
    )
    assert results[0]["final"] == results[1]["final"], "ranks ended with different weights"
    assert results[0]["history"] == results[1]["history"], "MetricAverageCallback left the ranks' logs apart"
    assert_close(results[0]["final"], fit_reference(2), "model.fit, 2 ranks vs one process")


# -- one 3-worker job: both styles and the multi-rank checks ------------------------------------

_job = {}


def three_ranks():
    if not _job:
        with reducers(2, workers=3) as group:
            results = run_workers(
                3,
                group,
                str(ROOT / "tests" / "jobs" / "test_tensorflow.py"),
                ["worker"],
                timeout=240,
                extra_env={"RS_FUSION_THRESHOLD": "256"},
            )  # several buckets per step
        _job["results"] = results
    return _job["results"]


def test_three_ranks_custom_loop_matches_single_process():
    results = three_ranks()
    start = tf_custom_loop.weights(tf_custom_loop.make_model(seed=0))
    for r in results:
        if r["rank"]:
            assert r["loop"]["before"] != results[0]["loop"]["before"], "ranks were meant to start apart"
        assert_close(r["loop"]["initial"], start, f"rank {r['rank']} after the broadcast")
        assert r["loop"]["final"] == results[0]["loop"]["final"], "ranks ended with different weights"
    assert_close(results[0]["loop"]["final"], loop_reference(3), "custom loop, 3 ranks vs one process")


def test_three_ranks_fit_matches_single_process_and_averages_metrics():
    results = three_ranks()
    start = keras_fit.weights(keras_fit.make_model(seed=0))
    for r in results:
        fit = r["fit"]
        assert_close(fit["initial"], start, f"rank {r['rank']}: weights when training began (after the broadcast)")
        assert fit["final"] == results[0]["fit"]["final"], "ranks ended with different weights"
        assert fit["history"] == results[0]["fit"]["history"], "the ranks' logs differ after MetricAverageCallback"
    raw = np.array([[[e[k] for k in ("loss", "mae")] for e in r["fit"]["raw_logs"]] for r in results])
    assert not np.allclose(raw[0], raw[1]), "the ranks' own metrics were meant to differ (different shards)"
    averaged = np.array([results[0]["fit"]["history"][k] for k in ("loss", "mae")]).T
    np.testing.assert_allclose(averaged, raw.mean(axis=0), rtol=1e-12)
    assert_close(results[0]["fit"]["final"], fit_reference(3), "model.fit, 3 ranks vs one process")


def test_mixed_dtypes_none_and_indexed_slices():
    results = three_ranks()
    world = len(results)
    ranks = np.arange(world)
    for r in results:
        for mode in ("eager", "graph"):
            got = r["mixed"][mode]
            assert got["none"] is None
            assert got["dtypes"] == ["float32", "float16", "bfloat16", "float64", "float32"], got["dtypes"]
            np.testing.assert_array_equal(got["sum"][0], np.full(3, (ranks + 1).sum()))
            np.testing.assert_array_equal(got["sum"][1], np.full((2, 2), 0.5 * (ranks + 1).sum()))
            np.testing.assert_array_equal(got["sum"][2], np.full(4, (ranks + 1).sum()))
            assert got["sum"][3] == ranks.sum()
            # IndexedSlices (row r = r + 1 on rank r), dense after the all-reduce.
            np.testing.assert_array_equal(got["sum"][4], np.repeat((ranks + 1.0)[:, None], 2, axis=1))
            np.testing.assert_allclose(got["avg"][0], np.full(3, (ranks + 1).mean()), rtol=1e-7)
            assert got["min"] == 1.0 and got["max"] == world and got["prod"] == float(np.prod(ranks + 1))


def test_gradient_tape_skips_none_and_densifies_indexed_slices():
    results = three_ranks()
    world = len(results)
    for r in results:
        tape = r["tape"]
        assert tape["unused"] is None, "a variable without a gradient must keep None"
        np.testing.assert_allclose(tape["used"], np.full(3, (world + 1) / 2), rtol=1e-7)  # mean of rank + 1
        want = np.zeros((4, 2))
        want[:world] = 1.0 / world  # rank r gathered row r
        np.testing.assert_allclose(tape["embedding"], want, rtol=1e-7)
        assert tape["embedding_type"] == "Tensor"


def test_fp16_compression():
    results = three_ranks()
    values = [np.float32(0.1 * (rank + 1) + 1e-4) for rank in range(len(results))]
    exact = np.mean(values, dtype=np.float64)
    wire = np.float16(np.mean([np.float32(np.float16(v)) for v in values]))  # fp16 on the wire, summed in fp32
    for r in results:
        got = r["fp16"]
        assert got["dtype"] == "float32"
        np.testing.assert_allclose(got["value"], float(wire), rtol=1e-3)
        assert got["value"] != pytest.approx(exact, rel=1e-6), "the values were not sent as float16"


def test_broadcast_inside_tf_function_from_another_root():
    results = three_ranks()
    for r in results:
        assert r["broadcast"] == [float(len(results) - 1)] * 3


def test_a_rank_with_a_different_variable_shape_gets_the_plan_error():
    results = three_ranks()
    for r in results:
        message = r["mismatch"]["error"]
        assert message is not None, "a differently shaped variable on rank 2 went through"
        assert "ranks [2] built a different fusion plan" in message, message
        assert r["mismatch"]["after"] == len(results), "the communicator should still work after the error"


# -- in-process checks (no collective is issued) ------------------------------------------------


def test_xla_compiled_step_is_refused():
    variable = tf.Variable(tf.ones(3))

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variable * 2.0)
        return rstf.DistributedGradientTape(tape).gradient(loss, [variable])

    with pytest.raises(rstf.XlaCompileError, match="jit_compile=False") as info:
        step()  # AutoGraph converts the body: the error must still come out as itself
    assert isinstance(info.value, ConfigError)
    assert not rstf.is_initialized(), "no collective may start before the refusal"


def test_keras_jit_compile_is_refused():
    model = keras_fit.make_model(seed=0)
    model.compile(optimizer=rstf.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    assert model.jit_compile is True
    x = np.zeros((4, keras_fit.IN), np.float32)
    with pytest.raises(rstf.XlaCompileError, match="model.compile"):
        model.fit(x, np.zeros((4, keras_fit.OUT), np.float32), verbose=0)
    assert not rstf.is_initialized()


def test_distributed_optimizer_wrapping():
    sgd = keras.optimizers.SGD(0.25, momentum=0.5, clipnorm=1.0)
    wrapped = rstf.DistributedOptimizer(sgd, op="sum")
    assert isinstance(wrapped, keras.optimizers.SGD) and type(wrapped).__name__ == "SGD"
    assert wrapped.get_config() == sgd.get_config()
    assert type(rstf.DistributedOptimizer(keras.optimizers.SGD(0.1))) is type(wrapped)  # one class per base
    # Saved configs name the plain optimizer, so a saved model loads without this package.
    assert keras.saving.serialize_keras_object(wrapped)["class_name"] == "SGD"
    with pytest.raises(TypeError, match="already a DistributedOptimizer"):
        rstf.DistributedOptimizer(wrapped)
    with pytest.raises(TypeError, match="Keras 3 optimizer"):
        rstf.DistributedOptimizer(object())
    built = keras.optimizers.Adam()
    built.build([keras.Variable(np.zeros(2, np.float32))])
    with pytest.raises(ValueError, match="already built"):
        rstf.DistributedOptimizer(built)
    with pytest.raises(ValueError, match="unknown reduction op"):
        rstf.DistributedGradientTape(tf.GradientTape(), op="median")
    with pytest.raises(ValueError, match="needs op average, not sum"):
        rstf.DistributedGradientTape(tf.GradientTape(), op="sum", gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="must be positive"):
        rstf.DistributedOptimizer(keras.optimizers.SGD(0.1), gradient_predivide_factor=0.0)


def test_all_none_needs_no_communicator():
    assert rstf.grouped_allreduce([None, None]) == [None, None]
    assert not rstf.is_initialized()


# -- the 3-worker job's rank process ------------------------------------------------------------


class _Fp16:
    """Horovod's Compression.fp16 shape: float32 -> float16 on the wire, back after."""

    def compress(self, array):
        return (array.astype(np.float16), array.dtype) if array.dtype == np.float32 else (array, None)

    def decompress(self, array, ctx):
        return array.astype(ctx) if ctx is not None else array


def _mixed(rank, world):
    """A group of tensors of every float dtype, a None and an IndexedSlices, eager and in a graph."""

    def tensors():
        return [
            tf.fill([3], float(rank + 1)),
            None,
            tf.fill([2, 2], tf.constant(0.5 * (rank + 1), tf.float16)),
            tf.fill([4], tf.constant(rank + 1, tf.bfloat16)),
            tf.constant(float(rank), tf.float64),
            tf.IndexedSlices(tf.fill([1, 2], float(rank + 1)), tf.constant([rank]), tf.constant([world, 2])),
        ]

    def run():
        summed = rstf.grouped_allreduce(tensors(), op="sum", name="mixed")
        averaged = rstf.grouped_allreduce(tensors()[:1], op="average", name="mixed")
        ops = [rstf.allreduce(tf.constant(float(rank + 1)), op) for op in ("min", "max", "product")]
        return summed, averaged, ops

    out = {}
    for mode, fn in (("eager", run), ("graph", tf.function(run))):
        summed, averaged, ops = fn()
        present = [t for t in summed if t is not None]
        out[mode] = {
            "none": summed[1],
            "dtypes": [t.dtype.name for t in present],
            "sum": [np.asarray(tf.cast(t, tf.float64)).tolist() for t in present],
            "avg": [np.asarray(averaged[0]).tolist()],
            "min": float(ops[0]),
            "max": float(ops[1]),
            "prod": float(ops[2]),
        }
    return out


def _tape(rank):
    used, unused = tf.Variable(tf.zeros(3)), tf.Variable(tf.zeros(2))
    embedding = tf.Variable(tf.zeros((4, 2)))

    @tf.function
    def grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(used * float(rank + 1)) + tf.reduce_sum(tf.gather(embedding, [rank]))
        tape = rstf.DistributedGradientTape(tape)
        return tape.gradient(loss, {"used": used, "unused": unused, "embedding": embedding})

    g = grads()
    return {
        "used": g["used"].numpy().tolist(),
        "unused": g["unused"],
        "embedding": g["embedding"].numpy().tolist(),
        "embedding_type": type(g["embedding"]).__name__.replace("EagerTensor", "Tensor"),
    }


def _mismatch(rank, world):
    """Rank world-1 has a variable of another shape: every rank must get the plan error."""
    variable = tf.Variable(tf.ones(4 if rank == world - 1 else 3))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variable)
        return rstf.DistributedGradientTape(tape).gradient(loss, [variable])

    error = None
    try:
        step()
    except tf.errors.OpError as exc:
        error = exc.message
    return {"error": error, "after": float(rstf.allreduce(tf.constant(1.0), "sum"))}


def _worker():
    rank, world = rstf.rank(), rstf.size()
    out = {"rank": rank}

    model = tf_custom_loop.make_model(seed=rank)
    before = tf_custom_loop.weights(model)
    rstf.broadcast_variables(model.weights, root_rank=0)
    initial = tf_custom_loop.weights(model)
    tf_custom_loop.train(model, LOOP["steps"], PER, rank, world, LOOP["lr"])
    out["loop"] = {
        "before": before.tolist(),
        "initial": initial.tolist(),
        "final": tf_custom_loop.weights(model).tolist(),
    }

    class Record(keras.callbacks.Callback):  # runs after the broadcast, before the metric averaging
        def on_train_begin(self, logs=None):
            self.initial = keras_fit.weights(self.model)
            self.raw = []

        def on_epoch_end(self, epoch, logs=None):
            self.raw.append(dict(logs))

    record = Record()
    model = keras_fit.make_model(seed=rank)
    history = keras_fit.fit(model, FIT["steps"], PER, rank, world, FIT["lr"], FIT["epochs"], callbacks=(record,))
    out["fit"] = {
        "initial": record.initial.tolist(),
        "final": keras_fit.weights(model).tolist(),
        "history": history,
        "raw_logs": record.raw,
    }

    out["mixed"] = _mixed(rank, world)
    out["tape"] = _tape(rank)
    value = rstf.allreduce(tf.constant(0.1 * (rank + 1) + 1e-4, tf.float32), compression=_Fp16())
    out["fp16"] = {"dtype": value.dtype.name, "value": float(value)}
    variables = [tf.Variable(tf.fill([3], float(rank)))]
    tf.function(lambda: rstf.broadcast_variables(variables, root_rank=world - 1))()
    out["broadcast"] = variables[0].numpy().tolist()
    out["mismatch"] = _mismatch(rank, world)
    rstf.shutdown()
    report(out)


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    _worker()
