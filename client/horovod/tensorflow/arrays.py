"""Horovod's collectives on NumPy arrays: what the TensorFlow ops (mpi_ops.py) run inside
tf.numpy_function. Each array is one named collective among a process set's ranks, negotiated
by name (coordinator.py); a call submits all of its arrays before waiting for any, so they are
negotiated, and fused, together. A failed collective raises HorovodInternalError; a bad argument
raises ArgumentError (both ValueError and tf.errors.InvalidArgumentError, as Horovod's ops
raise the latter). hvd.init() (init, here) joins the job and routes the TensorFlow adapter's
collectives through NegotiatedCollectives."""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf  # the real tensorflow: absolute import

from reduction_server.wire.protocol import ReduceOp

from ... import tensorflow as rstf
from ...communicator import Communicator
from .. import basics, shares
from ..basics import coordinator, submit
from ..coordinator import ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, REDUCESCATTER
from ..exceptions import HorovodInternalError, MismatchError, as_horovod_errors
from ..process_sets import ProcessSet

#: kinds whose result is written into an output buffer of the input's shape
_WRITES = (ALLREDUCE, BROADCAST, REDUCESCATTER)
#: kinds that move elements unchanged: they travel as bytes, so that every dtype (bool, int16, ...) does
_MOVES = (ALLGATHER, ALLTOALL, BROADCAST)


class ArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """A collective's arguments are wrong (Horovod's ops raise InvalidArgumentError; Python
    code catches ValueError). Inside tf.function it surfaces as InvalidArgumentError."""

    def __init__(self, message: str) -> None:  # noqa: D107
        super().__init__(None, None, message)


class PreconditionError(HorovodInternalError, tf.errors.FailedPreconditionError):
    """The ranks asked for a named collective in ways that cannot run together (shapes, dtypes,
    roots that differ): tf.errors.FailedPreconditionError, as Horovod's ops raise, and
    HorovodInternalError, as this API's collectives raise on failure. Inside tf.function it
    surfaces as tf.errors.UnknownError carrying it (a py_function keeps no other error's code)."""

    def __init__(self, message: str) -> None:  # noqa: D107
        HorovodInternalError.__init__(self, message)
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)

    def __str__(self) -> str:
        return self.message


class _Pending(NamedTuple):
    kind: str
    future: Any
    out: Optional[np.ndarray]
    dtype: np.dtype
    shape: Tuple[int, ...]


def scale(array: np.ndarray, factor: float) -> np.ndarray:
    """array * factor as Horovod scales: integers in float64 (truncated back), 16-bit floats in float32."""
    if factor == 1.0:
        return array
    if np.issubdtype(array.dtype, np.integer):
        return (array.astype(np.float64) * factor).astype(array.dtype)
    if array.dtype.itemsize == 2:  # float16, bfloat16
        return (array.astype(np.float32) * np.float32(factor)).astype(array.dtype)
    return array * array.dtype.type(factor)


def _submit(
    kind: str,
    name: str,
    array: np.ndarray,
    process_set: Optional[ProcessSet],
    op: ReduceOp = ReduceOp.SUM,
    root: int = 0,
    splits: Sequence[int] = (),
    compression: str = "",
    residual: Optional[np.ndarray] = None,
) -> _Pending:
    """Submit one named collective of `array`; the dtype's name travels in the request, so ranks
    that disagree on it fail even where the bytes would not show it. `compression` and
    `residual` as for basics.submit."""
    send = np.require(array, requirements="C")
    if kind in _MOVES:  # one trailing dimension of itemsize bytes: rows stay rows
        send = send.reshape(*send.shape, 1).view(np.uint8) if send.ndim else send.reshape(1, 1).view(np.uint8)
    out = np.empty_like(send) if kind in _WRITES else None
    future = submit(
        kind,
        name,
        send,
        out,
        op=op,
        root=root,
        process_set=process_set,
        splits=splits,
        type_name=array.dtype.name,
        compression=compression,
        residual=residual,
    )
    return _Pending(kind, future, out, array.dtype, array.shape)


