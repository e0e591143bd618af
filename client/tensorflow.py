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
"""
from __future__ import annotations

import atexit
import threading
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf  # the real tensorflow: absolute import, this module is reduction_server.client.tensorflow
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util

from reduction_server.errors import ConfigError
from reduction_server.protocol import DType, ReduceOp

from .communicator import Communicator
from .fusion import FusedAllReduce, FusionPlan, TensorSpec, verify_plan

__all__ = ["BroadcastVariablesCallback", "Collectives", "Compressor", "DistributedGradientTape",
           "DistributedOptimizer", "FusedCollectives", "MetricAverageCallback", "XlaCompileError", "allreduce",
           "broadcast_variables", "collectives", "dense", "grouped_allreduce", "init", "is_initialized", "rank",
           "refuse_xla", "shutdown", "size", "use_collectives"]


class Compressor(Protocol):
    """What ``compression=`` takes (Horovod's Compression.none / Compression.fp16 shape): NumPy
    arrays in, NumPy arrays out. ``decompress`` must give back the original dtype."""

    def compress(self, array: np.ndarray) -> Tuple[np.ndarray, Any]: ...

    def decompress(self, array: np.ndarray, ctx: Any) -> np.ndarray: ...


class Collectives(Protocol):
    """Where the adapter's collectives go: NumPy arrays in, results out, called from inside
    tf.numpy_function (so from TensorFlow's threads, one call at a time per step). The default
    is FusedCollectives; the Horovod layer installs one that matches tensors by name
    (use_collectives)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def reduce(self, arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp) -> List[np.ndarray]: ...

    def broadcast(self, arrays: Sequence[np.ndarray], names: Sequence[str], root: int) -> List[np.ndarray]: ...


class FusedCollectives:
    """The default Collectives over one Communicator. Collectives are matched across ranks by
    their order (every rank issues them in the same order, as NCCL requires); each call's
    arrays travel as fused buckets (one broadcast buffer), and a layout is checked across ranks
    on its first use, so a rank whose tensors differ gets an error naming the ranks."""

    def __init__(self, comm: Communicator, owns: bool) -> None:
        self.communicator = comm
        self._owns = owns
        self._lock = threading.Lock()  # one call's collectives are issued together, in call order
        self._verified: Dict[Tuple, FusionPlan] = {}  # plans every rank is known to share, by signature

    @property
    def rank(self) -> int:
        return self.communicator.rank

    @property
    def size(self) -> int:
        return self.communicator.world_size

    def reduce(self, arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp) -> List[np.ndarray]:
        """The reduced arrays (views of this call's bucket buffers, bfloat16 as itself)."""
        # A plan is looked up by what NumPy tells cheaply; its specs are built on a miss only.
        key = (op, tuple(names), tuple(a.shape for a in arrays), tuple(a.dtype for a in arrays))
        with self._lock:
            plan = self._verified.get(key)
            if plan is None:
                # Grouped by dtype (a stable order, the same on every rank): one bucket run per dtype.
                specs = sorted((_spec(name, array) for name, array in zip(names, arrays)), key=lambda s: s.dtype)
                fused = FusedAllReduce(self.communicator, FusionPlan(specs), op)  # checks it across ranks
                self._verified[key] = fused.plan
            else:
                fused = FusedAllReduce(self.communicator, plan, op, verified=True)
            for name, array in zip(names, arrays):
                fused.ready(name, array)
            reduced = fused.wait()
        return [reduced[name].view(array.dtype) for name, array in zip(names, arrays)]  # bfloat16: uint16 bits

    def broadcast(self, arrays: Sequence[np.ndarray], names: Sequence[str], root: int) -> List[np.ndarray]:
        """Root's arrays on every rank (any dtype), as ONE broadcast of their bytes."""
        comm = self.communicator
        # The layout is checked like a fusion plan: one byte tensor per array, named with its
        # dtype and shaped (*shape, itemsize) so that its size is its bytes.
        specs = [TensorSpec(f"{name}:{a.dtype.name}", (*a.shape, a.dtype.itemsize), DType.UINT8)
                 for name, a in zip(names, arrays)]
        key = ("broadcast", tuple(specs))
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        buf = np.empty(total, np.uint8)
        if comm.rank == root:
            for a, start in zip(arrays, offsets):
                buf[start:start + a.nbytes] = np.require(a, requirements="C").reshape(-1).view(np.uint8)
        with self._lock:
            if key not in self._verified:
                plan = FusionPlan(specs, threshold=0)
                verify_plan(comm, plan)
                self._verified[key] = plan
            comm.broadcast(buf, root)
        return [buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape) for a, start in zip(arrays, offsets)]

    def close(self) -> None:
        if self._owns:
            self.communicator.close()


_ALIGN = 64  # each array's bytes start on a cache line of the broadcast buffer


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.default: Optional[FusedCollectives] = None  # over this process's communicator
        self.installed: Optional[Collectives] = None  # use_collectives()


_state = _State()


def init(comm: Optional[Communicator] = None) -> Communicator:
    """Use `comm` as this process's communicator, or create one from the environment
    (Communicator.from_env()). Calling it again without an argument returns the current one."""
    with _state.lock:
        if _state.default is not None:
            if comm is not None and comm is not _state.default.communicator:
                raise ConfigError("reduction_server.client.tensorflow is already initialised with another "
                                  "communicator; call shutdown() first")
            return _state.default.communicator
        owns = comm is None
        _state.default = FusedCollectives(Communicator.from_env() if owns else comm, owns)
        return _state.default.communicator


def use_collectives(collectives: Optional[Collectives]) -> None:
    """Send every collective of this module through `collectives` from now on (the Horovod
    layer's name-matching negotiation); None goes back to the default FusedCollectives."""
    with _state.lock:
        _state.installed = collectives


def shutdown() -> None:
    """Close the communicator if init() created it (one handed to init() is the caller's to
    close), and forget it and any installed Collectives; a later collective starts afresh."""
    with _state.lock:
        default, _state.default, _state.installed = _state.default, None, None
    if default is not None:
        default.close()


atexit.register(shutdown)  # say goodbye to the reducers even if the script never calls shutdown()


def is_initialized() -> bool:
    return _state.default is not None or _state.installed is not None


def collectives() -> Collectives:
    """The installed Collectives, else the default one (whose communicator init() creates from
    the environment on first use)."""
    installed = _state.installed
    if installed is not None:
        return installed
    init()
    return _state.default


def rank() -> int:
    return collectives().rank


def size() -> int:
    return collectives().size


# -- checks shared by every entry point -------------------------------------------------------

class XlaCompileError(ConfigError):
    """A step containing the all-reduce is being compiled with XLA (jit_compile)."""

    # AutoGraph re-raises an error from converted code (a tf.function body) as its own type only
    # if that type takes just a message the way Exception does; otherwise it becomes a StagingError.
    __init__ = Exception.__init__


def refuse_xla(what: str) -> None:
    """Raise XlaCompileError if the graph being traced will be compiled by XLA (TensorFlow's own
    test for whether a function call is inside an XLA context); `what` names the operation."""
    if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph()):
        raise XlaCompileError(
            f"{what} runs through tf.numpy_function, which XLA cannot compile, but this step is being "
            "compiled with XLA. Pass jit_compile=False: to tf.function(...) for a custom loop, or to "
            "model.compile(...) for model.fit (Keras's default jit_compile='auto' turns XLA on when a GPU "
            "is present)")


