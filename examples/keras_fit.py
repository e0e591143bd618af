"""Train a small Keras model with model.fit, the DistributedOptimizer and the broadcast callback.

Run it under the local launcher (reducers and workers on this machine):

    reduction-server run -np 2 --reducers 1 -- python examples/keras_fit.py

or in any job where discovery finds the reducers and the ranks (RS_*, CLUSTER_SPEC, TF_CONFIG).
The changes from a single-process script: wrap the optimizer, add the two callbacks, and pass
jit_compile=False (Keras's "auto" turns XLA on when a GPU is present, and XLA cannot compile
the all-reduce).

Synthetic data: a fixed global data set of steps x (ranks x batch) rows; in step s rank r trains
on its r-th shard of global batch s. Shards are equal, so the averaged gradient is the gradient
of the whole global batch, and the weights end as `fit` on the whole data set with the global
batch size leaves them in a single process.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up banner, before it loads

try:
    import tensorflow  # noqa: F401
except ModuleNotFoundError as missing:  # the framework is an extra of the package: say which
    if missing.name != "tensorflow":
        raise
    raise SystemExit(f'{__file__} needs tensorflow: pip install "reduction-server[tensorflow]"') from None

import keras  # noqa: E402
import numpy as np  # noqa: E402
from tf_custom_loop import add_common_arguments, finish, weights  # noqa: E402  (the sibling example)

import reduction_server.client.tensorflow as rstf  # noqa: E402

IN, HIDDEN, OUT = 8, 32, 4


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((IN,)), keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(OUT)]
    )


def dataset(steps: int, per_rank: int, world: int) -> tuple:
    """The global data set: global batch s is rows [s * world * per_rank, (s + 1) * world * per_rank)."""
    rng = np.random.default_rng(2024)
    x = rng.standard_normal((steps * world * per_rank, IN)).astype(np.float32)
    truth = rng.standard_normal((IN, OUT)).astype(np.float32)
    y = x @ truth + 0.01 * rng.standard_normal((len(x), OUT)).astype(np.float32)
    return x, y


def shard(x: np.ndarray, per_rank: int, rank: int, world: int) -> np.ndarray:
    """Rank's rows of every global batch, in step order."""
    return x.reshape(-1, world, per_rank, *x.shape[1:])[:, rank].reshape(-1, *x.shape[1:])


def fit(
    model: keras.Model,
    steps: int,
    per_rank: int,
    rank: int,
    world: int,
    lr: float,
    epochs: int = 1,
    distributed: bool = True,
    callbacks: tuple = (),
) -> dict:
    """model.fit on rank's shards; returns the History's logs. distributed=False is the plain
    single-process fit (the reference the tests compare against: rank 0, world 1, the global
    batch size)."""
    optimizer = keras.optimizers.SGD(lr)
    if distributed:
        optimizer = rstf.DistributedOptimizer(optimizer)
        callbacks = (rstf.BroadcastVariablesCallback(root_rank=0), *callbacks, rstf.MetricAverageCallback())
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], jit_compile=False)
    x, y = dataset(steps, per_rank, world)
    history = model.fit(
        shard(x, per_rank, rank, world),
        shard(y, per_rank, rank, world),
        batch_size=per_rank,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )
    return history.history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    add_common_arguments(parser, lr=0.05)
    args = parser.parse_args()

    rank, world = rstf.rank(), rstf.size()
    model = make_model(seed=rank)  # different on every rank: the callback broadcasts rank 0's
    history = fit(model, args.steps, args.batch, rank, world, args.lr, args.epochs)
    finish(
        rank,
        weights(model),
        f"{args.epochs} epochs of {args.steps} steps on {world} ranks: loss (averaged "
        f"over ranks) {history['loss'][0]:.5f} -> {history['loss'][-1]:.5f}",
        {"history": history},
        args.json,
    )


if __name__ == "__main__":
    main()
