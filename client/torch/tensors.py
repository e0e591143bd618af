"""torch tensors on the wire: torch's reduce ops, the dtypes the wire carries, and the staging of
non-contiguous and CUDA tensors through contiguous host buffers.

CUDA tensors go through pinned host buffers: copied to the host before the collective (after the
producing stream's work) and back, on the completing thread's current stream, before the Future
completes (the Future then orders its consumers after that copy). An output that is not loaded
first is copied back after the work its caller had queued when the collective started.
"""

from typing import Any, List, Optional, Sequence, Tuple, Union

import torch  # the real torch: imports are absolute
import torch.distributed as dist

from reduction_server.wire.protocol import ReduceOp

# torch's ReduceOp names (its numbering differs from NCCL's, so never by number).
_OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "PRODUCT": ReduceOp.PROD, "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX}

# torch dtypes the wire carries as themselves.
_NATIVE = {
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
}
for _name in ("uint32", "uint64"):
    if hasattr(torch, _name):
        _NATIVE.add(getattr(torch, _name))
_COMPLEX = {torch.complex64, torch.complex128}  # sum and avg, as pairs of reals


def torch_reduce_op(op: Any) -> ReduceOp:
    """The protocol op for a torch ReduceOp (an instance, a RedOpType or a name such as "sum");
    ValueError for PREMUL_SUM, whose factor only reduction() carries."""
    op, factor = reduction(op)
    if factor is not None:
        raise ValueError("ReduceOp.PREMUL_SUM carries a factor: use reduction(op), which returns (SUM, factor)")
    return op


def _premul_factor(op: Any) -> Union[float, torch.Tensor]:
    """PREMUL_SUM's factor: its `factor` attribute (torch 2.13+), else its pickled state, (op, factor)."""
    factor = getattr(op, "factor", None)
    if factor is None:
        try:
            factor = op.__getstate__()[1]
        except (AttributeError, TypeError, IndexError, RuntimeError):
            factor = None
    if factor is None:
        raise ValueError(
            f"ReduceOp.PREMUL_SUM: torch {torch.__version__} shows the reduction_server backend no factor for it"
        )
    return factor


def reduction(op: Any) -> Tuple[ReduceOp, Optional[Union[float, torch.Tensor]]]:
    """The protocol op for a torch ReduceOp and its premultiplier: PREMUL_SUM(f) is a SUM of
    f x each input (f a number or a one-element tensor); None for the other ops."""
    if not isinstance(op, (dist.ReduceOp.RedOpType, str)) and isinstance(
        getattr(op, "op", None), dist.ReduceOp.RedOpType
    ):
        if op.op == dist.ReduceOp.RedOpType.PREMUL_SUM:
            return ReduceOp.SUM, _premul_factor(op)
        op = op.op  # a ReduceOp instance (AllreduceOptions.reduceOp)
    name = op.name if isinstance(op, dist.ReduceOp.RedOpType) else str(op).strip().upper()
    name = {"PROD": "PRODUCT", "MEAN": "AVG"}.get(name, name)
    if name not in _OPS:
        raise ValueError(
            f"the reduction_server backend does not support ReduceOp.{name}; supported: {', '.join(_OPS)}, PREMUL_SUM"
        )
    return _OPS[name], None


def _require_cuda(tensor: torch.Tensor) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"a tensor on {tensor.device} was passed to reduction_server, but CUDA is not "
            "available in this process (torch.cuda.is_available() is False)"
        )


def check_device(tensor: Any, what: str) -> str:
    """'cpu' or 'cuda'; anything else is a clear TypeError."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(tensor).__name__}")
    kind = tensor.device.type
    if kind == "cuda":
        _require_cuda(tensor)
    elif kind != "cpu":
        raise TypeError(f"{what} is on {tensor.device}; the reduction_server backend takes cpu and cuda tensors")
    return kind


class Staged:
    """One user tensor as a contiguous host tensor the Communicator can view, and the way back.

    CPU contiguous tensors are used in place (zero copy). Non-contiguous tensors go through a
    contiguous copy and CUDA tensors through a pinned host buffer; finish() copies the result back.
    """

    def __init__(self, tensor: torch.Tensor, what: str, *, load: bool = True) -> None:
        self.tensor = tensor
        self.cuda = check_device(tensor, what) == "cuda"
        self.queued: Optional[torch.cuda.Event] = None  # the caller's stream, for a copy back of an output not loaded
        if self.cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            if load:  # blocking: ordered after the work queued on the current stream (the producer)
                self.host.copy_(tensor)
            else:  # the copy back must land after the caller's own writes queued so far
                self.queued = torch.cuda.Event()
                self.queued.record(torch.cuda.current_stream(tensor.device))
        elif tensor.is_contiguous():
            self.host = tensor.detach()
        else:
            self.host = (
                tensor.detach().contiguous() if load else torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            )
        self.copy_back = self.cuda or self.host.data_ptr() != tensor.data_ptr()

    def finish(self) -> None:
        """Copy the result back into the user's tensor when it was staged (non-blocking for
        CUDA, on this thread's current stream); nothing for a tensor used in place."""
        if self.copy_back:
            if self.queued is not None:
                torch.cuda.current_stream(self.tensor.device).wait_event(self.queued)
            with torch.no_grad():
                self.tensor.copy_(self.host, non_blocking=self.cuda)

    def wire(self, op: Optional[ReduceOp]) -> Any:
        """The host tensor as a wire dtype (as_wire)."""
        return as_wire(self.host, op)


def as_wire(host: torch.Tensor, op: Optional[ReduceOp]) -> Any:
    """A contiguous host tensor as a dtype the wire carries: op None means a broadcast (any
    dtype, as bytes); TypeError for a dtype the op cannot reduce."""
    dtype = host.dtype
    if dtype in _NATIVE:
        return host
    if op is None:
        return host.reshape(-1).view(torch.uint8)
    if dtype in _COMPLEX and op in (ReduceOp.SUM, ReduceOp.AVG):
        return torch.view_as_real(host)
    if dtype == torch.bool and op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD):
        return host.view(torch.uint8)  # 0/1: max is or, min and product are and
    raise TypeError(
        f"the reduction_server backend cannot reduce {dtype} with {op.name}; dtypes: "
        + ", ".join(sorted(str(d).replace("torch.", "") for d in _NATIVE))
        + " (complex: sum and avg; bool: min, max, product)"
    )


def devices_of(tensors: Sequence[torch.Tensor]) -> List[torch.device]:
    """The CUDA devices of `tensors`, those a Future for a collective of them is on."""
    return sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
