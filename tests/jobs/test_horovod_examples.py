"""Horovod's PyTorch examples (examples/pytorch/ in Horovod's repository, vendored in
fixtures/horovod/examples/ with only their imports changed) under this project's launcher, on real
reducers, as a user would run them.

Both need torchvision, and no torchvision build matches the torch 2.13 CPU wheel tested here (nor
is there network for MNIST's download): fixtures/horovod/stand_ins/torchvision, first on the
examples' PYTHONPATH, stands in for it. The synthetic benchmark's model is a ResNet-50 defined
there (torchvision's architecture and its 25.6 M parameters), and MNIST's images are synthetic
28x28 digits of the same shapes and types. Everything else runs as Horovod ships it.
"""

import re

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install torch) - the examples need it")

from helpers.cluster import ROOT, run_example  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "horovod"
STAND_INS = {"PYTHONPATH": str(FIXTURES / "stand_ins")}


def test_synthetic_benchmark_reports_the_throughput_of_both_ranks(tmp_path):
    out = run_example(
        str(FIXTURES / "examples" / "pytorch_synthetic_benchmark.py"),
        "--batch-size",
        "2",
        "--num-warmup-batches",
        "1",
        "--num-batches-per-iter",
        "1",
        "--num-iters",
        "2",
        cwd=tmp_path,
        env=STAND_INS,
        timeout=240,
    )
    assert "[rank 0] Model: resnet50" in out and "Number of CPUs: 2" in out, out
    iters = re.findall(r"\[rank 0\] Iter #(\d+): ([\d.]+) img/sec per CPU", out)
    assert [i for i, _ in iters] == ["0", "1"] and all(float(v) > 0 for _, v in iters), out
    total = re.search(r"\[rank 0\] Total img/sec on 2 CPU\(s\): ([\d.]+) \+-", out)
    assert total and float(total.group(1)) > 0, out
    assert "[rank 1] Iter" not in out, "the example logs from rank 0 only"


def test_mnist_trains_and_both_ranks_report_the_same_averaged_test_metrics(tmp_path):
    out = run_example(
        str(FIXTURES / "examples" / "pytorch_mnist.py"),
        "--epochs",
        "2",
        "--log-interval",
        "4",
        "--data-dir",
        str(tmp_path / "data"),
        cwd=tmp_path,
        env=STAND_INS,
        timeout=240,
    )
    for rank in (0, 1):  # each rank trains on its half of the data, every epoch
        epochs = re.findall(rf"\[rank {rank}\] Train Epoch: (\d+) \[0/1024", out)
        assert epochs == ["1", "2"], out
    tests = re.findall(r"\[rank 0\] Test set: Average loss: ([\d.]+), Accuracy: ([\d.]+)%", out)
    assert len(tests) == 2, out  # one evaluation per epoch, metrics averaged over the ranks with hvd.allreduce
    losses = [float(loss) for loss, _ in tests]
    assert all(0 < loss < 10 for loss in losses), out
    assert losses[1] < losses[0], f"the test loss did not go down from epoch 1 to 2: {losses}"
