"""An elastic Keras job for tests/jobs/test_horovod_elastic.py: `python horovod_tf_elastic.py EPOCHS
DIE_AT`. Ranks start with different weights (seeded by rank); hvd.elastic.run's first sync makes
them rank 0's. Worker 1 SIGKILLs itself at the end of epoch DIE_AT; the others go on from their
last commit. Each rank prints JSON lines: its digest after the first sync, and at the end its
size, the epochs done and whether every rank holds the same weights."""

import hashlib
import json
import os
import signal
import sys

import keras
import numpy as np

import reduction_server.client.horovod.keras as hvd

EPOCHS, DIE_AT = int(sys.argv[1]), int(sys.argv[2])


def digest(model) -> str:
    return hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()


class Die(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if os.environ["RS_WORKER_ID"] == "1" and state.epoch >= DIE_AT:
            os.kill(os.getpid(), signal.SIGKILL)


class Report(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        print(
            json.dumps(
                {
                    "worker": os.environ["RS_WORKER_ID"],
                    "size": hvd.size(),
                    "epoch": state.epoch,
                    "synced": digest(self.model),
                }
            ),
            flush=True,
        )


hvd.init()
keras.utils.set_random_seed(100 + hvd.rank())
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse", jit_compile=False)
x = np.random.default_rng(0).standard_normal((256, 8)).astype("float32")
y = x.sum(axis=1, keepdims=True)
model.fit(x, y, batch_size=32, steps_per_epoch=1, epochs=1, verbose=0)  # builds the optimizer's variables
import tensorflow as tf  # noqa: E402

import reduction_server.client.horovod.tensorflow as hvd_tf  # noqa: E402 (horovod.tensorflow.elastic's state)

counter = tf.Variable([float(hvd.rank())] * 3)
plain = hvd_tf.elastic.TensorFlowState([counter], steps=hvd.rank())
plain.sync()  # rank 0's values and attributes everywhere
synced = counter.numpy().tolist() + [plain.steps]
counter.assign([7.0, 7.0, 7.0])
plain.steps = 9
plain.restore()  # back to what sync saved
print(
    json.dumps(
        {"worker": os.environ["RS_WORKER_ID"], "tensorflow_state": [synced, counter.numpy().tolist() + [plain.steps]]}
    ),
    flush=True,
)
state = hvd.elastic.KerasState(model, batch=0, epoch=0)
callbacks = [
    Report(),
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state, batches_per_commit=2),
    Die(),
]


@hvd.elastic.run
def train(state):
    state.model.fit(x, y, batch_size=32, steps_per_epoch=8, epochs=EPOCHS - state.epoch, callbacks=callbacks, verbose=0)


train(state)
same = len(set(hvd.allgather_object(digest(model)))) == 1
print(
    json.dumps(
        {"worker": os.environ["RS_WORKER_ID"], "final_size": hvd.size(), "epoch": state.epoch, "same_model": same}
    ),
    flush=True,
)
