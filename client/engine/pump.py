"""The chunk pump: each group's chunks go out in its order, never more than `window` of a group
unanswered per endpoint (a reducer's shard, endpoints.py).

Every rank of a group sends the group's same sequence (collective by collective, chunk by chunk),
so every key a rank waits for is one that all the group's ranks reach: the window cannot
deadlock, and sending, summing and receiving overlap across endpoints and across consecutive
collectives. Groups have windows of their own, so that ranks may use groups in different orders
(a send/recv ring: each rank's receive waits for a send in another group). Each chunk is sent
without a copy from the user's buffer, or through a shared-memory slot (slots.py). With
RS_INTEGRITY each message's tag frame (wire/integrity.py) follows it, made before it is queued.
"""

from __future__ import annotations

import time
from typing import Deque, List, Optional

import zmq

from reduction_server.wire import protocol
from reduction_server.wire.integrity import Channel
from reduction_server.wire.protocol import MSG_DATA, MSG_DATA_SHM, MSG_MOVED, OP_BROADCAST

from .collective import SENT, Collective
from .connections import Connections
from .failover import Failover
from .identity import Identity
from .kept import Kept
from .ledger import Ledger
from .slots import Slots

# Chunks go through pyzmq's backend send: its Python wrapper adds only draft-API options (~0.5 us a frame).
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
_backend_send = zmq.backend.Socket.send


def _send(sock: zmq.Socket, tags: Optional[Channel], header: bytes, payload=None, copy: bool = False) -> None:
    """One message (a header, a payload unless None) without blocking, its tag frame after it
    when the connection has tags (`tags`); zmq.Again if the connection is gone."""
    if payload is None:
        parts = (header,)
        _backend_send(sock, header, _NOBLOCK if tags is None else _NOBLOCK | _SNDMORE)
    else:
        parts = (header, payload)
        _backend_send(sock, header, _NOBLOCK | _SNDMORE)
        # a message's parts go out together
        _backend_send(sock, payload, _NOBLOCK if tags is None else _NOBLOCK | _SNDMORE, copy)
    if tags is not None:
        _backend_send(sock, tags.seal(parts), _NOBLOCK)


