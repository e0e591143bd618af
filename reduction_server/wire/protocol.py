"""The wire protocol between workers and reducers (documented in docs/protocol.md).

Every message is a ZeroMQ multipart message: one fixed-size binary header frame, then at most
one payload frame. The header is little-endian, versioned and starts with a magic number;
payloads (gradient chunks, JSON for the handshake, UTF-8 text for errors) travel as their own
frame so that they are sent and received without copies.

Codes for dtypes and reduction ops follow NCCL's numbering (ncclDataType_t, ncclRedOp_t), so
the NCCL-style client passes them straight through.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import struct
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import numpy as np
import zmq

from ..errors import ProtocolError
from .formats import COMPRESSED, INT8_BLOCK, WireFormat, block_of

MAGIC = 0x52535631  # b"1VSR" little-endian: "RSV1"
VERSION = 6  # 2: the reducer proves the token too; 3: groups; 4: failover; 5: shards; 6: drain (DRAIN, DRAINED)

# magic, version, type, dtype, op, rank, world, generation, chunk, nchunks, aux,
# job, group, seq, offset, count, total, nbytes
HEADER = struct.Struct("<IBBBBIIIIIIQQQQQQQ")
HEADER_SIZE = HEADER.size  # 88 bytes

MAX_WORLD_SIZE = 1 << 20
MAX_TEXT_PAYLOAD = 64 * 1024  # handshake JSON and error text
#: below this, a received frame may share libzmq's receive buffer (a batch of ZMQ_IN_BATCH_SIZE,
#: 8 KiB by default and not set here, or a larger read's buffer): never held or adopted then
BATCHED_RECV_BYTES = 64 << 10
#: a reducer that comes back is used from this many collectives past the furthest a rank of the
#: group had started when it reported (PROGRESS); a rank starts none beyond its own report plus
#: this before it knows (JOIN)
REJOIN_LEAD = 32


class MsgType(enum.IntEnum):
    HELLO = 1  # worker -> reducer: who I am and a nonce (JSON payload)
    CHALLENGE = 2  # reducer -> worker: its proof of the job token over that nonce, and a nonce of its own
    AUTH = 3  # worker -> reducer: its proof over the reducer's nonce (and a shared-memory offer)
    WELCOME = 4  # reducer -> worker: admitted (JSON payload: reducer facts)
    REJECT = 5  # reducer -> worker: refused (text payload: the reason)
    DATA = 6  # worker -> reducer: one chunk contribution
    RESULT = 7  # reducer -> worker: one reduced chunk
    ERROR = 8  # either way: a collective or frame failed (aux: ErrorCode, text payload)
    BYE = 9  # worker -> reducer: leaving cleanly
    PING = 10  # either way: a heartbeat (no payload); any message is a sign of life
    # Same host (shared_memory.py): the payload lies in slot `aux` of the worker's segment.
    DATA_SHM = 11  # worker -> reducer: DATA whose chunk is in the slot (no payload frame)
    RESULT_SHM = 12  # reducer -> worker: RESULT written into the slot the chunk came in
    GROUP = 13  # worker -> reducer: the ranks of group `group` (payload: uint32 ranks, ascending)
    # Failover (client/engine/failover.py): a chunk whose reducer was lost, sent to its substitute.
    MOVED = 14  # worker -> reducer: DATA of a moved chunk (always a frame)
    FINAL = 15  # worker -> reducer: a moved chunk's result, which this rank received from the lost reducer
    # A lost reducer that comes back (reducer/rejoin.py): from which collective of each group it is used again.
    PROGRESS = 16  # worker -> reducer: per group, the seq of the next collective this rank will start
    JOIN = 17  # reducer -> worker: per group, the seq from which every rank uses this reducer again
    # Same host, a result written once for several ranks: it lies in a slot of the reducer's own segment
    # (shared_memory.py, "shared results"); aux packs the slot and the use of it to release (shared_result_aux).
    RESULT_SHARED = 18  # reducer -> worker: RESULT in a result slot; the chunk's own slot is free again
    # A reducer told to stop (SIGTERM, reducer/drain.py): its chunks move from a boundary per group.
    DRAIN = 19  # reducer -> worker: per group, the seq from which no rank sends it that group's chunks
    DRAINED = 20  # reducer -> worker: every round before the boundaries is answered; it closes now


class ErrorCode(enum.IntEnum):
    MALFORMED = 1  # a frame the reducer could not parse
    NOT_ADMITTED = 2  # DATA from a peer that did not complete the handshake
    MISMATCH = 3  # contributions to one key disagree (dtype, op, size, ...)
    BAD_PAYLOAD = 4  # payload size disagrees with the header
    # 5 is unused: an unknown dtype or op code is MALFORMED (the header cannot be parsed)
    DUPLICATE = 6  # a rank contributed twice to one key
    STALE = 7  # a key from an older generation or another job
    TOO_LARGE = 8  # a size over the reducer's caps
    INTERNAL = 9  # a bug on the reducer side; reported, never swallowed
    LOST = 10  # a rank the collective needs was lost (died, disconnected, left, skipped it)
    DRAINING = 11  # a chunk at or past its group's DRAIN boundary: the reducer drains and sums it not


class ReduceOp(enum.IntEnum):
    """Reduction ops; values are NCCL's ncclRedOp_t."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4
    # Not an NCCL op: the root's contribution is the result (broadcast). aux = root rank.
    BROADCAST = 64

    @classmethod
    def parse(cls, op: Union[str, int, "ReduceOp"]) -> "ReduceOp":
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            name = op.strip().upper()
            aliases = {"AVERAGE": "AVG", "MEAN": "AVG", "PRODUCT": "PROD"}
            name = aliases.get(name, name)
            if name in cls.__members__ and name != "BROADCAST":
                return cls[name]
            raise ValueError(f"unknown reduction op {op!r}; expected one of sum, avg, min, max, prod")
        # NCCL's integer constants (ncclSum=0, ...). Not int(op): 1.5 must not pass as PROD, and
        # other frameworks number their ops differently (their adapters map them by name).
        try:
            return cls(operator.index(op))
        except (TypeError, ValueError):
            raise ValueError(f"unknown reduction op {op!r}; expected one of sum, avg, min, max, prod") from None


