"""The Horovod-style TensorFlow/Keras API (reduction_server.client.horovod.tensorflow and .keras)
through real reducers and real rank processes: a custom loop with hvd.DistributedGradientTape and
model.fit with hvd.DistributedOptimizer and hvd.callbacks, each against a single process on the
concatenated batch, the collectives, and the errors."""
import json
import os
import sys

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="tensorflow is not installed (pip install tensorflow-cpu) - "
                                              "the adapter needs it")

from helpers.cluster import ROOT, reducers, run_workers  # noqa: E402
from helpers.reference import assert_close  # noqa: E402

sys.path.insert(0, str(ROOT / "examples"))
import keras_fit  # noqa: E402
import tf_custom_loop  # noqa: E402

PER = 4
SPEC = {"loop": {"steps": 4, "per": PER, "lr": 0.1, "predivide": 2.0},
        "fit": {"steps": 4, "per": PER, "lr": 0.05, "epochs": 2},
        "warmup": {"steps": 2, "per": PER, "lr": 0.08, "epochs": 3, "warmup": 2}}
_results = {}


def run_job(world):
    if world not in _results:
        with reducers(world - 1, workers=world) as group:
            _results[world] = run_workers(world, group, "horovod_tf_worker.py", [json.dumps(SPEC)], timeout=240)
    return _results[world]


@pytest.fixture(params=[2, 3], ids=lambda w: f"W{w}")
def job(request):
    return request.param, run_job(request.param)


def test_custom_loop_matches_a_single_process(job):
    world, results = job
    loop = SPEC["loop"]
    reference = tf_custom_loop.make_model(seed=0)
    start = tf_custom_loop.weights(reference)
    tf_custom_loop.train(reference, loop["steps"], world * PER, rank=0, world=1, lr=loop["lr"], distributed=False)
    for r in results:
        assert_close(r["loop"]["initial"], start, f"rank {r['rank']} after broadcast_variables")
        assert r["loop"]["final"] == results[0]["loop"]["final"], "ranks differ"
    assert_close(results[0]["loop"]["final"], tf_custom_loop.weights(reference), "custom loop vs one process")


def test_fit_matches_a_single_process_and_averages_metrics(job):
    world, results = job
    fit = SPEC["fit"]
    reference = keras_fit.make_model(seed=0)
    history = keras_fit.fit(reference, fit["steps"], world * PER, rank=0, world=1, lr=fit["lr"],
                            epochs=fit["epochs"], distributed=False)
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
        assert c["in_graph"] == [[float(sum(ranks))], [float(k) for k in ranks]]
        assert c["object"] == {"from": 1}
        assert c["objects"] == [10 * k for k in ranks]
        shapes = "; ".join(f"ranks [{k}]: [{k + 1}]" for k in ranks)
        assert f"tensor 'mismatch.0': ranks disagree on its shape: {shapes}" in c["mismatch"], c["mismatch"]
        assert "XLA" in c["xla"] and "jit_compile=False" in c["xla"], c["xla"]
