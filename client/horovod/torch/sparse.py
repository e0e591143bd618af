"""Horovod's sparse all-reduce for torch: a sparse COO tensor's indices and values gathered from
every rank and concatenated (duplicate indices add up when the result is densified or
coalesced), as Horovod does it."""

from __future__ import annotations

from typing import Callable

import torch  # the real torch: absolute import

from ..ops import Average, Sum
from ..process_sets import ProcessSet, global_process_set
from .mpi_ops import allgather_async, synchronize


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: int, process_set: ProcessSet = global_process_set
) -> Callable[[], torch.Tensor]:
    """Start all-reducing the sparse COO `tensor` (op Average or Sum); returns a callable that
    waits and returns the sparse result (uncoalesced)."""
    if not tensor.is_sparse:
        raise ValueError(f"sparse_allreduce_async takes a sparse COO tensor, got a {tensor.layout} one")
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async supports op=hvd.Average and hvd.Sum, got {op!r}")
    # Gathering concatenates along the first dimension: indices travel transposed, one row per entry.
    indices = allgather_async(tensor._indices().transpose(0, 1).contiguous(), f"{name}.indices", process_set)
    values = allgather_async(tensor._values().contiguous(), f"{name}.values", process_set)

    def result() -> torch.Tensor:
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / process_set.size()
        return torch.sparse_coo_tensor(
            gathered_indices.transpose(0, 1),
            gathered_values,
            tensor.size(),
            device=tensor.device,
            check_invariants=False,
        )

    return result
