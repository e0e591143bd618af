"""Unit tests of the wire protocol (reduction_server/wire/protocol.py, docs/protocol.md): header
packing and validation, op parsing and dtype mapping. Fast: no processes, no sockets."""

import struct

import ml_dtypes
import numpy as np
import pytest

from reduction_server.errors import ProtocolError
from reduction_server.wire import protocol
from reduction_server.wire.protocol import (
    HEADER_SIZE,
    MAGIC,
    MAX_TEXT_PAYLOAD,
    VERSION,
    DType,
    ErrorCode,
    Header,
    MsgType,
    ReduceOp,
)


def data(**overrides) -> Header:
    """A valid DATA header (rank 1 of 4, chunk 2 of 3 of a 1000-element float32 sum)."""
    fields = dict(
        type=MsgType.DATA,
        dtype=int(DType.FLOAT32),
        op=int(ReduceOp.SUM),
        rank=1,
        world=4,
        generation=3,
        chunk=2,
        nchunks=3,
        aux=0,
        job=0xDEADBEEFCAFEF00D,
        seq=12345678901,
        offset=900,
        count=100,
        total=1000,
        nbytes=400,
    )
    fields.update(overrides)
    return Header(**fields)


def raw(magic=MAGIC, version=VERSION, mtype=int(MsgType.DATA), **overrides) -> bytes:
    """Pack a header by hand, bypassing Header.pack (which always writes MAGIC and VERSION)."""
    h = data(**overrides)
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


def rejects(frame, *words):
    with pytest.raises(ProtocolError) as info:
        protocol.unpack(frame)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    return message


# -- layout and round trips ----------------------------------------------------------------
def test_header_layout_matches_the_documentation():
    assert HEADER_SIZE == 88
    packed = data().pack()
    assert len(packed) == 88
    magic, version, mtype = struct.unpack_from("<IBB", packed)
    assert (magic, version, mtype) == (0x52535631, 6, 6)
    assert packed[:4] == b"1VSR"
    # u64 fields at the documented offsets
    assert struct.unpack_from("<Q", packed, 32)[0] == 0xDEADBEEFCAFEF00D  # job
    assert struct.unpack_from("<Q", packed, 40)[0] == 0  # group: all ranks
    assert struct.unpack_from("<Q", packed, 48)[0] == 12345678901  # seq
    assert struct.unpack_from("<Q", packed, 80)[0] == 400  # nbytes
    grouped = Header(MsgType.DATA, group=0x0123456789ABCDEF).pack()
    assert struct.unpack_from("<Q", grouped, 40)[0] == 0x0123456789ABCDEF
    assert struct.unpack_from("<I", packed, 16)[0] == 3  # generation


@pytest.mark.parametrize("mtype", list(MsgType))
def test_round_trip_every_message_type(mtype):
    if mtype in protocol.DATA_TYPES:
        h = data(type=mtype)
    else:
        h = Header(mtype, rank=3, world=8, generation=2, job=(1 << 64) - 1, seq=7, aux=5, nbytes=32)
    for frame in (h.pack(), memoryview(h.pack()), bytearray(h.pack())):
        back = protocol.unpack(frame)
        assert back == h
        assert back.type is mtype
    assert back.key == (h.job, h.generation, h.group, h.seq, h.chunk)


def test_round_trip_extremes():
    h = data(
        rank=0,
        world=1,
        chunk=0,
        nchunks=1,
        offset=0,
        count=(1 << 61),
        total=(1 << 64) - 1,
        nbytes=(1 << 63),
        generation=(1 << 32) - 1,
        seq=(1 << 64) - 1,
    )
    assert protocol.unpack(h.pack()) == h


def test_helpers_build_valid_headers():
    text = b"something went wrong"
    about = data()
    err = protocol.unpack(protocol.error_header(ErrorCode.MISMATCH, text, about))
    assert err.type is MsgType.ERROR and err.aux == ErrorCode.MISMATCH and err.nbytes == len(text)
    assert err.key == about.key  # the ERROR repeats the key it answers
    bare = protocol.unpack(protocol.error_header(ErrorCode.MALFORMED, b"x"))
    assert (bare.type, bare.aux, bare.nbytes, bare.key) == (MsgType.ERROR, 1, 1, (0, 0, 0, 0, 0))
    hello = protocol.unpack(protocol.text_header(MsgType.HELLO, b"{}", rank=2, world=4, job=9, generation=1))
    assert (hello.type, hello.rank, hello.world, hello.job, hello.generation, hello.nbytes) == (
        MsgType.HELLO,
        2,
        4,
        9,
        1,
        2,
    )
    packed = protocol.data_header(
        MsgType.DATA,
        dtype=DType.BFLOAT16,
        op=ReduceOp.BROADCAST,
        rank=1,
        world=2,
        job=5,
        generation=0,
        seq=1,
        chunk=0,
        nchunks=1,
        offset=0,
        count=3,
        total=3,
        nbytes=6,
        aux=1,
    )
    back = protocol.unpack(packed)
    assert (back.dtype, back.op, back.aux, back.nbytes) == (9, 64, 1, 6)


