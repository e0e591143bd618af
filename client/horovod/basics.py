"""Process-wide Horovod state shared by every framework module: init, shutdown, rank, size,
local rank, and collectives of picklable objects.

One Communicator and one Coordinator per process, whichever of the framework modules the script
imports (``horovod.torch`` and ``horovod.tensorflow`` in one process share them).
"""

from __future__ import annotations

import atexit
import pickle
import socket
import threading
from concurrent.futures import Future
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from reduction_server.config import settings
from reduction_server.errors import ConfigError
from reduction_server.wire.protocol import ReduceOp

from ..buffers import wire_view
from ..communicator import Communicator
from ..timeline import open_timeline, timeline_path
from . import elastic
from .coordinator import ALLGATHER, BROADCAST, Coordinator, Request, gather_bytes, name_counter
from .exceptions import HorovodInternalError, as_horovod_errors
from .process_sets import ProcessSet, ProcessSetLike, ProcessSets

_lock = threading.Lock()
_state: Optional["_Process"] = None
_incarnations = 0  # communicators this process opened for Horovod: each init after a shutdown takes the next
_inits = 0  # init() calls so far: each init's process-set groups get names no earlier init's had


class _Process:
    def __init__(self, comm: Communicator, owns: bool, init: int) -> None:
        hosts = [h.decode() for h in gather_bytes(comm, socket.gethostname().encode())]
        me = hosts[comm.rank]
        distinct = list(dict.fromkeys(hosts))  # hosts in order of their first rank
        self.local_rank = hosts[: comm.rank].count(me)
        self.local_size = hosts.count(me)
        self.cross_rank = distinct.index(me)
        self.cross_size = len(distinct)
        self.coordinator = Coordinator(comm, owns_communicator=owns)
        self.process_sets = ProcessSets(comm, self.coordinator, f"horovod.{init}")
        self.object_names = name_counter("object")
        self.set_names = name_counter("process_set")  # advanced by every rank alike, unlike object_names


def init(comm: Optional[Communicator] = None, process_sets: Optional[Union[Sequence[ProcessSet], str]] = None) -> None:
    """Join the job: a Communicator from the environment (or `comm`), and the negotiation thread;
    then add `process_sets` (every rank passes the same). Calling it again while initialized does
    nothing, as in Horovod; after shutdown() it joins the job again, on a generation of its own.
    `process_sets="dynamic"` (Horovod's switch for adding them later) adds none: here they may
    always be added and removed at run time."""
    global _state, _incarnations, _inits
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f'process_sets={process_sets!r}: give a list of ProcessSets, or "dynamic"')
        process_sets = None
    with _lock:
        if _state is not None:
            if _state.coordinator.running:
                return
            _state.process_sets.shutdown()  # a failure ended it: its process sets go too
        owns = comm is None
        # Counted per call, failed or not: ranks that call init() alike stay on one generation.
        _inits += 1
        if owns and elastic.enabled():  # the rendezvous names the rank, size and generation
            comm = elastic.join()
        elif owns:
            _incarnations += 1
            comm = Communicator.from_env(incarnation=_incarnations - 1)
        try:
            _state = _Process(comm, owns, _inits)
        except BaseException:
            _state = None
            if owns:
                comm.close()
            raise
    path = settings.read("HOROVOD_TIMELINE")
    if path and path != "DYNAMIC":
        start_timeline(path, settings.read("HOROVOD_TIMELINE_MARK_CYCLES"))
    for process_set in process_sets or ():
        add_process_set(process_set)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's hvd.start_timeline: from now on, write the collectives to a Chrome trace.
    Rank 0 writes `file_path` itself, as in Horovod; the other ranks write their own beside it
    (`.rank<N>` before the extension). Calling it again switches files."""
    state = _process()
    comm = state.coordinator.comm
    path = file_path if comm.rank == 0 else timeline_path(file_path, comm.rank)
    comm._engine.set_timeline(open_timeline(path, comm.rank, mark_cycles))


def stop_timeline() -> None:
    """Horovod's hvd.stop_timeline: stop writing the timeline; its file is complete JSON."""
    _process().coordinator.comm._engine.set_timeline(None)


def shutdown() -> None:
    """Leave the job: collectives still pending fail on every rank, naming this one."""
    global _state
    with _lock:
        state, _state = _state, None
    if state is not None:
        state.process_sets.shutdown()


atexit.register(shutdown)


def _process() -> _Process:
    state = _state
    if state is None:
        raise ConfigError("Horovod has not been initialized; call hvd.init() first")
    return state


def coordinator(process_set: Optional[ProcessSet] = None) -> Coordinator:
    """The Coordinator of `process_set` (default: every rank's); raises ConfigError before
    hvd.init(), ValueError for a set this rank is not in."""
    return _process().process_sets.coordinator(process_set)


def set_root(process_set: Optional[ProcessSet], root_rank: int) -> int:
    """`root_rank` (a global rank, as Horovod's collectives take it) as a rank of `process_set`."""
    return _process().process_sets.root(process_set, root_rank)


def add_process_set(process_set: ProcessSetLike) -> ProcessSet:
    """Horovod's hvd.add_process_set: a collective of every rank (each passes the same ranks);
    returns the set, its process_set_id assigned."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set} has been added already")
    state = _process()
    everyone = allgather_object(process_set.ranks, name=f"add.{state.set_names()}")
    if any(r != process_set.ranks for r in everyone):
        raise ValueError(
            f"rank {rank()}: ranks disagree on the process set to add: "
            + "; ".join(f"rank {r}: {ranks}" for r, ranks in enumerate(everyone))
        )
    process_set.process_set_id = state.process_sets.add(process_set.ranks)
    process_set._rank = rank()
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Horovod's hvd.remove_process_set: a collective of every rank; False for the global set
    or one never added. The set's object can no longer be used."""
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    state = _process()
    everyone = allgather_object(set_id, name=f"remove.{state.set_names()}")
    if any(i != set_id for i in everyone):
        raise ValueError(
            f"rank {rank()}: ranks disagree on the process set to remove: "
            + "; ".join(f"rank {r}: {i}" for r, i in enumerate(everyone))
        )
    process_set.process_set_id = None
    return state.process_sets.remove(set_id)


