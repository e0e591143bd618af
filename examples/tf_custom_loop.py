"""Train a small Keras model with a custom TensorFlow loop and DistributedGradientTape.

Run it under the local launcher (reducers and workers on this machine):

    reduction-server run -np 2 --reducers 1 -- python examples/tf_custom_loop.py

or in any job where discovery finds the reducers and the ranks (RS_*, CLUSTER_SPEC, TF_CONFIG).
The changes from a single-process loop: broadcast the initial weights, and wrap the tape.

Synthetic data: every step draws one global batch of a fixed linear problem, the same on every
rank, and rank r trains on its r-th shard. Shards are equal, so the averaged gradient is the
gradient of the whole batch: the weights end as a single process training on the whole batch
would leave them.
"""

import argparse
import json
import os
from typing import Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up banner, before it loads

try:
    import tensorflow as tf
except ModuleNotFoundError as missing:  # the framework is an extra of the package: say which
    if missing.name != "tensorflow":
        raise
    raise SystemExit(f'{__file__} needs tensorflow: pip install "reduction-server[tensorflow]"') from None

import keras  # noqa: E402
import numpy as np  # noqa: E402

import reduction_server.client.tensorflow as rstf  # noqa: E402

IN, HIDDEN, OUT = 8, 32, 4


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((IN,)),
            keras.layers.Dense(HIDDEN, activation="tanh"),
            keras.layers.Dense(HIDDEN, activation="tanh"),
            keras.layers.Dense(OUT),
        ]
    )


def global_batch(step: int, rows: int) -> tuple:
    """Step `step`'s global batch (the same on every rank)."""
    rng = np.random.default_rng([12345, step])
    x = rng.standard_normal((rows, IN)).astype(np.float32)
    truth = np.random.default_rng(0).standard_normal((IN, OUT)).astype(np.float32)
    y = np.tanh(x @ truth) + 0.01 * rng.standard_normal((rows, OUT)).astype(np.float32)
    return x, y


def train(
    model: keras.Model, steps: int, per_rank: int, rank: int, world: int, lr: float, distributed: bool = True
) -> list:
    """SGD on rank's shard of each global batch; returns the losses. distributed=False is the
    plain single-process loop (the reference the tests compare against)."""
    optimizer = keras.optimizers.SGD(lr)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function(jit_compile=False)  # XLA cannot compile the all-reduce
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if distributed:
            tape = rstf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    losses = []
    for s in range(steps):
        x, y = global_batch(s, world * per_rank)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        losses.append(float(step(x[mine], y[mine])))
    return losses


def weights(model: keras.Model) -> np.ndarray:
    return np.concatenate([np.asarray(v).ravel() for v in model.trainable_variables]).astype(np.float64)


def add_common_arguments(parser: argparse.ArgumentParser, lr: float) -> None:
    """The options both TensorFlow examples take (keras_fit.py uses them too)."""
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write this rank's weights (and losses) as JSON to PATH, in which {rank} stands for the rank",
    )


def finish(rank: int, final: np.ndarray, summary: str, report: dict, json_path: Optional[str]) -> None:
    """Check that every rank ended with the same weights (the min and max of their checksums over
    the ranks agree), print the summary on rank 0, write the JSON report if asked, and leave."""
    checksum = float(final.sum())
    low, high = (float(rstf.allreduce(tf.constant(checksum, tf.float64), op)) for op in ("min", "max"))
    same = low == high == checksum
    if rank == 0:
        print(f"{summary}; weights checksum {checksum:.10f}; identical on all ranks: {same}", flush=True)
    if json_path:
        with open(json_path.format(rank=rank), "w") as f:
            json.dump({"rank": rank, "final": final.tolist(), **report}, f)
    rstf.shutdown()
    if not same:
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    add_common_arguments(parser, lr=0.1)
    args = parser.parse_args()

    rank, world = rstf.rank(), rstf.size()
    model = make_model(seed=rank)  # different on every rank: the broadcast makes them rank 0's
    before = weights(model)
    rstf.broadcast_variables(model.weights, root_rank=0)
    initial = weights(model)
    losses = train(model, args.steps, args.batch, rank, world, args.lr)
    finish(
        rank,
        weights(model),
        f"{args.steps} steps on {world} ranks: loss {losses[0]:.5f} -> {losses[-1]:.5f}",
        {"before": before.tolist(), "initial": initial.tolist(), "losses": losses},
        args.json,
    )


if __name__ == "__main__":
    main()
