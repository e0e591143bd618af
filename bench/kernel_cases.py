"""The reducer's kernels and their NumPy peers, one case per dtype x op, on equal operands.

Accumulate cases time `acc = op(acc, widen(src))` (what the reducer does for every contribution
after the first); AVG times the final store (divide once, narrow to the wire dtype). The int8
case times a contribution of int8 blocks decoded into the float32 accumulator beside NumPy's
float32 add of as many elements (what an uncompressed contribution costs).
"""

from __future__ import annotations

from typing import Callable, Tuple

import numpy as np

from reduction_server import _native
from reduction_server.config import settings
from reduction_server.wire.formats import block_bytes
from reduction_server.wire.protocol import DType, ReduceOp

OPS = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG)
WORLD = 3
_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}


def _widen_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def case(dtype: DType, op: ReduceOp, acc_bytes: int) -> Tuple[Callable[[], None], Callable[[], None], int]:
    """(ours, numpy's, bytes of accumulator touched) for one dtype x op over acc_bytes."""
    acc_type = dtype.accumulator.storage
    n = max(1, acc_bytes // acc_type.itemsize)
    rng = np.random.default_rng(0)
    acc = np.ones(n, acc_type)
    if dtype is DType.BFLOAT16:
        src = (rng.uniform(0.5, 1.5, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        src = (
            rng.integers(1, 3, n).astype(dtype.storage)
            if not dtype.is_float
            else rng.uniform(0.5, 1.5, n).astype(dtype.storage)
        )
    if op is ReduceOp.AVG:
        dst = np.empty(n, dtype.storage)

        def ours() -> None:
            _native.store(acc, dst, dtype, op, WORLD)

        def theirs() -> None:
            if dtype is DType.BFLOAT16:
                dst[:] = np.divide(acc, WORLD).view(np.uint32) >> 16  # truncates: less work than numpy would do
            elif dtype.is_float:
                np.divide(acc, WORLD, out=dst, casting="unsafe")
            else:
                np.floor_divide(acc, WORLD, out=dst)

        return ours, theirs, acc.nbytes

    ufunc = _UFUNC[op]

    def ours() -> None:
        _native.accumulate(acc, src, dtype, op)

    if dtype is DType.BFLOAT16:

        def theirs() -> None:
            ufunc(acc, _widen_bf16(src), out=acc)
    else:

        def theirs() -> None:
            ufunc(acc, src, out=acc)  # float16 into float32: numpy's mixed-type loop

    return ours, theirs, acc.nbytes


def int8_case(acc_bytes: int) -> Tuple[Callable[[], None], Callable[[], None], int]:
    """(ours: acc += decode(int8 blocks), numpy's: float32 acc += float32, bytes of accumulator)."""
    n = max(1, acc_bytes // 4)
    block = settings.read("RS_INT8_BLOCK")
    values = np.random.default_rng(0).uniform(0.5, 1.5, n).astype(np.float32)
    blocks = np.empty(block_bytes(n, block), np.uint8)
    _native.store_int8(values, blocks, block)
    acc = np.ones(n, np.float32)

    def ours() -> None:
        _native.accumulate_int8(acc, blocks, block)

    def theirs() -> None:
        np.add(acc, values, out=acc)

    return ours, theirs, acc.nbytes
