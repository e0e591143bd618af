"""The native reduction kernels (reduction_server._native, built from native/) against NumPy.

Every test that computes runs once per instruction-set level this CPU supports (baseline C,
AVX2+F16C, AVX-512), so the portable fallback is tested on the same machine as the SIMD paths.
Exact semantics are compared bit for bit; NaNs are compared as NaNs (payloads may differ).
"""
from __future__ import annotations

import numpy as np
import pytest

from reduction_server import _native
from reduction_server.protocol import DType, ReduceOp

try:
    import ml_dtypes
except ImportError:  # the numpy reference below covers bfloat16 without it
    ml_dtypes = None

OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG]
LENGTHS = [1, 7, 1023, 4097]  # scalar only, scalar tail, vector + tails of every width
WORLD = 3
HALF = (DType.FLOAT16, DType.BFLOAT16)
UFUNC = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
         ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}


@pytest.fixture(params=_native.available_isas())
def isa(request):
    previous = _native._select_isa(request.param)
    assert _native.isa() == request.param
    yield request.param
    _native._select_isa(previous)


def test_best_isa_is_selected_by_default():
    assert _native.isa() == _native.available_isas()[-1]
    assert _native.available_isas()[0] == "baseline"
    with pytest.raises(ValueError, match="unknown ISA"):
        _native._select_isa("sse9")


# ------------------------------------------------------------------------------------------
# References

def acc_dtype(dtype: DType) -> np.dtype:
    return dtype.accumulator.storage


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_by_definition(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even), computed from the definition in
    float64 rather than with the bit trick the kernels use."""
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32)
    sign = (u >> 16) & 0x8000
    lo = (u >> 16) & 0x7FFF  # truncated magnitude, and the next one up
    hi = lo + 1

    def value(m):  # bfloat16 magnitude bits -> float64, with 0x7F80 read as 2^128 (not inf)
        e, f = (m >> 7).astype(np.int64), (m & 0x7F).astype(np.float64)
        return np.where(e == 0, f / 128 * 2.0**-126, (1 + f / 128) * np.exp2(e - 127.0))

    with np.errstate(invalid="ignore", over="ignore"):
        mag = np.abs(x.astype(np.float64))
        d_lo, d_hi = mag - value(lo), value(hi) - mag
        up = (d_hi < d_lo) | ((d_hi == d_lo) & ((lo & 1) == 1))
    out = (sign | np.where(up, hi, lo)).astype(np.uint16)
    out[np.isinf(x)] = (sign[np.isinf(x)] | 0x7F80).astype(np.uint16)
    out[np.isnan(x)] = (sign[np.isnan(x)] | 0x7FC0).astype(np.uint16)
    return out


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    if ml_dtypes is not None:
        with np.errstate(invalid="ignore"):
            return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    return f32_to_bf16_by_definition(x)


def widen(x: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype is DType.FLOAT16:
        return x.astype(np.float32)
    if dtype is DType.BFLOAT16:
        return bf16_to_f32(x)
    return x.copy()


def narrow(acc: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype is DType.FLOAT16:
        with np.errstate(over="ignore", invalid="ignore"):
            return acc.astype(np.float16)
    if dtype is DType.BFLOAT16:
        return f32_to_bf16(acc)
    return acc.copy()


def trunc_div(s: np.ndarray, world: int) -> np.ndarray:
    """C integer division (toward zero), without overflow for any int64."""
    w = s.dtype.type(world)
    if s.dtype.kind == "u":
        return s // w
    return (s - np.fmod(s, w)) // w  # s - fmod(s, w) is an exact multiple of w


def reference(inputs, dtype: DType, op: ReduceOp, world: int):
    """(accumulator, stored result) for a load of inputs[0] and accumulates of the rest."""
    acc = widen(inputs[0], dtype)
    with np.errstate(all="ignore"):
        for x in inputs[1:]:
            acc = UFUNC[op](acc, widen(x, dtype))
        stored = acc
        if op is ReduceOp.AVG:
            stored = trunc_div(acc, world) if acc.dtype.kind in "iu" else acc / acc.dtype.type(world)
    return acc, narrow(stored, dtype)


def assert_same(got: np.ndarray, want: np.ndarray, *, bf16: bool = False,
                signed_zero_ties: bool = False):
    """Bitwise equality, except that any NaN matches any NaN. bf16: the uint16 arrays hold
    bfloat16 bits. With signed_zero_ties, +0 and -0 compare equal (MAX/MIN of +0 and -0 may
    return either)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.kind in "iu" and not bf16:
        np.testing.assert_array_equal(got, want)
        return
    if bf16:
        got_f, want_f = bf16_to_f32(got), bf16_to_f32(want)
    else:
        got_f, want_f = got, want
    nan = np.isnan(want_f)
    np.testing.assert_array_equal(np.isnan(got_f), nan, err_msg="NaN positions differ")
    if signed_zero_ties:
        np.testing.assert_array_equal(got_f[~nan], want_f[~nan])
    else:
        uint = np.dtype(f"u{got.dtype.itemsize}")
        np.testing.assert_array_equal(got[~nan].view(uint), want[~nan].view(uint))


