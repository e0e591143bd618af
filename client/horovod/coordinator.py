"""The Horovod-style core: collectives matched across ranks by tensor name.

A Communicator needs every rank to issue the same collectives in the same order. Horovod does
not: each rank submits named tensors whenever they are ready (a backward pass may finish its
gradients in a different order on each rank), and a background cycle matches them by name. This
module does the same over the reducers.

Every HOROVOD_CYCLE_TIME milliseconds a background thread exchanges each rank's newly submitted
requests with every other rank: an all-reduce of a small table in which each rank fills its own
row (its payload's length, a stopping flag and, when they fit in 512 bytes, the requests
themselves; an integer sum with zeros elsewhere, so exact), and only for longer payloads a second
all-reduce of a byte buffer filled the same way. Every rank then holds the same table of
who asked for what, and computes the same list of names that every rank has asked for, in the
same order. Those run in that order; consecutive all-reduces of one dtype and op are fused into
one collective of up to the fusion threshold (HOROVOD_FUSION_THRESHOLD). A name whose kind, dtype,
shape, op or root differs across ranks fails on every rank with one message naming it and the
ranks; a name that some ranks submitted and others did not within RS_TIMEOUT fails naming both.

The cycle thread is the only thread that issues collectives on its Communicator (so every
rank's order is the agreed one); a second thread waits for them and completes the Futures, so a
large copy-out never delays the next negotiation.
"""
from __future__ import annotations

import json
import math
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from reduction_server.errors import CollectiveError
from reduction_server.log import get_logger
from reduction_server.protocol import DType, ReduceOp
from reduction_server.settings import DEFAULT_CYCLE_TIME_MS, DEFAULT_TIMEOUT, env_number

from ..buffers import WireBuffer, wire_view
from ..communicator import Communicator
from ..fusion import fusion_threshold
from ..timeline import Trace

log = get_logger("horovod")

#: an idle job backs off to at most this many cycle times between negotiations
_IDLE_BACKOFF = 8
#: request bytes a rank sends inside the per-cycle table (more take a second exchange)
_INLINE_BYTES = 512

ALLREDUCE, ALLGATHER, BROADCAST = "allreduce", "allgather", "broadcast"


def cycle_time(environ: Optional[Mapping[str, str]] = None) -> float:
    """Seconds between cycles: RS_CYCLE_TIME, else HOROVOD_CYCLE_TIME (both in ms), else 1 ms."""
    environ = os.environ if environ is None else environ
    for name in ("RS_CYCLE_TIME", "HOROVOD_CYCLE_TIME"):
        if environ.get(name, "").strip():
            return env_number(name, DEFAULT_CYCLE_TIME_MS, minimum=0.0, maximum=10_000.0, kind=float,
                              environ=environ) / 1000.0
    return DEFAULT_CYCLE_TIME_MS / 1000.0


@dataclass(frozen=True)
class Request:
    """What every rank learns about one rank's submission."""

    name: str
    kind: str
    dtype: DType
    shape: Tuple[int, ...]
    op: ReduceOp = ReduceOp.SUM
    root: int = 0
    type_name: str = ""  # the framework's name for the dtype (torch.bool travels as uint8)

    def encode(self) -> list:
        return [self.name, self.kind, int(self.dtype), list(self.shape), int(self.op), self.root, self.type_name]

    @classmethod
    def decode(cls, item: list) -> "Request":
        name, kind, dtype, shape, op, root, type_name = item
        return cls(name, kind, DType(dtype), tuple(shape), ReduceOp(op), root, type_name)

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        text = f"{self.kind} of {list(self.shape)} {self.type_name or self.dtype.name.lower()}"
        if self.kind == ALLREDUCE:
            text += f" op {self.op.name.lower()}"
        if self.kind == BROADCAST:
            text += f" from root {self.root}"
        return text


@dataclass
class _Mine:
    """This rank's side of a submission: its buffers and the Future its caller waits on."""

    request: Request
    send: Optional[WireBuffer]
    out: Optional[WireBuffer]
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class _Pending:
    """A name some ranks have submitted: every rank keeps the same table."""

    first_seen: float  # rank 0's clock, so every rank judges staleness alike
    requests: Dict[int, Request] = field(default_factory=dict)