class Pump:
    """Sends the ledger's collectives' chunks as their endpoints' windows allow."""

    def __init__(
        self, me: Identity, ledger: Ledger, connections: Connections, slots: Slots, failover: Failover, window: int
    ) -> None:
        self.me = me
        self.ledger = ledger
        self.connections = connections
        self.slots = slots
        self.failover = failover
        self.window = window

    def run(self) -> None:
        """Send what a lost endpoint left first, then chunks in each group's order until one's
        endpoint has a full window for that group: a group that waits holds back only its own
        later collectives."""
        if self.failover.resend:
            self._resend()
        sending = self.ledger.sending
        for group, queue in list(sending.items()):
            self._run_group(queue, self.ledger.window(group))
            if not queue:
                del sending[group]

    def _run_group(self, queue: Deque[Collective], inflight: List[int]) -> None:
        while queue:
            coll = queue[0]
            if self.connections.down and coll.next == 0 and not self._startable(coll):
                if queue and queue[0] is coll:
                    return  # it waits for a lost endpoint to come back
                continue  # it failed and left the queue
            while coll.next < len(coll.chunks):
                k = coll.next
                e = coll.chunks[k].reducer
                if inflight[e] >= self.window:
                    return
                if not self._send_chunk(coll, k, e, inflight):
                    # Its socket has no connection left (and never makes another): the endpoint is
                    # gone, though its monitor has not said so yet. This fails coll, among others.
                    return self.connections.lose(e, "its connection closed; reconnecting", reconnect=True)
                coll.next += 1
            queue.popleft()

    def _resend(self) -> None:
        """Chunks a lost endpoint had not answered (MOVED) and results it had given this rank
        (FINAL), each to its chunk's endpoint now, outside the window: they are few (a window of
        each group, and what earlier losses moved there), and the collectives in flight wait
        for them."""
        failover = self.failover
        while failover.resend:
            item = failover.resend.popleft()
            if isinstance(item, Kept):
                e = failover.bring(item)
                if e is None:
                    continue  # every endpoint is lost: nobody can ask for it
                if self._send_final(item, e):
                    failover.finals += 1
                    continue
            else:
                coll, k = item
                if not failover.still_owed(coll, k):
                    continue
                e = coll.chunks[k].reducer
                if self._send_chunk(coll, k, e, self.ledger.window(coll.group)):
                    continue
                failover.resend.appendleft(item)
            # Gone too: its chunks, this one among them, move on again.
            return self.connections.lose(e, "its connection closed; reconnecting", reconnect=True)

    def _send_final(self, item: Kept, e: int) -> bool:
        """A kept result to endpoint e as a FINAL; False if its connection is gone."""
        sock = self.connections.sockets[e]
        try:
            # Copied: the kept buffer may hold another result before libzmq sends this one.
            _send(
                sock,
                self.connections.tags_out[e],
                item.final_header(self.me),
                memoryview(item.data)[: item.nbytes],
                True,
            )
        except zmq.Again:
            return False
        return True

    def _startable(self, coll: Collective) -> bool:
        """Whether coll can start now; False: it waits for a lost endpoint (or has just failed)."""
        down = self.connections.down
        waiting = [e for e in coll.endpoints if e in down]
        if not waiting:
            return True
        now = time.monotonic()
        if coll.blocked_since is None:
            coll.blocked_since = now
        final = [e for e in waiting if not down[e][1]]
        if final or now - coll.blocked_since >= self.connections.liveness:
            e = min(final or waiting)
            reason = down[e][0]
            if not final:
                reason += f"; it did not come back within {self.connections.liveness:g} s (RS_LIVENESS_TIMEOUT)"
            self.ledger.give_up(coll, reason)
        return False

    def _send_chunk(self, coll: Collective, k: int, e: int, inflight: List[int]) -> bool:
        """Send chunk k of coll to endpoint e; False if its connection is gone."""
        offset, count, _ = coll.chunks[k]
        payload = coll.send[coll.send_span(offset, count)] if coll.send is not None else None
        nbytes = len(payload) if payload is not None else 0
        slot = None
        moved = coll.moved[k]
        # A moved or compressed chunk goes as a frame (docs/protocol.md)
        if payload is not None and coll.op is not OP_BROADCAST and not moved and coll.fmt is None:
            slot = self.slots.take(e, nbytes)
        mtype = MSG_MOVED if moved else MSG_DATA if slot is None else MSG_DATA_SHM
        header = protocol.data_header(
            mtype,
            dtype=coll.code,
            op=coll.op,
            rank=self.me.rank,
            world=self.me.world,
            job=self.me.job,
            generation=self.me.generation,
            seq=coll.seq,
            chunk=k,
            nchunks=len(coll.chunks),
            offset=offset,
            count=count,
            total=coll.total,
            nbytes=nbytes,
            aux=coll.root if slot is None else slot,
            group=coll.group,
        )
        if slot is not None:
            self.slots.view(e, slot, nbytes)[:] = payload
        sock = self.connections.sockets[e]
        try:  # windows of chunks stay far below libzmq's queue: only a lost connection says Again
            _send(sock, self.connections.tags_out[e], header, None if slot is not None else payload)
        except zmq.Again:
            return False
        if slot is not None:
            self.slots.put(e, slot, coll.group, coll.seq, k)
        if moved:
            self.failover.moved_chunks += 1
        coll.state[k] = SENT
        inflight[e] += 1
        coll.last_progress = time.monotonic()  # its clock starts when it goes out, not in the queue
        if coll.trace is not None:
            coll.trace.chunk_sent()
        return True
