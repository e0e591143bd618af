"""Where the TensorFlow adapter's collectives go: one Communicator per process, through
FusedCollectives (matched across ranks by order, fused into buckets), unless the Horovod layer
installs its own (matched by name) with use_collectives."""

from __future__ import annotations

import atexit
import threading
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from reduction_server.errors import ConfigError
from reduction_server.wire.protocol import DType, ReduceOp

from ..communicator import Communicator
from ..fusion import FusedAllReduce, FusionPlan, TensorSpec, verify_plan


class Compressor(Protocol):
    """What ``compression=`` takes (Horovod's Compression.none / Compression.fp16 shape): NumPy
    arrays in, NumPy arrays out. ``decompress`` must give back the original dtype."""

    def compress(self, array: np.ndarray) -> Tuple[np.ndarray, Any]:
        """(array to send, ctx that decompress() needs): `array` in its wire form."""
        ...

    def decompress(self, array: np.ndarray, ctx: Any) -> np.ndarray:
        """The received `array` restored with compress()'s ctx, in the original dtype."""
        ...


class Collectives(Protocol):
    """Where the adapter's collectives go: NumPy arrays in, results out, called from inside
    tf.numpy_function (so from TensorFlow's threads, one call at a time per step). The default
    is FusedCollectives; the Horovod layer installs one that matches tensors by name
    (use_collectives)."""

    @property
    def rank(self) -> int:
        """This process's rank."""
        ...

    @property
    def size(self) -> int:
        """The number of ranks."""
        ...

    def reduce(self, arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp) -> List[np.ndarray]:
        """All-reduce `arrays` (identified by `names`) with `op` over every rank; the results, in
        order, with the inputs' shapes and dtypes."""
        ...

    def broadcast(self, arrays: Sequence[np.ndarray], names: Sequence[str], root: int) -> List[np.ndarray]:
        """Root's `arrays` (identified by `names`) on every rank; the results, in order, with the
        inputs' shapes and dtypes."""
        ...


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
        """The communicator's rank."""
        return self.communicator.rank

    @property
    def size(self) -> int:
        """The communicator's world size."""
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
        specs = [
            TensorSpec(f"{name}:{a.dtype.name}", (*a.shape, a.dtype.itemsize), DType.UINT8)
            for name, a in zip(names, arrays)
        ]
        key = ("broadcast", tuple(specs))
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        buf = np.empty(total, np.uint8)
        if comm.rank == root:
            for a, start in zip(arrays, offsets):
                buf[start : start + a.nbytes] = np.require(a, requirements="C").reshape(-1).view(np.uint8)
        with self._lock:
            if key not in self._verified:
                plan = FusionPlan(specs, threshold=0)
                verify_plan(comm, plan)
                self._verified[key] = plan
            comm.broadcast(buf, root)
        return [buf[start : start + a.nbytes].view(a.dtype).reshape(a.shape) for a, start in zip(arrays, offsets)]

    def close(self) -> None:
        """Close the communicator if this object owns it (init() created it)."""
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
                raise ConfigError(
                    "reduction_server.client.tensorflow is already initialised with another "
                    "communicator; call shutdown() first"
                )
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
    """Whether init() has set up a communicator or use_collectives() installed Collectives."""
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
    """This process's rank, from the current Collectives (init() from the environment if needed)."""
    return collectives().rank


def size() -> int:
    """The number of ranks, from the current Collectives (init() from the environment if needed)."""
    return collectives().size


def _spec(name: str, array: np.ndarray) -> TensorSpec:
    try:
        dtype = DType.from_numpy(array.dtype)
    except TypeError as exc:
        raise TypeError(f"tensor {name!r}: {exc}") from None
    return TensorSpec(name, tuple(array.shape), dtype)
