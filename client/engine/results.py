"""The result path: every message an endpoint (a reducer's shard, endpoints.py) sends a worker,
after the first handshake.

A RESULT is received with recv_into straight into the output buffer (no copy, nothing
allocated), or, when failover keeps it and it is large, as the message libzmq received, copied
into the output and kept as it is; a RESULT_SHM is copied out of its shared-memory slot, and a
RESULT_SHARED out of the reducer's result slot, which failover may keep as it is (slots.Lease)
or else is released at once; an ERROR fails its chunk, and so its collective, with
the reducer's words; a DRAIN moves an endpoint's chunks from its boundaries, a DRAINED
ends its use; a handshake message from an endpoint that was lost readmits it (or refuses
it). Each answer is checked against the chunk it answers (its offset,
count, dtype and slot), and frees the chunk's slot whatever became of the collective.

With RS_INTEGRITY a message is received whole (as the frames libzmq received) and its tag checked
before anything of it is used: a RESULT's payload is copied into the output only once it holds.
A message that fails its check loses its endpoint (failover moves its chunks), naming why.
"""

from __future__ import annotations

import json
from typing import List, Optional

import numpy as np
import zmq

from reduction_server.errors import ProtocolError
from reduction_server.wire import protocol
from reduction_server.wire.protocol import (
    BATCHED_RECV_BYTES,
    MSG_ERROR,
    MSG_PING,
    MSG_RESULT,
    MSG_RESULT_SHARED,
    MSG_RESULT_SHM,
    OP_BROADCAST,
    ErrorCode,
    MsgType,
)

from .collective import Collective
from .connections import Connections
from .failover import Failover
from .handshake import Handshake
from .ledger import Ledger
from .slots import Slots
from .watch import CHALLENGED

_NOBLOCK, _RCVMORE = int(zmq.NOBLOCK), int(zmq.RCVMORE)


def _skip(sock: zmq.Socket, more: int) -> None:
    """Read and drop the rest of a message."""
    while more:
        sock.recv(copy=False)
        more = sock.getsockopt(_RCVMORE)


def _rest(sock: zmq.Socket, more: int) -> List[zmq.Frame]:
    """The rest of a message's frames, as libzmq received them (no copies)."""
    frames = []
    while more:
        frames.append(sock.recv(copy=False))
        more = sock.getsockopt(_RCVMORE)
    return frames


