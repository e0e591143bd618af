"""The Horovod TensorFlow API's collectives beyond allreduce, run by horovod_tf_worker.py on every
rank: reducescatter, alltoall, grouped allgather, process sets, join, barrier, the ops'
gradients, IndexedSlices, integer scaling and the errors. Each returns plain values (lists,
strings) for test_horovod_tensorflow.py to compare with NumPy references."""

import time

import keras
import numpy as np
import tensorflow as tf

import reduction_server.client.horovod.keras as hvd
from reduction_server.client.horovod.tensorflow.gradients import residuals as int8_residuals


def _error(call):
    """`call()`'s exception as "Type: message" (None if it raised none), and whether it is a ValueError."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return [
            f"{type(exc).__name__}: {exc}",
            isinstance(exc, ValueError),
            isinstance(exc, tf.errors.InvalidArgumentError),
        ]
    return None


def rows_tensor(rank, rows, dtype=tf.float32):
    """Rank-dependent rows: row k of rank r holds [100 r + k, 100 r + k + 0.5]."""
    base = np.arange(rows, dtype=np.float64)[:, None] + 100 * rank + np.array([0.0, 0.5])
    return tf.constant(base.astype(dtype.as_numpy_dtype))


def ops(rank, world):
    out = {}
    rows = 2 * world + 1  # uneven: the first rows % world ranks get one more row
    x = rows_tensor(rank, rows)
    out["reducescatter_sum"] = hvd.reducescatter(x, op=hvd.Sum).numpy().tolist()
    out["reducescatter_avg"] = hvd.reducescatter(x).numpy().tolist()
    out["reducescatter_scaled"] = (
        hvd.reducescatter(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0).numpy().tolist()
    )
    out["grouped_reducescatter"] = [
        t.numpy().tolist() for t in hvd.grouped_reducescatter([x, tf.cast(x[:world], tf.float64)], op=hvd.Sum)
    ]
    out["reducescatter_scalar"] = _error(lambda: hvd.reducescatter(tf.constant(1.0)))
    ints = tf.constant([7, -7, 5, 100], tf.int32) * (rank + 1)
    out["int_prescale"] = hvd.allreduce(ints, op=hvd.Sum, prescale_factor=0.35).numpy().tolist()
    out["int_postscale"] = hvd.allreduce(ints, op=hvd.Sum, postscale_factor=0.35).numpy().tolist()
    out["int_average"] = hvd.allreduce(ints, op=hvd.Average).numpy().tolist()
    out["int64_reducescatter_prescale"] = (
        hvd.reducescatter(
            tf.cast(tf.reshape(tf.range(world * 2) * (rank + 3), [world * 2, 1]), tf.int64),
            op=hvd.Sum,
            prescale_factor=0.7,
        )
        .numpy()
        .tolist()
    )
    out["half_prescale"] = (
        hvd.allreduce(tf.constant([1.5, 3.0], tf.float16) * (rank + 1), op=hvd.Sum, prescale_factor=0.1)
        .numpy()
        .tolist()
    )
    # alltoall: rank r sends (r + i) % 3 rows to rank i (some none); row values name sender and receiver.
    splits = [(rank + i) % 3 for i in range(world)]
    sent = np.concatenate([np.full((n, 2), 100 * rank + i, np.float32) for i, n in enumerate(splits)])
    got, received = hvd.alltoall(tf.constant(sent), splits=splits)
    out["alltoall"] = [got.numpy().tolist(), received.numpy().tolist(), received.dtype.name]
    equal = hvd.alltoall(tf.constant(np.repeat(np.arange(world, dtype=np.int16), 2) + 10 * rank))
    out["alltoall_equal"] = [type(equal).__name__, equal.dtype.name, equal.numpy().tolist()]
    out["alltoall_indivisible"] = _error(lambda: hvd.alltoall(tf.ones([world + 1])))
    out["alltoall_too_many"] = _error(lambda: hvd.alltoall(tf.ones([world - 1]), splits=[1] * world))
    out["alltoall_length"] = _error(lambda: hvd.alltoall(tf.ones([4]), splits=[1] * (world + 1)))
    gathered = hvd.grouped_allgather(
        [tf.fill([rank + 1, 2], float(rank)), tf.fill([1], tf.constant(rank, tf.int64)), tf.constant([rank % 2 == 0])]
    )
    out["grouped_allgather"] = [[t.dtype.name, t.numpy().tolist()] for t in gathered]
    out["broadcast_bool"] = hvd.broadcast(tf.constant([rank == 1, True]), root_rank=1).numpy().tolist()

    @tf.function(jit_compile=False)
    def in_graph(t):
        return hvd.reducescatter(t, op=hvd.Sum), hvd.alltoall(t[:world])

    scattered, swapped = in_graph(x)
    out["in_graph"] = [scattered.numpy().tolist(), swapped.numpy().tolist()]
    return out


def gradients(rank, world):
    """The gradients as Horovod's test_tensorflow.py computes them: ones for the output's
    gradient unless said; each result as (shape, sorted distinct values)."""

    def summary(grad):
        grad = tf.convert_to_tensor(grad).numpy()
        return [list(grad.shape), np.unique(grad).tolist()]

    def grad_of(fn, value, grad_ys=None):
        variable = tf.Variable(value)
        with tf.GradientTape() as tape:
            result = fn(variable)
        return summary(tape.gradient(result, variable, grad_ys))

    out = {}
    square = tf.random.uniform([5, 5], -100, 100)
    out["allreduce_sum"] = grad_of(lambda v: hvd.allreduce(v, op=hvd.Sum), square, tf.ones([5, 5]))
    out["allreduce_average"] = grad_of(lambda v: hvd.allreduce(v, op=hvd.Average), square, tf.ones([5, 5]))
    out["allreduce_scaled"] = grad_of(
        lambda v: hvd.allreduce(v, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), square, tf.ones([5, 5])
    )
    variables = [tf.Variable(square), tf.Variable(tf.cast(square, tf.float64))]
    with tf.GradientTape(persistent=True) as tape:
        summed = hvd.grouped_allreduce(variables, op=hvd.Sum)
    out["grouped_allreduce"] = [summary(tape.gradient(s, v)) for s, v in zip(summed, variables)]
    sizes = [3, 2, 7][:world]
    grad_ys = tf.concat([tf.ones([n, 4]) * r for r, n in enumerate(sizes)], axis=0)
    out["allgather"] = grad_of(hvd.allgather, tf.ones([sizes[rank], 4]) * rank, grad_ys)
    variables = [tf.Variable(tf.ones([sizes[rank], 4]) * rank) for _ in range(2)]
    with tf.GradientTape(persistent=True) as tape:
        gathered = hvd.grouped_allgather(variables)
    out["grouped_allgather"] = [summary(tape.gradient(g, v, grad_ys)) for g, v in zip(gathered, variables)]
    out["broadcast"] = [
        grad_of(lambda v, root=root: hvd.broadcast(v, root), tf.ones([5, 5]) * rank) for root in range(world)
    ]
    splits = tf.constant([rank + 1] * world)
    values = tf.constant(np.repeat(np.arange(world), rank + 1)[:, None] * np.ones([1, 3]), tf.float32)
    out["alltoall"] = grad_of(lambda v: hvd.alltoall(v, splits)[0], values)
    out["alltoall_equal"] = grad_of(hvd.alltoall, tf.ones([2 * world, 3]))
    big = tf.random.uniform([world * 4, 3], -100, 100)
    out["reducescatter_sum"] = grad_of(lambda v: hvd.reducescatter(v, op=hvd.Sum), big, tf.ones([4, 3]))
    out["reducescatter_average"] = grad_of(hvd.reducescatter, big, tf.ones([4, 3]))
    variables = [tf.Variable(big), tf.Variable(big * 2)]
    with tf.GradientTape(persistent=True) as tape:
        scattered = hvd.grouped_reducescatter(variables, op=hvd.Sum)
    out["grouped_reducescatter"] = [summary(tape.gradient(s, v)) for s, v in zip(scattered, variables)]

    variable = tf.Variable(tf.ones([sizes[rank], 4]) * rank)

    @tf.function(jit_compile=False)
    def in_graph():
        with tf.GradientTape() as tape:
            gathered = hvd.allgather(variable)
            scattered = hvd.reducescatter(gathered[:world], op=hvd.Sum)
        return tape.gradient([gathered, scattered], variable, [grad_ys, tf.ones([1, 4])])

    # d(gathered)/dv: this rank's rows of the averaged grad_ys (ones x rank); d(scattered)/dv: each
    # rank's rows among the first `world` gathered ones get world (Sum's factor) x ones.
    out["in_graph"] = in_graph().numpy().tolist()
    return out


def sparse(rank, world):
    """tf.IndexedSlices all-reduced by gathering, as in Horovod's test_horovod_allreduce_indexed_slices."""

    def dense(result):
        return tf.math.unsorted_segment_sum(result.values, result.indices, world + 1).numpy().tolist()

    values = tf.reshape(tf.range(6, dtype=tf.float32), [3, 2])
    slices = tf.IndexedSlices(tf.stack([values] * 2), tf.constant([rank, rank + 1]))
    out = {}
    summed = hvd.allreduce(slices, op=hvd.Sum)
    out["sum"] = [type(summed).__name__, dense(summed)]
    out["average"] = dense(hvd.allreduce(slices))
    mixed = hvd.grouped_allreduce([slices, tf.ones([2]) * rank], op=hvd.Sum)
    out["grouped"] = [dense(mixed[0]), mixed[1].numpy().tolist()]
    out["min"] = _error(lambda: hvd.allreduce(slices, op=hvd.Min))
    out["prescale"] = _error(lambda: hvd.allreduce(slices, op=hvd.Sum, prescale_factor=2.0))
    table = tf.Variable(tf.zeros([world, 2]))
    for sparse_as_dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, [rank, rank]) * (rank + 1))
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        [grad] = tape.gradient(loss, [table])
        out[f"tape_as_dense_{sparse_as_dense}"] = [type(grad).__name__, tf.convert_to_tensor(grad).numpy().tolist()]
    return out


