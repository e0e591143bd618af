"""NumPy references for the native kernels (reduction_server._native): widening, narrowing
(bfloat16 rounding computed from its definition), the reduction of W inputs, bitwise comparison
with NaNs as NaNs, and inputs that exercise every path (specials, subnormals, wraparound)."""

from __future__ import annotations

import numpy as np

from reduction_server.wire.protocol import DType, ReduceOp

try:
    import ml_dtypes
except ImportError:  # the numpy reference covers bfloat16 without it
    ml_dtypes = None

OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG]
LENGTHS = [1, 7, 1023, 4097]  # scalar only, scalar tail, vector + tails of every width
WORLD = 3
HALF = (DType.FLOAT16, DType.BFLOAT16)
UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
}


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


def assert_same(got: np.ndarray, want: np.ndarray, *, bf16: bool = False, signed_zero_ties: bool = False):
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
