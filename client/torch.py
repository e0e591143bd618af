"""PyTorch adapter: a `torch.distributed` backend and DDP comm hooks over the reducers.

Importing this module registers the backend ``"reduction_server"``::

    import torch.distributed as dist
    import reduction_server.client.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("reduction_server")      # rank and world size: arguments or environment
    model = torch.nn.parallel.DistributedDataParallel(model)

The process group implements what DDP and ordinary scripts call: allreduce (SUM, AVG, PRODUCT,
MIN, MAX), allreduce_coalesced, broadcast, allgather and barrier. Each call hands its collective
to the shared Communicator without waiting and returns a Work whose Future one background thread
completes, in submission order, as the reducers answer: DDP's bucket all-reduces run while
backward computes the earlier layers' gradients.

For jobs that keep gloo or nccl as their process group, the same all-reduce is a DDP comm hook::

    state = ReductionServerHookState.from_env()
    ddp.register_comm_hook(state, reduction_server_hook)          # or reduction_server_fp16_hook,
                                                                   #    reduction_server_bf16_hook

Rendezvous: with MASTER_ADDR/MASTER_PORT set, ``init_process_group`` works as for any backend
(torchrun). Without them, the ``env://`` rendezvous takes rank and world size from the
arguments, RANK/WORLD_SIZE or the package's discovery (RS_RANK, CLUSTER_SPEC, TF_CONFIG, ...)
and gives the group a process-local store: this backend needs no store, and a backend that does
(gloo) fails with an error saying to set MASTER_ADDR/MASTER_PORT instead of hanging.

CUDA tensors are staged through pinned host buffers: copied to the host before the collective
(after the producing stream's work) and back, on the completing thread's current stream, before
the Future completes (the Future then orders its consumers after that copy).
"""
import atexit
import os
import queue
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch  # the real torch: this module is reduction_server.client.torch, imports are absolute
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from reduction_server.discovery import discover_worker
from reduction_server.errors import ConfigError
from reduction_server.protocol import ReduceOp

from .communicator import Communicator, Handle

__all__ = ["BACKEND_NAME", "ReductionServerHookState", "ReductionServerProcessGroup", "create_backend",
           "reduction_server_bf16_hook", "reduction_server_fp16_hook", "reduction_server_hook",
           "torch_reduce_op"]

BACKEND_NAME = "reduction_server"

# torch's ReduceOp names (its numbering differs from NCCL's, so never by number).
_OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "PRODUCT": ReduceOp.PROD, "MIN": ReduceOp.MIN,
        "MAX": ReduceOp.MAX}

# torch dtypes the wire carries as themselves.
_NATIVE = {torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
           torch.float64}
for _name in ("uint32", "uint64"):
    if hasattr(torch, _name):
        _NATIVE.add(getattr(torch, _name))
_COMPLEX = {torch.complex64, torch.complex128}  # sum and avg, as pairs of reals


def torch_reduce_op(op: Any) -> ReduceOp:
    """The protocol op for a torch ReduceOp (an instance, a RedOpType or a name such as "sum")."""
    if not isinstance(op, (dist.ReduceOp.RedOpType, str)) and isinstance(getattr(op, "op", None),
                                                                        dist.ReduceOp.RedOpType):
        op = op.op  # a ReduceOp instance (AllreduceOptions.reduceOp)
    name = op.name if isinstance(op, dist.ReduceOp.RedOpType) else str(op).strip().upper()
    name = {"PROD": "PRODUCT", "MEAN": "AVG"}.get(name, name)
    if name not in _OPS:
        raise ValueError(f"the reduction_server backend does not support ReduceOp.{name}; "
                         f"supported: {', '.join(_OPS)}")
    return _OPS[name]


# -- staging ----------------------------------------------------------------------------------

def _require_cuda(tensor: torch.Tensor) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"a tensor on {tensor.device} was passed to reduction_server, but CUDA is not "
                           "available in this process (torch.cuda.is_available() is False)")