# -- what unpack rejects, and that it says what is wrong ----------------------------------
@pytest.mark.parametrize("size", [0, 1, 40, 79])
def test_truncated_header(size):
    rejects(data().pack()[:size], f"{size} bytes", f"expected {HEADER_SIZE}")


@pytest.mark.parametrize("extra", [1, 8, 100])
def test_too_long_header(extra):
    rejects(data().pack() + b"\0" * extra, f"{HEADER_SIZE + extra} bytes", f"expected {HEADER_SIZE}")


def test_bad_magic():
    message = rejects(raw(magic=0x12345678), "magic", "0x12345678")
    assert "0x52535631" in message


def test_garbage_is_rejected():
    rejects(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".ljust(HEADER_SIZE, b"x"), "magic")


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4, 5, 7, 255])
def test_other_version(version):
    rejects(raw(version=version), "version", str(version))


@pytest.mark.parametrize("mtype", [0, 21, 99, 255])
def test_unknown_message_type(mtype):
    rejects(raw(mtype=mtype), "message type", str(mtype))


@pytest.mark.parametrize("mtype", [MsgType.DATA, MsgType.RESULT])
def test_unknown_dtype_code(mtype):
    rejects(raw(mtype=int(mtype), dtype=10), "dtype", "10")
    rejects(raw(mtype=int(mtype), dtype=255), "dtype", "255")


@pytest.mark.parametrize("op", [5, 63, 65, 255])
def test_unknown_op_code(op):
    rejects(raw(op=op), "op", str(op))


def test_count_zero():
    rejects(raw(count=0, nbytes=0), "0 elements")


def test_offset_plus_count_over_total():
    rejects(raw(offset=901, count=100, total=1000), "100 elements", "offset 901", "1000")
    rejects(raw(offset=0, count=1001, total=1000, nbytes=4004), "1001", "1000")
    # u64 overflow of offset + count cannot sneak through
    rejects(raw(offset=(1 << 64) - 1, count=2, total=(1 << 64) - 1, nbytes=8), "does not fit")


def test_offset_plus_count_equal_to_total_is_fine():
    assert protocol.unpack(raw(offset=900, count=100, total=1000)).count == 100


@pytest.mark.parametrize("chunk,nchunks", [(3, 3), (4, 3), (0, 0)])
def test_chunk_out_of_range(chunk, nchunks):
    rejects(raw(chunk=chunk, nchunks=nchunks), "chunk index", str(chunk), f"{nchunks} chunks")


@pytest.mark.parametrize("rank,world", [(4, 4), (5, 4), (1, 1)])
def test_rank_out_of_range_in_data(rank, world):
    rejects(raw(rank=rank, world=world), "rank", str(rank), f"world size {world}")


def test_rank_field_of_a_result_is_the_reducer_index():
    # RESULT carries the reducer's index in `rank`; it may exceed the world size.
    assert protocol.unpack(raw(mtype=int(MsgType.RESULT), rank=7, world=2)).rank == 7


def test_world_zero_or_huge():
    rejects(raw(world=0, rank=0), "world size 0")
    rejects(raw(world=protocol.MAX_WORLD_SIZE + 1, rank=0), "world size")


def test_broadcast_root_out_of_range():
    rejects(raw(op=int(ReduceOp.BROADCAST), aux=4, world=4), "root 4", "world size 4")


@pytest.mark.parametrize("nbytes", [0, 399, 401, 800, 100])
def test_nbytes_must_be_count_times_itemsize(nbytes):
    rejects(raw(nbytes=nbytes), f"{nbytes} payload bytes", "100 x float32", "400")


@pytest.mark.parametrize("dtype", list(DType))
def test_nbytes_uses_each_dtypes_itemsize(dtype):
    ok = raw(dtype=int(dtype), count=10, offset=0, total=10, nbytes=10 * dtype.itemsize)
    assert protocol.unpack(ok).nbytes == 10 * dtype.itemsize
    rejects(raw(dtype=int(dtype), count=10, offset=0, total=10, nbytes=10 * dtype.itemsize + 1), "payload bytes")


