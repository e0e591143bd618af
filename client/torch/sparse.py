"""Sparse all-reduce, as Gloo does it: every rank's (indices, values) relayed to every rank by the
reducers, then summed by torch into one coalesced tensor that replaces the input, in place."""

from typing import List, Optional, Sequence

import numpy as np
import torch  # the real torch: imports are absolute

from reduction_server.wire.protocol import ReduceOp

from .collectives import Collectives
from .pipeline import Started


class Sparse:
    """Sparse COO all-reduce (SUM) over a group's Collectives."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], op: ReduceOp, timeout: Optional[float] = None
    ) -> torch.futures.Future:
        """Each sparse COO tensor replaced, in place, by the sum of every rank's; the ranks first
        all-reduce their non-zero counts (waited for here), then broadcast indices and values."""
        if op is not ReduceOp.SUM:
            raise ValueError(f"sparse all_reduce supports ReduceOp.SUM only (as Gloo does), not {op.name}")
        collectives = self.collectives
        comm, world = collectives.comm, collectives.world

        def start() -> Started:
            coalesced = [t.detach().to("cpu").coalesce() for t in tensors]
            counts = np.zeros((len(tensors), world), np.int64)
            counts[:, comm.rank] = [c._nnz() for c in coalesced]
            comm.all_reduce(counts, out=counts)
            handles, received = [], []
            for mine, nnz in zip(coalesced, counts.tolist()):
                parts: List[tuple] = []
                for j in range(world):
                    if j == comm.rank:
                        indices, values = mine.indices().contiguous(), mine.values().contiguous()
                    else:
                        indices = torch.empty((mine.sparse_dim(), nnz[j]), dtype=torch.int64, device="cpu")
                        values = torch.empty((nnz[j], *mine.shape[mine.sparse_dim() :]), dtype=mine.dtype, device="cpu")
                    handles += [collectives.relay(indices, j, timeout), collectives.relay(values, j, timeout)]
                    parts.append((indices, values))
                received.append(parts)

            def finish():
                with torch.no_grad():
                    for t, parts in zip(tensors, received):
                        total = torch.sparse_coo_tensor(
                            torch.cat([i for i, _ in parts], 1), torch.cat([v for _, v in parts]), t.shape
                        ).coalesce()
                        t.copy_(total.to(t.device))
                return list(tensors)

            return handles, finish

        return collectives.submit(start, tensors)