def dense(tensor: Any, what: str) -> Optional[tf.Tensor]:
    """`tensor` as a dense tf.Tensor (IndexedSlices included: the reducers sum dense buffers);
    None stays None. `what` names it in the error for something that is not a tensor."""
    if tensor is None:
        return None
    try:
        return tf.convert_to_tensor(tensor)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what}: cannot all-reduce a {type(tensor).__name__}: {exc}") from None


def _as_list(outputs: Any) -> List[tf.Tensor]:
    """numpy_function's outputs as a list (it may return one tensor for a one-element Tout)."""
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


# -- the fused all-reduce, run by tf.numpy_function -------------------------------------------

def _spec(name: str, array: np.ndarray) -> TensorSpec:
    try:
        dtype = DType.from_numpy(array.dtype)
    except TypeError as exc:
        raise TypeError(f"tensor {name!r}: {exc}") from None
    return TensorSpec(name, tuple(array.shape), dtype)


def _reduce_arrays(arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp,
                   compression: Optional[Compressor]) -> List[np.ndarray]:
    """All-reduce NumPy arrays through the current Collectives, compressed on the wire if asked;
    the results have the inputs' dtypes and shapes."""
    if compression is None:
        return collectives().reduce([np.require(a, requirements="C") for a in arrays], names, op)
    wires, contexts = [], []
    for array in arrays:
        wire, ctx = compression.compress(array)
        wires.append(np.require(wire, requirements="C"))  # (ascontiguousarray would make 0-d arrays 1-d)
        contexts.append(ctx)
    results = []
    for name, array, out, ctx in zip(names, arrays, collectives().reduce(wires, names, op), contexts):
        out = compression.decompress(out, ctx)
        if out.dtype != array.dtype:
            raise TypeError(f"compression {getattr(compression, '__name__', type(compression).__name__)}"
                            f".decompress returned {out.dtype} for tensor {name!r}, which was {array.dtype}")
        results.append(out)
    return results


