"""The results a worker keeps for failover: each group's last results from each endpoint (a
reducer's shard, endpoints.py), and those it brought to a substitute (failover.py says why a rank
must keep them).

A result that came back through shared memory stays in its slot (its own, or the reducer's
result slot), lent out until it is kept no longer (slots.py); a large one that came as a frame is
the message libzmq received (results.py). Any other is a view of the collective's own buffer while
the collective is in flight, which nobody else writes then; only those still kept when the
collective ends are copied out of it, before its caller gets the buffer back. A large collective's
earlier chunks are no longer kept by then, so most of its result is never copied
(bench/RESULTS.md, "Failover: what keeping results costs").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Tuple, Union

import numpy as np

from reduction_server.wire import protocol
from reduction_server.wire.protocol import MSG_FINAL

from .collective import Collective
from .identity import Identity
from .slots import Lease


@dataclass
class Kept:
    """A chunk's result as this rank received it, and what its FINAL header says of the chunk."""

    group: int
    seq: int
    chunk: int
    nchunks: int
    dtype: int
    op: int
    root: int
    offset: int
    count: int
    total: int
    #: a buffer of its own, of at least count x itemsize bytes (one is reused for a smaller chunk);
    #: its shared-memory slot (`lease`) or received message; while its collective is in flight, a
    #: view of the result in the collective's buffer; None once kept no longer
    data: Union[bytearray, memoryview, None]
    endpoint: int = 0  # the endpoint that answered it (or, once brought as a FINAL, the one it went to)
    lease: Optional[Lease] = None  # the slot it stays in, if any
    nbytes: int = 0  # the result's size in bytes (its buffer may be larger)

    def final_header(self, me: Identity) -> bytes:
        """The FINAL that brings this result to the chunk's new endpoint."""
        return protocol.data_header(
            MSG_FINAL,
            dtype=self.dtype,
            op=self.op,
            rank=me.rank,
            world=me.world,
            job=me.job,
            generation=me.generation,
            seq=self.seq,
            chunk=self.chunk,
            nchunks=self.nchunks,
            offset=self.offset,
            count=self.count,
            total=self.total,
            nbytes=self.nbytes,
            aux=self.root,
            group=self.group,
        )


#: where a result is besides its collective's buffer, if anywhere: the shared-memory slot it came
#: back in, lent out, or the memory of the message it came in
Held = Union[Lease, memoryview, None]

Key = Tuple[int, int]  # (group, endpoint)


class KeptResults:
    """The results a rank keeps, by (group, endpoint), and the spare buffers of those it no
    longer keeps."""

    def __init__(self, window: int, num_endpoints: int) -> None:
        self.window = window
        self.num_endpoints = num_endpoints
        self.kept: Dict[Key, Deque[Kept]] = {}  # (group, endpoint) -> its last results here
        # (group, endpoint) -> results brought there as FINAL: kept for the generation, since a rank
        # that lacks one is not bounded by any window there (a substitute lost in turn needs them again)
        self.brought: Dict[Key, List[Kept]] = {}
        self.spare: List[bytearray] = []  # buffers of results no longer kept

    def keep(self, coll: Collective, k: int, e: int, held: Held, depth: int) -> None:
        """Chunk k of coll was answered by endpoint e: keep its result where it is `held`, or as a
        view of coll's buffer until coll ends; `depth` results of the group on e at most."""
        offset, count, _ = coll.chunks[k]
        where = coll.recv_span(offset, count)
        lease = held if isinstance(held, Lease) else None
        data = lease.view if lease is not None else held
        if data is None:
            data = coll.recv[where]
        item = Kept(
            coll.group,
            coll.seq,
            k,
            len(coll.chunks),
            coll.code,
            coll.op,
            coll.root,
            offset,
            count,
            coll.total,
            data,
            e,
            lease,
            where.stop - where.start,
        )
        if held is None:
            coll.kept.append(item)
        ring = self.kept.get((item.group, item.endpoint))
        if ring is None:
            ring = self.kept[item.group, item.endpoint] = deque()
        ring.append(item)
        while len(ring) > depth:
            self._discard(ring.popleft())

    def settle(self, coll: Collective) -> None:
        """coll ends, completed or failed, and its caller gets its buffer back: the results of
        it still kept (or queued as FINALs) are copied out of it now."""
        for item in coll.kept:
            if isinstance(item.data, memoryview):
                self._copy(item)
        coll.kept.clear()

    def take(self, e: int) -> List[Kept]:
        """Endpoint e is lost: every result kept from it or brought to it, to bring on, each in a
        buffer of its own (a slot's view would keep its whole segment mapped for the generation)."""
        taken = []
        for store in (self.kept, self.brought):
            for key in [key for key in store if key[1] == e]:
                taken.extend(store.pop(key))
        for item in taken:
            if item.lease is not None:
                self._copy(item)
                item.lease.end()
                item.lease = None
        return taken

    def brought_past(self, e: int, boundaries: Dict[int, int]) -> List[Kept]:
        """Endpoint e drains from these boundaries (a group not named: from its first
        collective): the results brought to it at or past them, to bring on elsewhere."""
        taken = []
        for key in [key for key in self.brought if key[1] == e]:
            group, items = key[0], self.brought[key]
            boundary = boundaries.get(group, 0)
            taken += [item for item in items if item.seq >= boundary]
            items[:] = [item for item in items if item.seq < boundary]
        return taken

    def drop(self, e: int) -> None:
        """Endpoint e drained: every rank has its results, none is kept of it any more."""
        self._forget(lambda key: key[1] == e)

    def brought_to(self, item: Kept, e: int) -> None:
        """item went to endpoint e as a FINAL: kept there from now on, since e may be lost in turn."""
        item.endpoint = e
        self.brought.setdefault((item.group, e), []).append(item)

    def forget_group(self, group: int) -> None:
        """A closed group's results are kept no longer."""
        self._forget(lambda key: key[0] == group)

    def close(self) -> None:
        """Keep nothing any more, so that no view holds a shared-memory segment mapped once its
        connection is closed."""
        self._forget(lambda key: True)

    def _forget(self, which: Callable[[Key], bool]) -> None:
        """Keep no longer the results of the (group, endpoint) keys `which` picks."""
        for store in (self.kept, self.brought):
            for key in [key for key in store if which(key)]:
                for item in store.pop(key):
                    self._discard(item)

    def _copy(self, item: Kept) -> None:
        """item's result into a buffer of its own, which it keeps from now on."""
        data = self._buffer(item.nbytes)
        # NumPy copies without the GIL: the training thread runs on meanwhile.
        np.copyto(np.frombuffer(data, np.uint8, item.nbytes), np.frombuffer(item.data, np.uint8, item.nbytes))
        item.data = data

    def _discard(self, item: Kept) -> None:
        """item is kept no longer: its slot is free again, its own buffer spare (as many as a
        collective's end may copy with one group in use, a window per endpoint), a view let go."""
        if item.lease is not None:
            item.lease.end()
            item.lease = None
        elif isinstance(item.data, bytearray):
            self.spare.append(item.data)
            del self.spare[: -self.window * self.num_endpoints]
        item.data = None

    def _buffer(self, nbytes: int) -> bytearray:
        for i, data in enumerate(self.spare):
            if len(data) >= nbytes:
                return self.spare.pop(i)
        return bytearray(nbytes)