class DType(enum.IntEnum):
    """Element types; values are NCCL's ncclDataType_t."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self]

    @property
    def accumulator(self) -> "DType":
        """Type the reducer accumulates in: 16-bit floats widen to float32, the rest stay."""
        return DType.FLOAT32 if self in (DType.FLOAT16, DType.BFLOAT16) else self

    @property
    def storage(self) -> np.dtype:
        """A NumPy dtype with this type's bytes; bfloat16 is carried as uint16 bits."""
        return np.dtype(np.uint16) if self is DType.BFLOAT16 else np.dtype(self.name.lower())

    @property
    def is_float(self) -> bool:
        return self in (DType.FLOAT16, DType.FLOAT32, DType.FLOAT64, DType.BFLOAT16)

    @classmethod
    def from_numpy(cls, dtype: np.dtype) -> "DType":
        dtype = np.dtype(dtype)
        known = _FROM_NUMPY.get(dtype)  # runs per tensor per collective; dtype.name alone costs ~10 us
        if known is not None:
            return known
        name = dtype.name.upper()
        # Checked before the bfloat16 shortcut: a big-endian bfloat16 is not ours either.
        if dtype.byteorder == ">" or (name not in cls.__members__ and dtype.name != "bfloat16"):
            raise TypeError(
                f"dtype {dtype}{' (big-endian)' if dtype.byteorder == '>' else ''} is not supported; "
                "supported: " + ", ".join(d.name.lower() for d in cls)
            )
        # ml_dtypes.bfloat16 (used by JAX and TensorFlow) has no member name of its own.
        known = _FROM_NUMPY[dtype] = cls.BFLOAT16 if dtype.name == "bfloat16" else cls[name]
        return known


