"""Compressed all-reduce on the worker: `compression=` of Communicator.all_reduce.

A name ("none", "bf16", "fp16", "int8") is the format both ways; a pair (up, down) chooses them
apart: int8 up and "none" (float32), "bf16", "fp16" or "int8" down. The worker encodes its
contribution once into the format up (bf16/fp16: rounded to nearest even; int8: blocks of
RS_INT8_BLOCK elements, each a float32 scale and int8 values, docs/protocol.md "Formats"), the
reducers decode every contribution into float32, sum (or average) it, and encode the result once
into the format down, which the worker decodes into the output. Only float tensors, and only sum
and average, compress.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from reduction_server import _native
from reduction_server.config import settings
from reduction_server.errors import ConfigError
from reduction_server.wire.formats import COMPRESSED, INT8_BLOCK, WireFormat, block_bytes, format_code
from reduction_server.wire.protocol import ITEMSIZE, DType, ReduceOp

from .buffers import WireBuffer, wire_view

#: the names compression= takes, and the format each is (None: the tensor's own type)
_FORMATS = {
    "none": None,
    "bf16": DType.BFLOAT16,
    "bfloat16": DType.BFLOAT16,
    "fp16": DType.FLOAT16,
    "float16": DType.FLOAT16,
    "int8": INT8_BLOCK,
}
CompressionLike = Union[None, str, Tuple[str, str]]


@dataclass(frozen=True)
class Compression:
    """A compressed all-reduce's formats: `up` (DType.BFLOAT16/FLOAT16, or INT8_BLOCK) and `down`
    (up itself, or, for INT8_BLOCK, DType.FLOAT32, BFLOAT16, FLOAT16 or INT8_BLOCK)."""

    up: int
    down: int
    block: int = 0  # elements per int8 block (RS_INT8_BLOCK)

    @property
    def fmt(self) -> Optional[WireFormat]:
        """The wire format when int8 blocks travel up; None for a 16-bit float both ways."""
        return COMPRESSED[format_code(self.up, self.down)] if self.up == INT8_BLOCK else None

    def wire_bytes(self, code: int, count: int) -> int:
        return block_bytes(count, self.block) if code == INT8_BLOCK else count * ITEMSIZE[code]


def parse(compression: CompressionLike) -> Optional[Compression]:
    """compression= as its formats, or None for "none"; ValueError naming what is not known."""
    pair = (compression, compression) if compression is None or isinstance(compression, str) else compression
    try:
        up_name, down_name = pair
        up, down = (_FORMATS[name.lower() if isinstance(name, str) else name] for name in (up_name, down_name))
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"compression {compression!r} is not known: expected one of {', '.join(map(repr, _FORMATS))}, or a "
            "pair (up, down) such as ('int8', 'none')"
        ) from None
    if up is None and down is None:
        return None
    if up == INT8_BLOCK:
        block = settings.read("RS_INT8_BLOCK")
        if block & (block - 1):
            raise ConfigError(f"RS_INT8_BLOCK={block} is not a power of two")
        return Compression(up, DType.FLOAT32 if down is None else down, block)
    if down != up:
        raise ValueError(
            f"compression {compression!r}: only int8 up may come back in another format ('none', 'bf16', "
            "'fp16' or 'int8'); 16-bit floats come back as they went"
        )
    return Compression(up, down)


def check(compression: Compression, src: WireBuffer, op: ReduceOp) -> None:
    """Raise unless src and op may compress: a float tensor, summed or averaged."""
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"compressed all_reduce sums or averages; op {op.name.lower()} cannot be compressed")
    if not src.dtype.is_float:
        raise TypeError(f"only float tensors compress; this one holds {src.describe()}")


def residual_view(residual: Any, src: WireBuffer, compression: Optional[Compression]) -> np.ndarray:
    """all_reduce's `residual=` as a float32 array of src's size; ValueError naming what is wrong."""
    if compression is None:
        raise ValueError("residual= is what compression loses: it needs compression= other than 'none'")
    view = wire_view(residual, writable=True, what="residual")
    if (view.dtype, view.count) != (DType.FLOAT32, src.count):
        raise ValueError(f"residual holds {view.describe()}, not {src.count} x float32 like the input")
    return np.frombuffer(view.data, np.float32)


def as_float32(buf: WireBuffer) -> np.ndarray:
    """buf's elements as float32: its own memory when it is float32, else a widened copy."""
    if buf.dtype is DType.FLOAT32:
        return np.frombuffer(buf.data, np.float32)
    if buf.dtype is DType.FLOAT64:
        return np.frombuffer(buf.data, np.float64).astype(np.float32)
    out = np.empty(buf.count, np.float32)
    _native.load(out, buf.data, buf.dtype)  # float16, bfloat16: exact
    return out


class Buffers:
    """The byte buffers of a communicator's compressed collectives, reused by size: a training
    step all-reduces the same sizes every step, and a fresh multi-MiB array is page-faulted (and
    zeroed by the kernel) each time. At most KEEP_BYTES are kept free."""

    KEEP_BYTES = 256 << 20

    def __init__(self) -> None:
        self._free: Dict[int, List[np.ndarray]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()  # user threads start and finish collectives

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._free_bytes -= nbytes
                return free.pop()
        return np.empty(nbytes, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """buf is free again (its collective has ended); dropped when KEEP_BYTES are kept already."""
        with self._lock:
            if self._free_bytes + buf.nbytes <= self.KEEP_BYTES:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._free_bytes += buf.nbytes


def encode(compression: Compression, values: np.ndarray, code: int, out: np.ndarray) -> np.ndarray:
    """float32 values in format `code` (the format up, or down), written into `out` (bytes of
    compression.wire_bytes(code, values.size)); returns out."""
    if code == INT8_BLOCK:
        _native.store_int8(values, out, compression.block)
    else:  # a 16-bit float, rounded to nearest even
        _native.store(values, out, code, ReduceOp.SUM, 1)
    return out


def residual_into(compression: Compression, values: np.ndarray, sent: np.ndarray, out: np.ndarray) -> None:
    """out = values - decode(sent): what encoding `values` (float32) into `sent` (the format up) lost."""
    if compression.up == INT8_BLOCK:
        _native.load_int8(out, sent, compression.block)
    else:
        _native.load(out, sent, compression.up)
    np.subtract(values, out, out=out)


def decode_into(compression: Compression, result: np.ndarray, dst: WireBuffer) -> None:
    """The result (bytes in the format down) into dst, whatever its float type."""
    code = compression.down
    if code == dst.dtype:  # a 16-bit float down to a tensor of that type
        np.frombuffer(dst.data, np.uint8)[:] = result
        return
    if dst.dtype is DType.FLOAT32:
        values = np.frombuffer(dst.data, np.float32)
    else:
        values = np.empty(dst.count, np.float32)
    if code == INT8_BLOCK:
        _native.load_int8(values, result, compression.block)
    elif code == DType.FLOAT32:
        values[:] = np.frombuffer(result, np.float32)
    else:
        _native.load(values, result, code)
    if dst.dtype is DType.FLOAT64:
        np.frombuffer(dst.data, np.float64)[:] = values
    elif dst.dtype is not DType.FLOAT32:
        _native.store(values, dst.data, dst.dtype, ReduceOp.SUM, 1)  # rounded to nearest even
