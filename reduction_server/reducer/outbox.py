"""Every message a reducer sends: never blocking, and with its failures accounted.

With ROUTER_MANDATORY a blocking send would wait as long as one peer's queue is full, so a peer
that sends but does not read would stop the reducer for everyone. Sends are therefore
non-blocking: a worker never has more than its window of answers outstanding, so only such a
peer, or one that is gone, loses messages here. A send to a peer whose connection has closed
fails at once (EHOSTUNREACH): that is how the reducer ties a closed connection to its rank.
With RS_INTEGRITY every message to a peer past its HELLO carries its tag frame (wire/integrity.py),
a REJECT aside.
"""

from __future__ import annotations

import logging
from types import MethodType
from typing import Callable, Dict, Mapping, Optional

import zmq

from ..log import Throttle, get_logger
from ..wire import protocol
from ..wire.protocol import ErrorCode, Header, MsgType

log = get_logger("reducer")

_NOBLOCK, _MORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
# Longest error or reject text: well inside protocol.MAX_TEXT_PAYLOAD (a longer one would be a
# frame the client must refuse as malformed), and a log line that stays readable.
MAX_ERROR_TEXT = 16 * 1024
# Peers whose unsent messages are counted at once (identities of peers long gone are dropped).
_MAX_UNSENT_ENTRIES = 4096


def clip(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """text, cut to at most `limit` UTF-8 bytes with a marker saying so."""
    if len(text.encode()) <= limit:
        return text
    marker = " ... [truncated]"
    return text.encode()[: limit - len(marker)].decode(errors="ignore") + marker


class Outbox:
    """The reducer's sending side of its ROUTER socket."""

    def __init__(
        self,
        socket: zmq.Socket,
        index: int,
        name: str,
        on_gone: Callable[[bytes], None],
        throttle: Optional[Throttle] = None,
    ) -> None:
        # A real socket's frames go through pyzmq's backend method: the Python wrapper above it
        # adds only draft-API options, at ~0.5 us a frame.
        self._send_part = (
            MethodType(zmq.backend.Socket.send, socket) if isinstance(socket, zmq.backend.Socket) else socket.send
        )
        self.index = index
        self.name = name
        self.on_gone = on_gone  # told of each identity whose connection a send found closed
        self.unsent: Dict[bytes, int] = {}  # messages that could not be sent, per peer
        # every line a peer can cause before it proved the token goes through it (log.Throttle)
        self.throttle = throttle if throttle is not None else Throttle(log)
        #: with RS_INTEGRITY, the peers by identity (membership.py), whose `down` channel tags what they are sent
        self.tagged: Optional[Mapping[bytes, object]] = None

    def send(self, identity: bytes, frames: list) -> bool:
        """Queue one message for a peer; whether it was queued."""
        if self.tagged is not None:
            peer = self.tagged.get(identity)
            channel = peer.down if peer is not None else None
            if channel is not None:
                # Not sent (refused at its first frame: libzmq takes a message whole or not at
                # all), its number is the next message's: the peer must not see one dropped.
                if self._send(identity, [*frames, channel.seal(frames)]):
                    return True
                channel.seq -= 1
                return False
        return self._send(identity, frames)

    def _send(self, identity: bytes, frames: list) -> bool:
        try:
            # Part by part, as send_multipart does, with its flags as plain ints (~1 us per message).
            send = self._send_part
            send(identity, _MORE_NOBLOCK, False)
            for frame in frames[:-1]:
                send(frame, _MORE_NOBLOCK, False)
            send(frames[-1], _NOBLOCK, False)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer is gone; EAGAIN: it does not read
            if exc.errno == zmq.EHOSTUNREACH:
                self.on_gone(identity)
            if len(self.unsent) > _MAX_UNSENT_ENTRIES:
                self.unsent.clear()
            unsent = self.unsent[identity] = self.unsent.get(identity, 0) + 1
            if unsent == 1 or unsent % 1000 == 0:  # a log line per peer, not per message
                # A string, not the exception: a local holding it would outlive this block, and its
                # traceback this frame and its callers', with the peers in their locals, until a
                # garbage collection that an idle reducer may never run.
                reason = "its send queue is full (it does not read)" if isinstance(exc, zmq.Again) else str(exc)
                # A peer that is gone is no news: its loss, if it matters, is logged as rank_lost.
                level = logging.DEBUG if exc.errno == zmq.EHOSTUNREACH else logging.WARNING
                self.throttle.event(
                    level, "send_failed", reducer=self.index, peer=identity.hex(), reason=reason, unsent=unsent
                )
            return False

    def error(self, identity: bytes, code: ErrorCode, text: str, about: Optional[Header] = None) -> None:
        """An ERROR of `code`; it repeats the key of the message it answers, when there is one."""
        payload = clip(text).encode()
        self.send(identity, [protocol.error_header(code, payload, about), payload])

    def reject(self, identity: bytes, reason: str, logged: bool = True) -> None:
        """A REJECT of a handshake, logged (throttled) unless the caller logs it."""
        reason = clip(reason)  # the log line and the reply both stay short
        if logged:
            self.throttle.event(logging.WARNING, "rejected", reducer=self.index, peer=identity.hex(), reason=reason)
        text = f"{self.name}: {reason}".encode()
        self._send(identity, [protocol.text_header(MsgType.REJECT, text), text])  # never tagged (integrity.py)