_FROM_NUMPY: dict = {}  # numpy dtype -> DType, filled by DType.from_numpy

# Code -> member, for the per-message paths: calling an IntEnum costs about 1 us, a dict lookup 30 ns.
MSG_TYPES: Dict[int, MsgType] = {int(m): m for m in MsgType}
#: the largest payload of a message that is neither a chunk nor text: GROUP's ranks, PROGRESS's and
#: JOIN's (group, seq) pairs (at most a reducer's 65,536 groups and group 0)
_PAYLOAD_LIMITS = {
    MsgType.GROUP: 4 * MAX_WORLD_SIZE,
    MsgType.PROGRESS: 16 * 65537,
    MsgType.JOIN: 16 * 65537,
    MsgType.DRAIN: 16 * 65537,
}
#: the largest payload of any message that carries no chunk
MAX_CONTROL_PAYLOAD = max(MAX_TEXT_PAYLOAD, *_PAYLOAD_LIMITS.values())
DTYPES: Dict[int, DType] = {int(m): m for m in DType}
OPS: Dict[int, ReduceOp] = {int(m): m for m in ReduceOp}


#: message types that carry (or point at) a chunk
DATA_TYPES = frozenset(
    (
        MsgType.DATA,
        MsgType.RESULT,
        MsgType.DATA_SHM,
        MsgType.RESULT_SHM,
        MsgType.MOVED,
        MsgType.FINAL,
        MsgType.RESULT_SHARED,
    )
)
_FROM_WORKER = frozenset((MsgType.DATA, MsgType.DATA_SHM, MsgType.MOVED, MsgType.FINAL))
#: contributions to a chunk moved off a lost reducer: exempt from the skipped-collective rule
MOVED_TYPES = frozenset((MsgType.MOVED, MsgType.FINAL))
_SHARED = frozenset((MsgType.DATA_SHM, MsgType.RESULT_SHM, MsgType.RESULT_SHARED))
#: RESULT_SHARED's aux: the result slot in its low bits, the use of that slot above them
_RESULT_SLOT_BITS = 9
#: uses of a result slot are numbered 1..MAX_RESULT_USE, then from 1 again
MAX_RESULT_USE = (1 << (32 - _RESULT_SLOT_BITS)) - 1

#: the size of an element, and of the type it is accumulated in (float32 for the 16-bit floats),
#: by DType or by its code (an IntEnum hashes and compares as its int): the per-message paths look
#: them up here rather than through the enum's properties
ITEMSIZE: Dict[int, int] = {
    DType.INT8: 1,
    DType.UINT8: 1,
    DType.INT32: 4,
    DType.UINT32: 4,
    DType.INT64: 8,
    DType.UINT64: 8,
    DType.FLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FLOAT64: 8,
    DType.BFLOAT16: 2,
}
ACCUMULATOR_ITEMSIZE: Dict[int, int] = {d: ITEMSIZE[d.accumulator] for d in DType}
ACCUMULATOR_ITEMSIZE.update(dict.fromkeys(COMPRESSED, 4))  # int8 blocks are decoded into float32


def format_name(code: int) -> str:
    """A header's dtype byte in words: an element type's name, or a compressed format's (formats.py)."""
    return DTYPES[code].name.lower() if code in DTYPES else COMPRESSED[code].name if code in COMPRESSED else str(code)


#: the members the per-message paths (here, reducer.py, client/engine.py) compare with, as module
#: globals: an enum class attribute costs a lookup each time
MSG_DATA, MSG_DATA_SHM, MSG_RESULT, MSG_RESULT_SHM = MsgType.DATA, MsgType.DATA_SHM, MsgType.RESULT, MsgType.RESULT_SHM
MSG_ERROR, MSG_PING, OP_BROADCAST = MsgType.ERROR, MsgType.PING, ReduceOp.BROADCAST
MSG_MOVED, MSG_FINAL, MSG_RESULT_SHARED = MsgType.MOVED, MsgType.FINAL, MsgType.RESULT_SHARED


