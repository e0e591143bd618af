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
from typing import Any, List, Optional

import numpy as np

from reduction_server.errors import ConfigError
from reduction_server.protocol import ReduceOp

from ..buffers import wire_view
from ..communicator import Communicator
from .coordinator import ALLGATHER, BROADCAST, Coordinator, Request, gather_bytes, name_counter

_lock = threading.Lock()
_state: Optional["_Process"] = None


class _Process:
    def __init__(self, comm: Communicator, owns: bool) -> None:
        hosts = [h.decode() for h in gather_bytes(comm, socket.gethostname().encode())]
        me = hosts[comm.rank]
        distinct = list(dict.fromkeys(hosts))  # hosts in order of their first rank
        self.local_rank = hosts[:comm.rank].count(me)
        self.local_size = hosts.count(me)
        self.cross_rank = distinct.index(me)
        self.cross_size = len(distinct)
        self.coordinator = Coordinator(comm, owns_communicator=owns)
        self.object_names = name_counter("object")


def init(comm: Optional[Communicator] = None) -> None:
    """Join the job: a Communicator from the environment (or `comm`), and the negotiation thread.
    Calling it again while initialized does nothing, as in Horovod."""
    global _state
    with _lock:
        if _state is not None and _state.coordinator.running:
            return
        _state = _Process(comm if comm is not None else Communicator.from_env(), owns=comm is None)


def shutdown() -> None:
    """Leave the job: collectives still pending fail on every rank, naming this one."""
    global _state
    with _lock:
        state, _state = _state, None
    if state is not None:
        state.coordinator.shutdown()


atexit.register(shutdown)


def _process() -> _Process:
    state = _state
    if state is None:
        raise ConfigError("Horovod has not been initialized; call hvd.init() first")
    return state


def coordinator() -> Coordinator:
    """This process's Coordinator; raises ConfigError before hvd.init()."""
    return _process().coordinator


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


def broadcast_object(obj: Any = None, root_rank: int = 0, name: Optional[str] = None) -> Any:
    """root_rank's `obj` (pickled), on every rank."""
    state = _process()
    name = name or state.object_names()
    coord = state.coordinator
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if coord.rank == root_rank else b""
    length = np.array([len(data)], np.int64)
    run(BROADCAST, f"{name}.length", length, length, root=root_rank)
    buf = np.zeros(int(length[0]), np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    run(BROADCAST, f"{name}.bytes", buf, buf, root=root_rank)
    return obj if coord.rank == root_rank else pickle.loads(buf.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None) -> List[Any]:
    """Every rank's `obj` (pickled), in rank order."""
    name = name or _process().object_names()
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    lengths = run(ALLGATHER, f"{name}.length", np.array([len(data)], np.int64))
    joined = run(ALLGATHER, f"{name}.bytes", data)
    ends = np.cumsum(lengths)
    return [pickle.loads(joined[e - n:e].tobytes()) for e, n in zip(ends, lengths)]


def submit(kind: str, name: str, send: np.ndarray, out: Optional[np.ndarray] = None, *,
           op: ReduceOp = ReduceOp.SUM, root: int = 0) -> Future:
    """Start one named collective of NumPy arrays: the Future's value is the gathered array for
    allgather; the others leave their result in `out`."""
    wire = wire_view(send, what=f"tensor {name!r}")
    request = Request(name, kind, wire.dtype, tuple(np.shape(send)), op, root)
    dst = None if out is None else wire_view(out, writable=True, what=f"output of {name!r}")
    return coordinator().submit(request, wire, dst)


def run(kind: str, name: str, send: np.ndarray, out: Optional[np.ndarray] = None, *,
        op: ReduceOp = ReduceOp.SUM, root: int = 0) -> Any:
    """submit(), waited for."""
    return submit(kind, name, send, out, op=op, root=root).result()