def test_broadcast_non_root_data_may_have_no_payload():
    h = protocol.unpack(raw(op=int(ReduceOp.BROADCAST), aux=0, nbytes=0))
    assert (h.op, h.nbytes) == (ReduceOp.BROADCAST, 0)
    # ... with the full payload too (the root's); but nothing in between
    assert protocol.unpack(raw(op=int(ReduceOp.BROADCAST), aux=0, nbytes=400)).nbytes == 400
    rejects(raw(op=int(ReduceOp.BROADCAST), aux=0, nbytes=4), "payload bytes")


def test_only_broadcasts_and_bare_results_may_omit_the_payload():
    rejects(raw(op=int(ReduceOp.SUM), nbytes=0), "0 payload bytes")
    rejects(raw(mtype=int(MsgType.MOVED), op=int(ReduceOp.SUM), nbytes=0), "0 payload bytes")
    rejects(raw(mtype=int(MsgType.FINAL), op=int(ReduceOp.SUM), nbytes=0), "0 payload bytes")
    rejects(raw(mtype=int(MsgType.FINAL), op=int(ReduceOp.BROADCAST), aux=1, nbytes=0), "0 payload bytes")
    # a non-root's contribution to a broadcast carries none, nor does the reducer's answer to a
    # rank that holds the data (a broadcast's root, a FINAL's sender)
    assert protocol.unpack(raw(op=int(ReduceOp.BROADCAST), aux=1, nbytes=0)).nbytes == 0
    assert protocol.unpack(raw(mtype=int(MsgType.MOVED), op=int(ReduceOp.BROADCAST), aux=1, nbytes=0)).nbytes == 0
    assert protocol.unpack(raw(mtype=int(MsgType.RESULT), op=int(ReduceOp.BROADCAST), aux=0, nbytes=0)).nbytes == 0
    assert protocol.unpack(raw(mtype=int(MsgType.RESULT), op=int(ReduceOp.SUM), nbytes=0)).nbytes == 0


@pytest.mark.parametrize(
    "mtype",
    [
        t
        for t in MsgType
        if t not in protocol.DATA_TYPES and t not in (MsgType.GROUP, MsgType.PROGRESS, MsgType.JOIN, MsgType.DRAIN)
    ],
)
def test_text_payload_limit(mtype):
    ok = Header(mtype, nbytes=MAX_TEXT_PAYLOAD)
    assert protocol.unpack(ok.pack()).nbytes == MAX_TEXT_PAYLOAD
    rejects(Header(mtype, nbytes=MAX_TEXT_PAYLOAD + 1).pack(), mtype.name, str(MAX_TEXT_PAYLOAD + 1))


def test_a_group_lists_up_to_every_rank_of_the_largest_world():
    most = 4 * protocol.MAX_WORLD_SIZE
    assert protocol.unpack(Header(MsgType.GROUP, nbytes=most).pack()).nbytes == most
    rejects(Header(MsgType.GROUP, nbytes=most + 1).pack(), "GROUP", str(most + 1))
    assert protocol.group_ranks(protocol.group_payload([5, 0, 2]), 6) == (0, 2, 5)
    for bad, words in (
        (b"\0\0\0", "uint32"),
        (b"", "distinct"),
        (protocol.group_payload([0, 6]), "below the world size"),
        (b"\x01\0\0\0\x01\0\0\0", "ascending"),
    ):
        with pytest.raises(ProtocolError, match=words):
            protocol.group_ranks(bad, 6)


# -- ReduceOp.parse --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,op",
    [
        ("sum", ReduceOp.SUM),
        ("SUM", ReduceOp.SUM),
        (" Sum ", ReduceOp.SUM),
        ("prod", ReduceOp.PROD),
        ("product", ReduceOp.PROD),
        ("max", ReduceOp.MAX),
        ("MIN", ReduceOp.MIN),
        ("avg", ReduceOp.AVG),
        ("Average", ReduceOp.AVG),
        ("AVERAGE", ReduceOp.AVG),
        ("mean", ReduceOp.AVG),
    ],
)
def test_parse_strings(text, op):
    assert ReduceOp.parse(text) is op


@pytest.mark.parametrize(
    "value,op", [(0, ReduceOp.SUM), (1, ReduceOp.PROD), (2, ReduceOp.MAX), (3, ReduceOp.MIN), (4, ReduceOp.AVG)]
)
def test_parse_nccl_values(value, op):
    # ncclSum=0, ncclProd=1, ncclMax=2, ncclMin=3, ncclAvg=4
    assert ReduceOp.parse(value) is op
    assert ReduceOp.parse(np.int32(value)) is op
    assert ReduceOp.parse(op) is op


def test_parse_framework_enum_with_an_integer_value():
    import enum

    class NcclRedOp(enum.IntEnum):
        ncclSum = 0
        ncclMax = 2

    assert ReduceOp.parse(NcclRedOp.ncclMax) is ReduceOp.MAX