def is_initialized() -> bool:
    """Whether hvd.init() has run and shutdown() has not since (hvd.is_initialized())."""
    return _state is not None


def size() -> int:
    """The number of ranks in the job (hvd.size()); raises ConfigError before hvd.init()."""
    return _process().coordinator.size


def rank() -> int:
    """This process's rank (hvd.rank()); raises ConfigError before hvd.init()."""
    return _process().coordinator.rank


def local_rank() -> int:
    """This process's index among the job's processes on its host (picks its device)."""
    return _process().local_rank


def local_size() -> int:
    """The number of the job's processes on this host (hvd.local_size())."""
    return _process().local_size


def cross_rank() -> int:
    """The index of this process's host among the job's hosts."""
    return _process().cross_rank


def cross_size() -> int:
    """The number of hosts the job's processes run on (hvd.cross_size())."""
    return _process().cross_size


def _serialized(obj: Any) -> Tuple[bytes, Optional[BaseException]]:
    """obj as bytes, by cloudpickle as in Horovod (lambdas and local functions too), or why it
    cannot be: the collective still runs with a mark of the failure, so that no other rank waits."""
    import cloudpickle  # only the object collectives need it

    try:
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as exc:  # noqa: BLE001 - raised again once every rank knows
        return b"", exc


def _unserializable(ranks: Sequence[int], error: Optional[BaseException]) -> None:
    """Raise `error` (this rank's own), or HorovodInternalError naming the ranks whose object
    could not be serialized."""
    if error is not None:
        raise error
    if len(ranks):
        raise HorovodInternalError(f"rank(s) {', '.join(map(str, ranks))} could not serialize the object")


def broadcast_object(
    obj: Any = None, root_rank: int = 0, name: Optional[str] = None, process_set: Optional[ProcessSet] = None
) -> Any:
    """root_rank's `obj` (pickled), on every rank (of `process_set`)."""
    state = _process()
    name = name or state.object_names()
    data, error = _serialized(obj) if rank() == root_rank else (b"", None)
    length = np.array([len(data) if error is None else -1], np.int64)
    run(BROADCAST, f"{name}.length", length, length, root=root_rank, process_set=process_set)
    _unserializable([root_rank] if length[0] < 0 else [], error)
    buf = np.zeros(int(length[0]), np.uint8)
    buf[: len(data)] = np.frombuffer(data, np.uint8)
    run(BROADCAST, f"{name}.bytes", buf, buf, root=root_rank, process_set=process_set)
    return obj if rank() == root_rank else pickle.loads(buf.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> List[Any]:
    """Every rank's `obj` (pickled), in rank order (the ranks of `process_set`)."""
    name = name or _process().object_names()
    data, error = _serialized(obj)
    length = np.array([len(data) if error is None else -1], np.int64)
    lengths = run(ALLGATHER, f"{name}.length", length, process_set=process_set)
    _unserializable(np.flatnonzero(lengths < 0).tolist(), error)
    joined = run(ALLGATHER, f"{name}.bytes", np.frombuffer(data, np.uint8), process_set=process_set)
    ends = np.cumsum(lengths)
    return [pickle.loads(joined[e - n : e].tobytes()) for e, n in zip(ends, lengths)]


def submit(
    kind: str,
    name: str,
    send: np.ndarray,
    out: Optional[np.ndarray] = None,
    *,
    op: ReduceOp = ReduceOp.SUM,
    root: int = 0,
    process_set: Optional[ProcessSet] = None,
    splits: Sequence[int] = (),
    type_name: str = "",
    compression: str = "",
    residual: Optional[np.ndarray] = None,
) -> Future:
    """Start one named collective of NumPy arrays among `process_set` (default: every rank);
    `root` is a global rank, `splits` alltoall's rows for each rank. The Future's value is the
    gathered array for allgather, (rows received, rows from each rank) for alltoall, None for
    the others, which leave their result in `out` (reducescatter: the whole reduction).
    `type_name`: the framework's name for the dtype, checked across ranks where the wire's
    dtype would not show it (bytes). `compression`: an allreduce's wire format ("int8"), every
    rank the same; `residual`: a float32 array of send's size that gets what compressing it
    lost (error feedback). A collective that cannot start raises HorovodInternalError."""
    coord = coordinator(process_set)
    wire = wire_view(send, what=f"tensor {name!r}")
    local_root = set_root(process_set, root) if kind == BROADCAST else 0
    request = Request(
        name, kind, wire.dtype, tuple(np.shape(send)), op, local_root, type_name, tuple(splits), compression
    )
    dst = None if out is None else wire_view(out, writable=True, what=f"output of {name!r}")
    with as_horovod_errors():
        return coord.submit(request, wire, dst, residual)


def run(
    kind: str,
    name: str,
    send: np.ndarray,
    out: Optional[np.ndarray] = None,
    *,
    op: ReduceOp = ReduceOp.SUM,
    root: int = 0,
    process_set: Optional[ProcessSet] = None,
    splits: Sequence[int] = (),
) -> Any:
    """submit(), waited for; a failed collective raises HorovodInternalError."""
    with as_horovod_errors():
        return submit(kind, name, send, out, op=op, root=root, process_set=process_set, splits=splits).result()
