"""Deterministic per-rank inputs and NumPy references for every dtype x op."""

from __future__ import annotations

from typing import List

import ml_dtypes
import numpy as np

DTYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "bfloat16", "float32", "float64"]
OPS = ["sum", "prod", "min", "max", "avg"]
#: op name -> the all-reduce of two ranks' values
TWO_RANKS = {
    "sum": lambda a, b: a + b,
    "prod": lambda a, b: a * b,
    "min": np.minimum,
    "max": np.maximum,
    "avg": lambda a, b: (a + b) / 2,
}


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def make_input(dtype: str, op: str, count: int, seed: int, rank: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    dt = np_dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        if op == "prod":  # small factors: the product still wraps sometimes, and must match
            return rng.integers(max(info.min, -3), 4, count, dtype=dt)
        return rng.integers(info.min, info.max, count, dtype=dt, endpoint=True)
    if op == "prod":
        values = rng.uniform(0.5, 1.5, count)
    else:
        values = rng.uniform(-100, 100, count)
    return values.astype(np.float32).astype(dt)


def reference(inputs: List[np.ndarray], dtype: str, op: str) -> np.ndarray:
    dt = np_dtype(dtype)
    world = len(inputs)
    if dt.kind in "iu":
        stack = np.stack(inputs)
        if op in ("sum", "avg"):
            total = np.sum(stack, axis=0, dtype=dt)  # wraps like the reducer
            if op == "sum":
                return total
            quotient = total // world
            if dt.kind == "i":  # C division truncates toward zero
                quotient = quotient + ((total % world != 0) & (total < 0))
            return quotient.astype(dt)
        if op == "prod":
            return np.prod(stack, axis=0, dtype=dt)
        return (np.min if op == "min" else np.max)(stack, axis=0)
    # Floats: 16-bit types accumulate in float32 on the reducer; the reference sums in float64.
    stack = np.stack([x.astype(np.float64) for x in inputs])
    result = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op if op != "avg" else "sum"](stack, axis=0)
    if op == "avg":
        result = result / world
    return result.astype(dt)


def tolerance(dtype: str, world: int) -> dict:
    """Room for accumulation order and one final rounding."""
    eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}[dtype]
    return {"rtol": 2 * eps, "atol": 400 * world * max(eps, 2.0**-23)}


def check(result: np.ndarray, inputs: List[np.ndarray], dtype: str, op: str) -> str:
    """'' if result matches the reference, else what differs."""
    ref = reference(inputs, dtype, op)
    dt = np_dtype(dtype)
    if result.dtype != dt or result.shape != ref.shape:
        return f"got {result.dtype}{result.shape}, expected {dt}{ref.shape}"
    if dt.kind in "iu" or op in ("min", "max"):
        bad = np.flatnonzero(result.view(f"u{dt.itemsize}") != ref.view(f"u{dt.itemsize}"))
    else:
        r64, ref64 = result.astype(np.float64), ref.astype(np.float64)
        tol = tolerance(dtype, len(inputs))
        bad = np.flatnonzero(np.abs(r64 - ref64) > tol["atol"] + tol["rtol"] * np.abs(ref64))
    if bad.size:
        i = bad[0]
        return f"{bad.size} elements differ, first at {i}: got {result[i]!r}, expected {ref[i]!r}"
    return ""


def assert_close(got, want, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """got equals want, elementwise within rtol and atol (same shape); the message names `what`
    and the largest error."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    assert np.allclose(got, want, rtol=rtol, atol=atol), f"{what}: max error {err}"