@pytest.mark.parametrize(
    "bad", ["", "add", "sum2", "broadcast", "BROADCAST", 5, 7, -1, 1000, None, object(), [0], 1.5, 2.0]
)
def test_parse_errors(bad):
    with pytest.raises(ValueError) as info:
        ReduceOp.parse(bad)
    message = str(info.value)
    assert "unknown reduction op" in message and repr(bad) in message
    assert "sum" in message and "avg" in message


# -- DType.from_numpy ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,dtype",
    [
        ("int8", DType.INT8),
        ("uint8", DType.UINT8),
        ("int32", DType.INT32),
        ("uint32", DType.UINT32),
        ("int64", DType.INT64),
        ("uint64", DType.UINT64),
        ("float16", DType.FLOAT16),
        ("float32", DType.FLOAT32),
        ("float64", DType.FLOAT64),
    ],
)
def test_from_numpy_supported(name, dtype):
    assert DType.from_numpy(np.dtype(name)) is dtype
    assert DType.from_numpy(name) is dtype
    assert DType.from_numpy(np.zeros(2, name).dtype) is dtype
    assert DType.from_numpy(np.dtype(name).newbyteorder("<")) is dtype  # explicit little-endian
    assert dtype.itemsize == np.dtype(name).itemsize
    assert dtype.storage == np.dtype(name)


def test_from_numpy_bfloat16():
    assert DType.from_numpy(ml_dtypes.bfloat16) is DType.BFLOAT16
    assert DType.from_numpy(np.dtype(ml_dtypes.bfloat16)) is DType.BFLOAT16
    assert DType.BFLOAT16.itemsize == 2
    assert DType.BFLOAT16.storage == np.dtype(np.uint16)


def test_accumulator_and_is_float():
    assert DType.FLOAT16.accumulator is DType.FLOAT32
    assert DType.BFLOAT16.accumulator is DType.FLOAT32
    for d in (DType.INT8, DType.UINT64, DType.FLOAT32, DType.FLOAT64):
        assert d.accumulator is d
    assert {d for d in DType if d.is_float} == {DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64}


@pytest.mark.parametrize(
    "bad",
    [
        np.bool_,
        np.complex64,
        np.complex128,
        np.int16,
        np.uint16,
        np.float128 if hasattr(np, "float128") else np.longdouble,
        object,
        "U3",
        "M8[s]",
        ml_dtypes.float8_e4m3fn,
    ],
)
def test_from_numpy_unsupported(bad):
    with pytest.raises(TypeError) as info:
        DType.from_numpy(bad)
    message = str(info.value)
    assert "not supported" in message and str(np.dtype(bad)) in message
    assert "float32" in message and "bfloat16" in message  # lists what is supported


@pytest.mark.parametrize("name", ["int32", "uint32", "int64", "uint64", "float16", "float32", "float64"])
def test_from_numpy_big_endian(name):
    big = np.dtype(name).newbyteorder(">")
    with pytest.raises(TypeError) as info:
        DType.from_numpy(big)
    assert "not supported" in str(info.value) and str(big) in str(info.value)
    assert "big-endian" in str(info.value)


def test_from_numpy_big_endian_bfloat16():
    big = np.dtype(ml_dtypes.bfloat16).newbyteorder(">")
    assert big.byteorder == ">"
    with pytest.raises(TypeError) as info:
        DType.from_numpy(big)
    assert "not supported" in str(info.value)


def test_single_byte_types_have_no_byte_order():
    # numpy reports '|' for 1-byte types: they are the same in either order and stay supported
    assert DType.from_numpy(np.dtype(">i1")) is DType.INT8
    assert DType.from_numpy(np.dtype(">u1")) is DType.UINT8


@pytest.mark.parametrize("mtype", [MsgType.PROGRESS, MsgType.JOIN])
def test_progress_and_join_carry_a_seq_for_each_group_of_a_job(mtype):
    most = 16 * 65537  # a reducer's 65,536 groups and group 0
    assert protocol.unpack(Header(mtype, nbytes=most).pack()).nbytes == most
    rejects(Header(mtype, nbytes=most + 1).pack(), mtype.name, str(most + 1))
    pairs = {0: 7, 0xFFFFFFFFFFFFFFFF: 1 << 40}
    assert protocol.seq_pairs(protocol.seq_pairs_payload(pairs.items())) == pairs
    for bad, words in ((b"\0" * 15, "pairs"), (protocol.seq_pairs_payload([(1, 2)]) * 2, "twice")):
        with pytest.raises(ProtocolError, match=words):
            protocol.seq_pairs(bad)
