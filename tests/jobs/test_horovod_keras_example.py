"""Horovod's Keras callbacks example (examples/tensorflow2/tensorflow2_keras_mnist.py in Horovod's
repository, vendored in fixtures/horovod/examples/ with its imports changed and the edits its
README lists) under this project's launcher, on real reducers, as a user would run it: 2 ranks
train a Keras model with hvd.DistributedOptimizer(backward_passes_per_step=1,
average_aggregated_gradients=True), hvd.callbacks.BroadcastGlobalVariablesCallback,
MetricAverageCallback and LearningRateWarmupCallback(verbose=1), and rank 0 saves a
ModelCheckpoint every epoch.

MNIST's download needs the internet, so the example trains on synthetic data of MNIST's shapes
and dtypes whose brightness follows the label (learnable), for 4 epochs (3 of them warm-up) of
40 // size steps instead of 24 of 500 // size.
"""

import os
import re

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
pytest.importorskip(
    "tensorflow", reason="tensorflow is not installed (pip install tensorflow-cpu) - the example needs it"
)

from helpers.cluster import ROOT, run_example  # noqa: E402

EXAMPLE = ROOT / "tests" / "fixtures" / "horovod" / "examples" / "tensorflow2_keras_mnist.py"
EPOCHS, WARMUP_EPOCHS, SIZE = 4, 3, 2
PREFIX = re.compile(r"^\[(rank \d+|reducer \d+)\] ")
ANSI = re.compile(r"\x1b\[[0-9;]*m|\x08")


def rank_output(out, rank):
    """What rank `rank` printed, without the launcher's prefix and Keras's progress-bar colours
    and backspaces. Keras redraws its progress bar with carriage returns, which the text-mode
    capture turns into line breaks that the launcher did not prefix: such a line is the previous
    prefixed line's process's."""
    owner, lines = None, []
    for line in out.splitlines():
        m = PREFIX.match(line)
        if m:
            owner, line = m.group(1), line[m.end() :]
        if owner == f"rank {rank}":
            lines.append(ANSI.sub("", line))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("tensorflow2_keras_mnist")  # the checkpoints land in the working directory
    out = run_example(str(EXAMPLE), cwd=cwd, world=SIZE, timeout=240)  # asserts exit status 0
    return cwd, out


def test_rank_0_trains_every_epoch_and_the_loss_goes_down(run):
    _, out = run
    rank0 = rank_output(out, 0)
    starts = [m.start() for m in re.finditer(rf"^Epoch \d+/{EPOCHS}$", rank0, re.M)]
    assert re.findall(rf"^Epoch (\d+)/{EPOCHS}$", rank0, re.M) == [str(e) for e in range(1, EPOCHS + 1)], out
    steps = 40 // SIZE
    losses = []
    for begin, end in zip(starts, starts[1:] + [len(rank0)]):
        epoch = rank0[begin:end]
        assert f"{steps}/{steps}" in epoch, epoch  # the example's steps_per_epoch = 40 // hvd.size()
        # Keras prints the running loss after every step and the epoch's (averaged over the ranks
        # by MetricAverageCallback) at its end: the epoch's is the last.
        values = re.findall(r"\bloss: ([\d.]+)", epoch)
        assert values, epoch
        losses.append(float(values[-1]))
    assert all(0 < loss < 10 for loss in losses), losses
    assert losses[-1] < 0.8 * losses[0], f"the loss did not go down from the first epoch to the last: {losses}"
    assert "loss:" not in rank_output(out, 1), "rank 1 trains with verbose=0"


def test_learning_rate_warms_up_over_the_first_three_epochs(run):
    """LearningRateWarmupCallback(initial_lr=0.001 * size, warmup_epochs=3, verbose=1): from
    initial_lr / size up to initial_lr, reported at the end of each warm-up epoch."""
    _, out = run
    target = 0.001 * SIZE
    warmup = re.findall(r"Epoch (\d+): learning rate warm-up at ([\d.e+-]+)", rank_output(out, 0))
    assert [int(e) for e, _ in warmup] == list(range(1, WARMUP_EPOCHS + 1)), out
    for epoch, lr in warmup:
        expected = target / SIZE * (1 + int(epoch) / WARMUP_EPOCHS * (SIZE - 1))
        assert float(lr) == pytest.approx(expected, rel=1e-4), (epoch, lr, expected)
    assert float(warmup[-1][1]) == pytest.approx(target, rel=1e-4)


def test_rank_0_saves_a_checkpoint_every_epoch(run):
    cwd, _ = run
    names = sorted(p.name for p in cwd.iterdir() if p.name.startswith("checkpoint-"))
    assert names == [f"checkpoint-{e}.h5" for e in range(1, EPOCHS + 1)], names
    for name in names:
        with open(cwd / name, "rb") as f:
            assert f.read(8) == b"\x89HDF\r\n\x1a\n", f"{name} is not an HDF5 file"  # Keras's legacy .h5 format
    import keras

    first, last = (keras.models.load_model(cwd / names[i], compile=False) for i in (0, -1))
    assert [w.shape for w in last.get_weights()] == [w.shape for w in first.get_weights()]
    assert last.output_shape == (None, 10)
    assert any((a != b).any() for a, b in zip(first.get_weights(), last.get_weights())), "training did not move"