def disagreement(name: str, requests: Mapping[int, Request]) -> Optional[str]:
    """None when every rank's request for `name` is compatible, else the message naming them."""
    first = requests[min(requests)]
    for what, key in (("kind", lambda r: r.kind), ("dtype", lambda r: r.type_name or r.dtype.name.lower()),
                      ("op", lambda r: r.op.name.lower() if r.kind == ALLREDUCE else ""),
                      ("root", lambda r: r.root if r.kind == BROADCAST else 0),
                      ("shape", lambda r: list(r.shape[1:]) if r.kind == ALLGATHER else list(r.shape)),
                      ("rank", lambda r: len(r.shape) if r.kind == ALLGATHER else 0)):
        values: Dict[str, List[int]] = {}
        for rank in sorted(requests):
            values.setdefault(str(key(requests[rank])), []).append(rank)
        if len(values) > 1:
            shown = "; ".join(f"ranks {ranks}: {value}" for value, ranks in values.items())
            what = "shape (beyond the first dimension)" if what == "shape" and first.kind == ALLGATHER else what
            what = "number of dimensions" if what == "rank" else what
            return f"tensor {name!r}: ranks disagree on its {what}: {shown}"
    return None


class Coordinator:
    """Matches named collectives across ranks and runs them, fused, over one Communicator."""

    def __init__(self, comm: Communicator, *, owns_communicator: bool = True,
                 cycle_seconds: Optional[float] = None, threshold: Optional[int] = None,
                 stall_timeout: Optional[float] = None) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.world_size
        self.cycle_seconds = cycle_time() if cycle_seconds is None else cycle_seconds
        self.threshold = fusion_threshold() if threshold is None else threshold
        self.stall_timeout = (env_number("RS_TIMEOUT", DEFAULT_TIMEOUT, minimum=0.01, kind=float)
                              if stall_timeout is None else stall_timeout)
        self._owns = owns_communicator
        self._timeline = comm._engine.timeline  # None unless RS_TIMELINE is set
        self._lock = threading.Lock()
        self._wake = threading.Event()  # cuts a cycle's wait short at shutdown
        self._new: List[_Mine] = []  # submitted, not yet announced
        self._mine: Dict[str, _Mine] = {}  # announced or queued, not yet launched, by name
        self._pending: Dict[str, _Pending] = {}  # the replicated table
        self._stopping = False
        self._failure: Optional[BaseException] = None  # what ended the negotiation, if it failed
        self._ended: Optional[str] = None  # why no collective can run any more
        self._spare: List[np.ndarray] = []  # fusion buffers, reused
        self._completions: "queue.SimpleQueue" = queue.SimpleQueue()
        self._cycle = threading.Thread(target=self._run, name=f"rs-hvd-cycle-rank{self.rank}", daemon=True)
        self._completer = threading.Thread(target=self._complete, name=f"rs-hvd-done-rank{self.rank}",
                                           daemon=True)
        self._completer.start()
        self._cycle.start()

    # -- submission (any thread) -----------------------------------------------------------
    def submit(self, request: Request, send: Optional[WireBuffer], out: Optional[WireBuffer]) -> Future:
        """Queue one named collective; the Future's value is `out`'s owner-free result: for
        allreduce and broadcast None (the result is in `out`), for allgather a new array."""
        mine = _Mine(request, send, out)
        with self._lock:
            if self._stopping:
                raise CollectiveError(f"rank {self.rank}: {request.kind} of {request.name!r} cannot run: "
                                      + (self._ended or "this rank has shut down"))
            if request.name in self._mine:
                raise ValueError(f"rank {self.rank}: a collective named {request.name!r} is already in "
                                 "flight; names must be unique among outstanding collectives")
            self._mine[request.name] = mine
            self._new.append(mine)
        return mine.future

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop, with every other rank at its next cycle (as Horovod does): what is still
        pending then fails, naming the ranks that shut down."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self._cycle:
            self._cycle.join(timeout)

    close = shutdown

    @property
    def failure(self) -> Optional[BaseException]:
        return self._failure

    @property
    def running(self) -> bool:
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
            error = exc if isinstance(exc, CollectiveError) else CollectiveError(
                f"rank {self.rank}: negotiation failed: {exc!r}")
            self._fail_all(error, f"an earlier collective failed: {error}")
            self._failure = error
        finally:
            self._completions.put(None)
            self._completer.join()
            if self._owns:
                self.comm.close()

    def _negotiate(self) -> Tuple[bool, bool]:
        """One cycle: (whether anything is pending or new anywhere, whether every rank is done)."""
        with self._lock:
            new, self._new = self._new, []
            stopping = self._stopping
        payload = json.dumps([m.request.encode() for m in new], separators=(",", ":")).encode() if new else b""
        # Each rank's row: payload length, stopping flag, rank 0's clock, and the payload itself when
        # it fits (a few requests): one collective per cycle, a second only for a longer payload.
        table = np.zeros((self.size, 3 + _INLINE_BYTES // 8), np.int64)
        table[self.rank, :3] = (len(payload), stopping, int(time.monotonic() * 1e6) if self.rank == 0 else 0)
        if len(payload) <= _INLINE_BYTES:
            table[self.rank, 3:].view(np.uint8)[:len(payload)] = np.frombuffer(payload, np.uint8)
        _sum(self.comm, table, traced=False)  # every cycle: kept off the timeline
        clock = table[0, 2] / 1e6
        lengths = table[:, 0]
        ready: List[Tuple[str, Dict[int, Request]]] = []
        if lengths.any():
            blobs = (exchange_bytes(self.comm, payload, lengths, traced=False) if lengths.max() > _INLINE_BYTES
                     else [row[3:].view(np.uint8)[:n].tobytes() for row, n in zip(table, lengths)])
            for r, blob in enumerate(blobs):
                for item in json.loads(blob) if blob else ():
                    self._arrived(r, Request.decode(item), clock, ready)
        self._launch(ready)
        self._expire(clock)
        if table[:, 1].any():  # as in Horovod, one rank shutting down ends the job's collectives
            leaving = [int(r) for r in np.flatnonzero(table[:, 1])]
            self._fail_all(CollectiveError(f"rank {self.rank}: ranks {leaving} shut down before this "
                                           "collective completed"), f"ranks {leaving} have shut down")
            return False, True
        return bool(ready or self._pending or lengths.any()), False

    def _arrived(self, rank: int, request: Request, clock: float,
                 ready: List[Tuple[str, Dict[int, Request]]]) -> None:
        pending = self._pending.setdefault(request.name, _Pending(clock))
        pending.requests[rank] = request
        if len(pending.requests) == self.size:
            ready.append((request.name, self._pending.pop(request.name).requests))

    def _expire(self, clock: float) -> None:
        """Fail names that some ranks submitted and others have not, for longer than the timeout."""
        for name, pending in list(self._pending.items()):
            if clock - pending.first_seen <= self.stall_timeout:
                continue
            del self._pending[name]
            have = sorted(pending.requests)
            lacking = [r for r in range(self.size) if r not in pending.requests]
            self._fail_mine(name, CollectiveError(
                f"rank {self.rank}: tensor {name!r} ({pending.requests[have[0]].describe()}) was submitted by "
                f"ranks {have} but not by ranks {lacking} within {self.stall_timeout:g} s (RS_TIMEOUT); "
                "every rank must submit every named collective"))

    # -- running what is ready -----------------------------------------------------------------
    def _launch(self, ready: List[Tuple[str, Dict[int, Request]]]) -> None:
        batch: List[_Mine] = []
        for name, requests in ready:
            problem = disagreement(name, requests)
            mine = self._take(name)
            if problem is not None:
                self._flush(batch)
                batch = []
                mine.future.set_exception(CollectiveError(f"rank {self.rank}: {problem}"))
                continue
            req = mine.request
            if req.kind == ALLREDUCE:
                if batch:
                    head = batch[0].request
                    fused_bytes = (sum(m.request.count for m in batch) + req.count) * req.dtype.itemsize
                    if (head.dtype, head.op) != (req.dtype, req.op) or fused_bytes > max(self.threshold, 1):
                        self._flush(batch)
                        batch = []
                batch.append(mine)
                continue
            self._flush(batch)
            batch = []
            if req.kind == BROADCAST:
                self._start([mine], mine.send, mine.out, ReduceOp.BROADCAST, req.root)
            else:
                self._allgather(mine, requests)
        self._flush(batch)

    def _take(self, name: str) -> _Mine:
        with self._lock:
            return self._mine.pop(name)

    def _flush(self, batch: List[_Mine]) -> None:
        """Start one all-reduce for a batch: in place for one tensor, through a fusion buffer for more."""
        if not batch:
            return
        req = batch[0].request
        if len(batch) == 1:
            self._start(batch, batch[0].send, batch[0].out, req.op, 0)
            return
        trace = self._trace(batch)
        size = req.dtype.itemsize
        total = sum(m.request.count for m in batch)
        fused = self._buffer(total * size)
        offset = 0
        copy_started = time.perf_counter()
        for m in batch:
            n = m.request.count * size
            fused[offset:offset + n] = m.send.data
            offset += n
        if trace is not None:
            trace.copied(copy_started)
        wire = WireBuffer(req.dtype, total, memoryview(fused[:total * size]))
        self._start(batch, wire, wire, req.op, 0, fused, trace=trace)

    def _allgather(self, mine: _Mine, requests: Dict[int, Request]) -> None:
        """Each rank's rows at its offset in a zero buffer, summed as bytes: exact for any dtype."""
        size = mine.request.dtype.itemsize
        counts = [requests[r].count * size for r in range(self.size)]
        offset = sum(counts[:self.rank])
        out = np.zeros(sum(counts), np.uint8)
        out[offset:offset + counts[self.rank]] = np.frombuffer(mine.send.data, np.uint8)
        rows = sum(requests[r].shape[0] if requests[r].shape else 1 for r in range(self.size))
        shape = (rows, *mine.request.shape[1:])
        mine.out = WireBuffer(mine.request.dtype, math.prod(shape), memoryview(out))
        wire = WireBuffer(DType.UINT8, len(out), memoryview(out))
        self._start([mine], wire, wire, ReduceOp.SUM, 0, result=(out, shape))

    def _trace(self, batch: List[_Mine]) -> Optional[Trace]:
        """The timeline record of a batch's collective, named after its tensors, begun now that
        negotiation has agreed on it; `negotiation_us` is how long its first tensor waited."""
        if self._timeline is None:
            return None
        waited = time.perf_counter() - min(m.submitted for m in batch)
        return self._timeline.begin_tensors(f"{batch[0].request.kind} ", [m.request.name for m in batch],
                                            {"negotiation_us": round(waited * 1e6)})

    def _start(self, batch: List[_Mine], send: Optional[WireBuffer], out: WireBuffer, op: ReduceOp, root: int,
               fused: Optional[np.ndarray] = None, result: Any = None, trace: Optional[Trace] = None) -> None:
        if trace is None and len(batch) == 1:
            trace = self._trace(batch)
        try:
            handle = self.comm._start(send if op is not ReduceOp.BROADCAST or self.rank == root else None,
                                      out, op, root, None, trace=trace)
        except BaseException as exc:  # noqa: BLE001 - e.g. the communicator has failed
            if trace is not None:
                self._timeline.finish(trace, str(exc))
            for m in batch:
                m.future.set_exception(exc)
            return
        self._completions.put((handle, batch, fused, result))

    def _buffer(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._spare):
                if len(buf) >= nbytes:
                    return self._spare.pop(i)
        return np.empty(max(nbytes, min(self.threshold, 64 << 20)), np.uint8)

    # -- the completing thread -------------------------------------------------------------------
    def _complete(self) -> None:
        while True:
            item = self._completions.get()
            if item is None:
                return
            handle, batch, fused, result = item
            try:
                handle.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the callers
                for m in batch:
                    m.future.set_exception(exc)
                continue
            if fused is not None:
                offset = 0
                for m in batch:
                    n = len(m.out.data)
                    m.out.data[:] = fused[offset:offset + n]
                    offset += n
                with self._lock:
                    self._spare.append(fused)
            for m in batch:
                if result is not None:
                    out, shape = result
                    m.future.set_result(out.view(m.request.dtype.storage).reshape(shape))
                else:
                    m.future.set_result(None)

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
            victims = list(self._mine.values())
            self._mine.clear()
            self._new.clear()
        self._pending.clear()
        for m in victims:
            if not m.future.done():
                m.future.set_exception(exc)


def _sum(comm: Communicator, array: np.ndarray, traced: bool = True) -> None:
    """In-place sum of `array` over every rank."""
    wire = wire_view(array, writable=True)
    comm._start(wire, wire, ReduceOp.SUM, 0, None, traced=traced).wait()


def exchange_bytes(comm: Communicator, payload: bytes, lengths: Sequence[int], traced: bool = True) -> List[bytes]:
    """Every rank's payload, given every rank's length: each rank fills its own slice of a zero
    buffer and the buffer is summed as bytes (exact: the other ranks add zeros)."""
    ends = np.cumsum(np.asarray(lengths, np.int64))
    buf = np.zeros(int(ends[-1]), np.uint8)
    start = int(ends[comm.rank]) - len(payload)
    buf[start:start + len(payload)] = np.frombuffer(payload, np.uint8)
    _sum(comm, buf, traced)
    raw = buf.tobytes()
    return [raw[int(e - n):int(e)] for e, n in zip(ends, lengths)]


def gather_bytes(comm: Communicator, payload: bytes) -> List[bytes]:
    """Every rank's payload, in rank order (two all-reduces; call on every rank in the same order)."""
    lengths = np.zeros(comm.world_size, np.int64)
    lengths[comm.rank] = len(payload)
    _sum(comm, lengths)
    return exchange_bytes(comm, payload, lengths) if lengths.any() else [b""] * comm.world_size


def name_counter(prefix: str) -> Callable[[], str]:
    """Horovod's automatic names ("allreduce.noname.7"): the same sequence on every rank that
    makes the same unnamed calls in the same order."""
    counter = iter(range(1 << 62))
    lock = threading.Lock()

    def next_name() -> str:
        with lock:
            return f"{prefix}.noname.{next(counter)}"
    return next_name