def _check_device(tensor: Any, what: str) -> str:
    """'cpu' or 'cuda'; anything else is a clear TypeError."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(tensor).__name__}")
    kind = tensor.device.type
    if kind == "cuda":
        _require_cuda(tensor)
    elif kind != "cpu":
        raise TypeError(f"{what} is on {tensor.device}; the reduction_server backend takes cpu and cuda tensors")
    return kind


class Staged:
    """One user tensor as a contiguous host tensor the Communicator can view, and the way back.

    CPU contiguous tensors are used in place (zero copy). Non-contiguous tensors go through a
    contiguous copy and CUDA tensors through a pinned host buffer; finish() copies the result back.
    """

    def __init__(self, tensor: torch.Tensor, what: str, *, load: bool = True) -> None:
        self.tensor = tensor
        self.cuda = _check_device(tensor, what) == "cuda"
        if self.cuda:
            # Blocking copy: ordered after the work queued on the current stream (the producer).
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            if load:
                self.host.copy_(tensor)
        elif tensor.is_contiguous():
            self.host = tensor.detach()
        else:
            self.host = tensor.detach().contiguous() if load else torch.empty(tensor.shape, dtype=tensor.dtype)
        self.copy_back = self.cuda or self.host.data_ptr() != tensor.data_ptr()

    def finish(self) -> None:
        if self.copy_back:
            with torch.no_grad():
                self.tensor.copy_(self.host, non_blocking=self.cuda)

    def wire(self, op: Optional[ReduceOp]) -> Any:
        """The host tensor as a wire dtype: op None means broadcast (any dtype, as bytes)."""
        host, dtype = self.host, self.host.dtype
        if dtype in _NATIVE:
            return host
        if op is None:
            return host.reshape(-1).view(torch.uint8)
        if dtype in _COMPLEX and op in (ReduceOp.SUM, ReduceOp.AVG):
            return torch.view_as_real(host)
        if dtype == torch.bool and op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD):
            return host.view(torch.uint8)  # 0/1: max is or, min and product are and
        raise TypeError(f"the reduction_server backend cannot reduce {dtype} with {op.name}; dtypes: "
                        + ", ".join(sorted(str(d).replace("torch.", "") for d in _NATIVE))
                        + " (complex: sum and avg; bool: min, max, product)")


def _future(tensors: Sequence[torch.Tensor]) -> torch.futures.Future:
    devices = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


# -- the completing thread --------------------------------------------------------------------

class _Pipeline:
    """A Communicator and one thread that completes torch Futures in submission order.

    Collectives are submitted on the calling thread (so every rank's order is its program order)
    and never waited for there; the thread waits for each one's handles, copies staged results
    back and completes its Future, which runs DDP's callbacks off the communication engine.
    """

    def __init__(self, communicator: Communicator, owns: bool) -> None:
        self.communicator = communicator
        self._owns = owns
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()  # submission and enqueueing happen as one step
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"rs-torch-rank{communicator.rank}", daemon=True)
        self._thread.start()
        _live.add(self)

    # Every collective: submit(start) under the lock, so the completion queue has submission order.
    def run(self, start: Callable[[], Tuple[List[Handle], Callable[[], Any]]],
            future: torch.futures.Future) -> torch.futures.Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("the reduction_server process group has been shut down")
            handles, finish = start()
            self._queue.put((handles, finish, future))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handles, finish, future = item
            try:
                for handle in handles:
                    handle.wait()
                value = finish()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the Future
                future.set_exception(exc)
            else:
                future.set_result(value)

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp,
                   value: Any = None) -> torch.futures.Future:
        """In-place all-reduce of each tensor; the Future's value is `value` (default: the list)."""
        def start():
            staged = [Staged(t, "all_reduce tensor") for t in tensors]
            wires = [s.wire(op) for s in staged]
            handles = [self.communicator.all_reduce_async(w, op, out=w) for w in wires]

            def finish():
                for s in staged:
                    s.finish()
                return list(tensors) if value is None else value
            return handles, finish
        return self.run(start, _future(tensors))

    def broadcast(self, tensors: Sequence[torch.Tensor], root: int) -> torch.futures.Future:
        rank = self.communicator.rank

        def start():
            staged = [Staged(t, "broadcast tensor", load=rank == root) for t in tensors]
            wires = [s.wire(None) for s in staged]
            handles = [self.communicator.broadcast_async(w, root) for w in wires]

            def finish():
                if rank != root:
                    for s in staged:
                        s.finish()
                return list(tensors)
            return handles, finish
        return self.run(start, _future(tensors))

    def all_gather(self, outputs: Sequence[Sequence[torch.Tensor]],
                   inputs: Sequence[torch.Tensor]) -> torch.futures.Future:
        comm = self.communicator
        world, rank = comm.world_size, comm.rank
        if len(outputs) != len(inputs):
            raise ValueError(f"allgather: {len(outputs)} output lists for {len(inputs)} inputs")
        for outs, x in zip(outputs, inputs):
            if len(outs) != world:
                raise ValueError(f"allgather: an output list holds {len(outs)} tensors; the world size is {world}")
            for o in outs:
                if o.dtype != x.dtype or o.numel() != x.numel():
                    raise ValueError(f"allgather: output {tuple(o.shape)} {o.dtype} does not match input "
                                     f"{tuple(x.shape)} {x.dtype}")

        def start():
            for x in inputs:
                _check_device(x, "allgather input")
            staged = []  # everything staged (and checked) before anything is sent
            for outs, x in zip(outputs, inputs):
                with torch.no_grad():
                    outs[rank].copy_(x.reshape(outs[rank].shape))
                for root, o in enumerate(outs):  # W broadcasts, each rank the root of its slot
                    s = Staged(o, "allgather output", load=root == rank)
                    staged.append((root, s, s.wire(None)))
            handles = [comm.broadcast_async(wire, root) for root, _, wire in staged]

            def finish():
                for root, s, _ in staged:
                    if root != rank:
                        s.finish()
                return [list(outs) for outs in outputs]
            return handles, finish
        return self.run(start, _future([o for outs in outputs for o in outs]))

    def barrier(self) -> torch.futures.Future:
        def start():
            token = np.zeros(1, np.int32)
            return [self.communicator.all_reduce_async(token, ReduceOp.SUM, out=token)], lambda: None
        return self.run(start, torch.futures.Future())

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        if self._owns:  # first: it fails what is still pending, so the thread cannot wait on it
            self.communicator.close()
        if threading.current_thread() is not self._thread:
            self._thread.join(None if self._owns else 30)
        _live.discard(self)


_live: "weakref.WeakSet[_Pipeline]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # say goodbye to the reducers even without destroy_process_group()
    for pipeline in list(_live):
        try:
            pipeline.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


# -- the process group ------------------------------------------------------------------------

def _as_list(tensors: Union[torch.Tensor, Sequence[torch.Tensor]]) -> List[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _work(future: torch.futures.Future) -> dist.Work:
    return _create_work_from_future(future)


class ReductionServerProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives go through the reducers.

    Made by ``init_process_group("reduction_server")``; or directly, from a Communicator, for
    ``DistributedDataParallel(model, process_group=ReductionServerProcessGroup(comm))``.
    Every call returns at once with a Work; its Future completes on a background thread.
    """

    def __init__(self, communicator: Optional[Communicator] = None, *, owns_communicator: Optional[bool] = None,
                 _share: Optional["ReductionServerProcessGroup"] = None) -> None:
        if _share is not None:  # another group over the same ranks: the same Communicator and order
            self._pipeline, self._owner = _share._pipeline, False
        else:
            if owns_communicator is None:
                owns_communicator = communicator is None
            communicator = communicator or Communicator.from_env()
            self._pipeline, self._owner = _Pipeline(communicator, owns_communicator), True
        comm = self._pipeline.communicator
        super().__init__(comm.rank, comm.world_size)
        self._rank, self._size = comm.rank, comm.world_size

    @property
    def communicator(self) -> Communicator:
        return self._pipeline.communicator

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"ReductionServerProcessGroup(rank={self._rank}, world_size={self._size})"

    # -- collectives -----------------------------------------------------------------------
    def allreduce(self, tensors, opts=None) -> dist.Work:
        op = torch_reduce_op(opts.reduceOp) if isinstance(opts, dist.AllreduceOptions) else (
            torch_reduce_op(opts) if opts is not None else ReduceOp.SUM)
        return _work(self._pipeline.all_reduce(_as_list(tensors), op))

    def allreduce_coalesced(self, tensors, opts=None) -> dist.Work:
        op = torch_reduce_op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        return _work(self._pipeline.all_reduce(_as_list(tensors), op))

    def broadcast(self, tensors, opts=None) -> dist.Work:
        root = opts.rootRank if isinstance(opts, dist.BroadcastOptions) else (0 if opts is None else int(opts))
        if not 0 <= root < self._size:
            raise ValueError(f"broadcast root {root} is out of range for world size {self._size}")
        return _work(self._pipeline.broadcast(_as_list(tensors), root))

    def allgather(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        if isinstance(input_tensors, torch.Tensor):  # allgather([outs], x)
            input_tensors = [input_tensors]
            if output_tensors and isinstance(output_tensors[0], torch.Tensor):
                output_tensors = [output_tensors]
        return _work(self._pipeline.all_gather(output_tensors, list(input_tensors)))

    def barrier(self, opts=None) -> dist.Work:
        return _work(self._pipeline.barrier())

    def shutdown(self) -> None:
        """Finish the queued completions and, if this group made it, close the Communicator."""
        _forget(self)
        if self._owner:
            self._pipeline.close()

    def abort(self) -> None:
        self.shutdown()


# One process group per process over the reducers (a second Communicator on the same job would
# reuse its sequence numbers). Groups over the whole world share it; subgroups are refused.
_groups: Dict[int, ReductionServerProcessGroup] = {}
_groups_lock = threading.Lock()


def _forget(pg: ReductionServerProcessGroup) -> None:
    with _groups_lock:
        for key, value in list(_groups.items()):
            if value is pg:
                del _groups[key]


def _communicator_for(rank: int, world_size: int) -> Communicator:
    """A Communicator at torch's rank and world size, reducers and job identity from discovery."""
    env = dict(os.environ, RS_RANK=str(rank), RS_WORLD_SIZE=str(world_size))
    place = discover_worker(env)
    return Communicator(place.reducers, rank, world_size, job_token=place.job_token, job_id=place.job_id,
                        generation=place.generation)


def create_backend(store: Any, rank: int, world_size: int, timeout: timedelta) -> ReductionServerProcessGroup:
    """The creator registered with torch for "reduction_server" (store and timeout are unused:
    the reducers are the meeting point, and RS_TIMEOUT bounds each collective)."""
    with _groups_lock:
        existing = next(iter(_groups.values()), None)
        if existing is not None:
            if world_size != existing.size() or rank != existing.rank():
                raise NotImplementedError(
                    f"the reduction_server backend serves one group of all {existing.size()} ranks; a subgroup "
                    f"(rank {rank} of {world_size}) needs another backend (dist.new_group(ranks, backend='gloo'))")
            # The same ranks: share the one Communicator, so collectives keep one order.
            return ReductionServerProcessGroup(_share=existing)
        pg = ReductionServerProcessGroup(_communicator_for(rank, world_size), owns_communicator=True)
        _groups[id(pg)] = pg
        return pg


# -- rendezvous without MASTER_ADDR -----------------------------------------------------------

class _LocalStore(dist.Store):
    """The store of a job that has no rendezvous server: process-local keys. This backend never
    reads it; a backend that must meet its peers through it gets a clear error, not a hang."""

    def __init__(self) -> None:
        super().__init__()
        self._data: Dict[str, bytes] = {}

    def _missing(self, key: str) -> RuntimeError:
        return RuntimeError(
            f"no rendezvous store: init_process_group ran without MASTER_ADDR/MASTER_PORT, which only the "
            f"reduction_server backend can do (key {key!r} is another process's). Set MASTER_ADDR and "
            f"MASTER_PORT (or pass init_method/store) for gloo, nccl and new_group()")

    def set(self, key, value) -> None:
        self._data[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key) -> bytes:
        if key not in self._data:
            raise self._missing(key)
        return self._data[key]

    def add(self, key, value) -> int:
        current = int(self._data.get(key, b"0")) + int(value)
        self._data[key] = str(current).encode()
        return current

    def compare_set(self, key, expected, desired) -> bytes:
        current = self._data.get(key)
        if (current is None and not expected) or current == expected:
            self._data[key] = desired
            return desired
        return current if current is not None else expected

    def check(self, keys) -> bool:
        return all(k in self._data for k in keys)

    def wait(self, keys, timeout=None) -> None:
        for key in keys:
            if key not in self._data:
                raise self._missing(key)

    def delete_key(self, key) -> bool:
        return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._data)

    def set_timeout(self, timeout) -> None:
        pass


_env_handler = None
_stores: List[_LocalStore] = []


def _env_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any):
    from urllib.parse import parse_qs, urlparse

    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        yield from _env_handler(url, timeout=timeout, **kwargs)
        return
    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    try:
        place = discover_worker()
    except ConfigError:
        place = None
    if place is None and not os.environ.get("RS_REDUCERS"):
        yield from _env_handler(url, timeout=timeout, **kwargs)  # not a reduction_server job: torch's error
        return
    rank = int(query.get("rank", os.environ.get("RANK") or (place.rank if place else -1)))
    world_size = int(query.get("world_size", os.environ.get("WORLD_SIZE") or (place.world_size if place else -1)))
    if rank < 0 or world_size < 1:
        raise ValueError("init_process_group: no rank and world size (pass rank= and world_size=, or set "
                         "RS_RANK/RS_WORLD_SIZE or RANK/WORLD_SIZE)")
    store = _LocalStore()
    _stores.append(store)  # the Python object must outlive torch's C++ references to it
    yield store, rank, world_size
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")