def grouped_allreduce(tensors: Sequence[Any], op: Any = "average", compression: Optional[Compressor] = None,
                      names: Optional[Sequence[str]] = None, name: str = "tensor") -> List[Optional[tf.Tensor]]:
    """All-reduce a list of tensors as one fused collective (one tf.numpy_function call).

    `op`: "average" (default), "sum", "min", "max", "product". `None` entries stay `None`;
    IndexedSlices are made dense. `names` (default: `name`.0, `name`.1, ...) identify the tensors
    in the fusion plan, which every rank must build alike: a rank whose tensors differ in count,
    shape, dtype or name gets a CollectiveError naming the ranks (inside tf.function it surfaces
    as a tf.errors error carrying that message). Works eagerly and inside tf.function, not
    under XLA."""
    reduce_op = ReduceOp.parse(op)
    tensors = list(tensors)
    if names is not None and len(names) != len(tensors):
        raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
    names = [f"{name}.{i}" for i in range(len(tensors))] if names is None else [str(n) for n in names]
    present = [i for i, t in enumerate(tensors) if t is not None]
    if not present:
        return list(tensors)
    refuse_xla("the reduction_server all-reduce")
    values = [dense(tensors[i], names[i]) for i in present]
    kept = [names[i] for i in present]

    def run(*arrays: np.ndarray) -> List[np.ndarray]:
        return _reduce_arrays(arrays, kept, reduce_op, compression)

    with tf.name_scope("ReductionServerAllreduce"):
        outputs = _as_list(tf.numpy_function(run, values, [t.dtype for t in values], stateful=True))
    results: List[Optional[tf.Tensor]] = [None] * len(tensors)
    for i, src, out in zip(present, values, outputs):
        out.set_shape(src.shape)
        results[i] = out
    return results


def allreduce(tensor: Any, op: Any = "average", compression: Optional[Compressor] = None,
              name: str = "tensor") -> tf.Tensor:
    """All-reduce one tensor (see grouped_allreduce)."""
    if tensor is None:
        raise ValueError(f"allreduce: {name} is None")
    return grouped_allreduce([tensor], op, compression, names=[name])[0]


# -- broadcast --------------------------------------------------------------------------------

def broadcast_variables(variables: Sequence[Any], root_rank: int = 0) -> None:
    """Overwrite every variable (tf.Variable or keras.Variable) with root_rank's value, as one
    collective. Every rank must pass the same variables in the same order (same shapes and
    dtypes; a difference is a CollectiveError naming the ranks). Eager or inside tf.function."""
    variables = list(variables)
    if not variables:
        return
    world = size()
    if not (isinstance(root_rank, int) and 0 <= root_rank < world):
        raise ValueError(f"broadcast_variables: root_rank {root_rank!r} is out of range for world size {world}")
    refuse_xla("broadcast_variables")
    values = [tf.convert_to_tensor(v) for v in variables]
    names = [f"variable.{i}" for i in range(len(values))]

    def run(*arrays: np.ndarray) -> List[np.ndarray]:
        return collectives().broadcast(arrays, names, root_rank)

    with tf.name_scope("ReductionServerBroadcast"):
        outputs = _as_list(tf.numpy_function(run, values, [v.dtype for v in values], stateful=True))
    for variable, value, out in zip(variables, values, outputs):
        out.set_shape(value.shape)
        variable.assign(out)


# -- gradient tape and optimizer --------------------------------------------------------------

def scaled(tensor: Optional[tf.Tensor], factor: float) -> Optional[tf.Tensor]:
    """tensor x factor in its own dtype (None and a factor of 1 pass through)."""
    return tensor if tensor is None or factor == 1.0 else tensor * tf.cast(factor, tensor.dtype)


class _GradientReduction:
    """How a step's gradients are reduced: as one fused collective with `op`, compressed on the
    wire if asked. Horovod's gradient_predivide_factor f (op average only) splits the averaging:
    gradients are scaled by 1/f before the sum and by f/size after it (keeps float16 sums in
    range)."""

    def __init__(self, op: Any, compression: Optional[Compressor], gradient_predivide_factor: float) -> None:
        self.op = ReduceOp.parse(op)
        self.compression = compression
        self.predivide = float(gradient_predivide_factor)
        if not self.predivide > 0:
            raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
        if self.predivide != 1.0 and self.op is not ReduceOp.AVG:
            raise ValueError(f"gradient_predivide_factor splits an average; it needs op average, not "
                             f"{self.op.name.lower()}")

    def __call__(self, grads: Sequence[Any]) -> List[Optional[tf.Tensor]]:
        if self.predivide == 1.0:
            return grouped_allreduce(grads, self.op, self.compression, name="gradient")
        pre = [None if g is None else scaled(dense(g, f"gradient.{i}"), 1.0 / self.predivide)
               for i, g in enumerate(grads)]
        post = self.predivide / size()
        return [None if g is None else scaled(g, post)
                for g in grouped_allreduce(pre, ReduceOp.SUM, self.compression, name="gradient")]