def process_sets(rank, world, even, odd):
    mine, other = (even, odd) if rank % 2 == 0 else (odd, even)
    out = {"ranks": mine.ranks, "size": mine.size(), "rank": mine.rank()}
    out["allreduce"] = hvd.allreduce(tf.fill([2], float(rank + 1)), op=hvd.Sum, process_set=mine).numpy().tolist()
    out["grouped"] = [
        t.numpy().tolist()
        for t in hvd.grouped_allreduce([tf.fill([2], float(rank)), tf.fill([1], rank)], op=hvd.Sum, process_set=mine)
    ]
    out["broadcast"] = (
        hvd.broadcast(tf.fill([2], float(rank)), root_rank=mine.ranks[-1], process_set=mine).numpy().tolist()
    )
    out["allgather"] = hvd.allgather(tf.fill([rank + 1], rank), process_set=mine).numpy().tolist()
    out["reducescatter"] = hvd.reducescatter(rows_tensor(rank, 3), op=hvd.Sum, process_set=mine).numpy().tolist()
    out["alltoall"] = hvd.alltoall(tf.fill([mine.size()], rank), process_set=mine).numpy().tolist()
    variable = tf.Variable([rank])
    hvd.broadcast_variables([variable], root_rank=mine.ranks[0], process_set=mine)
    out["broadcast_variables"] = variable.numpy().tolist()
    out["object"] = hvd.broadcast_object({"from": rank}, root_rank=mine.ranks[0], process_set=mine)
    out["objects"] = hvd.allgather_object(rank * 10, process_set=mine)
    with tf.GradientTape() as tape:
        variable = tf.Variable(tf.ones([3]))
        summed = hvd.allreduce(variable, op=hvd.Sum, process_set=mine)
    out["gradient"] = tape.gradient(summed, variable).numpy().tolist()
    hvd.barrier(process_set=mine)
    out["outsider"] = _error(lambda: hvd.allreduce(tf.ones([1]), process_set=other))
    # Horovod's test_distributed_gradient_tape_process_sets and test_process_set_optimizer: reduced
    # over the even ranks there, left as it is on the others.
    x = tf.constant(float(rank * rank + 1))  # values whose even-rank mean no odd rank has
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = x * x
    [out["tape"]] = hvd.DistributedGradientTape(tape, process_set=even).gradient(y, [x])
    out["tape"] = float(out["tape"])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=even)
    weight = keras.Variable([0.0])
    optimizer.apply([tf.constant([float(rank * rank + 1)])], [weight])
    out["optimizer"] = weight.numpy().tolist()
    return out


