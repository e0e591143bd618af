"""Error feedback (EF-SGD, Karimireddy et al., ICML 2019) for compressed all-reduces: each tensor
keeps what compressing its last contribution lost and adds it to its next one, so that over the
steps every rank sends its gradients' sum to within one quantum, however coarse the format.

    feedback = ErrorFeedback(comm, compression="int8")
    for step ...:
        grad_sum = feedback.all_reduce(name, grad, op="avg")

Costs a float32 residual and a float32 buffer per tensor (8 bytes an element). Every rank uses
the same names in the same order, as for any collective; a name's previous all-reduce must be
waited for before its next one starts (its buffer is reused).
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, Optional, Tuple

import numpy as np

from .communicator import Communicator, Handle, OpLike
from .compression import CompressionLike


class ErrorFeedback:
    """Residuals per tensor name for one communicator's compressed all-reduces."""

    def __init__(self, comm: Communicator, compression: CompressionLike = "int8") -> None:
        self.comm = comm
        self.compression = compression
        #: name -> (residual, the buffer its corrected contribution is sent from), both float32
        self._state: Dict[Hashable, Tuple[np.ndarray, np.ndarray]] = {}

    def residual(self, name: Hashable) -> Optional[np.ndarray]:
        """What compressing name's last contribution lost (None before its first)."""
        state = self._state.get(name)
        return None if state is None else state[0]

    def all_reduce_async(self, name: Hashable, grad: Any, op: OpLike = "avg", out: Any = None) -> Handle:
        """All-reduce grad + name's residual, compressed; the residual becomes what that lost."""
        values = np.asarray(grad, np.float32)
        state = self._state.get(name)
        if state is None or state[0].shape != values.shape:
            state = self._state[name] = (np.zeros(values.shape, np.float32), np.empty(values.shape, np.float32))
        residual, corrected = state
        np.add(values, residual, out=corrected)
        result = np.empty(values.shape, np.float32) if out is None else out
        return self.comm.all_reduce_async(corrected, op, result, compression=self.compression, residual=residual)

    def all_reduce(self, name: Hashable, grad: Any, op: OpLike = "avg", out: Any = None) -> Any:
        """all_reduce_async(...).wait()."""
        return self.all_reduce_async(name, grad, op, out).wait()