# ------------------------------------------------------------------------------------------
# Inputs

def make_input(rng: np.random.Generator, dtype: DType, op: ReduceOp, n: int) -> np.ndarray:
    st = dtype.storage
    if st.kind in "iu":  # full range: sums and products wrap
        info = np.iinfo(st)
        return rng.integers(info.min, info.max, n, dtype=st, endpoint=True)
    if op is ReduceOp.PROD:
        values = rng.uniform(-2.0, 2.0, n)
    elif dtype is DType.FLOAT16:
        values = rng.normal(0, 300, n)  # sums need rounding back to float16
    else:
        values = rng.normal(0, 1e3, n) * rng.choice([1e-30, 1.0, 1e30], n, p=[0.1, 0.8, 0.1])
    specials = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e-45, 65504.0, 1e-7, 3.0e38]
    if n >= 7:  # sprinkle NaN, infinities, signed zeros, subnormals, huge values
        where = rng.choice(n, size=max(1, n // 20), replace=False)
        values[where] = rng.choice(specials, where.size)
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype is DType.BFLOAT16:
            return f32_to_bf16(values.astype(np.float32))
        return values.astype(st)


# ------------------------------------------------------------------------------------------
# The dtype x op matrix

@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_matrix(isa, dtype, op, n):
    rng = np.random.default_rng([int(dtype), int(op), n])
    inputs = [make_input(rng, dtype, op, n) for _ in range(4)]  # a load, then 3 accumulates
    want_acc, want_out = reference(inputs, dtype, op, WORLD)

    acc = np.full(n, 123, acc_dtype(dtype))  # garbage that load must overwrite
    _native.load(acc, inputs[0], int(dtype))
    assert_same(acc, widen(inputs[0], dtype))
    for x in inputs[1:]:
        _native.accumulate(acc, x, int(dtype), int(op))
    ties = op in (ReduceOp.MAX, ReduceOp.MIN)
    assert_same(acc, want_acc, signed_zero_ties=ties)

    out = np.full(n, 77, dtype.storage)
    _native.store(acc, out, int(dtype), int(op), WORLD)
    assert_same(out, want_out, bf16=dtype is DType.BFLOAT16, signed_zero_ties=ties)
    assert_same(acc, want_acc, signed_zero_ties=ties)  # store leaves a separate acc alone


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.FLOAT64, DType.INT32, DType.UINT8],
                         ids=lambda d: d.name)