def shared_result_aux(slot: int, use: int) -> int:
    """RESULT_SHARED's aux for `use` (1..MAX_RESULT_USE) of result slot `slot` (< 512)."""
    return slot | use << _RESULT_SLOT_BITS


def shared_result_slot(aux: int) -> Tuple[int, int]:
    """(slot, use) from a RESULT_SHARED's aux."""
    return aux & ((1 << _RESULT_SLOT_BITS) - 1), aux >> _RESULT_SLOT_BITS


@dataclass
class Header:
    """One message header. Fields that a message type does not use are zero."""

    type: MsgType
    dtype: int = 0
    op: int = 0
    rank: int = 0
    world: int = 0
    generation: int = 0
    chunk: int = 0
    nchunks: int = 0
    aux: int = 0  # BROADCAST: root rank; ERROR: ErrorCode; DATA_SHM, RESULT_SHM: slot; RESULT_SHARED: result slot
    # and use (shared_result_aux); CHALLENGE: token set (1)
    job: int = 0
    group: int = 0  # which group of the job's ranks the collective belongs to (0: all of them)
    seq: int = 0  # the collective's number in its group
    offset: int = 0  # element offset of this chunk in the collective's buffer
    count: int = 0  # elements in this chunk
    total: int = 0  # elements in the whole collective
    nbytes: int = 0  # bytes in the payload frame (0: no payload frame), or in the slot (*_SHM)
    #: not on the wire: the block size of an int8-block payload, derived from count and nbytes (formats.py)
    block: int = 0

    def pack(self) -> bytes:
        return pack_as(self, self.type, self.rank, self.nbytes)

    @property
    def key(self) -> tuple:
        """What identifies one chunk of one collective on a reducer."""
        return (self.job, self.generation, self.group, self.seq, self.chunk)

    def describe(self) -> str:
        """The collective and chunk in words, for error messages."""
        group = f" of group {self.group:#x}" if self.group else ""
        return (
            f"collective seq={self.seq}{group} chunk={self.chunk}/{self.nchunks} (job={self.job:#x}, "
            f"generation={self.generation})"
        )


