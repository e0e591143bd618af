"""Zero-copy byte views of what users pass to a collective: NumPy arrays, objects exporting the
buffer protocol, and torch CPU tensors (through their NumPy view)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from reduction_server.wire.protocol import DType


@dataclass
class WireBuffer:
    """A collective's buffer as the wire sees it: its element type, its element count, and the
    same memory as C-contiguous bytes."""

    dtype: DType
    count: int  # elements
    data: memoryview  # the same memory, as C-contiguous bytes

    def describe(self) -> str:
        """`count x dtype` in words (e.g. "1024 x float32"), for error messages."""
        return f"{self.count} x {self.dtype.name.lower()}"


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def _as_ndarray(x: Any, what: str) -> tuple:
    """(ndarray sharing x's memory, DType)."""
    if isinstance(x, np.ndarray):
        return x, DType.from_numpy(x.dtype)
    if _is_torch(x):
        import torch

        if x.device.type != "cpu":
            raise TypeError(
                f"{what} is a {x.device.type} tensor; the Communicator takes host memory. Use "
                "reduction_server.client.torch, which stages device tensors through pinned host buffers"
            )
        x = x.detach()
        if x.dtype == torch.bfloat16:  # NumPy has no bfloat16: carry the bits
            return x.view(torch.int16).numpy().view(np.uint16), DType.BFLOAT16
        arr = x.numpy()
        return arr, DType.from_numpy(arr.dtype)
    try:
        arr = np.asarray(memoryview(x))
    except TypeError:
        raise TypeError(f"{what} must be a NumPy array, a buffer or a CPU tensor, not {type(x).__name__}") from None
    return arr, DType.from_numpy(arr.dtype)


def wire_view(x: Any, *, writable: bool = False, what: str = "input") -> WireBuffer:
    """A byte view of x without copying (x itself when it is one already); errors name what was wrong."""
    if isinstance(x, WireBuffer):
        if writable and x.data.readonly:
            raise ValueError(f"{what} is read-only; the result needs a writable buffer")
        return x
    arr, dtype = _as_ndarray(x, what)
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"{what} must be C-contiguous (shape {arr.shape}, strides {arr.strides}); pass numpy.ascontiguousarray(x)"
        )
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what} is read-only; the result needs a writable buffer")
    return WireBuffer(dtype, arr.size, memoryview(arr.reshape(-1).view(np.uint8)))


def raw_view(address: int, count: int, dtype: DType) -> WireBuffer:
    """A view of count elements at a raw host address (the NCCL model's buffers)."""
    if count < 0:
        raise ValueError(f"count must be non-negative, got {count}")
    if count and not address:
        raise ValueError("buffer address is NULL")
    nbytes = count * dtype.itemsize
    data = memoryview((ctypes.c_uint8 * nbytes).from_address(address)).cast("B") if nbytes else memoryview(b"")
    return WireBuffer(dtype, count, data)


def empty_like(x: Any) -> Any:
    """A new, uninitialised container of x's kind, shape and dtype."""
    if _is_torch(x):
        import torch

        return torch.empty_like(x, memory_format=torch.contiguous_format)
    if isinstance(x, np.ndarray):
        return np.empty(x.shape, x.dtype)
    arr = np.asarray(memoryview(x))
    return np.empty(arr.shape, arr.dtype)