def test_store_in_place(isa, dtype):
    rng = np.random.default_rng(int(dtype))
    inputs = [make_input(rng, dtype, ReduceOp.SUM, 1023) for _ in range(3)]
    want_acc, want_avg = reference(inputs, dtype, ReduceOp.AVG, WORLD)
    acc = inputs[0].copy()
    for x in inputs[1:]:
        _native.accumulate(acc, x, int(dtype), int(ReduceOp.AVG))
    for op in (ReduceOp.SUM, ReduceOp.MAX):  # nothing to do: acc stays as it is
        _native.store(acc, acc, int(dtype), int(op), WORLD)
        assert_same(acc, want_acc)
    _native.store(acc, acc, int(dtype), int(ReduceOp.AVG), WORLD)  # divides in place
    assert_same(acc, want_avg)
    # The same memory through two different objects counts as the same buffer too.
    acc2 = want_acc.copy()
    _native.store(acc2, memoryview(acc2).cast("B"), int(dtype), int(ReduceOp.AVG), WORLD)
    assert_same(acc2, want_avg)


def test_accumulate_into_itself(isa):
    acc = np.arange(1027, dtype=np.float32)
    _native.accumulate(acc, acc, DType.FLOAT32, ReduceOp.SUM)
    assert_same(acc, np.arange(1027, dtype=np.float32) * 2)


def test_enums_and_plain_ints_are_accepted():
    acc = np.zeros(4, np.float32)
    _native.load(acc, np.ones(4, np.float16), DType.FLOAT16)
    _native.accumulate(acc, np.ones(4, np.float16), DType.FLOAT16, ReduceOp.AVG)
    out = np.zeros(4, np.float16)
    _native.store(acc, out, np.int64(6), np.int32(4), np.int64(2))
    assert_same(out, np.ones(4, np.float16))


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
EDGE_WORLDS = sorted({1, 2, 3, 5, 6, 7, 9, 10, 100, 127, 641, 1000, 65535, 65537, 2**53 + 1,
                      *(2**k + e for k in (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 33, 52, 53, 62)
                        for e in (-1, 0, 1)), 2**63 - 1})


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
        acc = np.concatenate([rng.integers(info.min, info.max, 517, dtype=st, endpoint=True), multiples,
                              extremes])
        out = np.full_like(acc, 99)
        _native.store(acc, out, int(dtype), int(ReduceOp.AVG), world)
        wide = acc.astype(np.int64) if st.itemsize < 8 else acc  # world fits: the reference's type
        np.testing.assert_array_equal(out, trunc_div(wide, world).astype(st), err_msg=f"world {world}")


# ------------------------------------------------------------------------------------------
# Float semantics

@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.FLOAT32, DType.FLOAT64, DType.BFLOAT16],
                         ids=lambda d: d.name)
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
    assert_same(out, want_out, bf16=dtype is DType.BFLOAT16,
                signed_zero_ties=op in (ReduceOp.MAX, ReduceOp.MIN))
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
        assert_same(out, narrow(np.full(17, big + 2, np.float32), dtype),
                    bf16=dtype is DType.BFLOAT16)
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
    edges = np.array([0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0x33000000, 0x33000001,
                      0x32FFFFFF, 0x387FFFFF, 0x38800000, 0x7F7FFFFF, 0x7F800000, 0x7F800001,
                      0x7FBFFFFF, 0x7FC00000, 0x7FFFFFFF, 0x00000001, 0x007FFFFF, 0x7F7F8000,
                      0x7F7F7FFF, 0x3F808000, 0x3F818000, 0x3F808001], np.uint32)
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


# ------------------------------------------------------------------------------------------
# Buffers

