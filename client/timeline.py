"""A worker's timeline: RS_TIMELINE=path writes its collectives as a Chrome trace (the Trace
Event Format that Horovod's timeline also uses), for chrome://tracing or ui.perfetto.dev.

One file per rank: `{rank}` in the path is replaced by the rank; a path without it gets
`.rank<N>` before its extension (timeline.json -> timeline.rank3.json), so ranks never
overwrite each other. Every communicator of one rank in a process writes to the same file.

Each collective is one complete ("X") event named after what it reduces (a fused bucket: its
tensors), on a row (tid) of its own while it runs, with its phases nested inside it, in order:
fusion (fused buckets only: from the bucket's first tensor to the end of copying its last; the
time spent copying is its `copy_us`), queue (submitted, waiting for earlier collectives' window
slots), send (first chunk sent to last chunk sent), wait (only when it lasted: everything sent,
no result yet) and receive (from then until the last result). Results that arrive while chunks
are still being sent fall in `send`: the phases never overlap.

Events are appended to the file, one flushed write per finished collective, as a JSON array.
When its last user lets go (the rank's last communicator closes, or hvd.stop_timeline()) and no
collective is still on it, the file gets its closing bracket and is closed; an atexit hook
brackets one still open, so a process that ends normally leaves a file that json.load reads. A
process that is killed leaves the array unterminated, which chrome://tracing and Perfetto still load.

With RS_TIMELINE unset nothing here runs: the engine checks one attribute per chunk.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from reduction_server.config import settings

_lock = threading.Lock()
_open: Dict[str, "Timeline"] = {}  # resolved path -> the timeline writing it


def timeline_path(template: str, rank: int) -> str:
    """The file rank `rank` writes for RS_TIMELINE=template."""
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    path = Path(template)
    return str(path.with_name(f"{path.stem}.rank{rank}{path.suffix}"))


def acquire(rank: int) -> Optional["Timeline"]:
    """The timeline for this rank if RS_TIMELINE is set (else None); release() it when done."""
    template = settings.read("RS_TIMELINE")
    return open_timeline(timeline_path(template, rank), rank) if template else None


def open_timeline(path: str, rank: int, mark_cycles: bool = False) -> "Timeline":
    """The timeline writing `path` (started if no one writes it yet); release() it when done.
    `mark_cycles`: Horovod's negotiation cycles are marked on it (CYCLE_START)."""
    path = os.path.abspath(path)
    with _lock:
        timeline = _open.get(path)
        if timeline is None or timeline.closed:
            timeline = _open[path] = Timeline(path, rank)
        timeline.users += 1
        timeline.released = False  # released but still finishing collectives: it goes on
        timeline.mark_cycles = mark_cycles
    return timeline


class Trace:
    """The timestamps (time.perf_counter()) of one collective, filled in as it progresses."""

    __slots__ = (
        "timeline",
        "name",
        "args",
        "lane",
        "start",
        "fusion_end",
        "submitted",
        "first_send",
        "last_send",
        "first_result",
        "copy_s",
        "negotiated",
    )

    def __init__(
        self, timeline: "Timeline", name: str, lane: int, start: float, args: Optional[Dict[str, Any]] = None
    ) -> None:
        self.timeline = timeline  # the file it is written to, though the engine may have moved on
        self.name = name
        self.args = args or {}
        self.lane = lane
        self.start = start
        self.fusion_end: Optional[float] = None
        self.submitted: Optional[float] = None
        self.first_send: Optional[float] = None
        self.last_send: Optional[float] = None
        self.first_result: Optional[float] = None
        self.copy_s = 0.0  # time spent copying tensors into the bucket (fusion)
        self.negotiated: Optional[tuple] = None  # Horovod's (NEGOTIATE_<KIND>, first submitted, agreed)

    def chunk_sent(self) -> None:
        """A chunk went out now: the first sets first_send, every one moves last_send."""
        now = time.perf_counter()
        if self.first_send is None:
            self.first_send = now
        self.last_send = now

    def copied(self, started: float) -> None:
        """A tensor was copied into the bucket from `started` (perf_counter) until now."""
        now = self.fusion_end = time.perf_counter()
        self.copy_s += now - started

    def chunk_answered(self) -> None:
        """A chunk's answer arrived now: the first sets first_result."""
        if self.first_result is None:
            self.first_result = time.perf_counter()


