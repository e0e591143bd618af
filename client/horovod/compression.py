"""Horovod's gradient compression (hvd.Compression.none / .fp16), for every framework.

compress(tensor) -> (tensor, ctx) before the wire and decompress(tensor, ctx) after, as in
Horovod, on torch tensors, TensorFlow tensors and NumPy arrays alike.
"""

from __future__ import annotations

from typing import Any, Tuple


def _framework(tensor: Any) -> str:
    return type(tensor).__module__.split(".")[0]


def _is_float(tensor: Any) -> bool:
    dtype = tensor.dtype
    return bool(
        getattr(dtype, "is_floating_point", None)
        if _framework(tensor) == "torch"
        else getattr(dtype, "is_floating", None)
        if _framework(tensor) in ("tensorflow", "keras")
        else dtype.kind == "f"
    )


def _cast(tensor: Any, dtype: Any) -> Any:
    """tensor as `dtype` (a framework dtype, or "float16")."""
    kind = _framework(tensor)
    if kind == "torch":
        import torch

        return tensor.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    if kind in ("tensorflow", "keras"):
        import tensorflow as tf

        return tf.cast(tensor, dtype)
    return tensor.astype(dtype)


class Compressor:
    """Interface: compress before the all-reduce, decompress after."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        """(tensor to send, ctx that decompress() needs to undo the compression)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """The received `tensor` restored with the ctx compress() returned."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (hvd.Compression.none): tensors travel as they are."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        """`tensor` unchanged, and no ctx."""
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """`tensor` unchanged."""
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (half the bytes), and come back in their own dtype."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        """A floating-point `tensor` cast to float16, with its dtype as ctx; any other tensor
        unchanged, with ctx None."""
        if not _is_float(tensor):
            return tensor, None
        return _cast(tensor, "float16"), tensor.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """`tensor` cast back to the dtype in ctx; unchanged when ctx is None."""
        return tensor if ctx is None else _cast(tensor, ctx)


class Compression:
    """Horovod's hvd.Compression: the compressors by name, `none` and `fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
