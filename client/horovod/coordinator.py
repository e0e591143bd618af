"""The Horovod-style core: collectives matched across ranks by tensor name.

A Communicator needs every rank to issue the same collectives in the same order. Horovod does
not: each rank submits named tensors whenever they are ready (a backward pass may finish its
gradients in a different order on each rank), and a background cycle matches them by name. This
module does the same over the reducers.

Every HOROVOD_CYCLE_TIME milliseconds a background thread exchanges each rank's newly submitted
requests with every other rank (negotiation.py), so that all agree on the names every rank has
asked for and their order; those run in that order, all-reduces fused up to
HOROVOD_FUSION_THRESHOLD (runner.py). A name whose kind, dtype, shape, op or root differs across
ranks fails on every rank with one message naming it and the ranks; a name that some ranks
submitted and others did not within RS_TIMEOUT fails naming both.

Modules: requests (Request, Submission, disagreement), negotiation (the replicated table),
runner (fusion, starting and completing), coordinator (submission, the cycle, failure).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from reduction_server.config import settings
from reduction_server.errors import CollectiveError

from ..buffers import WireBuffer
from ..communicator import Communicator
from ..fusion import fusion_threshold
from .negotiation import Negotiation, cycle_time, exchange_bytes, gather_bytes
from .requests import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    REDUCESCATTER,
    Request,
    Submission,
    disagreement,
    name_counter,
)
from .runner import Runner

__all__ = [
    "ALLGATHER",
    "ALLREDUCE",
    "ALLTOALL",
    "BARRIER",
    "BROADCAST",
    "REDUCESCATTER",
    "Coordinator",
    "Request",
    "cycle_time",
    "disagreement",
    "exchange_bytes",
    "gather_bytes",
    "name_counter",
]

#: an idle job backs off to at most this many cycle times between negotiations
_IDLE_BACKOFF = 8


class Coordinator:
    """Matches named collectives across ranks and runs them, fused, over one Communicator."""

    def __init__(
        self,
        comm: Communicator,
        *,
        owns_communicator: bool = True,
        cycle_seconds: Optional[float] = None,
        threshold: Optional[int] = None,
        stall_timeout: Optional[float] = None,
        marks_cycles: bool = True,
    ) -> None:
        self.comm = comm
        self._marks_cycles = marks_cycles  # the job's own coordinator marks them; a process set's does not
        self.rank, self.size = comm.rank, comm.world_size
        self.cycle_seconds = cycle_time() if cycle_seconds is None else cycle_seconds
        self.negotiation = Negotiation(comm, settings.read("RS_TIMEOUT") if stall_timeout is None else stall_timeout)
        self.runner = Runner(comm, fusion_threshold() if threshold is None else threshold, self._take)
        self._owns = owns_communicator
        self._lock = threading.Lock()
        self._wake = threading.Event()  # cuts a cycle's wait short at shutdown
        self._new: List[Submission] = []  # submitted, not yet announced
        self._mine: Dict[str, Submission] = {}  # announced or queued, not yet launched, by name
        self._stopping = False
        self._join: Optional[Future] = None  # this rank's hvd.join(), until every rank has joined
        self._joining = False  # join() called, not yet announced
        self._ended: Optional[str] = None  # why no collective can run any more
        self._names: Dict[str, Callable[[], str]] = {}  # automatic names, by kind: this coordinator's own
        self._cycle = threading.Thread(target=self._run, name=f"rs-hvd-cycle-rank{self.rank}", daemon=True)
        self._cycle.start()

    def auto_name(self, kind: str) -> str:
        """The next automatic name for an unnamed collective of `kind` ("allreduce.noname.7"),
        counted per coordinator: a process set's, or a new session's, start again at 0."""
        with self._lock:
            counter = self._names.setdefault(kind, name_counter(kind))
        return counter()

    # -- submission (any thread) -----------------------------------------------------------
    def submit(
        self,
        request: Request,
        send: Optional[WireBuffer],
        out: Optional[WireBuffer],
        residual: Optional[np.ndarray] = None,
    ) -> Future:
        """Queue one named collective; the Future's value is `out`'s owner-free result: for
        allreduce and broadcast None (the result is in `out`), for allgather a new array.
        `residual`: see Submission."""
        mine = Submission(request, send, out, residual)
        with self._lock:
            if self._stopping:
                raise CollectiveError(
                    f"rank {self.rank}: {request.kind} of {request.name!r} cannot run: "
                    + (self._ended or "this rank has shut down")
                )
            if self._join is not None:
                raise ValueError(
                    f"rank {self.rank}: {request.kind} of {request.name!r} cannot start: this rank has "
                    "joined (hvd.join()) and takes part with zeros until every rank has"
                )
            if request.name in self._mine:
                raise ValueError(
                    f"rank {self.rank}: a collective named {request.name!r} is already in "
                    "flight; names must be unique among outstanding collectives"
                )
            self._mine[request.name] = mine
            self._new.append(mine)
        return mine.future

    def join(self) -> Future:
        """This rank has no more collectives to start: until every rank has joined, it adds
        zeros to the others' allreduces (their other collectives fail, as in Horovod). The
        Future's value is the rank that joined last, the same on every rank."""
        with self._lock:
            if self._stopping:
                raise CollectiveError(
                    f"rank {self.rank}: join cannot run: " + (self._ended or "this rank has shut down")
                )
            if self._join is not None:
                raise ValueError(f"rank {self.rank}: join() is already waiting for the other ranks")
            self._join = Future()
            self._joining = True
            return self._join

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop, with every other rank at its next cycle (as Horovod does): what is still
        pending then fails, naming the ranks that shut down."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self._cycle:
            self._cycle.join(timeout)

    close = shutdown  # a Coordinator closes like the Communicator under it

    @property
    def running(self) -> bool:
        """Whether collectives can still be submitted: False after shutdown() or once a failure
        ended the collectives."""
        return not self._stopping

    # -- the cycle thread --------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 1
        started = time.monotonic()
        try:
            while True:
                # Wait out the cycle first, so what is submitted during it is negotiated (and fused) together.
                pause = self.cycle_seconds * backoff - (time.monotonic() - started)
                if pause > 0:
                    self._wake.wait(pause)  # set only by shutdown()
                started = time.monotonic()
                busy, done = self._negotiate()
                if done:
                    break
                backoff = 1 if busy else min(backoff * 2, _IDLE_BACKOFF)
        except BaseException as exc:  # noqa: BLE001 - every waiter gets it
            error = (
                exc
                if isinstance(exc, CollectiveError)
                else CollectiveError(f"rank {self.rank}: negotiation failed: {exc!r}")
            )
            self._fail_all(error, f"an earlier collective failed: {error}")
        finally:
            self.runner.stop()
            if self._owns:
                self.comm.close()

    def _negotiate(self) -> Tuple[bool, bool]:
        """One cycle: (whether anything is pending or new anywhere, whether every rank is done)."""
        timeline = self.comm._engine.timeline
        if timeline is not None and timeline.mark_cycles and self._marks_cycles:
            timeline.mark("CYCLE_START")
        with self._lock:
            new, self._new = self._new, []
            stopping, joining, self._joining = self._stopping, self._joining, False
        cycle = self.negotiation.cycle([m.request for m in new], stopping, joining)
        self.runner.launch(cycle.ready)
        if cycle.joined is not None:
            with self._lock:
                done, self._join = self._join, None
            done.set_result(cycle.joined)
        for name, why in cycle.stale:
            self._fail_mine(name, CollectiveError(why))
        if cycle.leaving:  # as in Horovod, one rank shutting down ends the job's collectives
            self._fail_all(
                CollectiveError(f"rank {self.rank}: ranks {cycle.leaving} shut down before this collective completed"),
                f"ranks {cycle.leaving} have shut down",
            )
            return False, True
        return cycle.busy, False

    def _take(self, name: str) -> Optional[Submission]:
        with self._lock:
            return self._mine.pop(name, None)

    # -- failure -------------------------------------------------------------------------------
    def _fail_mine(self, name: str, exc: BaseException) -> None:
        with self._lock:
            mine = self._mine.pop(name, None)
        if mine is not None:
            mine.future.set_exception(exc)

    def _fail_all(self, exc: BaseException, ended: str) -> None:
        with self._lock:
            self._ended = self._ended or ended
            self._stopping = True
            victims = [m.future for m in self._mine.values()] + ([self._join] if self._join else [])
            self._mine.clear()
            self._new.clear()
            self._join = None
        self.negotiation.forget()
        for future in victims:
            if not future.done():
                future.set_exception(exc)