def join_and_barrier(rank, world):
    """Rank 0 joins at once; the others reduce without it (and an allgather fails meanwhile, as
    in Horovod), then join. Then a barrier that rank 0 reaches late."""
    out = {}
    if rank == 0:
        last = hvd.join()
    else:
        value = tf.fill([3], float(rank))
        out["sum"] = hvd.allreduce(value, op=hvd.Sum, name="join.sum").numpy().tolist()
        out["average"] = hvd.allreduce(value, op=hvd.Average, name="join.average").numpy().tolist()
        try:
            hvd.allgather(tf.fill([rank], rank), name="join.allgather")
            out["allgather"] = "no error"
        except hvd.HorovodInternalError as error:
            out["allgather"] = str(error)
        last = hvd.join()
    out["last"] = [int(last), last.dtype.name]
    out["last_everywhere"] = hvd.allgather_object(int(last))
    if rank == 0:
        time.sleep(0.5)
    started = time.monotonic()
    hvd.barrier()
    out["barrier_wait"] = time.monotonic() - started
    return out


def errors(rank, world):
    out = {}
    try:
        hvd.allgather(tf.ones([2], tf.int32 if rank % 2 else tf.float32), name="dtype_mismatch")
        out["dtype"] = None
    except hvd.HorovodInternalError as exc:
        out["dtype"] = str(exc)
    try:
        tf.function(lambda t: hvd.allreduce(t, name="graph_mismatch"), jit_compile=False)(tf.zeros([rank + 1]))
        out["in_graph"] = None
    except tf.errors.OpError as exc:
        out["in_graph"] = f"{type(exc).__name__}: {exc.message}"
    out["after"] = hvd.allreduce(tf.ones([1]), op=hvd.Sum, name="after_mismatch").numpy().tolist()
    return out


