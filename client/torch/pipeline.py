"""The completing thread: a Communicator, and one thread that completes torch Futures in
submission order.

Collectives are submitted on the calling thread (so every rank's order is its program order)
and never waited for there; the thread waits for each one's handles, copies staged results back
and completes its Future, which runs DDP's callbacks off the communication engine.
"""
import atexit
import queue
import threading
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch  # the real torch: imports are absolute

from reduction_server.protocol import ReduceOp

from ..communicator import Communicator, Handle
from .tensors import Staged, check_device, future_for


class Pipeline:
    """A Communicator and one thread that completes torch Futures in submission order."""

    def __init__(self, communicator: Communicator, owns: bool) -> None:
        self.communicator = communicator
        self._owns = owns
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()  # submission and enqueueing happen as one step
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"rs-torch-rank{communicator.rank}", daemon=True)
        self._thread.start()
        _live.add(self)

    @classmethod
    def over(cls, communicator: Optional[Communicator], owns: Optional[bool]) -> "Pipeline":
        """A pipeline over `communicator`, or over Communicator.from_env() when None; it closes
        the communicator when `owns` says so (None: when it made it)."""
        owns = communicator is None if owns is None else owns
        return cls(communicator or Communicator.from_env(), owns)

    # Every collective: submit(start) under the lock, so the completion queue has submission order.
    def run(self, start: Callable[[], Tuple[List[Handle], Callable[[], Any]]],
            future: torch.futures.Future) -> torch.futures.Future:
        """Call start() under the lock (it submits the collectives; returns their handles and a
        finish callback) and queue them; `future` completes with finish()'s value or the error.
        RuntimeError once closed."""
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
        return self.run(start, future_for(tensors))

    def broadcast(self, tensors: Sequence[torch.Tensor], root: int) -> torch.futures.Future:
        """Overwrite each tensor with root's, in place (sent as bytes); the Future's value is the list."""
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
        return self.run(start, future_for(tensors))

    def all_gather(self, outputs: Sequence[Sequence[torch.Tensor]],
                   inputs: Sequence[torch.Tensor]) -> torch.futures.Future:
        """Each input into outputs[i][rank] on every rank, as one broadcast per rank; the
        Future's value is the output lists. ValueError for lists or tensors that do not match."""
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
                check_device(x, "allgather input")
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
        return self.run(start, future_for([o for outs in outputs for o in outs]))

    def barrier(self) -> torch.futures.Future:
        """A Future that completes once every rank has reached the barrier (a one-element all-reduce)."""
        def start():
            token = np.zeros(1, np.int32)
            return [self.communicator.all_reduce_async(token, ReduceOp.SUM, out=token)], lambda: None
        return self.run(start, torch.futures.Future())

    def close(self) -> None:
        """Refuse new collectives, close the Communicator if owned (what is pending fails), and
        join the thread once it has completed the queue."""
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


_live: "weakref.WeakSet[Pipeline]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # say goodbye to the reducers even without destroy_process_group()
    for pipeline in list(_live):
        try:
            pipeline.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
