"""Horovod's Keras allreduce and reducescatter (horovod.tensorflow.keras), whose signatures differ
from TensorFlow's: the second argument is the name (TensorFlow's allreduce takes `average` there,
its reducescatter `device_dense`), and reducescatter averages by default. TensorFlow's keyword
arguments (process_set, ...) are taken too. allgather and broadcast are TensorFlow's already."""

from __future__ import annotations

from typing import Any, Optional

from .. import tensorflow as hvd_tf
from ..compression import Compression

__all__ = ["allreduce", "reducescatter"]


def allreduce(
    value: Any,
    name: Optional[str] = None,
    average: Optional[bool] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: Optional[int] = None,
    compression: Any = Compression.none,
    **options: Any,
) -> Any:
    """`value` (tensor-compatible) reduced over every rank (op, Average by default), scaled before and after."""
    return hvd_tf.allreduce(
        value,
        average=average,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        op=op,
        compression=compression,
        name=name,
        **options,
    )


def reducescatter(value: Any, name: Optional[str] = None, op: int = hvd_tf.Average, **options: Any) -> Any:
    """`value` reduced over every rank (Average by default), this rank keeping its share of the
    first dimension."""
    return hvd_tf.reducescatter(value, op=op, name=name, **options)