def int8_inputs(rank):
    """This rank's inputs of the int8 collectives (the test makes the same): 300 and 768 floats."""
    rng = np.random.default_rng(rank)
    return (
        (rng.standard_normal(300) * 10.0 ** (rank % 3)).astype(np.float32),
        rng.standard_normal(768).astype(np.float32),
    )


def residuals(variables):
    """Each variable's error feedback residual as [size, largest magnitude] (None: none kept)."""
    found = [int8_residuals.of(v) for v in variables]
    return [None if r is None else [int(r.size), float(np.abs(r).max())] for r in found]


def _int8_optimizers(steps=10):
    """DistributedOptimizer under Compression.int8, with error feedback on and off: `steps`
    apply() of a gradient [1, 0.002, 0.002, 0.002], whose small values round to zero in its
    block; the final weight and its residual (None: none kept)."""
    out = {}
    for feedback in (True, False):
        weight = keras.Variable(tf.zeros([4]))
        sgd = hvd.DistributedOptimizer(
            keras.optimizers.SGD(1.0), compression=hvd.Compression.int8, error_feedback=feedback
        )
        for _ in range(steps):
            sgd.apply([tf.constant([1.0, 0.002, 0.002, 0.002])], [weight])
        residual = int8_residuals.of(weight)
        out[f"feedback_{feedback}"] = [weight.numpy().tolist(), None if residual is None else residual.tolist()]
    return out


def int8():
    """Compression.int8: allreduce (eager and in tf.function), grouped_allreduce, an int64 tensor
    (sent as it is), ranks that disagree on the compression, op Min and reducescatter (refused),
    and DistributedOptimizer's error feedback, on and off (the custom loop trains under int8 in
    horovod_tf_worker.py)."""
    rank = hvd.rank()
    one, two = (tf.constant(a) for a in int8_inputs(rank))
    int8 = hvd.Compression.int8
    out = {
        "sum": hvd.allreduce(one, name="int8", compression=int8, op=hvd.Sum).numpy().tolist(),
        "grouped": tf.concat(hvd.grouped_allreduce([two[:256], two[256:]], name="int8.grouped", compression=int8), 0)
        .numpy()
        .tolist(),
        "int64": hvd.allreduce(tf.range(3, dtype=tf.int64) + rank, name="int8.int64", compression=int8, op=hvd.Sum),
        "in_graph": tf.function(
            lambda t: hvd.allreduce(t, name="int8.graph", compression=int8, op=hvd.Sum), jit_compile=False
        )(one)
        .numpy()
        .tolist(),
    }
    out["int64"] = [out["int64"].dtype.name, out["int64"].numpy().tolist()]
    out["disagree"] = _error(
        lambda: hvd.allreduce(one, name="int8.disagree", compression=[int8, hvd.Compression.none][rank % 2])
    )
    out["min"] = _error(lambda: hvd.allreduce(one, name="int8.min", compression=int8, op=hvd.Min))
    out["reducescatter"] = _error(lambda: hvd.reducescatter(one, compression=int8))
    out["optimizer"] = _int8_optimizers()
    return out