def test_any_buffer_object_by_dtype_code():
    src = np.array([1.5, -2.0, 3.25], np.float16)
    acc = bytearray(12)  # 3 x float32
    _native.load(acc, memoryview(src.tobytes()), DType.FLOAT16)  # read-only src is fine
    np.testing.assert_array_equal(np.frombuffer(acc, np.float32), [1.5, -2.0, 3.25])
    _native.accumulate(acc, src.view(np.uint8), DType.FLOAT16, ReduceOp.SUM)
    dst = np.zeros((3, 2), np.uint8)  # any shape and format: only the bytes count
    _native.store(memoryview(acc), dst, DType.FLOAT16, ReduceOp.SUM, 1)
    np.testing.assert_array_equal(dst.reshape(-1).view(np.float16), [3.0, -4.0, 6.5])
    acc2d = np.zeros((2, 3), np.int32)
    _native.load(acc2d, np.arange(6, dtype=np.int32).tobytes(), DType.INT32)
    np.testing.assert_array_equal(acc2d, np.arange(6).reshape(2, 3))


def test_empty_is_a_noop():
    for dtype in DType:
        acc = np.empty(0, acc_dtype(dtype))
        src = np.empty(0, dtype.storage)
        _native.load(acc, src, int(dtype))
        _native.accumulate(acc, src, int(dtype), int(ReduceOp.PROD))
        _native.store(acc, src, int(dtype), int(ReduceOp.AVG), WORLD)
    _native.load(bytearray(), b"", DType.FLOAT16)


# ------------------------------------------------------------------------------------------
# Errors

def test_size_mismatch_names_sizes_and_dtype():
    with pytest.raises(ValueError) as e:
        _native.load(np.zeros(3, np.float32), np.zeros(4, np.float16), DType.FLOAT16)
    msg = str(e.value)
    assert "12 bytes (3 x float32)" in msg and "8 bytes (4 x float16)" in msg
    with pytest.raises(ValueError, match=r"accumulator holds 16 bytes \(4 x int32\).*24 bytes \(6 x int32\)"):
        _native.accumulate(np.zeros(4, np.int32), np.zeros(6, np.int32), DType.INT32, ReduceOp.SUM)
    with pytest.raises(ValueError, match="13 bytes.*not a whole number of float32"):
        _native.accumulate(bytearray(13), np.zeros(4, np.float16), DType.BFLOAT16, ReduceOp.SUM)
    with pytest.raises(ValueError, match=r"destination holds 16 bytes \(8 x float16\).*16 bytes \(4 x float32\)"):
        _native.store(np.zeros(4, np.float32), np.zeros(8, np.float16), DType.FLOAT16, ReduceOp.SUM, 1)
    with pytest.raises(ValueError, match=r"destination holds 8 bytes.*\(1 x float64\).*2 x float64"):
        _native.store(np.zeros(2), np.zeros(1), DType.FLOAT64, ReduceOp.SUM, 1)


def test_partial_elements():
    with pytest.raises(ValueError, match="7 bytes, not a whole number of float16"):
        _native.load(np.zeros(4, np.float32), bytes(7), DType.FLOAT16)
    with pytest.raises(ValueError, match="10 bytes, not a whole number of int64"):
        _native.accumulate(bytearray(8), bytes(10), DType.INT64, ReduceOp.SUM)
    with pytest.raises(ValueError, match="6 bytes, not a whole number of float32"):
        _native.store(bytearray(6), bytearray(3), DType.FLOAT16, ReduceOp.SUM, 1)


@pytest.mark.parametrize("which", ["acc", "src", "dst"])
def test_non_contiguous(which):
    acc, src, dst = np.zeros(4, np.float32), np.zeros(4, np.float16), np.zeros(4, np.float16)
    strided = {"acc": np.zeros(8, np.float32)[::2], "src": np.zeros(8, np.float16)[::2],
               "dst": np.zeros(8, np.float16)[::2]}[which]
    role = {"acc": "accumulator", "src": "contribution", "dst": "destination"}[which]
    args = {"acc": acc, "src": src, "dst": dst}
    args[which] = strided
    with pytest.raises(ValueError, match=f"{role} must be C-contiguous"):
        if which == "dst":
            _native.store(args["acc"], args["dst"], DType.FLOAT16, ReduceOp.SUM, 1)
        else:
            _native.accumulate(args["acc"], args["src"], DType.FLOAT16, ReduceOp.SUM)
    with pytest.raises(ValueError, match="must be C-contiguous"):
        _native.load(memoryview(bytearray(32))[::2], bytes(8), DType.FLOAT16)
    with pytest.raises(ValueError, match="must be C-contiguous"):
        _native.load(np.zeros((4, 4), np.float32).T, np.zeros(16, np.float32), DType.FLOAT32)