def _register() -> None:
    global _env_handler
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create_backend, devices=["cpu", "cuda"])
    import sys

    rdzv = sys.modules["torch.distributed.rendezvous"]  # the module (its package re-exports a function)
    handler = rdzv._rendezvous_handlers.get("env")
    if handler is not None and handler is not _env_rendezvous:
        _env_handler = handler
        rdzv._rendezvous_handlers["env"] = _env_rendezvous


_register()


# -- DDP comm hooks (any process group) -------------------------------------------------------

class ReductionServerHookState:
    """What the comm hooks need: a Communicator (default: from the environment) and the thread
    that completes their Futures. ``ddp.register_comm_hook(state, reduction_server_hook)``."""

    def __init__(self, communicator: Optional[Communicator] = None) -> None:
        owns = communicator is None
        self.communicator = communicator or Communicator.from_env()
        self._pipeline = _Pipeline(self.communicator, owns)

    @classmethod
    def from_env(cls, **options: Any) -> "ReductionServerHookState":
        return cls(Communicator.from_env(**options)) if options else cls()

    def close(self) -> None:
        self._pipeline.close()


def reduction_server_hook(state: ReductionServerHookState,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's allreduce hook through the reducers: the bucket's gradients averaged over the ranks
    (divided by the world size, then summed, as DDP's default does)."""
    tensor = bucket.buffer()
    tensor.div_(state.communicator.world_size)
    return state._pipeline.all_reduce([tensor], ReduceOp.SUM, value=tensor)


def _compressed_hook(state: ReductionServerHookState, bucket: dist.GradBucket, dtype: torch.dtype):
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(state.communicator.world_size)

    def start():
        staged = Staged(compressed, "compressed bucket")
        wire = staged.wire(ReduceOp.SUM)
        handle = state.communicator.all_reduce_async(wire, ReduceOp.SUM, out=wire)

        def finish():
            staged.finish()
            with torch.no_grad():
                buffer.copy_(compressed)
            return buffer
        return [handle], finish
    return state._pipeline.run(start, _future([buffer]))


def reduction_server_fp16_hook(state: ReductionServerHookState,
                               bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """reduction_server_hook with the bucket sent as float16 (half the bytes; the reducers sum in
    float32 and round once)."""
    return _compressed_hook(state, bucket, torch.float16)


def reduction_server_bf16_hook(state: ReductionServerHookState,
                               bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """reduction_server_hook with the bucket sent as bfloat16."""
    return _compressed_hook(state, bucket, torch.bfloat16)
