"""The Pipeline: a Communicator, its lanes (lane.py) and the Futures of the collectives that run
through it (the collectives themselves are in collectives.py).

Collectives are submitted on the calling thread (so every rank's order is its program order)
and never waited for there: a lane's thread waits for each one's handles, copies staged results
back and completes its Future, which runs DDP's callbacks off the communication engine.

Which lane a collective goes to depends only on the thread that issues it: the first lane from
the user's threads, lane k + 1 from lane k's thread, that is from a callback of a Future. Every
rank runs the same callbacks in the same order (what then() and add_done_callback() add runs on
the adding lane's thread, in the order added, as NCCL runs them at once on the adding thread),
so each lane's collectives have the same order on every rank, and lane k + 1 has a Group of its
own on the reducers, numbering them apart from lane k's. A callback that waits on a collective
it issued waits for another thread, never for its own.
"""

import atexit
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch  # the real torch: imports are absolute

from ..communicator import Communicator, Handle
from ..group import Group
from .lane import Lane

#: what a collective's start() returns: the handles it submitted, and the finish() that copies results out
Started = Tuple[List[Handle], Callable[[], Any]]

#: how deep callbacks may nest: the callbacks run by lane MAX_LANES - 1 issue no collectives
MAX_LANES = 4


class PipelineFuture(torch.futures.Future):
    """A Future of the backend's: what then() and add_done_callback() add runs on the Pipeline's
    thread of the adding thread's lane once this Future has completed, in the order added, so it
    may issue collectives and wait on them."""

    def __init__(self, pipeline: "Pipeline", devices: Sequence[torch.device]) -> None:
        if devices:
            super().__init__(devices=list(devices))
        else:
            super().__init__()
        self._pipeline, self._devices = pipeline, devices
        self.lane: Optional[Lane] = None  # the lane that completes it, once queued

    def wait(self) -> Any:
        """torch's Future.wait; RuntimeError, not a hang, on the thread of the lane that is to
        complete this Future, since that thread waits here (a callback waiting on what was
        queued behind it)."""
        if self.lane is not None and threading.current_thread() is self.lane.thread and not self.done():
            raise RuntimeError(
                "a Future callback waits on a collective or callback queued behind it in the same "
                "order (issued or added after the callback was added): it would wait forever"
            )
        return super().wait()

    def then(self, callback: Callable) -> torch.futures.Future:
        """torch's Future.then; the child Future is the backend's too."""
        child = PipelineFuture(self._pipeline, self._devices)
        return child if self._pipeline.defer(self, callback, child) else super().then(callback)

    def add_done_callback(self, callback: Callable) -> None:
        """torch's Future.add_done_callback."""
        if not self._pipeline.defer(self, callback, None):
            super().add_done_callback(callback)


class Pipeline:
    """A Communicator, and the lanes that complete its collectives' torch Futures in order."""

    def __init__(self, communicator: Communicator, owns: bool) -> None:
        self.communicator = communicator
        self._owns = owns
        self._lock = threading.Lock()  # lanes and their groups made, and closing
        self._closed = False
        self._lanes: List[Lane] = []
        self._lane_of: Dict[int, int] = {}  # a lane's thread -> the lane its callbacks' collectives go to
        self._groups: Dict[Tuple[int, int], Group] = {}  # (id of a communicator, lane) -> its group there
        self._open(0)
        _live.add(self)

    @classmethod
    def over(cls, communicator: Optional[Communicator], owns: Optional[bool]) -> "Pipeline":
        """A pipeline over `communicator`, or over Communicator.from_env() when None; it closes
        the communicator when `owns` says so (None: when it made it)."""
        owns = communicator is None if owns is None else owns
        return cls(communicator or Communicator.from_env(), owns)

    def _index(self) -> int:
        return self._lane_of.get(threading.get_ident(), 0)

    def _open(self, index: int) -> Lane:
        """Lane `index`, started with those before it if not yet; RuntimeError past MAX_LANES."""
        if index >= MAX_LANES:
            raise RuntimeError(
                f"the reduction_server backend runs Future callbacks {MAX_LANES} deep at most: a callback "
                f"of a collective issued {MAX_LANES - 1} callbacks down issues no collective and adds no callback"
            )
        with self._lock:
            if self._closed:
                raise RuntimeError("the reduction_server process group has been shut down")
            while len(self._lanes) <= index:
                k = len(self._lanes)
                lane = Lane(f"rs-torch-rank{self.communicator.rank}" + (f"-lane{k}" if k else ""))
                self._lane_of[lane.thread.ident] = k + 1
                self._lanes.append(lane)
        return self._lanes[index]

    def _lane(self) -> Lane:
        """The calling thread's lane."""
        index = self._index()
        return self._lanes[index] if index < len(self._lanes) else self._open(index)

    def communicator_for(self, base: Communicator) -> Communicator:
        """The communicator of `base`'s collectives issued by the calling thread: base in the
        first lane; in lane k, a Group over base's ranks named after base and k."""
        index = self._index()
        if index == 0:
            return base
        group = self._groups.get((id(base), index))
        if group is None:
            with self._lock:
                group = self._groups.get((id(base), index))
                if group is None:
                    named = isinstance(base, Group)
                    group = Group(
                        base.parent if named else base,
                        base.ranks if named else range(base.world_size),
                        f"{base.name if named else 'torch'}:lane{index}",
                    )
                    self._groups[id(base), index] = group
        return group

    def future(self, devices: Sequence[torch.device] = ()) -> PipelineFuture:
        """A Future for a collective run through this pipeline, on `devices` (CUDA)."""
        return PipelineFuture(self, devices)

    # Every collective: submit(start) under its lane's lock, so the lane's queue has submission order.
    def run(self, start: Callable[[], Started], future: torch.futures.Future) -> torch.futures.Future:
        """Call start() under the lock of the calling thread's lane (it submits the collectives;
        returns their handles and a finish callback) and queue them; `future` completes with
        finish()'s value or the error. RuntimeError once closed."""
        lane = self._lane()
        with lane.lock:
            if self._closed:
                raise RuntimeError("the reduction_server process group has been shut down")
            handles, finish = start()
            if isinstance(future, PipelineFuture):
                future.lane = lane
            lane.complete(handles, finish, future)
        return future

    def defer(self, parent: torch.futures.Future, callback: Callable, child: Optional[PipelineFuture]) -> bool:
        """Queue callback(parent) on the calling thread's lane, child (if any) to complete with
        its value; False once closed (torch's own then() or add_done_callback() runs it)."""
        lane = self._lane()
        with lane.lock:
            if self._closed:
                return False
            if child is not None:
                child.lane = lane
            lane.call(parent, callback, child)
        return True

    def close(self) -> None:
        """Refuse new collectives, close the Communicator if owned (what is pending fails), and
        join the lanes' threads once they have completed their queues."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            lanes = list(self._lanes)
        for lane in lanes:
            with lane.lock:
                lane.stop()
        if self._owns:  # first: it fails what is still pending, so no thread can wait on it
            self.communicator.close()
        for lane in lanes:
            if threading.current_thread() is not lane.thread:
                lane.thread.join(None if self._owns else 30)
        for group in self._groups.values():
            group.close()
        _live.discard(self)


_live: "weakref.WeakSet[Pipeline]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # say goodbye to the reducers even without destroy_process_group()
    for pipeline in list(_live):
        try:
            pipeline.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
