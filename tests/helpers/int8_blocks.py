"""A NumPy reference of the int8 block format (docs/protocol.md, "Formats"): encoding, decoding,
and the reducer's decode-sum-encode in rank order, in the same float32 operations as the kernels."""

from __future__ import annotations

from typing import Any, List

import numpy as np

NAN_SCALE = np.uint32(0x7FC00000).view(np.float32)
TINY_BITS = 0x0F800000  # 2^-96
F32 = np.float32


def _rows(x: np.ndarray, block: int):
    """x's whole blocks as rows, then its tail block as a row of its own (if any)."""
    full = x.size // block * block
    rows = [x[:full].reshape(-1, block)]
    return rows + [x[full:].reshape(1, -1)] if full < x.size else rows


def encode(x: np.ndarray, block: int) -> np.ndarray:
    """float32 values as int8 blocks: bytes."""
    x = np.ascontiguousarray(x, F32)
    parts = []
    for b in _rows(x, block):
        top = (b.view(np.uint32) & 0x7FFFFFFF).max(axis=1, initial=0)
        amax = np.maximum(top, TINY_BITS).astype(np.uint32).view(F32)  # kept finite where it is not used
        amax = np.where(top >= 0x7F800000, F32(1), amax)
        s = np.where(top >= 0x7F800000, NAN_SCALE, np.where(top < TINY_BITS, F32(0), amax / F32(127))).astype(F32)
        with np.errstate(invalid="ignore"):  # a non-finite block's values are replaced by zeros below
            q = np.clip(np.rint(b * (F32(127) / amax)[:, None]), -127, 127).astype(np.int8)
        q[(top >= 0x7F800000) | (top < TINY_BITS)] = 0
        parts.append(np.concatenate([s.astype("<f4")[:, None].view(np.uint8), q.view(np.uint8)], axis=1).ravel())
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def decode(data: np.ndarray, count: int, block: int) -> np.ndarray:
    """int8 blocks as float32: scale x value, rounded to float32."""
    data = np.asarray(data, np.uint8)
    full, out = count // block, []
    rows = data[: full * (block + 4)].reshape(full, block + 4)
    if count > full * block:
        rows = [rows, data[full * (block + 4) :].reshape(1, -1)]
    else:
        rows = [rows]
    for r in rows:
        s = np.ascontiguousarray(r[:, :4]).view("<f4").astype(F32)
        out.append((s * np.ascontiguousarray(r[:, 4:]).view(np.int8).astype(F32)).ravel())
    return np.concatenate(out)


def reduced(encoded: List[np.ndarray], count: int, block: int, average: bool = False) -> np.ndarray:
    """The reducer's float32 sum (or average) of the ranks' int8 blocks, in rank order."""
    acc = decode(encoded[0], count, block)
    for data in encoded[1:]:
        acc = acc + decode(data, count, block)
    return acc / F32(len(encoded)) if average else acc


def allreduced(xs: List[np.ndarray], block: int, average: bool = False) -> np.ndarray:
    """What every rank gets of an int8 all-reduce of the ranks' `xs`: each encoded, decoded and
    summed (averaged), the sum encoded once and decoded."""
    total = reduced([encode(x, block) for x in xs], xs[0].size, block, average)
    return decode(encode(total, block), total.size, block)


def matches(got: Any, want: np.ndarray, world: int, block: int) -> bool:
    """Bit for bit at W=2 (a sum of two has one order); else within one quantum of want's block
    (the reducers sum three in any order, and a last bit may round to the next step)."""
    got = np.array(got, F32)
    if world == 2:
        return np.array_equal(got, want)
    padded = np.concatenate([np.abs(want), np.zeros(-want.size % block, F32)])  # whole blocks
    quantum = np.repeat(padded.reshape(-1, block).max(axis=1) / 127, block)[: want.size]
    return bool(np.all(np.abs(got - want) <= quantum * 1.001))
