"""Horovod's gradient compression (hvd.Compression.none / .fp16 / .int8), for every framework.

compress(tensor) -> (tensor, ctx) before the wire and decompress(tensor, ctx) after, as in
Horovod, on torch tensors, TensorFlow tensors and NumPy arrays alike. int8 is no cast: a
compressor with a `wire` format leaves the tensor as it is and has the all-reduce itself send
that format (`compression=` of Communicator.all_reduce: int8 blocks summed by the reducers).
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


class Int8Compressor(NoneCompressor):
    """Floating-point tensors travel as int8 blocks (about a quarter of float32's bytes), which
    the reducers decode into float32, sum and encode once; they come back in their own dtype.
    DistributedOptimizer adds each gradient's error feedback residual (error_feedback=)."""

    wire = "int8"


def wire_format(compression: Any, tensor: Any) -> str:
    """The format the all-reduce of `tensor` sends under `compression`: "int8" for a float
    tensor under Compression.int8, "" (its own type) otherwise."""
    wire = getattr(compression, "wire", "")
    return wire if wire and _is_float(tensor) else ""


def cast_only(compression: Any, what: str) -> None:
    """Raise unless `compression` is a cast (none, fp16): int8 blocks go only where the all-reduce
    sends them (allreduce, grouped_allreduce and DistributedOptimizer, torch's and TensorFlow's)."""
    if getattr(compression, "wire", ""):
        raise ValueError(
            f"{what} cannot send Compression.int8 (allreduce, grouped_allreduce and DistributedOptimizer "
            "can); use Compression.none or Compression.fp16"
        )


class Compression:
    """Horovod's hvd.Compression: the compressors by name, `none`, `fp16` and `int8`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    int8 = Int8Compressor
