"""The native kernels' semantics against NumPy, per instruction-set level (the `isa` fixture):
integers wrap and average by truncation toward zero for any world size; floats keep NaN and
infinities, round 16-bit floats once, and widen and narrow float16 and bfloat16 exactly."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.kernel_reference import (
    HALF,
    OPS,
    WORLD,
    acc_dtype,
    assert_same,
    f32_to_bf16_by_definition,
    ml_dtypes,
    narrow,
    reference,
    trunc_div,
    widen,
)
from reduction_server import _native
from reduction_server.wire.protocol import DType, ReduceOp

# ------------------------------------------------------------------------------------------
# Integer semantics


@pytest.mark.parametrize("dtype", [d for d in DType if not d.is_float], ids=lambda d: d.name)
def test_integer_wraparound(isa, dtype):
    st = dtype.storage
    info = np.iinfo(st)
    n = 37  # through the vector loop of 8-bit types and a tail
    acc = np.full(n, info.max, st)
    _native.accumulate(acc, np.ones(n, st), int(dtype), int(ReduceOp.SUM))
    np.testing.assert_array_equal(acc, np.full(n, info.min, st))
    acc = np.full(n, info.max, st)
    _native.accumulate(acc, np.full(n, 3, st), int(dtype), int(ReduceOp.PROD))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(acc, np.full(n, info.max, st) * st.type(3))
    acc = np.full(n, info.min, st)
    _native.accumulate(acc, np.full(n, info.max, st), int(dtype), int(ReduceOp.MIN))
    np.testing.assert_array_equal(acc, np.full(n, info.min, st))
    _native.accumulate(acc, np.full(n, info.max, st), int(dtype), int(ReduceOp.MAX))
    np.testing.assert_array_equal(acc, np.full(n, info.max, st))


@pytest.mark.parametrize("dtype", [DType.INT8, DType.INT32, DType.INT64], ids=lambda d: d.name)
def test_integer_avg_truncates_toward_zero(isa, dtype):
    st = dtype.storage
    info = np.iinfo(st)
    sums = np.array([-7, 7, -6, 6, -1, 1, 0, info.min, info.max, info.min + 1], st)
    out = np.empty_like(sums)
    _native.store(sums, out, int(dtype), int(ReduceOp.AVG), 3)
    want = [abs(int(v)) // 3 * (-1 if v < 0 else 1) for v in sums]
    np.testing.assert_array_equal(out, np.array(want, st))
    assert list(out[:6]) == [-2, 2, -2, 2, 0, 0]  # C division, not floor division


def test_unsigned_avg():
    acc = np.array([0, 1, 2, 3, 255, 254], np.uint8)
    out = np.empty_like(acc)
    _native.store(acc, out, DType.UINT8, ReduceOp.AVG, 2)
    np.testing.assert_array_equal(out, [0, 0, 1, 1, 127, 127])
    acc = np.array([2**64 - 1, 2**63], np.uint64)
    _native.store(acc, acc, DType.UINT64, ReduceOp.AVG, 3)
    np.testing.assert_array_equal(acc, np.array([(2**64 - 1) // 3, 2**63 // 3], np.uint64))


# Divisors around every power of two the reciprocal division depends on (1, 2^k - 1, 2^k,
# 2^k + 1, the 8-, 16-, 32- and 53-bit edges), then log-uniform ones up to 2^63 - 1.
EDGE_WORLDS = sorted(
    {
        1,
        2,
        3,
        5,
        6,
        7,
        9,
        10,
        100,
        127,
        641,
        1000,
        65535,
        65537,
        2**53 + 1,
        *(2**k + e for k in (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 33, 52, 53, 62) for e in (-1, 0, 1)),
        2**63 - 1,
    }
)


@pytest.mark.parametrize("dtype", [d for d in DType if not d.is_float], ids=lambda d: d.name)
def test_integer_avg_by_any_world(isa, dtype):
    """AVG divides exactly (C division) for every world: full-range values, the multiples of the
    world and their neighbours, the extremes, at lengths that cover vector bodies and tails."""
    st = dtype.storage
    info = np.iinfo(st)
    rng = np.random.default_rng(100 + int(dtype))
    worlds = EDGE_WORLDS + sorted({min(int(x), 2**63 - 1) for x in np.exp2(rng.uniform(0, 63, 60))})
    extremes = np.array([info.min, info.min + 1, info.max, info.max - 1, 0, 1, info.max // 2], st)
    for world in worlds:
        bound = int(info.max) // world  # multiples k * world of every k in [-bound, bound] fit
        k = rng.integers(-bound if info.min else 0, bound, 300, np.int64 if info.min else np.uint64, endpoint=True)
        multiples = np.concatenate([k.astype(object) * world + e for e in (-1, 0, 1)])
        multiples = multiples[(multiples >= int(info.min)) & (multiples <= int(info.max))].astype(st)
        acc = np.concatenate([rng.integers(info.min, info.max, 517, dtype=st, endpoint=True), multiples, extremes])
        out = np.full_like(acc, 99)
        _native.store(acc, out, int(dtype), int(ReduceOp.AVG), world)
        wide = acc.astype(np.int64) if st.itemsize < 8 else acc  # world fits: the reference's type
        np.testing.assert_array_equal(out, trunc_div(wide, world).astype(st), err_msg=f"world {world}")


# ------------------------------------------------------------------------------------------
# Float semantics


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.FLOAT32, DType.FLOAT64, DType.BFLOAT16], ids=lambda d: d.name)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_nan_and_inf(isa, dtype, op):
    nan, inf = np.nan, np.inf
    a = [nan, 1.0, nan, inf, -inf, inf, -inf, 2.0, -2.0, inf, nan, 0.0, -0.0, 5.0]
    b = [1.0, nan, nan, -inf, inf, inf, -inf, inf, -inf, 0.0, -inf, -0.0, 0.0, 3.0]
    a, b = np.array(a * 3, np.float32), np.array(b * 3, np.float32)  # 42: vectors and tails
    xa, xb = (narrow(v, dtype) if dtype in HALF else v.astype(dtype.storage) for v in (a, b))
    acc = np.empty(a.size, acc_dtype(dtype))
    _native.load(acc, xa, int(dtype))
    _native.accumulate(acc, xb, int(dtype), int(op))
    want_acc, want_out = reference([xa, xb], dtype, op, WORLD)
    assert_same(acc, want_acc, signed_zero_ties=op in (ReduceOp.MAX, ReduceOp.MIN))
    out = np.empty(a.size, dtype.storage)
    _native.store(acc, out, int(dtype), int(op), WORLD)
    assert_same(out, want_out, bf16=dtype is DType.BFLOAT16, signed_zero_ties=op in (ReduceOp.MAX, ReduceOp.MIN))
    if op in (ReduceOp.MAX, ReduceOp.MIN):  # NaN in either operand gives NaN
        assert np.isnan(widen(out, dtype)[:3]).all()


def test_half_rounds_once_at_the_end(isa):
    # 2048 + 1 + 1 in float16 steps is 2048 (each +1 is a tie, to even); in float32, 2050.
    for dtype, big in ((DType.FLOAT16, 2048.0), (DType.BFLOAT16, 256.0)):
        x = narrow(np.full(17, big, np.float32), dtype)
        one = narrow(np.ones(17, np.float32), dtype)
        acc = np.empty(17, np.float32)
        _native.load(acc, x, int(dtype))
        _native.accumulate(acc, one, int(dtype), int(ReduceOp.SUM))
        _native.accumulate(acc, one, int(dtype), int(ReduceOp.SUM))
        out = np.empty(17, dtype.storage)
        _native.store(acc, out, int(dtype), int(ReduceOp.SUM), WORLD)
        assert_same(out, narrow(np.full(17, big + 2, np.float32), dtype), bf16=dtype is DType.BFLOAT16)
        assert widen(out, dtype)[0] == big + 2


def test_avg_divides_once_in_float32(isa):
    # 1/3 rounded once: (1+1+1)/3 is exactly 1, where sum(1/3) would not be.
    x = np.full(33, 1.0, np.float16)
    acc = np.empty(33, np.float32)
    _native.load(acc, x, DType.FLOAT16)
    for _ in range(2):
        _native.accumulate(acc, x, DType.FLOAT16, ReduceOp.AVG)
    out = np.empty(33, np.float16)
    _native.store(acc, out, DType.FLOAT16, ReduceOp.AVG, 3)
    assert (out == 1).all()
    acc = np.full(33, 0.1, np.float32)
    _native.store(acc, acc, DType.FLOAT32, ReduceOp.AVG, 7)
    assert_same(acc, np.full(33, 0.1, np.float32) / np.float32(7))  # a float32 division


def _interesting_f32() -> np.ndarray:
    """Every float16 value, the float32 values around every float16 rounding boundary, the
    overflow and underflow edges, NaN payloads, and random bit patterns."""
    h = np.arange(0x10000, dtype=np.uint32).astype(np.uint16).view(np.float16)
    f = h.astype(np.float32)
    bits = f[np.isfinite(f)].view(np.uint32).astype(np.int64)
    mids = bits + (1 << 12)  # halfway to the next float16 (for normal values)
    near = np.concatenate([bits, mids, mids - 1, mids + 1, bits + 1, bits - 1])
    near = near[(near >= 0) & (near < 2**32)].astype(np.uint32)
    edges = np.array(
        [
            0x477FEFFF,
            0x477FF000,
            0x477FF001,
            0x47800000,
            0x33000000,
            0x33000001,
            0x32FFFFFF,
            0x387FFFFF,
            0x38800000,
            0x7F7FFFFF,
            0x7F800000,
            0x7F800001,
            0x7FBFFFFF,
            0x7FC00000,
            0x7FFFFFFF,
            0x00000001,
            0x007FFFFF,
            0x7F7F8000,
            0x7F7F7FFF,
            0x3F808000,
            0x3F818000,
            0x3F808001,
        ],
        np.uint32,
    )
    rnd = np.random.default_rng(5).integers(0, 2**32, 200_000, dtype=np.uint32)
    u = np.concatenate([near, edges, edges | 0x80000000, rnd])
    return u.view(np.float32)


def test_float16_widening_exhaustive(isa):
    h = np.arange(0x10000, dtype=np.uint32).astype(np.uint16).view(np.float16)
    acc = np.empty(h.size, np.float32)
    _native.load(acc, h, DType.FLOAT16)
    assert_same(acc, h.astype(np.float32))
    # accumulate widens the same way (0 + x is x for every x, -0 + -0 is -0)
    acc2 = np.where(np.signbit(h), np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    _native.accumulate(acc2, h, DType.FLOAT16, ReduceOp.SUM)
    assert_same(acc2, h.astype(np.float32))


def test_float16_narrowing(isa):
    f = _interesting_f32()
    out = np.empty(f.size, np.float16)
    _native.store(f, out, DType.FLOAT16, ReduceOp.SUM, 1)
    with np.errstate(over="ignore", invalid="ignore"):
        assert_same(out, f.astype(np.float16))
    nan = np.isnan(f)
    assert (out.view(np.uint16)[nan] & 0x0200).all(), "NaN must come out quiet"
    assert (np.signbit(out[nan]) == np.signbit(f[nan])).all()


def test_bfloat16_widening_exhaustive(isa):
    b = np.arange(0x10000, dtype=np.uint32).astype(np.uint16)
    acc = np.empty(b.size, np.float32)
    _native.load(acc, b, DType.BFLOAT16)
    np.testing.assert_array_equal(acc.view(np.uint32), b.astype(np.uint32) << 16)  # NaNs too


def test_bfloat16_narrowing(isa):
    f = _interesting_f32()
    out = np.empty(f.size, np.uint16)
    _native.store(f, out, DType.BFLOAT16, ReduceOp.SUM, 1)
    assert_same(out, f32_to_bf16_by_definition(f), bf16=True)
    nan = np.isnan(f)
    assert ((out[nan] & 0x7F80) == 0x7F80).all() and (out[nan] & 0x007F).all(), "NaN stays NaN"
    assert (out[nan] & 0x0040).all(), "NaN comes out quiet"
    assert ((out[nan] >> 15) == (f[nan].view(np.uint32) >> 31)).all(), "NaN keeps its sign"
    small_nan = np.array([0x7F800001, 0xFF800001, 0x7FFFFFFF], np.uint32).view(np.float32)
    got = np.empty(3, np.uint16)
    _native.store(small_nan, got, DType.BFLOAT16, ReduceOp.SUM, 1)
    assert list(got) == [0x7FC0, 0xFFC0, 0x7FFF]  # not inf, not a wrapped-around -0


def test_bfloat16_against_ml_dtypes(isa):
    if ml_dtypes is None:
        pytest.skip("ml_dtypes is not installed; the by-definition reference still ran")
    f = _interesting_f32()
    out = np.empty(f.size, np.uint16)
    _native.store(f, out, DType.BFLOAT16, ReduceOp.SUM, 1)
    with np.errstate(invalid="ignore"):
        assert_same(out, f.astype(ml_dtypes.bfloat16).view(np.uint16), bf16=True)


def test_all_isas_give_the_same_bits():
    """The SIMD paths and the portable scalar code (which also does the loop tails) agree on
    every bit, NaN payloads included."""
    f = _interesting_f32()
    h = np.arange(0x10000, dtype=np.uint32).astype(np.uint16)
    results = {}
    previous = _native.isa()
    try:
        for level in _native.available_isas():
            _native._select_isa(level)
            outs = []
            for dtype in HALF:
                widened = np.empty(h.size, np.float32)
                _native.load(widened, h, int(dtype))
                narrowed = np.empty(f.size, np.uint16)
                _native.store(f, narrowed, int(dtype), int(ReduceOp.AVG), 3)
                for op in (ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD):
                    acc = f[: h.size].copy()
                    _native.accumulate(acc, h, int(dtype), int(op))
                    outs.append(acc.view(np.uint32))
                outs += [widened.view(np.uint32), narrowed]
            results[level] = outs
    finally:
        _native._select_isa(previous)
    base = results["baseline"]
    for level, outs in results.items():
        for i, (got, want) in enumerate(zip(outs, base)):
            np.testing.assert_array_equal(got, want, err_msg=f"{level} output {i}")
