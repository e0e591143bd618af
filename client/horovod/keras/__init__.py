"""Horovod's Keras API (horovod.tensorflow.keras) over the reduction server.

    import reduction_server.client.horovod.keras as hvd

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())),
                  loss="mse", jit_compile=False)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback(),
                               hvd.callbacks.LearningRateWarmupCallback(0.01 * hvd.size(), warmup_epochs=3)])

Everything in reduction_server.client.horovod.tensorflow is here too, except that allreduce and
reducescatter take Keras's signatures; ``hvd.callbacks`` holds the Keras callbacks, ``hvd.elastic``
the elastic states and callbacks. Its modules: docs/design.md, "Where each concept lives".
"""

import importlib

from ..tensorflow import *  # noqa: F401,F403 - Horovod's keras module re-exports the TensorFlow API
from ..tensorflow import __all__ as _tensorflow_all
from . import callbacks
from .ops import allreduce, reducescatter  # noqa: F401 - Keras's signatures, over TensorFlow's (in __all__)

# The star import bound `elastic` to TensorFlow's module, and `from . import elastic` would return
# that attribute: Keras's elastic states and callbacks are imported by their full name.
elastic = importlib.import_module(f"{__name__}.elastic")

__all__ = ["callbacks", *(name for name in _tensorflow_all if name != "elastic"), "elastic"]
