"""TensorFlow 2 / Keras 3 adapter: gradients all-reduced over the reducers.

Custom training loop::

    import reduction_server.client.tensorflow as rstf

    rstf.broadcast_variables(model.variables, root_rank=0)        # every rank starts from rank 0's
    @tf.function                                                   # eager works too; no jit_compile
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = rstf.DistributedGradientTape(tape)                  # gradient() all-reduces
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

``model.fit``::

    model.compile(optimizer=rstf.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=False)
    model.fit(x, y, callbacks=[rstf.BroadcastVariablesCallback(0), rstf.MetricAverageCallback()])

How it works. Every step's gradients go to the reducers in ONE ``tf.numpy_function(...,
stateful=True)`` call: it receives the list of gradient arrays, packs them into fused buckets
(fusion.py: buckets up to RS_FUSION_THRESHOLD / HOROVOD_FUSION_THRESHOLD bytes, grouped by dtype,
the plan checked across ranks on its first use) and returns the reduced list. One call per step
keeps the collective order identical on every rank: TensorFlow may run independent stateless
ops in any order, and a stateful=False call can be reordered or pruned, which deadlocks ranks
that disagree on the order. The same call works eagerly, inside ``tf.function`` and in
``model.fit``.

Limits, by design:
- XLA cannot compile a call back into Python. A step containing the all-reduce that is traced
  for XLA (``tf.function(jit_compile=True)``, ``model.compile(jit_compile=True)``, or Keras's
  default ``"auto"`` on a machine with a GPU) raises XlaCompileError (a ConfigError) naming
  jit_compile, when it is traced and before anything is sent.
- ``None`` gradients (variables the loss does not reach) stay ``None`` and are not sent: the
  graph's structure is the same on every rank, so every rank skips the same ones.
- ``tf.IndexedSlices`` gradients (embedding lookups) are made dense before the all-reduce: the
  reducers sum dense buffers (Horovod's ``sparse_as_dense=True``). This costs the full
  variable's size on the wire; large embeddings should be kept in mind.
- Gradients are reduced as the dtype they have (float16, bfloat16, float32, float64; the plan
  groups them by dtype), or as what ``compression.compress`` turns them into.

The collectives go through FusedCollectives over one Communicator per process
(``Communicator.from_env()``, created on first use, or handed over with ``init(comm)``;
``shutdown()`` closes it), matched across ranks by order; the Horovod layer installs its own,
matched by name, with ``use_collectives``.

The adapter's modules: docs/design.md, "Where each concept lives".
"""

from .callbacks import BroadcastVariablesCallback, MetricAverageCallback
from .collectives import (
    Collectives,
    Compressor,
    FusedCollectives,
    collectives,
    init,
    is_initialized,
    rank,
    shutdown,
    size,
    use_collectives,
)
from .gradients import DistributedGradientTape, DistributedOptimizer, scaled
from .graph import XlaCompileError, dense, refuse_xla
from .ops import allreduce, broadcast_variables, grouped_allreduce

__all__ = [
    "BroadcastVariablesCallback",
    "Collectives",
    "Compressor",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "FusedCollectives",
    "MetricAverageCallback",
    "XlaCompileError",
    "allreduce",
    "broadcast_variables",
    "collectives",
    "dense",
    "grouped_allreduce",
    "init",
    "is_initialized",
    "rank",
    "refuse_xla",
    "scaled",
    "shutdown",
    "size",
    "use_collectives",
]
