"""Type stubs for reduction_server._native (built from native/_native.pyx).

Buffers are any C-contiguous objects exporting the buffer protocol; their bytes are read as the
`dtype` code says (DType, NCCL numbering), whatever their own format. Codes are ints or
DType / ReduceOp members.
"""

from typing import Optional, Sequence, Tuple, Union

from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

from .protocol import DType, ReduceOp

DTYPE_NAMES: Tuple[str, ...]
OP_NAMES: Tuple[str, ...]

def load(acc: Buffer, src: Buffer, dtype: Union[int, DType]) -> None:
    """acc[:] = widen(src). acc holds len(src) elements of dtype's accumulator type."""

def accumulate(acc: Buffer, src: Buffer, dtype: Union[int, DType], op: Union[int, ReduceOp]) -> None:
    """acc[:] = op(acc, widen(src)) elementwise; AVG accumulates like SUM."""

def load_int8(acc: Buffer, src: Buffer, block: int) -> None:
    """acc[:] = decode(src): float32 from int8 blocks of `block` elements (formats.py)."""

def accumulate_int8(acc: Buffer, src: Buffer, block: int) -> None:
    """acc[:] += decode(src), in float32."""

def store_int8(acc: Buffer, dst: Buffer, block: int) -> None:
    """dst[:] = encode(acc): float32 to int8 blocks; a block with a NaN or infinity decodes as NaN."""

def accumulate_copies(
    acc: Buffer, src: Buffer, dtype: Union[int, DType], op: Union[int, ReduceOp], world: int, outs: Sequence[Buffer]
) -> None:
    """The last accumulate(), and each of outs as store(acc, out, dtype, op, world) gives it, a
    block at a time while it is in cache (acc divided in place for AVG of a dtype that
    accumulates in itself, left the float32 sum for FLOAT16 and BFLOAT16); an out may be src
    itself."""

def store(acc: Buffer, dst: Buffer, dtype: Union[int, DType], op: Union[int, ReduceOp], world: int) -> None:
    """dst[:] = narrow(acc), divided by world first when op is AVG; dst may be acc itself for
    dtypes that need no narrowing."""

def store_release(buf: Buffer, offset: int, value: int) -> None:
    """Write the uint64 at byte offset of buf after every memory access this thread made before it."""

def load_acquire(buf: Buffer, offset: int) -> int:
    """The uint64 at byte offset of buf, read before every memory access this thread makes after it."""

def isa() -> str: ...
def available_isas() -> Tuple[str, ...]: ...
def _select_isa(name: Optional[str] = ...) -> str: ...