class Results:
    """Reads what each endpoint sends and settles the chunks it answers."""

    def __init__(
        self, ledger: Ledger, connections: Connections, handshake: Handshake, slots: Slots, failover: Failover
    ) -> None:
        self.ledger = ledger
        self.connections = connections
        self.failover = failover
        self.handshake = handshake
        self.slots = slots

    def drain(self, e: int) -> None:
        """Handle every message endpoint e's socket holds now."""
        conn = self.connections
        sock = conn.sockets[e]
        while True:
            try:
                raw = sock.recv(_NOBLOCK)
            except zmq.Again:
                return
            more = sock.getsockopt(_RCVMORE)
            try:
                h = protocol.unpack(raw)
            except ProtocolError as exc:
                _skip(sock, more)
                self.ledger.fail_sent_to(e, f"{conn.name(e)} sent a malformed frame: {exc}")
                continue
            if conn.sockets[e] is not sock:
                return  # it was lost and replaced while this message was handled
            mtype = h.type
            if mtype is MSG_RESULT and conn.tags_in[e] is None:  # nearly every message: straight into the output
                self.slots.release(e, h)
                self._result(e, sock, h, more)
                continue
            frames = [raw, *_rest(sock, more)]
            altered = conn.untag(e, h, frames)
            if altered:
                # Nothing of it is used (not even its header's slot); the connection is not trusted any more.
                if e not in conn.down:
                    conn.lose(e, f"{altered}; reconnecting", reconnect=True)
                return
            payload = frames[1].bytes if len(frames) > 1 and mtype is not MSG_RESULT else b""
            if mtype is MSG_RESULT:
                self.slots.release(e, h)
                self._result(e, sock, h, 0, frames[1] if len(frames) > 1 else None)
            elif mtype is MSG_RESULT_SHM:
                self._shared_result(e, h, self.slots.release(e, h))
            elif mtype is MSG_RESULT_SHARED:
                self._result_slot(e, h, self.slots.release(e, h))
            elif mtype is MSG_ERROR:
                self.slots.release(e, h)
                self._error(e, h, payload.decode(errors="replace") if len(frames) > 1 else "(no message)")
            elif mtype is MSG_PING:
                pass
            elif mtype is MsgType.JOIN or mtype is MsgType.DRAIN:
                self._boundaries(e, mtype, payload)
            elif mtype is MsgType.DRAINED:
                conn.lose(e, "it drained (it was told to stop) and closes", reconnect=True, drained=True)
            elif mtype in (MsgType.CHALLENGE, MsgType.WELCOME, MsgType.REJECT) and e in conn.down:
                self._rejoin(e, h, payload)
            else:
                conn.event("unexpected_message", e, type=mtype.name)

    def _boundaries(self, e: int, mtype: MsgType, payload: bytes) -> None:
        """A lost endpoint that came back names the seqs from which every rank uses it again
        (JOIN); one that drains, the seqs from which no rank sends it chunks (DRAIN)."""
        try:
            boundaries = protocol.seq_pairs(payload)
        except ProtocolError as exc:
            return self.connections.event("unexpected_message", e, type=mtype.name, reason=str(exc))
        if mtype is MsgType.JOIN:
            self.failover.joined(e, boundaries)
        else:
            self.connections.drain(e, boundaries)

    def _rejoin(self, e: int, h: protocol.Header, text: bytes) -> None:
        """The handshake of an endpoint that was lost and answers a new connection."""
        conn = self.connections
        if h.type is MsgType.CHALLENGE:
            refused = self.handshake.answer_challenge(e, h, text)
            if refused:
                conn.refuse(e, f"{refused} (when it came back)")
        elif h.type is MsgType.WELCOME and conn.progress[e] != CHALLENGED:
            conn.refuse(e, self.handshake.unproved_welcome(e))
        elif h.type is MsgType.WELCOME:
            try:
                welcome = json.loads(text)
            except ValueError:
                welcome = {}
            welcome = welcome if isinstance(welcome, dict) else {}
            otherwise = self.handshake.came_back_otherwise(e, welcome)
            if otherwise:
                conn.refuse(e, otherwise)
            else:
                conn.readmitted(e, welcome)
        else:
            conn.refuse(e, f"{conn.name(e)} came back but refused this worker: {text.decode(errors='replace')}")

    def _result(
        self, e: int, sock: zmq.Socket, h: protocol.Header, more: int, received_frame: Optional[zmq.Frame] = None
    ) -> None:
        """A RESULT: its payload still in the socket (`more`), or received already (a message
        whose tag was checked: `received_frame`, None if it had no payload)."""
        coll = self.ledger.pending_chunk(h, e)
        if coll is None:
            return _skip(sock, more)
        offset, count, _ = coll.chunks[h.chunk]
        where = coll.send_span(offset, count)  # a broadcast: the same as recv_span
        has_payload = more or received_frame is not None
        if (
            not has_payload
            and h.nbytes == 0
            and coll.op is OP_BROADCAST
            and coll.send is not None
            and not self._misshapen(h, coll)
        ):
            # This rank is the root: its own data does not come back; out of place, it is copied.
            if coll.send is not coll.recv:
                coll.recv[where] = coll.send[where]
            return self.ledger.chunk_done(coll, h.chunk, e, None)
        if not has_payload or self._misshapen(h, coll):
            _skip(sock, more)
            return self.ledger.chunk_done(coll, h.chunk, e, self._shape_error(e, h, coll))
        view = coll.recv[coll.recv_span(offset, count)]
        held = None
        if received_frame is not None or self.failover.enabled and len(view) >= BATCHED_RECV_BYTES:
            # The result that failover keeps is the message itself: one copy, into the output.
            frame = sock.recv(copy=False) if received_frame is None else received_frame
            received = len(frame)
            if received == len(view):
                held = frame.buffer
                np.copyto(np.frombuffer(view, np.uint8), np.frombuffer(held, np.uint8))  # without the GIL
                if not self.failover.enabled or received < BATCHED_RECV_BYTES:
                    held = None  # kept as a view of the output (kept.py), or not at all
        else:
            received = sock.recv_into(view)
        error = None
        if received != len(view):
            error = f"{self.connections.name(e)} returned {received} bytes for chunk {h.chunk}, expected {len(view)}"
        _skip(sock, sock.getsockopt(_RCVMORE))
        self.ledger.chunk_done(coll, h.chunk, e, error, held)

    @staticmethod
    def _misshapen(h: protocol.Header, coll: Collective) -> bool:
        """Whether an answer's offset, count or dtype differ from its chunk's."""
        chunk = coll.chunks[h.chunk]
        return (h.offset, h.count) != (chunk.offset, chunk.count) or h.dtype != coll.code

    def _shape_error(self, e: int, h: protocol.Header, coll: Collective) -> str:
        offset, count, _ = coll.chunks[h.chunk]
        return (
            f"{self.connections.name(e)} returned chunk {h.chunk} as {h.count} elements at offset {h.offset} "
            f"(dtype code {h.dtype}), expected {count} at {offset}"
        )

    def _shared_result(self, e: int, h: protocol.Header, slot: Optional[int]) -> None:
        coll = self.ledger.pending_chunk(h, e)
        if coll is None:
            return  # late: its slot is free again all the same
        offset, count, _ = coll.chunks[h.chunk]
        size = coll.dtype.itemsize
        error, lease = None, None
        if slot is None or slot != h.aux:
            error = (
                f"{self.connections.name(e)} answered chunk {h.chunk} in shared-memory slot {h.aux}, but it was "
                "sent " + ("as a frame" if slot is None else f"in slot {slot}")
            )
        elif self._misshapen(h, coll):
            error = self._shape_error(e, h, coll)
        else:
            self.slots.copy_out(e, slot, coll.recv[offset * size : (offset + count) * size])
            if self.failover.enabled:  # the result it keeps may stay where it is
                lease = self.slots.lease(e, slot, count * size)
        self.ledger.chunk_done(coll, h.chunk, e, error, lease)

    def _result_slot(self, e: int, h: protocol.Header, slot: Optional[int]) -> None:
        """A result in endpoint e's result slot, for a chunk sent through this rank's `slot`."""
        coll = self.ledger.pending_chunk(h, e)
        if coll is None:
            return self.slots.release_result(e, h.aux)  # late: read by nobody
        offset, count, _ = coll.chunks[h.chunk]
        size = coll.dtype.itemsize
        error, lease = None, None
        if slot is None:
            error = f"{self.connections.name(e)} answered chunk {h.chunk} in a result slot, but it was sent as a frame"
        elif self._misshapen(h, coll):
            error = self._shape_error(e, h, coll)
        if error is not None:
            self.slots.release_result(e, h.aux)
            return self.ledger.chunk_done(coll, h.chunk, e, error)
        try:
            lease = self.slots.read_result(
                e, h.aux, coll.recv[offset * size : (offset + count) * size], keep=self.failover.enabled
            )
        except ValueError as exc:
            error = f"{self.connections.name(e)} answered chunk {h.chunk} in a result slot this rank cannot read: {exc}"
        self.ledger.chunk_done(coll, h.chunk, e, error, lease)

    def _error(self, e: int, h: protocol.Header, text: str) -> None:
        conn = self.connections
        if h.aux == ErrorCode.NOT_ADMITTED and e not in conn.down:
            # It no longer knows this worker (it serves another job now, or declared this worker
            # lost): nothing more can be sent to it. No new handshake: that could take the
            # reducer back from the job that replaced this one.
            return conn.lose(e, f"it no longer admits this worker: {text}", reconnect=False)
        coll = self.ledger.pending_chunk(h, e)
        if h.aux == ErrorCode.DRAINING:
            if coll is not None:  # not moved (connections.drain): it fails
                self.ledger.chunk_done(coll, h.chunk, e, f"{text}; {conn.unmovable()}")
            return
        if coll is None:
            # An error about no pending chunk (a malformed frame of ours, a stale key): log it.
            conn.event("reducer_error", e, key=h.describe(), reason=text)
            return
        self.ledger.chunk_done(coll, h.chunk, e, text)
