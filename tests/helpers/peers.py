"""Hand-driven peers of a reducer: a ZeroMQ DEALER that sends exactly what a test says and reads
with timeouts, raw ZMTP and TCP junk, and the headers such peers send. Everything is bounded in
time: every receive polls with a timeout."""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import List, Optional, Tuple

import zmq

from reduction_server.config.discovery import job_id_from
from reduction_server.wire import auth, gate, integrity, protocol
from reduction_server.wire.protocol import DType, ErrorCode, Header, MsgType, ReduceOp

from .cluster import TOKEN
from .handshake import auth_payload, hello_payload

JOB = job_id_from(TOKEN)  # the job id a Communicator with TOKEN uses


class Peer:
    """A hand-driven DEALER: sends exactly what a test tells it to, reads with timeouts. It
    presents a credential of `token` when it connects, as a worker does (gate.py): a reducer with a
    token lets no other connection through."""

    def __init__(self, address: str, token: str = TOKEN, **sockopts) -> None:
        self.context = zmq.Context.instance()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if token:
            gate.present(self.sock, token)
        for option, value in sockopts.items():
            self.sock.setsockopt(getattr(zmq, option), value)
        self.sock.connect(f"tcp://{address}")
        #: after a handshake with integrity (RS_INTEGRITY): (what it sends, what it reads)
        self.tags: Optional[Tuple[integrity.Channel, integrity.Channel]] = None

    def send(self, *frames: bytes) -> None:
        """One message; with tags, its tag frame after it."""
        self.sock.send_multipart(list(frames) + ([self.tags[0].seal(frames)] if self.tags else []))

    def send_raw(self, *frames: bytes) -> None:
        """Exactly these frames (a recorded message replayed, say)."""
        self.sock.send_multipart(list(frames))

    def recv(self, timeout: float = 5.0) -> Optional[Tuple[Header, bytes]]:
        """The next message as (header, payload), or None after `timeout` seconds of silence."""
        if not self.sock.poll(timeout * 1000):
            return None
        frames = self.sock.recv_multipart()
        header = protocol.unpack(frames[0])  # what the reducer sends must parse
        if self.tags is not None and header.type is not MsgType.REJECT:
            why = self.tags[1].open(frames[:-1], frames[-1])
            assert why is None, why
            frames.pop()
        assert 1 <= len(frames) <= 2, f"a reducer sent {len(frames)} frames"
        payload = frames[1] if len(frames) == 2 else b""
        assert len(payload) == (
            0 if header.type is MsgType.RESULT_SHM else header.nbytes
        )  # a slot's bytes are not in a frame
        return header, payload

    def expect_error(self, code: ErrorCode, *words: str, timeout: float = 5.0) -> Tuple[Header, str]:
        reply = self.recv(timeout)
        assert reply is not None, f"no answer within {timeout} s (expected ERROR {code.name})"
        header, payload = reply
        text = payload.decode()
        assert header.type is MsgType.ERROR, f"expected ERROR {code.name}, got {header.type.name}: {text}"
        assert header.aux == code, f"expected {code.name}, got {ErrorCode(header.aux).name}: {text}"
        for word in words:
            assert word in text, f"{word!r} not in {text!r}"
        return header, text

    def expect_silence(self, timeout: float = 0.5) -> None:
        reply = self.recv(timeout)
        assert reply is None, f"unexpected answer: {reply[0].type.name} {reply[1][:200]!r}"

    def handshake(
        self,
        rank: int,
        world: int,
        *,
        job: int = JOB,
        generation: int = 0,
        token: str = TOKEN,
        integrity_tags: bool = False,
        **facts,
    ) -> dict:
        info = hello_payload(
            host="test", pid=os.getpid(), version="test", **({"integrity": True} if integrity_tags else {})
        )
        ident = dict(rank=rank, world=world, job=job, generation=generation)
        self.send(protocol.text_header(MsgType.HELLO, info, **ident), info)
        reply = self.recv()
        assert reply is not None and reply[0].type is MsgType.CHALLENGE, reply
        if integrity_tags:
            self.tags = integrity.channels(token, info, reply[1][: auth.NONCE_BYTES])
        proof = auth_payload(reply[1], token, **ident) + (json.dumps(facts).encode() if facts else b"")
        self.send(protocol.text_header(MsgType.AUTH, proof, **ident), proof)
        reply = self.recv()
        assert reply is not None and reply[0].type is MsgType.WELCOME, reply
        return json.loads(reply[1])

    def close(self) -> None:
        self.sock.close(linger=0)