class DistributedGradientTape:
    """Wraps a tf.GradientTape; ``gradient()`` returns the gradients all-reduced over every rank
    (averaged by default) as one fused collective. Everything else is the wrapped tape's::

        with tf.GradientTape() as tape:
            loss = ...
        tape = DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    `op`: "average" or "sum" (or min, max, product); `compression`: see Compressor;
    `gradient_predivide_factor`: see Horovod (op average only).
    """

    def __init__(self, tape: tf.GradientTape, op: Any = "average", compression: Optional[Compressor] = None,
                 gradient_predivide_factor: float = 1.0) -> None:
        if isinstance(tape, DistributedGradientTape):
            raise TypeError("this tape is already a DistributedGradientTape")
        self._tape = tape
        self._reduce = _GradientReduction(op, compression, gradient_predivide_factor)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat = tf.nest.flatten(grads)  # None and IndexedSlices are leaves
        return tf.nest.pack_sequence_as(grads, self._reduce(flat))

    def __enter__(self) -> "DistributedGradientTape":
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._tape.__exit__(*exc)

    def __getattr__(self, attr: str) -> Any:  # watch, stop_recording, reset, jacobian, ...
        return getattr(self._tape, attr)


class _AllReducingOptimizer:
    """Mixed in before a Keras 3 optimizer class: ``apply`` (which ``apply_gradients`` and
    ``model.fit`` call) all-reduces the gradients, then applies them as the optimizer would.
    Reducing before anything else (loss-scale checks, clipping, weight decay, accumulation)
    makes those see the global gradient, identically on every rank."""

    _rs_reduce = None  # a _GradientReduction, set by DistributedOptimizer

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> Any:
        return super().apply(self._rs_reduce(list(grads)), trainable_variables)


_distributed_classes: Dict[type, type] = {}


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, op: Any = "average",  # noqa: N802 - Horovod's name
                         compression: Optional[Compressor] = None,
                         gradient_predivide_factor: float = 1.0) -> keras.optimizers.Optimizer:
    """A copy of `optimizer` (a Keras 3 optimizer, not yet built) whose ``apply`` /
    ``apply_gradients`` all-reduce the gradients first; use it with ``model.fit`` or a custom
    loop. `op`, `compression`, `gradient_predivide_factor`: as for DistributedGradientTape. The
    copy's class has the original's name and module, so a saved model loads with the plain
    optimizer. With Keras's gradient_accumulation_steps, every micro-step's gradients are
    all-reduced (the result is the same; the traffic is not saved)."""
    reduction = _GradientReduction(op, compression, gradient_predivide_factor)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer takes a Keras 3 optimizer (keras.optimizers.Optimizer), "
                        f"not {type(optimizer).__name__}")
    if isinstance(optimizer, _AllReducingOptimizer):
        raise TypeError("this optimizer is already a DistributedOptimizer")
    if optimizer.built:
        raise ValueError(f"{type(optimizer).__name__} is already built (it holds state that a copy would lose); "
                         "wrap the optimizer before the first training step")
    base = type(optimizer)
    cls = _distributed_classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_AllReducingOptimizer, base), {"__module__": base.__module__,
                                                                  "__doc__": base.__doc__})
        _distributed_classes[base] = cls
    wrapped = cls.from_config(optimizer.get_config())
    wrapped._rs_reduce = reduction
    return wrapped


# -- Keras callbacks --------------------------------------------------------------------------

class BroadcastVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's weights and the optimizer's variables from `root_rank` when
    training starts, so that every rank starts from root's state (Horovod's
    BroadcastGlobalVariablesCallback). The optimizer is built first if it is not yet, so that a
    restored optimizer state is broadcast too. Random-seed state (Dropout's) is not broadcast:
    ranks keep drawing different masks."""

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        self.root_rank = root_rank

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        model = self.model
        variables = list(model.weights)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            variables += list(optimizer.variables)
        broadcast_variables(variables, self.root_rank)


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's logged metrics (loss, metrics, validation metrics) over every rank at
    the end of each epoch, in place: put it before callbacks that read them (checkpoints, early
    stopping, logging). Every rank must log the same metric names."""

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        if not keys:
            return
        values = [np.asarray(float(logs[k]), np.float64) for k in keys]
        for key, value in zip(keys, _reduce_arrays(values, [f"metric/{k}" for k in keys], ReduceOp.AVG, None)):
            logs[key] = float(value)
