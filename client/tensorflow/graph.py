"""What a TensorFlow graph allows the adapter: no XLA around tf.numpy_function, dense tensors,
and numpy_function's outputs as a list."""

from __future__ import annotations

from typing import Any, List, Optional

import tensorflow as tf  # the real tensorflow: absolute import
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util

from reduction_server.errors import ConfigError


class XlaCompileError(ConfigError):
    """A step containing the all-reduce is being compiled with XLA (jit_compile)."""

    # AutoGraph re-raises an error from converted code (a tf.function body) as its own type only
    # if that type takes just a message the way Exception does; otherwise it becomes a StagingError.
    __init__ = Exception.__init__


def refuse_xla(what: str) -> None:
    """Raise XlaCompileError if the graph being traced will be compiled by XLA (TensorFlow's own
    test for whether a function call is inside an XLA context); `what` names the operation."""
    if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph()):
        raise XlaCompileError(
            f"{what} runs through tf.numpy_function, which XLA cannot compile, but this step is being "
            "compiled with XLA. Pass jit_compile=False: to tf.function(...) for a custom loop, or to "
            "model.compile(...) for model.fit (Keras's default jit_compile='auto' turns XLA on when a GPU "
            "is present)"
        )


def dense(tensor: Any, what: str) -> Optional[tf.Tensor]:
    """`tensor` as a dense tf.Tensor (IndexedSlices included: the reducers sum dense buffers);
    None stays None. `what` names it in the error for something that is not a tensor."""
    if tensor is None:
        return None
    try:
        return tf.convert_to_tensor(tensor)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what}: cannot all-reduce a {type(tensor).__name__}: {exc}") from None


def as_list(outputs: Any) -> List[tf.Tensor]:
    """numpy_function's outputs as a list (it may return one tensor for a one-element Tout)."""
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