def _typed(raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Bytes with a trailing itemsize dimension as the elements they hold."""
    return np.ascontiguousarray(raw).view(dtype).reshape(raw.shape[:-1])


def _wait(pending: Sequence[_Pending]) -> List[Any]:
    """Every submitted collective's result, in order (alltoall's: rows, received splits)."""
    with as_horovod_errors():
        try:
            values = [p.future.result() for p in pending]
        except MismatchError as error:  # a HorovodInternalError already: it passes as it is
            raise PreconditionError(str(error)) from error
    results: List[Any] = []
    for p, value in zip(pending, values):
        if p.kind == ALLTOALL:
            results.append((_typed(value[0], p.dtype), np.asarray(value[1], np.int32)))
        elif p.kind == ALLGATHER:
            results.append(_typed(value, p.dtype))
        elif p.kind == BROADCAST:
            results.append(_typed(p.out, p.dtype).reshape(p.shape))
        else:
            results.append(p.out)
    return results


def reduce(
    kind: str,
    arrays: Sequence[np.ndarray],
    names: Sequence[str],
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: Optional[ProcessSet],
    wires: Sequence[str] = (),
    residuals: Sequence[Optional[np.ndarray]] = (),
) -> List[np.ndarray]:
    """All-reduce (or, for kind REDUCESCATTER, the whole reduction of) `arrays`, scaled before
    and after. Integers are averaged as Horovod averages them: summed, then scaled by
    postscale / size in float64 (the reducers' integer average would truncate before the postscale).
    wires[i] is array i's format on the wire ("int8", or "" for its own); residuals[i], if not
    None, its error feedback: added to it after the prescale, and given what compressing that lost."""
    size = coordinator(process_set).size
    pending, posts = [], []
    for i, (name, array) in enumerate(zip(names, arrays)):
        wire = wires[i] if wires else ""
        residual = residuals[i] if residuals else None
        wire_op, post = shares.reduction(op, np.issubdtype(array.dtype, np.integer), postscale, size)
        send = scale(array, prescale)
        if residual is not None:
            send = send + residual.reshape(send.shape)
        pending.append(_submit(kind, name, send, process_set, wire_op, compression=wire, residual=residual))
        posts.append(post)
    return [scale(out, post) for out, post in zip(_wait(pending), posts)]


def reducescatter(
    arrays: Sequence[np.ndarray],
    names: Sequence[str],
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: Optional[ProcessSet],
) -> List[np.ndarray]:
    """Each array reduced over the set's ranks, this rank keeping its share of the first dimension."""
    if any(a.ndim == 0 for a in arrays):
        raise ArgumentError(
            "reducescatter needs tensors of at least one dimension (it divides the first); got a scalar"
        )
    coord = coordinator(process_set)
    kept = []
    for whole in reduce(REDUCESCATTER, arrays, names, op, prescale, postscale, process_set):
        first, rows = shares.piece(whole.shape[0], coord.rank, coord.size)
        kept.append(np.ascontiguousarray(whole[first : first + rows]))
    return kept


def gather(arrays: Sequence[np.ndarray], names: Sequence[str], process_set: Optional[ProcessSet]) -> List[np.ndarray]:
    """Every rank's arrays concatenated along the first dimension, in rank order."""
    return _wait([_submit(ALLGATHER, n, a, process_set) for n, a in zip(names, arrays)])


def broadcast(
    arrays: Sequence[np.ndarray], names: Sequence[str], root_rank: int, process_set: Optional[ProcessSet]
) -> List[np.ndarray]:
    """root_rank's (a global rank's) arrays, on every rank of the set."""
    return _wait([_submit(BROADCAST, n, a, process_set, root=root_rank) for n, a in zip(names, arrays)])


def alltoall(
    array: np.ndarray, splits: np.ndarray, name: str, process_set: Optional[ProcessSet]
) -> Tuple[np.ndarray, np.ndarray]:
    """splits[i] rows of `array` to rank i of the set; (the rows received, in rank order; how
    many came from each rank, int32)."""
    if array.ndim == 0:
        raise ArgumentError("alltoall needs a tensor of at least one dimension; got a scalar")
    counts = shares.splits(array.shape[0], splits.reshape(-1).tolist(), coordinator(process_set).size, ArgumentError)
    return _wait([_submit(ALLTOALL, name, array, process_set, splits=counts)])[0]


def barrier(name: str, process_set: Optional[ProcessSet]) -> None:
    """Return once every rank of the set has reached this barrier."""
    _wait([_submit(BARRIER, name, np.empty(0, np.uint8), process_set)])


def join() -> np.int32:
    """Take part in the other ranks' collectives with empty contributions until every rank has
    joined; the rank that joined last."""
    with as_horovod_errors():
        return np.int32(coordinator().join().result())


class NegotiatedCollectives:
    """The TensorFlow adapter's Collectives (client/tensorflow) among every rank, negotiated by
    name: hvd.init() installs it, so that the adapter's Keras callbacks take part in the same
    negotiation as the Horovod ops."""

    @property
    def rank(self) -> int:
        """This process's rank (hvd.rank())."""
        return coordinator().rank

    @property
    def size(self) -> int:
        """The number of ranks (hvd.size())."""
        return coordinator().size

    def reduce(self, arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp) -> List[np.ndarray]:
        """Collectives.reduce: the arrays all-reduced with `op`, fused together; new arrays."""
        return reduce(ALLREDUCE, arrays, names, op, 1.0, 1.0, None)

    def broadcast(self, arrays: Sequence[np.ndarray], names: Sequence[str], root: int) -> List[np.ndarray]:
        """Collectives.broadcast: root's arrays on every rank; new arrays."""
        return broadcast(arrays, names, root, None)


def init(comm: Optional[Communicator] = None, process_sets: Optional[Union[Sequence[ProcessSet], str]] = None) -> None:
    """Horovod's hvd.init: join the job (basics.init: a Communicator from the environment or
    `comm`, then `process_sets` added, every rank passing the same, or "dynamic"), and route the
    TensorFlow adapter's collectives (the Keras callbacks') through the same name-matching
    negotiation."""
    basics.init(comm, process_sets)
    rstf.use_collectives(NegotiatedCollectives())
