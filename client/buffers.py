"""Zero-copy byte views of what users pass to a collective: NumPy arrays, objects exporting the
buffer protocol, and torch CPU tensors (through NumPy's array interface over their memory)."""

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


_NUMPY_TYPES: dict = {}  # torch dtype -> NumPy's


class _TensorMemory:
    """A CPU tensor's memory as NumPy's array interface, keeping the tensor alive. Not
    Tensor.numpy(): that marks the tensor's storage unresizable for good, and DDP's batched
    PowerSGD hook resizes the bucket it all-reduces."""

    def __init__(self, tensor: Any, dtype: np.dtype) -> None:
        self._tensor = tensor
        self.__array_interface__ = {
            "version": 3,
            "shape": tuple(tensor.shape),
            "strides": tuple(s * dtype.itemsize for s in tensor.stride()),
            "typestr": dtype.str,
            "data": (tensor.data_ptr(), False),
        }


def _tensor_ndarray(x: Any, what: str) -> tuple:
    """(ndarray sharing CPU tensor x's memory, DType)."""
    import torch

    if x.device.type != "cpu":
        raise TypeError(
            f"{what} is a {x.device.type} tensor; the Communicator takes host memory. Use "
            "reduction_server.client.torch, which stages device tensors through pinned host buffers"
        )
    if x.is_conj() or x.is_neg():
        raise TypeError(f"{what} is a lazily conjugated or negated view; pass x.resolve_conj().resolve_neg()")
    if x.dtype == torch.bfloat16:  # NumPy has no bfloat16: carry the bits
        return np.asarray(_TensorMemory(x.detach(), np.dtype(np.uint16))), DType.BFLOAT16
    dtype = _NUMPY_TYPES.get(x.dtype)
    if dtype is None:  # a torch dtype NumPy lacks raises TypeError, naming it
        dtype = _NUMPY_TYPES[x.dtype] = torch.empty(0, dtype=x.dtype, device="cpu").numpy().dtype
    return np.asarray(_TensorMemory(x.detach(), dtype)), DType.from_numpy(dtype)


def _as_ndarray(x: Any, what: str) -> tuple:
    """(ndarray sharing x's memory, DType)."""
    if isinstance(x, np.ndarray):
        return x, DType.from_numpy(x.dtype)
    if _is_torch(x):
        return _tensor_ndarray(x, what)
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