def data(
    rank: int = 0,
    world: int = 2,
    *,
    job: int = JOB,
    generation: int = 0,
    seq: int = 1000,
    chunk: int = 0,
    nchunks: int = 1,
    offset: int = 0,
    count: int = 4,
    total: Optional[int] = None,
    dtype: DType = DType.FLOAT32,
    op: ReduceOp = ReduceOp.SUM,
    nbytes: Optional[int] = None,
    aux: int = 0,
    mtype: MsgType = MsgType.DATA,
    group: int = 0,
) -> bytes:
    """A worker's DATA header as it travels: the payload size follows count and dtype unless given."""
    return protocol.data_header(
        mtype,
        dtype=dtype,
        op=op,
        rank=rank,
        world=world,
        job=job,
        generation=generation,
        seq=seq,
        chunk=chunk,
        nchunks=nchunks,
        offset=offset,
        count=count,
        total=count if total is None else total,
        nbytes=count * dtype.itemsize if nbytes is None else nbytes,
        aux=aux,
        group=group,
    )


def raw_header(magic: int = protocol.MAGIC, version: int = protocol.VERSION, mtype: int = int(MsgType.DATA)) -> bytes:
    h = protocol.unpack(data())
    return protocol.HEADER.pack(
        magic,
        version,
        mtype,
        h.dtype,
        h.op,
        h.rank,
        h.world,
        h.generation,
        h.chunk,
        h.nchunks,
        h.aux,
        h.job,
        h.group,
        h.seq,
        h.offset,
        h.count,
        h.total,
        h.nbytes,
    )


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def junk_over_tcp(address: str, payload: bytes) -> None:
    """Connect with a plain TCP socket, write `payload`, close."""
    with socket.create_connection(("127.0.0.1", port_of(address)), timeout=5) as s:
        try:
            s.sendall(payload)
        except OSError:
            pass  # libzmq may hang up on us halfway: that is fine


class RawZmtp:
    """A ZMTP 3.0 DEALER spoken by hand over TCP: sends frames that pyzmq would never produce (a
    frame header claiming a terabyte). With a token its mechanism is PLAIN, with a credential of
    the token (gate.py), else NULL."""

    def __init__(self, address: str, token: str = TOKEN) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port_of(address)), timeout=5)
        mechanism = b"PLAIN" if token else b"NULL"
        greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" + b"\0" * 31
        metadata = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        if token:
            username, password = gate.credential(token)
            hello = b"\x05HELLO" + bytes([len(username)]) + username + bytes([len(password)]) + password
            self.sock.sendall(greeting + b"\x04" + bytes([len(hello)]) + hello)
            self._greeted()
            flags, body = self._frame()
            assert flags & 0x04 and body.startswith(b"\x07WELCOME"), (flags, body[:20])
            initiate = b"\x08INITIATE" + metadata
            self.sock.sendall(b"\x04" + bytes([len(initiate)]) + initiate)
        else:
            ready = b"\x05READY" + metadata
            self.sock.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
            self._greeted()
        flags, body = self._frame()
        assert flags & 0x04 and body.startswith(b"\x05READY"), (flags, body[:20])

    def _greeted(self) -> None:
        peer_greeting = self._read(64)
        assert peer_greeting[0] == 0xFF and peer_greeting[9] == 0x7F and peer_greeting[10] == 3, peer_greeting

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            more = self.sock.recv(n - len(buf))
            if not more:
                raise ConnectionError("closed by the reducer")
            buf += more
        return buf

    def _frame(self) -> Tuple[int, bytes]:
        flags = self._read(1)[0]
        size = struct.unpack(">Q", self._read(8))[0] if flags & 0x02 else self._read(1)[0]
        return flags, self._read(size)

    def send_message(self, *frames: bytes) -> None:
        out = b""
        for i, frame in enumerate(frames):
            more = 0x01 if i < len(frames) - 1 else 0
            if len(frame) > 255:
                out += bytes([more | 0x02]) + struct.pack(">Q", len(frame)) + frame
            else:
                out += bytes([more, len(frame)]) + frame
        self.sock.sendall(out)

    def recv_message(self) -> List[bytes]:
        frames = []
        while True:
            flags, body = self._frame()
            if flags & 0x04:
                continue  # a command (PING...)
            frames.append(body)
            if not flags & 0x01:
                return frames

    def closed_by_peer(self, timeout: float) -> bool:
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except socket.timeout:
            return False
        except ConnectionError:
            return True

    def close(self) -> None:
        self.sock.close()
