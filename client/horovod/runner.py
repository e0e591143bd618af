"""Running what the negotiation agreed on: consecutive reductions (allreduce, reducescatter) of
one dtype and op fused into one collective of up to the fusion threshold, the other kinds one by
one (allgather and alltoall as in gathering.py; a barrier needs no data), each
started on the cycle thread (so every rank's order is the agreed one) and completed on a thread
of its own, so a large copy-out never delays the next negotiation."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from reduction_server.wire.protocol import DType, ReduceOp

from ..buffers import WireBuffer
from ..communicator import Communicator
from ..timeline import Trace
from . import gathering
from .exceptions import MismatchError
from .requests import ALLREDUCE, BARRIER, BROADCAST, REDUCING, Request, Submission, disagreement


class Runner:
    """Starts agreed collectives, fused, and completes their Futures."""

    def __init__(self, comm: Communicator, threshold: int, take: Callable[[str], Optional[Submission]]) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.world_size
        self.threshold = threshold
        self._take_submission = take  # this rank's submission of an agreed name (None: it joined instead)
        self._lock = threading.Lock()
        self._spare: List[np.ndarray] = []  # fusion buffers, reused
        self._completions: "queue.SimpleQueue" = queue.SimpleQueue()
        self._completer = threading.Thread(target=self._complete, name=f"rs-hvd-done-rank{self.rank}", daemon=True)
        self._completer.start()

    def stop(self) -> None:
        """Complete what was started, then end the completing thread."""
        self._completions.put(None)
        self._completer.join()

    def launch(self, ready: List[Tuple[str, Dict[int, Request]]]) -> None:
        """Start one cycle's agreed names in their order: a name the ranks disagree on fails at
        once; consecutive reductions of one dtype and op are fused up to the threshold; the
        other kinds run one by one. A rank that has joined and did not ask for a name takes
        part in an allreduce with zeros; the other kinds fail on every rank while some have
        joined, as in Horovod."""
        batch: List[Submission] = []
        count = 0  # elements in batch, kept as it grows so that a cycle of N tensors costs O(N)
        for name, asked in ready:
            problem = disagreement(name, asked)
            template = asked[min(asked)]
            joined = [r for r in range(self.size) if r not in asked]
            if problem is None and joined and template.kind not in (ALLREDUCE, BARRIER):
                problem = (
                    f"tensor {name!r}: {template.kind} is not supported with join (ranks {joined} have joined "
                    "and wait for the others): only allreduce and barrier are, as in Horovod"
                )
            # A joined rank stands in even for a name it has submitted since: that one is announced later.
            mine = (self._take_submission(name) if self.rank in asked else None) or self._stand_in(template)
            if problem is not None:
                self._flush(batch, count)
                batch, count = [], 0
                mine.future.set_exception(MismatchError(f"rank {self.rank}: {problem}"))
                continue
            req = mine.request
            if req.kind in REDUCING:
                n = req.count
                if batch:
                    head = batch[0].request
                    fused_bytes = (count + n) * req.dtype.itemsize
                    same = (head.dtype, head.op, head.compression) == (req.dtype, req.op, req.compression)
                    if not same or fused_bytes > max(self.threshold, 1):
                        self._flush(batch, count)
                        batch, count = [], 0
                batch.append(mine)
                count += n
                continue
            self._flush(batch, count)
            batch, count = [], 0
            if req.kind == BROADCAST:
                self._start([mine], mine.send, mine.out, ReduceOp.BROADCAST, req.root)
            elif req.kind == BARRIER:  # agreed on means every rank has reached it; done after what came before
                self._completions.put((None, [mine], None, None))
            else:
                buf, finish = gathering.plan(req, mine.send.data, asked, self.rank)
                wire = WireBuffer(DType.UINT8, len(buf), memoryview(buf))
                self._start([mine], wire, wire, ReduceOp.SUM, 0, result=finish)
        self._flush(batch, count)

    @staticmethod
    def _stand_in(template: Request) -> Submission:
        """What this rank, joined, contributes to a name it did not ask for: zeros, into a
        buffer of its own."""
        zeros = np.zeros(template.count, template.dtype.storage)
        wire = WireBuffer(template.dtype, template.count, memoryview(zeros).cast("B"))
        return Submission(template, wire, wire)

    def _flush(self, batch: List[Submission], total: int) -> None:
        """Start one all-reduce for a batch of `total` elements: in place for one tensor, through
        a fusion buffer for more."""
        if not batch:
            return
        req = batch[0].request
        if len(batch) == 1:
            mine = batch[0]
            self._start(batch, mine.send, mine.out, req.op, 0, compression=req.compression, residual=mine.residual)
            return
        trace = None if req.compression else self._trace(batch)
        size = req.dtype.itemsize
        fused = self._buffer(total * size)
        offset = 0
        copy_started = time.perf_counter()
        for m in batch:
            n = m.request.count * size
            fused[offset : offset + n] = m.send.data
            offset += n
        if trace is not None:
            trace.copied(copy_started)
        wire = WireBuffer(req.dtype, total, memoryview(fused[: total * size]))
        residual = np.zeros(total, np.float32) if any(m.residual is not None for m in batch) else None
        self._start(batch, wire, wire, req.op, 0, fused, trace=trace, compression=req.compression, residual=residual)
        if residual is not None:  # written before the start returned: each tensor's part
            offset = 0
            for m in batch:
                if m.residual is not None:
                    m.residual[:] = residual[offset : offset + m.request.count]
                offset += m.request.count

    def _trace(self, batch: List[Submission]) -> Optional[Trace]:
        """The timeline record of a batch's collective, named after its tensors as Horovod names
        them ("allreduce.<name>"), begun now that negotiation has agreed on it; its negotiation
        (NEGOTIATE_ALLREDUCE, ...) spans from its first tensor's submission until now."""
        timeline = self.comm._engine.timeline  # None unless RS_TIMELINE is set or hvd.start_timeline() ran
        if timeline is None:
            return None
        asked, now = min(m.submitted for m in batch), time.perf_counter()
        trace = timeline.begin_tensors(
            "", [f"{m.request.kind}.{m.request.name}" for m in batch], {"negotiation_us": round((now - asked) * 1e6)}
        )
        trace.negotiated = (f"NEGOTIATE_{batch[0].request.kind.upper()}", asked, now)
        return trace

    def _start(
        self,
        batch: List[Submission],
        send: Optional[WireBuffer],
        out: WireBuffer,
        op: ReduceOp,
        root: int,
        fused: Optional[np.ndarray] = None,
        result: Optional[Callable[[], Any]] = None,
        trace: Optional[Trace] = None,
        compression: str = "",
        residual: Optional[np.ndarray] = None,
    ) -> None:
        """Start one collective for `batch`; its Futures get `result()` (None without it) once
        done. With `compression`, an all-reduce in that format (not on the timeline), what
        compressing lost written into `residual` before this returns."""
        if trace is None and len(batch) == 1 and not compression:
            trace = self._trace(batch)
        try:
            if compression:
                handle = self.comm.all_reduce_async(send, op, out, compression=compression, residual=residual)
            else:
                handle = self.comm._start(
                    send if op is not ReduceOp.BROADCAST or self.rank == root else None,
                    out,
                    op,
                    root,
                    None,
                    trace=trace,
                )
        except BaseException as exc:  # noqa: BLE001 - e.g. the communicator has failed
            if trace is not None:
                trace.timeline.finish(trace, str(exc))
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

    def _complete(self) -> None:
        while True:
            item = self._completions.get()
            if item is None:
                return
            handle, batch, fused, result = item
            try:
                if handle is not None:  # None: a barrier, done once what was started before it is
                    handle.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the callers
                for m in batch:
                    m.future.set_exception(exc)
                continue
            if fused is not None:
                offset = 0
                for m in batch:
                    n = len(m.out.data)
                    m.out.data[:] = fused[offset : offset + n]
                    offset += n
                with self._lock:
                    self._spare.append(fused)
            value = None if result is None else result()
            for m in batch:
                m.future.set_result(value)
