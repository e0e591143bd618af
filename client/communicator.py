"""The Communicator: NCCL's all-reduce model over R reducers.

Every rank creates one with the same reducers and world size and issues the same collectives in
the same order (as NCCL requires). A collective is cut into chunks (see chunking.py) that the
progress engine (engine.py) streams to the reducers and whose results it receives straight
into the output buffer.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from reduction_server.config.discovery import discover_worker
from reduction_server.wire.protocol import DType, ReduceOp

from . import compression as compressed
from .buffers import WireBuffer, empty_like, wire_view
from .chunking import plan, plan_chunks
from .engine import Collective, Engine
from .engine.options import EngineOptions
from .timeline import Trace

OpLike = Union[str, int, ReduceOp]


class Handle:
    """An all-reduce in progress: `wait()` returns its result, `done()` polls."""

    def __init__(self, future: Future, finish: Optional[Callable[[], None]] = None) -> None:
        self._future = future
        self._finish = finish  # a compressed result's decoding, done once by the first wait()
        self._lock = threading.Lock()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """The result; raises CollectiveError if the collective failed."""
        result = self._future.result(timeout)
        if self._finish is not None:
            with self._lock:
                if self._finish is not None:
                    self._finish()
                    self._finish = None
        return result

    def done(self) -> bool:
        """Whether the collective has finished (successfully or not)."""
        return self._future.done()


class Communicator:
    """One rank's view of the job: collectives over the reducers, NCCL-style.

    A Group (group.py) is a Communicator over some of the job's ranks, sharing this one's engine.

    Every rank makes one with the same reducers, world size and job, and issues the same
    collectives in the same order. `Communicator.from_env()` takes all of it from the environment
    (discovery.py); the settings left None come from their RS_* variables (README, settings.py).

    Args:
        reducers: the reducers' addresses, "host:port" (or "[ipv6]:port"), as a list or one
            comma-separated string; reducer i must be started with index i.
        rank: this rank, 0 <= rank < world_size.
        world_size: the number of ranks W.
        job_token: the job's shared secret (RS_JOB_TOKEN); each reducer must prove it before
            anything is sent to it, and this rank proves it back. "" for a job without one.
        job_id: the job's identity; None derives it from the token. Ranks of one job agree on it.
        generation: the job's generation; a newer one replaces an older one on the reducers.
        chunk_bytes: the largest chunk a collective is cut into (RS_CHUNK_BYTES); the same on
            every rank.
        window: chunks in flight per reducer (RS_WINDOW).
        pipeline_depth: chunks per reducer a collective is cut into at least (RS_PIPELINE_DEPTH);
            the same on every rank.
        timeout: seconds a collective may wait for its results (RS_TIMEOUT).
        connect_timeout: seconds to wait for every reducer to admit this rank (RS_CONNECT_TIMEOUT).
        io_threads: libzmq I/O threads (RS_IO_THREADS).
        encrypt: CurveZMQ on every connection, keys from the token (RS_ENCRYPT).
        integrity: a Poly1305 tag on every message, keys from the token (RS_INTEGRITY); no
            secrecy, at a fraction of encryption's cost (with encrypt, it adds nothing).
        shared_memory: offer shared-memory slots to reducers on this host (RS_SHM).
        send_buffer: the kernel send buffer of each connection: "auto" (each connection's from
            its round trip and delivery rate: reduction_server/wire/send_buffers.py), 0 for the kernel's
            autotuning, or bytes (RS_SNDBUF).
        failover: move a lost reducer's chunks to the reducers left, so that collectives
            complete (RS_FAILOVER, on by default); False: they fail naming it.
        spares: how many of the reducers, the last ones listed, are spares (RS_SPARE_REDUCERS):
            unused until a reducer is lost, then they take its chunks (with failover).
        run_id: this start of the job, the same on every rank and new at each start (None: the
            launcher's, discovery.run_id): a reducer takes a rank that says another run for a new
            run once the last one's ranks are gone, never for a late rank of the last.

    Raises:
        ConfigError: a setting is malformed or out of range (the message names it).
        CollectiveError: a reducer did not admit this rank within connect_timeout, or refused it.
    """

    #: the group its collectives run in (0: all of the job's ranks), and that group's ranks (None: all)
    group_id: int = 0
    ranks: Optional[Tuple[int, ...]] = None

    def __init__(
        self,
        reducers: Sequence[str],
        rank: int,
        world_size: int,
        *,
        job_token: Optional[str] = None,
        job_id: Optional[int] = None,
        generation: int = 0,
        chunk_bytes: Optional[int] = None,
        window: Optional[int] = None,
        pipeline_depth: Optional[int] = None,
        timeout: Optional[float] = None,
        connect_timeout: Optional[float] = None,
        io_threads: Optional[int] = None,
        encrypt: Optional[bool] = None,
        integrity: Optional[bool] = None,
        shared_memory: Optional[bool] = None,
        send_buffer: Union[int, str, None] = None,
        failover: Optional[bool] = None,
        spares: Optional[int] = None,
        run_id: Optional[str] = None,
    ) -> None:
        options = EngineOptions.resolve(
            reducers,
            rank,
            world_size,
            job_token=job_token,
            job_id=job_id,
            generation=generation,
            chunk_bytes=chunk_bytes,
            window=window,
            pipeline_depth=pipeline_depth,
            timeout=timeout,
            connect_timeout=connect_timeout,
            io_threads=io_threads,
            encrypt=encrypt,
            integrity=integrity,
            shared_memory=shared_memory,
            send_buffer=send_buffer,
            failover=failover,
            spares=spares,
            run=run_id,
        )
        # Every setting resolved and checked at once (engine/options.py); a Group copies these parts.
        self.rank, self.world_size, self.reducers = options.rank, options.world_size, options.reducers
        self.job_id, self.generation, self.run_id = options.job_id, options.generation, options.run_id
        self.chunk_bytes, self.pipeline_depth = options.chunk_bytes, options.pipeline_depth
        self._seq = itertools.count()
        self._submit_lock = threading.Lock()  # seq order == submission order
        self._engine = Engine(options)
        self._engine.start()
        self._buffers = compressed.Buffers()  # of compressed collectives (a Group shares its parent's)
        #: the reducers that size the chunk plan (RS_PIPELINE_DEPTH chunks each at least), and
        #: their shards, over which the chunks are spread (the spares' follow them): endpoints.py
        self.active_reducers = options.active_reducers
        self.active_endpoints = self._engine.active
        self._closed = False

    @classmethod
    def from_env(
        cls, environ: Optional[Mapping[str, str]] = None, *, incarnation: int = 0, **options: Any
    ) -> "Communicator":
        """Rank, world size, reducers and job identity from the environment (discovery.py).
        `incarnation`: how many communicators of this job each rank opened and closed before
        (Horovod's init after shutdown); each takes the next generation, so that the reducers
        never take its collectives for the previous one's."""
        place = discover_worker(environ)
        return cls(
            place.reducers,
            place.rank,
            place.world_size,
            job_token=place.job_token,
            job_id=place.job_id,
            generation=place.generation + incarnation,
            **options,
        )

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(
        self,
        x: Any,
        op: OpLike = "sum",
        out: Any = None,
        *,
        compression: compressed.CompressionLike = "none",
        residual: Any = None,
    ) -> Any:
        """Reduce x over all ranks; a new array (or `out`, which may be x itself)."""
        return self.all_reduce_async(x, op, out, compression=compression, residual=residual).wait()

    def all_reduce_async(
        self,
        x: Any,
        op: OpLike = "sum",
        out: Any = None,
        *,
        timeout: Optional[float] = None,
        compression: compressed.CompressionLike = "none",
        residual: Any = None,
    ) -> Handle:
        """all_reduce without waiting: a Handle whose wait() gives the result. x (and out) must
        not change until then; collectives complete in the order they were started. `timeout`:
        seconds it may take from this call before it fails, waiting to start included (None: the
        reducers' RS_TIMEOUT). `compression`: "none", "bf16", "fp16" or "int8" both ways, or a
        pair (up, down) such as ("int8", "none") (compression.py); every rank passes the same.
        `residual`: a float32 array of x's size that gets, before this returns, what compressing x
        lost (x minus what this rank sends), for error feedback (error_feedback.py)."""
        op = ReduceOp.parse(op)
        if op is ReduceOp.BROADCAST:
            raise ValueError("broadcast is not a reduction op; use broadcast()")
        src = wire_view(x, what="all_reduce input")
        result = empty_like(x) if out is None else out
        dst = wire_view(result, writable=True, what="all_reduce out")
        if (dst.dtype, dst.count) != (src.dtype, src.count):
            raise ValueError(f"out holds {dst.describe()} but the input holds {src.describe()}")
        how = compressed.parse(compression)
        lost = None if residual is None else compressed.residual_view(residual, src, how)
        if how is not None:
            compressed.check(how, src, op)
            if how.fmt is not None or how.up != src.dtype or lost is not None:  # else a 16-bit tensor goes as it is
                return self._start_compressed(how, src, dst, op, result, timeout, lost)
        return self._start(src, dst, op, 0, result, time_limit=timeout)

    def _start_compressed(
        self,
        how: compressed.Compression,
        src: WireBuffer,
        dst: WireBuffer,
        op: ReduceOp,
        result: Any,
        time_limit: Optional[float],
        lost: Optional[np.ndarray] = None,
    ) -> Handle:
        """A compressed all-reduce: src encoded (what that lost written into `lost`), its result
        received in the format down (straight into dst when that is dst's own type) and decoded
        into dst by the first wait(), which also gives its buffers back."""
        send = self._buffers.take(how.wire_bytes(how.up, src.count))
        values = compressed.as_float32(src)
        compressed.encode(how, values, how.up, send)
        if lost is not None:
            compressed.residual_into(how, values, send, lost)
        dtype = DType.FLOAT32 if how.fmt is not None else DType(how.up)  # int8 blocks describe float32
        received = None if how.down == dst.dtype else self._buffers.take(how.wire_bytes(how.down, dst.count))
        recv = dst.data if received is None else memoryview(received)

        def finish() -> None:
            if received is not None:
                compressed.decode_into(how, received, dst)
                self._buffers.give(received)
            self._buffers.give(send)

        wire_src = WireBuffer(dtype, src.count, memoryview(send))
        wire_dst = WireBuffer(dtype, dst.count, recv)
        return self._start(wire_src, wire_dst, op, 0, result, time_limit=time_limit, compression=how, finish=finish)

    def broadcast(self, x: Any, root: int = 0) -> Any:
        """Overwrite x on every rank with root's x; returns x."""
        return self.broadcast_async(x, root).wait()

    def broadcast_async(self, x: Any, root: int = 0, *, timeout: Optional[float] = None) -> Handle:
        """broadcast without waiting: a Handle whose wait() gives x once it holds root's value
        (`timeout` as for all_reduce_async)."""
        if not (isinstance(root, int) and 0 <= root < self.world_size):
            raise ValueError(f"broadcast root {root!r} is out of range for world size {self.world_size}")
        buf = wire_view(x, writable=True, what="broadcast buffer")
        return self._start(buf if self.rank == root else None, buf, ReduceOp.BROADCAST, root, x, time_limit=timeout)

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Return once every rank has entered the barrier; CollectiveError past `timeout` seconds
        (None: the reducers' RS_TIMEOUT)."""
        self.all_reduce_async(np.zeros(1, np.int32), timeout=timeout).wait()

    def _start(
        self,
        src: Optional[WireBuffer],
        dst: WireBuffer,
        op: ReduceOp,
        root: int,
        result: Any,
        trace: Optional[Trace] = None,
        traced: bool = True,
        time_limit: Optional[float] = None,
        compression: Optional[compressed.Compression] = None,
        finish: Optional[Callable[[], None]] = None,
    ) -> Handle:
        if self.ranks is not None and op is ReduceOp.BROADCAST:  # the wire names the root by its job rank
            root = self.ranks[root]
        if dst.count == 0:  # nothing to move; no rank sends anything, so seq stays in step
            if trace is not None:
                trace.timeline.finish(trace)  # frees its timeline row
            future: Future = Future()
            future.set_result(result)
            return Handle(future)
        # Every rank heard the same limit from the same reducers, so the plans still agree.
        fmt = compression.fmt if compression is not None else None
        itemsize = dst.dtype.itemsize if fmt is None else 1  # int8 blocks: about a byte an element
        limit = self._engine.max_chunk_bytes * itemsize // dst.dtype.accumulator.itemsize
        spans = plan_chunks(
            dst.count,
            itemsize,
            self.active_reducers,
            min(self.chunk_bytes, limit),
            self.pipeline_depth,
            block=compression.block if fmt is not None else 0,
        )
        with self._submit_lock:  # only what needs the seq: ranks must submit in one order
            seq = next(self._seq)
            chunks = plan(seq, spans, self.active_endpoints)
            coll = Collective(
                seq,
                dst.dtype,
                op,
                root,
                src.data if src else None,
                dst.data,
                dst.count,
                chunks,
                result,
                trace=trace,
                traced=traced,
                group=self.group_id,
                time_limit=time_limit,
                fmt=fmt,
                block=compression.block if fmt is not None else 0,
            )
            self._engine.submit(coll)
        return Handle(coll.future, finish)

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Fail what is still pending, say goodbye to the reducers, release the sockets."""
        if not self._closed:
            self._closed = True
            self._engine.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) is False:
            self.close()

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, reducers={list(self.reducers)})"