def unpack(frame: Union[bytes, memoryview]) -> Header:
    """Parse and validate a header frame; raise ProtocolError naming what is wrong."""
    size = len(frame)
    if size != HEADER_SIZE:
        raise ProtocolError(f"header frame is {size} bytes, expected {HEADER_SIZE}")
    (
        magic,
        version,
        mtype,
        dtype,
        op,
        rank,
        world,
        generation,
        chunk,
        nchunks,
        aux,
        job,
        group,
        seq,
        offset,
        count,
        total,
        nbytes,
    ) = HEADER.unpack(frame)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic number {magic:#010x}, expected {MAGIC:#010x}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION})")
    known = MSG_TYPES.get(mtype)
    if known is None:
        raise ProtocolError(f"unknown message type {mtype}")
    mtype = known
    header = Header(
        mtype, dtype, op, rank, world, generation, chunk, nchunks, aux, job, group, seq, offset, count, total, nbytes
    )
    if mtype in DATA_TYPES:
        validate_data(header)
    elif nbytes > _PAYLOAD_LIMITS.get(mtype, MAX_TEXT_PAYLOAD):
        raise ProtocolError(f"{mtype.name} payload of {nbytes} bytes is over its limit")
    return header


def validate_data(h: Header) -> None:
    """Field checks for DATA/RESULT headers that need no state."""
    itemsize, op = ITEMSIZE.get(h.dtype), h.op
    fmt = None if itemsize is not None else _compressed(h)
    if op not in OPS:
        raise ProtocolError(f"unknown op code {h.op}")
    if not 0 < h.world <= MAX_WORLD_SIZE:
        raise ProtocolError(f"world size {h.world} out of range 1..{MAX_WORLD_SIZE}")
    if h.type in _FROM_WORKER and h.rank >= h.world:  # a RESULT's rank field is the reducer's index
        raise ProtocolError(f"rank {h.rank} out of range for world size {h.world}")
    broadcast = op == OP_BROADCAST
    if broadcast and h.type in _SHARED:
        raise ProtocolError(f"{h.type.name} cannot carry a broadcast (its payload travels as a frame)")
    if broadcast and h.aux >= h.world:
        raise ProtocolError(f"broadcast root {h.aux} out of range for world size {h.world}")
    if h.nchunks == 0 or h.chunk >= h.nchunks:
        raise ProtocolError(f"chunk index {h.chunk} out of range for {h.nchunks} chunks")
    if h.count == 0 or h.offset + h.count > h.total:
        raise ProtocolError(f"chunk of {h.count} elements at offset {h.offset} does not fit a collective of {h.total}")
    if fmt is not None:
        return _check_blocks(h, fmt)
    expected = h.count * itemsize
    # A broadcast's non-root contributions carry no payload, nor does a RESULT to a rank that holds
    # the data already (a broadcast's root, a FINAL's sender).
    if h.nbytes != expected and not (
        h.nbytes == 0 and (h.type is MSG_RESULT or broadcast and h.type in (MSG_DATA, MSG_MOVED))
    ):
        raise ProtocolError(
            f"header says {h.nbytes} payload bytes but {h.count} x {DTYPES[h.dtype].name.lower()} is {expected}"
        )


def _compressed(h: Header) -> WireFormat:
    """h's compressed format (formats.py), which carries sums and averages only, as frames."""
    fmt = COMPRESSED.get(h.dtype)
    if fmt is None:
        raise ProtocolError(
            f"unknown dtype (format) code {h.dtype} (up {h.dtype & 15}, down {h.dtype >> 4}): this side knows the "
            f"element types 0-9 and int8 blocks up, {', '.join(f'{c:#x}' for c in sorted(COMPRESSED))}"
        )
    if h.op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ProtocolError(f"{fmt.name} carries sums and averages only, not op code {h.op}")
    if h.type in _SHARED:
        raise ProtocolError(f"{h.type.name} cannot carry {fmt.name} (a compressed chunk travels as a frame)")
    return fmt


def _check_blocks(h: Header, fmt: WireFormat) -> None:
    """The payload size of a compressed chunk: the format up's (the workers'), or down's (RESULT,
    FINAL); int8 blocks set h.block from it."""
    down = h.type in (MSG_RESULT, MSG_FINAL)
    code = fmt.down if down else fmt.up
    if h.nbytes == 0 and h.type is MSG_RESULT:  # to a FINAL's sender
        return
    if code == INT8_BLOCK:
        block = block_of(h.count, h.nbytes)
        if block is None:
            raise ProtocolError(
                f"{h.nbytes} payload bytes are not {h.count} elements in int8 blocks (a float32 scale and up to "
                "B int8 values each, B a power of two: RS_INT8_BLOCK)"
            )
        h.block = block
    elif h.nbytes != h.count * ITEMSIZE[code]:
        name, expected = DTYPES[code].name.lower(), h.count * ITEMSIZE[code]
        raise ProtocolError(f"header says {h.nbytes} payload bytes but {h.count} x {name} is {expected}")


def data_header(
    mtype: MsgType,
    *,
    dtype: DType,
    op: ReduceOp,
    rank: int,
    world: int,
    job: int,
    generation: int,
    seq: int,
    chunk: int,
    nchunks: int,
    offset: int,
    count: int,
    total: int,
    nbytes: int,
    aux: int = 0,
    group: int = 0,
) -> bytes:
    # Packed directly (a worker packs one per chunk): the same bytes as Header(...).pack().
    return HEADER.pack(
        MAGIC,
        VERSION,
        mtype,
        dtype,
        op,
        rank,
        world,
        generation,
        chunk,
        nchunks,
        aux,
        job,
        group,
        seq,
        offset,
        count,
        total,
        nbytes,
    )


def pack_as(h: Header, mtype: MsgType, rank: int, nbytes: int, aux: Optional[int] = None) -> bytes:
    """h packed, with its type, rank, payload size (and aux, when given) replaced: a reducer's
    RESULT for a DATA, or its RESULT_SHM naming the rank's slot."""
    return HEADER.pack(
        MAGIC,
        VERSION,
        int(mtype),
        h.dtype,
        h.op,
        rank,
        h.world,
        h.generation,
        h.chunk,
        h.nchunks,
        h.aux if aux is None else aux,
        h.job,
        h.group,
        h.seq,
        h.offset,
        h.count,
        h.total,
        nbytes,
    )


def error_header(code: ErrorCode, text: bytes, about: Optional[Header] = None) -> bytes:
    """An ERROR header; it repeats the key of the message it answers, when there is one."""
    h = Header(MsgType.ERROR) if about is None else dataclasses.replace(about, type=MsgType.ERROR)
    h.aux = int(code)
    h.nbytes = len(text)
    return h.pack()


def text_header(
    mtype: MsgType,
    payload: bytes,
    *,
    rank: int = 0,
    world: int = 0,
    job: int = 0,
    generation: int = 0,
    aux: int = 0,
    group: int = 0,
    chunk: int = 0,
) -> bytes:
    """The header of a handshake, PING, BYE, REJECT or GROUP message (no chunk; a CHALLENGE's
    `chunk` is the reducer's shard)."""
    return Header(
        mtype,
        rank=rank,
        world=world,
        job=job,
        generation=generation,
        aux=aux,
        group=group,
        chunk=chunk,
        nbytes=len(payload),
    ).pack()


def group_payload(ranks) -> bytes:
    """A GROUP message's payload: the group's ranks as little-endian uint32, ascending."""
    return np.asarray(sorted(ranks), "<u4").tobytes()


def group_ranks(payload: bytes, world: int) -> tuple:
    """The ranks a GROUP payload lists; ProtocolError unless they are distinct, ascending and
    within the world size."""
    if len(payload) % 4:
        raise ProtocolError(f"a GROUP payload of {len(payload)} bytes is not a list of uint32 ranks")
    ranks = np.frombuffer(payload, "<u4")
    if ranks.size == 0 or (ranks.size > 1 and not (np.diff(ranks.astype(np.int64)) > 0).all()) or ranks[-1] >= world:
        raise ProtocolError(f"a GROUP must list distinct ranks in ascending order below the world size {world}")
    return tuple(int(r) for r in ranks)


def seq_pairs_payload(pairs) -> bytes:
    """A PROGRESS or JOIN payload: (group, seq) pairs as little-endian uint64."""
    return np.asarray(sorted(pairs), "<u8").reshape(-1).tobytes()


def seq_pairs(payload: bytes) -> Dict[int, int]:
    """The group -> seq pairs of a PROGRESS or JOIN payload; ProtocolError unless whole pairs of distinct groups."""
    if len(payload) % 16 or len(payload) > _PAYLOAD_LIMITS[MsgType.PROGRESS]:
        raise ProtocolError(f"a payload of {len(payload)} bytes is not a list of (group, seq) uint64 pairs")
    words = np.frombuffer(payload, "<u8").reshape(-1, 2)
    pairs = {int(group): int(seq) for group, seq in words}
    if len(pairs) != len(words):
        raise ProtocolError("a (group, seq) list names a group twice")
    return pairs


def set_heartbeats(socket: zmq.Socket, interval: float, timeout: float) -> None:
    """ZMTP heartbeats on a socket: libzmq's I/O thread pings every `interval` seconds and closes
    a connection that stays silent for `timeout`. They need no GIL, so a worker busy in Python
    is not mistaken for a dead one; a stopped or vanished process is (its connection closes)."""
    socket.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(interval * 1000)))
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(timeout * 1000)))
    socket.setsockopt(zmq.HEARTBEAT_TTL, max(100, int(timeout * 1000)))  # the peer's side of the same rule
