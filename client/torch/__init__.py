"""PyTorch adapter: a `torch.distributed` backend and DDP comm hooks over the reducers.

Importing this module registers the backend ``"reduction_server"``::

    import torch.distributed as dist
    import reduction_server.client.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("reduction_server")      # rank and world size: arguments or environment
    model = torch.nn.parallel.DistributedDataParallel(model)

The process group implements every collective of torch.distributed's API (all_reduce with every
op torch has but the bitwise ones, reduce, reduce_scatter, all_gather and its tensor forms,
gather, scatter, all_to_all, broadcast, barrier, sparse all_reduce, send/recv, subgroups; the
docs/frameworks.md's table says how each is done) except a receive from any source. Each call hands its collective
to the shared Communicator without waiting and returns a Work whose Future one background thread
completes, in submission order, as the reducers answer: DDP's bucket all-reduces run while
backward computes the earlier layers' gradients.

For jobs that keep gloo or nccl as their process group, the same all-reduce is a DDP comm hook::

    state = ReductionServerHookState.from_env()
    ddp.register_comm_hook(state, reduction_server_hook)          # or reduction_server_fp16_hook,
                                                                   #    reduction_server_bf16_hook

and int8 blocks with error feedback, on this backend or another (hooks.py)::

    state = ReductionServerInt8HookState.for_process_group()      # or .from_env() over gloo/nccl
    ddp.register_comm_hook(state, reduction_server_int8_hook)

and FSDP2's reduce-scatter likewise (fsdp.py, imported on first use: torch's FSDP takes 0.7 s)::

    compress_reduce_scatter(model)                                  # after fully_shard

Rendezvous: with MASTER_ADDR/MASTER_PORT set, ``init_process_group`` works as for any backend
(torchrun). Without them, the ``env://`` rendezvous takes rank and world size from the
arguments, RANK/WORLD_SIZE or the package's discovery (RS_RANK, CLUSTER_SPEC, TF_CONFIG, ...)
and gives the group a process-local store: this backend needs no store, and a backend that does
(gloo) fails with an error saying to set MASTER_ADDR/MASTER_PORT instead of hanging.

CUDA tensors are staged through pinned host buffers (tensors.py).

The adapter's modules: docs/design.md, "Where each concept lives".
"""

from typing import Any

from .hooks import (
    ReductionServerHookState,
    ReductionServerInt8HookState,
    reduction_server_bf16_hook,
    reduction_server_fp16_hook,
    reduction_server_hook,
    reduction_server_int8_hook,
)
from .process_group import BACKEND_NAME, ReductionServerProcessGroup, create_backend
from .rendezvous import register
from .tensors import Staged, torch_reduce_op

__all__ = [
    "BACKEND_NAME",
    "ReductionServerHookState",
    "ReductionServerInt8AllReduce",
    "ReductionServerInt8HookState",
    "ReductionServerInt8ReduceScatter",
    "ReductionServerProcessGroup",
    "Staged",
    "compress_reduce_scatter",
    "create_backend",
    "reduction_server_bf16_hook",
    "reduction_server_fp16_hook",
    "reduction_server_hook",
    "reduction_server_int8_hook",
    "torch_reduce_op",
]

#: names of fsdp.py, which imports torch.distributed.fsdp: loaded when first asked for
_FSDP = ("ReductionServerInt8AllReduce", "ReductionServerInt8ReduceScatter", "compress_reduce_scatter")


def __getattr__(name: str) -> Any:
    if name in _FSDP:
        from . import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register()