class Timeline:
    """One rank's trace file."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        self.users = 0
        self.released = False  # its last user is gone: a new start writes a new file
        self.mark_cycles = False
        self._lock = threading.Lock()
        self._lanes: List[bool] = []  # busy flags: a collective holds its row while it runs
        # Timestamps: microseconds of wall-clock time, advanced by the monotonic counter, so the
        # files of several ranks on one host line up and each file's clock never goes back.
        self._wall0 = float(time.time_ns() // 1000)
        self._perf0 = time.perf_counter()
        self._file = open(path, "wb")
        self._end: Optional[int] = None  # file offset of the closing bracket, once written
        self._count = 0
        self._write(
            [
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": rank,
                    "tid": 0,
                    "args": {"name": f"rank {rank}", "start_time_since_epoch_in_micros": self._wall0},
                },
                {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
            ]
        )
        atexit.register(self._complete)

    # -- collectives -------------------------------------------------------------------------
    def begin(self, name: str, args: Optional[Dict[str, Any]] = None) -> Trace:
        """A collective (or a bucket being filled) starts now."""
        with self._lock:
            lane = next((i for i, busy in enumerate(self._lanes) if not busy), len(self._lanes))
            if lane == len(self._lanes):
                self._lanes.append(True)
                self._write(
                    [
                        {
                            "name": "thread_name",
                            "ph": "M",
                            "pid": self.rank,
                            "tid": lane + 1,
                            "args": {"name": f"collectives {lane}"},
                        }
                    ]
                )
            self._lanes[lane] = True
        # After taking the row: the collective that held it before has finished by now.
        return Trace(self, name, lane, time.perf_counter(), args)

    def begin_tensors(self, prefix: str, names: List[str], args: Dict[str, Any]) -> Trace:
        """begin() for a collective of named tensors: named after the first three, all in its args."""
        shown = ", ".join(names[:3]) + (f" +{len(names) - 3}" if len(names) > 3 else "")
        return self.begin(f"{prefix}{shown}", {**args, "tensors": names})

    def submitted(self, trace: Optional[Trace], name: str, args: Dict[str, Any]) -> Trace:
        """A collective (`name`, `args`) was handed to the engine; its trace is its bucket's
        (fusion), or a new one."""
        if trace is None:
            trace = self.begin(name, args)
        else:
            trace.args.update(args)
        trace.submitted = time.perf_counter()
        return trace

    def finish(self, trace: Trace, error: Optional[str] = None) -> None:
        """Write the collective's events and free its row."""
        done = time.perf_counter()
        tid = trace.lane + 1
        args = dict(trace.args, status="failed" if error else "ok")
        if error:
            args["error"] = error
        events = [self._event(trace.name, "collective", trace.start, done, tid, args)]
        if trace.negotiated is not None:
            label, asked, agreed = trace.negotiated
            events.append(self._event(label, "phase", asked, agreed, tid, {}))
        phases = [
            ("fusion", trace.start if trace.fusion_end is not None else None, trace.fusion_end),
            ("queue", trace.submitted, trace.first_send),
            ("send", trace.first_send, trace.last_send),
        ]
        if trace.last_send is not None:
            receiving = max(trace.last_send, trace.first_result) if trace.first_result is not None else done
            if receiving > trace.last_send:  # results started only after the last chunk went out
                phases.append(("wait", trace.last_send, receiving))
            phases.append(("receive", receiving, done))
        for phase, begin, end in phases:
            if begin is not None and end is not None:
                extra = {"copy_us": round(trace.copy_s * 1e6, 1)} if phase == "fusion" else {}
                events.append(self._event(phase, "phase", begin, min(end, done), tid, extra))
        with self._lock:
            self._lanes[trace.lane] = False
            self._write(events)
        self._settle()

    def mark(self, name: str) -> None:
        """An instant event now (Horovod's CYCLE_START)."""
        with self._lock:
            self._write(
                [{"name": name, "ph": "i", "s": "p", "pid": self.rank, "tid": 0, "ts": self._us(time.perf_counter())}]
            )

    # -- the file --------------------------------------------------------------------------
    def _event(self, name: str, cat: str, begin: float, end: float, tid: int, args: Dict[str, Any]) -> dict:
        # Both ends through one conversion: phases that share a boundary share it exactly.
        ts, until = self._us(begin), self._us(max(begin, end))
        return {
            "name": name,
            "cat": cat,
            "ph": "X",
            "pid": self.rank,
            "tid": tid,
            "ts": ts,
            "dur": until - ts,
            "args": args,
        }

    def _us(self, t: float) -> float:
        """perf_counter time t in the file's clock: microseconds since the epoch (a monotone map)."""
        return self._wall0 + (t - self._perf0) * 1e6

    def _write(self, events: List[dict]) -> None:
        """Append events (with the lock held), reopening the array if it was closed."""
        if self._file.closed:
            return  # the process is exiting
        if self._end is not None:
            self._file.seek(self._end)
            self._file.truncate()
            self._end = None
        parts = []
        for e in events:
            parts.append(("[\n" if self._count == 0 else ",\n") + json.dumps(e, separators=(",", ":")))
            self._count += 1
        self._file.write("".join(parts).encode())
        self._file.flush()  # a killed process leaves whole events behind

    def release(self) -> None:
        """One user (communicator) is done; the last one completes the file."""
        with _lock:
            self.users -= 1
            if self.users > 0:
                return
            self.released = True
        self._settle()

    @property
    def closed(self) -> bool:
        """Whether its file is complete and closed (a later start writes the path anew)."""
        return self._file.closed

    def _settle(self) -> None:
        """Once released and no collective is still on it: complete the file and close it."""
        with _lock, self._lock:
            if not self.released or any(self._lanes) or self._file.closed:
                return
            self._terminate()
            self._file.close()
        atexit.unregister(self._complete)

    def _complete(self) -> None:
        """Terminate the array so the file is valid JSON as it stands (later events reopen it)."""
        with self._lock:
            self._terminate()

    def _terminate(self) -> None:
        """_complete() with the lock held."""
        if self._file.closed or self._end is not None:
            return
        self._end = self._file.tell()
        self._file.write(b"\n]\n")
        self._file.flush()
