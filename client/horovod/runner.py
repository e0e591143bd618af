"""Running what the negotiation agreed on: consecutive all-reduces of one dtype and op fused
into one collective of up to the fusion threshold, broadcasts and allgathers one by one, each
started on the cycle thread (so every rank's order is the agreed one) and completed on a thread
of its own, so a large copy-out never delays the next negotiation."""
from __future__ import annotations

import math
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from reduction_server.errors import CollectiveError
from reduction_server.protocol import DType, ReduceOp

from ..buffers import WireBuffer
from ..communicator import Communicator
from ..timeline import Trace
from .requests import ALLREDUCE, BROADCAST, Request, Submission, disagreement


class Runner:
    """Starts agreed collectives, fused, and completes their Futures."""

    def __init__(self, comm: Communicator, threshold: int, take: Callable[[str], Submission]) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.world_size
        self.threshold = threshold
        self._take_submission = take  # this rank's submission of an agreed name, no longer pending
        self._timeline = comm._engine.timeline  # None unless RS_TIMELINE is set
        self._lock = threading.Lock()
        self._spare: List[np.ndarray] = []  # fusion buffers, reused
        self._completions: "queue.SimpleQueue" = queue.SimpleQueue()
        self._completer = threading.Thread(target=self._complete, name=f"rs-hvd-done-rank{self.rank}",
                                           daemon=True)
        self._completer.start()

    def stop(self) -> None:
        """Complete what was started, then end the completing thread."""
        self._completions.put(None)
        self._completer.join()

    def launch(self, ready: List[Tuple[str, Dict[int, Request]]]) -> None:
        """Start one cycle's agreed names in their order: a name the ranks disagree on fails at
        once; consecutive all-reduces of one dtype and op are fused up to the threshold;
        broadcasts and allgathers run one by one."""
        batch: List[Submission] = []
        count = 0  # elements in batch, kept as it grows so that a cycle of N tensors costs O(N)
        for name, requests in ready:
            problem = disagreement(name, requests)
            mine = self._take_submission(name)
            if problem is not None:
                self._flush(batch, count)
                batch, count = [], 0
                mine.future.set_exception(CollectiveError(f"rank {self.rank}: {problem}"))
                continue
            req = mine.request
            if req.kind == ALLREDUCE:
                n = req.count
                if batch:
                    head = batch[0].request
                    fused_bytes = (count + n) * req.dtype.itemsize
                    if (head.dtype, head.op) != (req.dtype, req.op) or fused_bytes > max(self.threshold, 1):
                        self._flush(batch, count)
                        batch, count = [], 0
                batch.append(mine)
                count += n
                continue
            self._flush(batch, count)
            batch, count = [], 0
            if req.kind == BROADCAST:
                self._start([mine], mine.send, mine.out, ReduceOp.BROADCAST, req.root)
            else:
                self._allgather(mine, requests)
        self._flush(batch, count)

    def _flush(self, batch: List[Submission], total: int) -> None:
        """Start one all-reduce for a batch of `total` elements: in place for one tensor, through
        a fusion buffer for more."""
        if not batch:
            return
        req = batch[0].request
        if len(batch) == 1:
            self._start(batch, batch[0].send, batch[0].out, req.op, 0)
            return
        trace = self._trace(batch)
        size = req.dtype.itemsize
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

    def _allgather(self, mine: Submission, requests: Dict[int, Request]) -> None:
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

    def _trace(self, batch: List[Submission]) -> Optional[Trace]:
        """The timeline record of a batch's collective, named after its tensors, begun now that
        negotiation has agreed on it; `negotiation_us` is how long its first tensor waited."""
        if self._timeline is None:
            return None
        waited = time.perf_counter() - min(m.submitted for m in batch)
        return self._timeline.begin_tensors(f"{batch[0].request.kind} ", [m.request.name for m in batch],
                                            {"negotiation_us": round(waited * 1e6)})

    def _start(self, batch: List[Submission], send: Optional[WireBuffer], out: WireBuffer, op: ReduceOp, root: int,
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