def test_read_only():
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="accumulator must be writable"):
        _native.load(ro, np.zeros(4, np.float32), DType.FLOAT32)
    with pytest.raises(ValueError, match="accumulator must be writable"):
        _native.accumulate(bytes(16), np.zeros(4, np.float32), DType.FLOAT32, ReduceOp.SUM)
    with pytest.raises(ValueError, match="destination must be writable"):
        _native.store(np.zeros(4, np.float32), bytes(8), DType.FLOAT16, ReduceOp.SUM, 1)
    with pytest.raises(ValueError, match="destination must be writable"):
        _native.store(ro, ro, DType.FLOAT32, ReduceOp.AVG, 2)
    _native.store(ro, np.zeros(4, np.float32), DType.FLOAT32, ReduceOp.AVG, 2)  # acc is only read


def test_not_a_buffer():
    with pytest.raises(TypeError, match="buffer protocol"):
        _native.load(np.zeros(4, np.float32), [1.0, 2.0], DType.FLOAT32)
    with pytest.raises(TypeError, match="buffer protocol"):
        _native.store(np.zeros(4, np.float32), None, DType.FLOAT32, ReduceOp.SUM, 1)


@pytest.mark.parametrize("code", [10, -1, 64, 255, 2**70])
def test_bad_dtype_code(code):
    buf = np.zeros(8, np.float64)
    with pytest.raises(ValueError, match=f"unknown dtype code {code}"):
        _native.load(buf, buf.copy(), code)
    with pytest.raises(ValueError, match=f"unknown dtype code {code}"):
        _native.accumulate(buf, buf.copy(), code, ReduceOp.SUM)
    with pytest.raises(ValueError, match=f"unknown dtype code {code}"):
        _native.store(buf, buf.copy(), code, ReduceOp.SUM, 1)
    with pytest.raises(ValueError, match="dtype code must be an integer"):
        _native.load(buf, buf.copy(), "float32")


@pytest.mark.parametrize("code", [5, -1, int(ReduceOp.BROADCAST), 2**70])
def test_bad_op_code(code):
    buf = np.zeros(8, np.float64)
    with pytest.raises(ValueError, match=f"unknown reduction op code {code}"):
        _native.accumulate(buf, buf.copy(), DType.FLOAT64, code)
    with pytest.raises(ValueError, match=f"unknown reduction op code {code}"):
        _native.store(buf, buf.copy(), DType.FLOAT64, code, 1)
    with pytest.raises(ValueError, match="op code must be an integer"):
        _native.accumulate(buf, buf.copy(), DType.FLOAT64, 1.0)


@pytest.mark.parametrize("world", [0, -3, "3", 2.0])
def test_bad_world_for_avg(world):
    buf = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="world must be a positive integer"):
        _native.store(buf, buf, DType.FLOAT32, ReduceOp.AVG, world)


def test_overlap_that_is_not_aliasing():
    buf = np.zeros(16, np.float32)
    with pytest.raises(ValueError, match="overlap"):  # float16 store needs its own buffer
        _native.store(buf, buf.view(np.uint8)[:32], DType.FLOAT16, ReduceOp.SUM, 1)
    with pytest.raises(ValueError, match="overlap"):
        _native.accumulate(buf[:8], buf[4:12], DType.FLOAT32, ReduceOp.SUM)
    with pytest.raises(ValueError, match="overlap"):
        _native.load(buf[:8], buf.view(np.uint16)[:8], DType.BFLOAT16)
    np.testing.assert_array_equal(buf, 0)
