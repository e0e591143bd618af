"""The torch.distributed process group over the reducers, and the backend creator torch calls."""
import os
import threading
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Union

import torch  # the real torch: imports are absolute
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from reduction_server.discovery import discover_worker
from reduction_server.protocol import ReduceOp

from ..communicator import Communicator
from .pipeline import Pipeline
from .tensors import torch_reduce_op

BACKEND_NAME = "reduction_server"


def _as_list(tensors: Union[torch.Tensor, Sequence[torch.Tensor]]) -> List[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _work(future: torch.futures.Future) -> dist.Work:
    return _create_work_from_future(future)


class ReductionServerProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives go through the reducers.

    Made by ``init_process_group("reduction_server")``; or directly, from a Communicator, for
    ``DistributedDataParallel(model, process_group=ReductionServerProcessGroup(comm))``.
    Every call returns at once with a Work; its Future completes on a background thread.
    """

    def __init__(self, communicator: Optional[Communicator] = None, *, owns_communicator: Optional[bool] = None,
                 _share: Optional["ReductionServerProcessGroup"] = None) -> None:
        if _share is not None:  # another group over the same ranks: the same Communicator and order
            self._pipeline, self._owner = _share._pipeline, False
        else:
            self._pipeline, self._owner = Pipeline.over(communicator, owns_communicator), True
        comm = self._pipeline.communicator
        super().__init__(comm.rank, comm.world_size)
        self._rank, self._size = comm.rank, comm.world_size

    @property
    def communicator(self) -> Communicator:
        """The Communicator this group's collectives go through (shared with groups over the same ranks)."""
        return self._pipeline.communicator

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """ProcessGroup.getBackendName: "reduction_server"."""
        return BACKEND_NAME

    def size(self) -> int:
        """ProcessGroup.size: the world size."""
        return self._size

    def rank(self) -> int:
        """ProcessGroup.rank: this process's rank."""
        return self._rank

    def __repr__(self) -> str:
        return f"ReductionServerProcessGroup(rank={self._rank}, world_size={self._size})"

    # -- collectives -----------------------------------------------------------------------
    def allreduce(self, tensors, opts=None) -> dist.Work:
        """ProcessGroup.allreduce: reduce the tensors in place over all ranks (the op from
        AllreduceOptions or given directly; SUM by default); returns a Work at once."""
        op = torch_reduce_op(opts.reduceOp) if isinstance(opts, dist.AllreduceOptions) else (
            torch_reduce_op(opts) if opts is not None else ReduceOp.SUM)
        return _work(self._pipeline.all_reduce(_as_list(tensors), op))

    def allreduce_coalesced(self, tensors, opts=None) -> dist.Work:
        """ProcessGroup.allreduce_coalesced: reduce the tensors in place with opts.reduceOp (SUM
        by default); returns a Work at once."""
        op = torch_reduce_op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        return _work(self._pipeline.all_reduce(_as_list(tensors), op))

    def broadcast(self, tensors, opts=None) -> dist.Work:
        """ProcessGroup.broadcast: overwrite the tensors on every rank with the root's
        (BroadcastOptions.rootRank or an int, 0 by default); returns a Work at once. ValueError
        for a root out of range."""
        root = opts.rootRank if isinstance(opts, dist.BroadcastOptions) else (0 if opts is None else int(opts))
        if not 0 <= root < self._size:
            raise ValueError(f"broadcast root {root} is out of range for world size {self._size}")
        return _work(self._pipeline.broadcast(_as_list(tensors), root))

    def allgather(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        """ProcessGroup.allgather: each input into output_tensors[i][rank] on every rank (also as
        allgather(outputs, tensor)); returns a Work at once."""
        if isinstance(input_tensors, torch.Tensor):  # allgather([outs], x)
            input_tensors = [input_tensors]
            if output_tensors and isinstance(output_tensors[0], torch.Tensor):
                output_tensors = [output_tensors]
        return _work(self._pipeline.all_gather(output_tensors, list(input_tensors)))

    def barrier(self, opts=None) -> dist.Work:
        """ProcessGroup.barrier: a Work that completes once every rank has entered the barrier."""
        return _work(self._pipeline.barrier())

    def shutdown(self) -> None:
        """Finish the queued completions and, if this group made it, close the Communicator."""
        _forget(self)
        if self._owner:
            self._pipeline.close()

    def abort(self) -> None:
        """ProcessGroup.abort: the same as shutdown()."""
        self.shutdown()


# One process group per process over the reducers (a second Communicator on the same job would
# reuse its sequence numbers). Groups over the whole world share it; subgroups are refused.
_groups: Dict[int, ReductionServerProcessGroup] = {}
_groups_lock = threading.Lock()


def _forget(pg: ReductionServerProcessGroup) -> None:
    with _groups_lock:
        for key, value in list(_groups.items()):
            if value is pg:
                del _groups[key]


def _communicator_for(rank: int, world_size: int) -> Communicator:
    """A Communicator at torch's rank and world size, reducers and job identity from discovery."""
    env = dict(os.environ, RS_RANK=str(rank), RS_WORLD_SIZE=str(world_size))
    place = discover_worker(env)
    return Communicator(place.reducers, rank, world_size, job_token=place.job_token, job_id=place.job_id,
                        generation=place.generation)


def create_backend(store: Any, rank: int, world_size: int, timeout: timedelta) -> ReductionServerProcessGroup:
    """The creator registered with torch for "reduction_server" (store and timeout are unused:
    the reducers are the meeting point, and RS_TIMEOUT bounds each collective)."""
    with _groups_lock:
        existing = next(iter(_groups.values()), None)
        if existing is not None:
            if world_size != existing.size() or rank != existing.rank():
                raise NotImplementedError(
                    f"the reduction_server backend serves one group of all {existing.size()} ranks; a subgroup "
                    f"(rank {rank} of {world_size}) needs another backend (dist.new_group(ranks, backend='gloo'))")
            # The same ranks: share the one Communicator, so collectives keep one order.
            return ReductionServerProcessGroup(_share=existing)
        pg = ReductionServerProcessGroup(_communicator_for(rank, world_size), owns_communicator=True)
        _groups[id(pg)] = pg
        return pg
