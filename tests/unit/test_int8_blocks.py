"""Block-scaled int8 (docs/protocol.md, "Formats"): the kernels (reduction_server._native, each
instruction-set level) against the NumPy reference bit for bit, its non-finite and tiny blocks,
and how the wire names and sizes the format."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import int8_blocks as ref
from reduction_server import _native
from reduction_server.errors import ProtocolError
from reduction_server.wire import protocol
from reduction_server.wire.formats import INT8_BLOCK, block_bytes, block_of, format_code
from reduction_server.wire.protocol import DType, Header, MsgType, ReduceOp

LENGTHS = [1, 7, 31, 255, 256, 257, 1000, 4099]  # one short block, whole blocks, tails, vector tails


def values(n: int, seed: int) -> np.ndarray:
    """Mixed magnitudes and signs, ties of the rounding (x.5 quanta) included."""
    rng = np.random.default_rng([seed, n])
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
    x[::17] = np.float32(0.5) * rng.integers(-250, 250, x[::17].size)  # halfway cases when absmax is 127
    return x


@pytest.mark.parametrize("block", [32, 256])
@pytest.mark.parametrize("n", LENGTHS)
def test_encode_and_decode_accumulate_match_numpy_bit_for_bit(isa, n, block):
    inputs = [values(n, seed) for seed in range(3)]
    encoded = []
    for x in inputs:
        out = np.full(block_bytes(n, block), 0xAB, np.uint8)  # garbage store_int8 must overwrite
        _native.store_int8(x, out, block)
        want = ref.encode(x, block)
        assert out.tobytes() == want.tobytes()
        encoded.append(out)
    acc = np.full(n, 123.0, np.float32)
    _native.load_int8(acc, encoded[0], block)
    assert acc.tobytes() == ref.decode(encoded[0], n, block).tobytes()
    for data in encoded[1:]:
        _native.accumulate_int8(acc, data, block)
    assert acc.tobytes() == ref.reduced(encoded, n, block).tobytes()


def test_the_error_of_a_round_trip_is_at_most_half_a_quantum(isa):
    x = values(4099, 9)
    out = np.empty(block_bytes(x.size, 256), np.uint8)
    _native.store_int8(x, out, 256)
    y = np.empty_like(x)
    _native.load_int8(y, out, 256)
    for start in range(0, x.size, 256):
        b, c = x[start : start + 256], y[start : start + 256]
        quantum = np.abs(b).max() / 127
        assert np.abs(b - c).max() <= quantum * (0.5 + 1e-5)
        assert np.abs(c).max() <= np.abs(b).max() * (1 + 1e-6)


def test_a_block_with_a_nan_or_an_infinity_decodes_as_nan_and_no_other_block_does(isa):
    x = values(1000, 3)
    x[5], x[300], x[999] = np.inf, np.nan, -np.inf  # blocks 0, 1 and the tail block 3
    out = np.empty(block_bytes(x.size, 256), np.uint8)
    _native.store_int8(x, out, 256)
    assert out.tobytes() == ref.encode(x, 256).tobytes()
    y = np.empty_like(x)
    _native.load_int8(y, out, 256)
    assert np.isnan(y[:512]).all() and np.isnan(y[768:]).all()
    assert np.isfinite(y[512:768]).all()
    acc = np.ones(1000, np.float32)
    _native.accumulate_int8(acc, out, 256)  # a NaN block poisons the sum it is added to
    assert np.isnan(acc[:512]).all() and np.isfinite(acc[512:768]).all()


def test_zero_and_tiny_blocks_encode_as_zeros(isa):
    x = np.zeros(600, np.float32)
    x[100:200] = np.float32(2.0**-100)  # block 0 below 2^-96: too small for 127 / absmax
    x[500] = np.float32(-(2.0**-90))  # block 1 above: quantized like any other
    out = np.empty(block_bytes(600, 256), np.uint8)
    _native.store_int8(x, out, 256)
    assert out.tobytes() == ref.encode(x, 256).tobytes()
    y = np.empty_like(x)
    _native.load_int8(y, out, 256)
    assert not y[:500].any() and not y[501:].any()
    assert y[500] == pytest.approx(x[500], rel=1e-6)
    assert not np.signbit(y[:256]).any()  # a zero scale times 0 is +0


def test_the_kernels_refuse_sizes_that_do_not_match():
    acc = np.zeros(300, np.float32)
    with pytest.raises(ValueError, match="300 elements in blocks of 256 take 308"):
        _native.load_int8(acc, np.zeros(300, np.uint8), 256)
    with pytest.raises(ValueError, match="block must be at least 1"):
        _native.store_int8(acc, np.zeros(308, np.uint8), 0)
    with pytest.raises(ValueError, match="writable"):
        _native.store_int8(acc, bytes(308), 256)


@pytest.mark.parametrize("block", [32, 64, 256, 4096, 1 << 16])
@pytest.mark.parametrize("count", [1, 31, 32, 33, 255, 256, 257, 1000, 100_003, 300_000])
def test_the_block_size_is_read_from_the_payload_size(count, block):
    found = block_of(count, block_bytes(count, block))
    if count > block:
        assert found == block  # two blocks or more: only one power of two gives that size
    else:
        assert block_bytes(count, found) == count + 4  # one block reads the same whatever B
    assert block_of(count, count) is None and block_of(count, count + 3) is None


def data(dtype: int, count: int, nbytes: int, op=ReduceOp.SUM, mtype=MsgType.DATA) -> bytes:
    return protocol.data_header(
        mtype, dtype=dtype, op=op, rank=0, world=2, job=1, generation=0, seq=0, chunk=0, nchunks=1,
        offset=0, count=count, total=count, nbytes=nbytes,
    )  # fmt: skip


def test_a_header_names_a_compressed_format_up_and_down():
    code = format_code(INT8_BLOCK, DType.BFLOAT16)
    assert code == 0x9C and format_code(INT8_BLOCK, INT8_BLOCK) == INT8_BLOCK
    h = protocol.unpack(data(code, 1000, block_bytes(1000, 256)))
    assert (h.dtype, h.block) == (code, 256)
    assert protocol.format_name(code) == "int8 blocks up, bfloat16 down"
    result = protocol.unpack(data(code, 1000, 2000, mtype=MsgType.RESULT))  # 1000 x bfloat16
    assert result.block == 0
    assert protocol.unpack(data(DType.FLOAT32, 10, 40)).dtype == DType.FLOAT32  # unchanged


@pytest.mark.parametrize(
    "dtype,op,mtype,nbytes,message",
    [
        (13, ReduceOp.SUM, MsgType.DATA, 100, "unknown dtype \\(format\\) code 13"),
        (0x8C, ReduceOp.SUM, MsgType.DATA, 1004, r"unknown dtype \(format\) code 140 \(up 12, down 8\)"),
        (INT8_BLOCK, ReduceOp.MAX, MsgType.DATA, 1004, "sums and averages only, not op code 2"),
        (INT8_BLOCK, ReduceOp.SUM, MsgType.DATA_SHM, 1004, "a compressed chunk travels as a frame"),
        (INT8_BLOCK, ReduceOp.SUM, MsgType.DATA, 1003, "are not 1000 elements in int8 blocks"),
        (0x7C, ReduceOp.SUM, MsgType.FINAL, 1004, "1000 x float32 is 4000"),
    ],
)
def test_a_malformed_compressed_header_is_refused_by_name(dtype, op, mtype, nbytes, message):
    with pytest.raises(ProtocolError, match=message):
        protocol.unpack(data(dtype, 1000, nbytes, op, mtype))


def test_header_unchanged_for_element_types():
    h = Header(MsgType.DATA, dtype=DType.BFLOAT16)
    assert h.block == 0 and len(h.pack()) == protocol.HEADER_SIZE
