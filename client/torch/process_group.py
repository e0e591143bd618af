"""The torch.distributed process group over the reducers, and the backend creator torch calls."""

import secrets
import threading
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch  # the real torch: imports are absolute
import torch.distributed as dist

from reduction_server.config import settings
from reduction_server.config.discovery import discover_worker, run_id
from reduction_server.wire.protocol import ReduceOp

from ..communicator import Communicator
from ..group import Group
from .collectives import Collectives
from .pipeline import Pipeline
from .sparse import Sparse
from .tensors import devices_of, reduction
from .work import FutureWork

BACKEND_NAME = "reduction_server"


def _as_list(tensors: Union[torch.Tensor, Sequence[torch.Tensor]]) -> List[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _leaves(value: Any) -> List[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else [t for v in value for t in _leaves(v)]


def _together(pipeline: Pipeline, futures: List[torch.futures.Future], value: Any) -> torch.futures.Future:
    """One Future for several: `value` (tensors, in lists) once all completed, the first error if
    one failed. On the CUDA devices of value's tensors, as each of the several is: collect_all's
    own Future has no devices, so its waiters' streams would not wait for the copies back."""
    together = pipeline.future(devices_of(_leaves(value)))

    def complete(_: torch.futures.Future) -> None:
        try:
            for each in futures:
                each.wait()  # the first error; and this thread's current stream after each one's copies back
        except Exception as exc:  # noqa: BLE001 - handed to whoever waits on the Future
            together.set_exception(exc)
        else:
            together.set_result(value)

    torch.futures.collect_all(futures).add_done_callback(complete)
    return together


def _split_rows(tensor: torch.Tensor, sizes: Sequence[int], world: int, what: str) -> List[torch.Tensor]:
    """tensor cut along its first dimension into `sizes` rows each (world equal parts when empty)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    if not sizes:
        if rows % world:
            raise ValueError(f"all_to_all_single: the {what}'s {rows} rows cannot be split equally over {world} ranks")
        sizes = [rows // world] * world
    if len(sizes) != world or sum(sizes) != rows:
        raise ValueError(
            f"all_to_all_single: {what} split sizes {list(sizes)} do not cut {rows} rows over {world} ranks"
        )
    if what == "output" and not tensor.is_contiguous():
        raise ValueError("all_to_all_single: the output tensor must be contiguous")
    width = tensor.numel() // rows if rows else 0
    return list(torch.split(tensor.reshape(rows, width), list(sizes)))


class ReductionServerProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives go through the reducers.

    Made by ``init_process_group("reduction_server")``; or directly, from a Communicator, for
    ``DistributedDataParallel(model, process_group=ReductionServerProcessGroup(comm))``.
    Every call returns at once with a Work; its Future completes on a background thread.
    """

    def __init__(
        self,
        communicator: Optional[Communicator] = None,
        *,
        owns_communicator: Optional[bool] = None,
        timeout: Optional[timedelta] = None,
        _share: Optional["ReductionServerProcessGroup"] = None,
    ) -> None:
        if _share is not None:  # another group over the same ranks: the same Communicator and order
            self._pipeline, self._owner = _share._pipeline, False
        else:
            self._pipeline, self._owner = Pipeline.over(communicator, owns_communicator), True
        comm = self._pipeline.communicator
        super().__init__(comm.rank, comm.world_size)
        self._rank, self._size = comm.rank, comm.world_size
        self._name, self._desc = "", ""
        self._pairs: Dict[Tuple[int, int, int], Collectives] = {}
        self._collectives = Collectives(self._pipeline)
        self._sparse = Sparse(self._collectives)
        # torch's timeout= bounds each collective when it is shorter than the reducers' RS_TIMEOUT
        # (which bounds every collective anyway: torch's default of 30 minutes is not a hang).
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        self._time_limit: Optional[float] = seconds if 0 < seconds < settings.read("RS_TIMEOUT") else None

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

    # torch names every group it makes (destroy_process_group looks it up by name); the C++ base
    # keeps the name on its device backends, and a Python group registers none.
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        """The name torch gave this group ("" until it gives one)."""
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        """The description torch gave this group."""
        return self._desc

    def __repr__(self) -> str:
        return f"ReductionServerProcessGroup(rank={self._rank}, world_size={self._size})"

    # -- collectives: torch's signatures, each handed to collectives.py ----------------------
    def _limit(self, opts: Any) -> Optional[float]:
        """Seconds the collective may take: its options' timeout when set, else the group's."""
        seconds = opts.timeout.total_seconds() if isinstance(getattr(opts, "timeout", None), timedelta) else -1
        return seconds if seconds > 0 else self._time_limit

    def _root(self, opts: Any, what: str) -> int:
        root = opts.rootRank if hasattr(opts, "rootRank") else (0 if opts is None else int(opts))
        if not 0 <= root < self._size:
            raise ValueError(f"{what} root {root} is out of range for world size {self._size}")
        return root

    def allreduce(self, tensors, opts=None) -> dist.Work:
        """ProcessGroup.allreduce: reduce the tensors in place over all ranks (the op from
        AllreduceOptions or given directly; SUM by default, PREMUL_SUM too); returns a Work at once."""
        op, factor = reduction(getattr(opts, "reduceOp", opts) if opts is not None else ReduceOp.SUM)
        tensors = _as_list(tensors)
        if any(t.is_sparse for t in tensors):
            return FutureWork(self._sparse.all_reduce(tensors, op, self._limit(opts)))
        return FutureWork(self._collectives.all_reduce(tensors, op, factor, timeout=self._limit(opts)))

    def allreduce_coalesced(self, tensors, opts=None) -> dist.Work:
        """ProcessGroup.allreduce_coalesced: allreduce of each tensor, as one Work."""
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts=None) -> dist.Work:
        """ProcessGroup.reduce: the tensors reduced into the root's (ReduceOptions); the other
        ranks' tensors are left unchanged."""
        op, factor = reduction(opts.reduceOp if opts is not None else ReduceOp.SUM)
        return FutureWork(
            self._collectives.reduce(_as_list(tensors), op, self._root(opts, "reduce"), factor, self._limit(opts))
        )

    def broadcast(self, tensors, opts=None) -> dist.Work:
        """ProcessGroup.broadcast: overwrite the tensors on every rank with the root's
        (BroadcastOptions.rootRank or an int, 0 by default); returns a Work at once. ValueError
        for a root out of range."""
        return FutureWork(
            self._collectives.broadcast(_as_list(tensors), self._root(opts, "broadcast"), self._limit(opts))
        )

    def allgather(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        """ProcessGroup.allgather: each input into output_tensors[i][rank] on every rank (also as
        allgather(outputs, tensor)); returns a Work at once."""
        if isinstance(input_tensors, torch.Tensor):  # allgather([outs], x)
            input_tensors = [input_tensors]
            if output_tensors and isinstance(output_tensors[0], torch.Tensor):
                output_tensors = [output_tensors]
        return FutureWork(self._collectives.all_gather(output_tensors, list(input_tensors), self._limit(opts)))

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> dist.Work:
        """ProcessGroup.allgather_coalesced: output_lists[r][i] receives rank r's input_list[i]."""
        by_input = [[outs[i] for outs in output_lists] for i in range(len(input_list))]
        return FutureWork(
            _together(
                self._pipeline,
                [self._collectives.all_gather(by_input, list(input_list), self._limit(opts))],
                output_lists,
            )
        )

    def all_gather_single(self, output, input, opts=None) -> dist.Work:  # noqa: A002
        """ProcessGroup.all_gather_single (all_gather_into_tensor): every rank's input into its
        piece of output, in rank order."""
        return FutureWork(self._collectives.all_gather_single(output, input, self._limit(opts)))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        """all_gather_single of each (output, input) pair, as one Work."""
        return FutureWork(
            _together(
                self._pipeline,
                [self._collectives.all_gather_single(o, i, self._limit(opts)) for o, i in zip(outputs, inputs)],
                list(outputs),
            )
        )

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        """ProcessGroup.gather: every rank's input into output_tensors[0][rank] on the root."""
        root = self._root(opts, "gather")
        outputs = output_tensors[0] if output_tensors else []
        return FutureWork(self._collectives.gather(outputs, _as_list(input_tensors)[0], root, self._limit(opts)))

    def scatter(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        """ProcessGroup.scatter: the root's input_tensors[0][r] into rank r's output_tensors[0]."""
        root = self._root(opts, "scatter")
        inputs = input_tensors[0] if input_tensors else []
        return FutureWork(self._collectives.scatter(_as_list(output_tensors)[0], inputs, root, self._limit(opts)))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        """ProcessGroup.reduce_scatter: input_tensors[0][r] reduced over the ranks into rank r's output_tensors[0]."""
        op, factor = reduction(opts.reduceOp if opts is not None else ReduceOp.SUM)
        return FutureWork(
            self._collectives.reduce_scatter(
                _as_list(output_tensors)[0], input_tensors[0], op, factor, self._limit(opts)
            )
        )

    def reduce_scatter_single(self, output, input, opts=None) -> dist.Work:  # noqa: A002
        """ProcessGroup.reduce_scatter_single (reduce_scatter_tensor): input cut into world-size
        pieces, piece r reduced into rank r's output."""
        op, factor = reduction(opts.reduceOp if opts is not None else ReduceOp.SUM)
        return FutureWork(self._collectives.reduce_scatter_single(output, input, op, factor, self._limit(opts)))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        """reduce_scatter_single of each (output, input) pair, as one Work."""
        op, factor = reduction(opts.reduceOp if opts is not None else ReduceOp.SUM)
        return FutureWork(
            _together(
                self._pipeline,
                [
                    self._collectives.reduce_scatter_single(o, i, op, factor, self._limit(opts))
                    for o, i in zip(outputs, inputs)
                ],
                list(outputs),
            )
        )

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        """ProcessGroup.alltoall: rank j's input_tensors[r] into rank r's output_tensors[j]."""
        return FutureWork(
            self._collectives.all_to_all(list(output_tensors), list(input_tensors), timeout=self._limit(opts))
        )

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None) -> dist.Work:  # noqa: A002
        """ProcessGroup.all_to_all_single: input cut along its first dimension by
        input_split_sizes (equal pieces when empty), piece r to rank r, received into output's
        pieces by output_split_sizes."""
        even = not output_split_sizes and not input_split_sizes
        outputs = _split_rows(output, output_split_sizes, self._size, "output")
        inputs = _split_rows(input, input_split_sizes, self._size, "input")
        return FutureWork(
            _together(
                self._pipeline, [self._collectives.all_to_all(outputs, inputs, even, self._limit(opts))], [output]
            )
        )

    alltoall_base = all_to_all_single

    def _job_rank(self, rank: int) -> int:
        ranks = self.communicator.ranks
        return ranks[rank] if ranks is not None else rank

    def _pair(self, src: int, dst: int, tag: int) -> Collectives:
        """The collectives of messages from job rank src to dst with `tag`: a group of the two
        (one per direction and tag, so that each keeps torch's matching order), made on first use."""
        key = (src, dst, tag)
        pair = self._pairs.get(key)
        if pair is None:
            comm = self.communicator
            job = comm.parent if isinstance(comm, Group) else comm
            group = Group(job, [src, dst], f"{self._name}:p2p:{src}>{dst}:{tag}")
            pair = self._pairs[key] = Collectives(self._pipeline, group)
        return pair

    def send(self, tensors, dstRank, tag=0) -> dist.Work:  # noqa: N803 - torch's names
        """ProcessGroup.send: the tensors to rank dstRank, relayed by the reducers (a broadcast in
        the pair's own group); matched with dstRank's recv of the same tag, in order."""
        src, dst = self._job_rank(self._rank), self._job_rank(int(dstRank))
        pair = self._pair(src, dst, int(tag))
        return FutureWork(pair.broadcast(_as_list(tensors), pair.comm.ranks.index(src), self._time_limit))

    def recv(self, tensors, srcRank, tag=0) -> dist.Work:  # noqa: N803 - torch's names
        """ProcessGroup.recv: the tensors from rank srcRank's send of the same tag."""
        src, dst = self._job_rank(int(srcRank)), self._job_rank(self._rank)
        pair = self._pair(src, dst, int(tag))
        return FutureWork(pair.broadcast(_as_list(tensors), pair.comm.ranks.index(src), self._time_limit))

    def recv_anysource(self, tensors, tag=0) -> dist.Work:
        """Not supported: a receive from any rank cannot be matched by the reducers, which relay
        each message within the pair that sends it. NotImplementedError."""
        raise NotImplementedError(
            "recv without a source (recv_anysource) is not supported by the reduction_server "
            "backend: name the source rank, or use a gloo group"
        )

    def barrier(self, opts=None) -> dist.Work:
        """ProcessGroup.barrier: a Work that completes once every rank has entered the barrier,
        or fails ("Timed out after ...") past BarrierOptions.timeout."""
        return FutureWork(self._collectives.barrier(self._limit(opts)))

    def shutdown(self) -> None:
        """Finish the queued completions and, if this group made it, close the Communicator."""
        _forget(self)
        if self._owner:
            self._pipeline.close()

    def abort(self) -> None:
        """ProcessGroup.abort: the same as shutdown()."""
        self.shutdown()


# The job's Communicator, made with the default group; every other group of the job runs on it
# (its own order of collectives when it has fewer ranks, the default group's when it has them all).
_groups: Dict[int, ReductionServerProcessGroup] = {}
_groups_lock = threading.Lock()


def _forget(pg: ReductionServerProcessGroup) -> None:
    with _groups_lock:
        for key, value in list(_groups.items()):
            if value is pg:
                del _groups[key]


def _communicator_for(rank: int, world_size: int, store: Any) -> Communicator:
    """A Communicator at torch's rank and world size, reducers and job identity from discovery.
    Whatever launcher started the process, torch's rank and world size stand: its placement on
    the host is not needed here, and may be unknown (Lightning's launcher sets LOCAL_RANK alone)."""
    place = discover_worker(rank=rank, world_size=world_size)
    return Communicator(
        place.reducers,
        rank,
        world_size,
        job_token=place.job_token,
        job_id=place.job_id,
        generation=place.generation,
        run_id=agreed_run_id(store, rank, place.generation),
    )


#: the key of the rendezvous store under which rank 0 names this start of the group, per
#: generation: torchrun's agent keeps its store, keys included, when it restarts the group
RUN_KEY = "reduction_server/run/{generation}"


def agreed_run_id(store: Any, rank: int, generation: int) -> Optional[str]:
    """This start of the job's name, agreed through torch's rendezvous store: the launcher's run
    id (discovery.run_id) and a nonce rank 0 draws and every rank reads. A group its platform
    starts again with the same environment (a pod restart keeps TORCHELASTIC_RUN_ID and
    CLOUD_ML_JOB_ID) is then a new run to the reducers, never the last one's late ranks. None
    (the launcher's alone) where the store is this process's own (no MASTER_ADDR: rendezvous.py)."""
    underlying = store
    while isinstance(underlying, dist.PrefixStore):
        underlying = underlying.underlying_store
    if underlying is None or getattr(underlying, "PROCESS_LOCAL", False):
        return None
    key = RUN_KEY.format(generation=generation)
    if rank == 0:
        store.set(key, secrets.token_hex(8))
    nonce = store.get(key).decode()  # waits for rank 0's, within the store's timeout
    launcher = run_id()
    return f"{launcher}/{nonce}" if launcher else nonce


def create_backend(options: Any, backend_options: Any = None) -> ReductionServerProcessGroup:
    """The creator registered with torch for "reduction_server" (its extended API: options is a
    _DistributedBackendOptions). The default group makes the job's Communicator; a group of
    fewer ranks is a Group of it, named by torch's group name; a group of all ranks shares the
    default group's. The store only names this start of the job (agreed_run_id): the reducers are
    the meeting point."""
    ranks, rank, size = list(options.global_ranks_in_group), options.group_rank, options.group_size
    with _groups_lock:
        world = next(iter(_groups.values()), None)
        if world is None:
            if ranks and len(ranks) != size:
                raise RuntimeError("the reduction_server backend's first group must be the default group")
            pg = ReductionServerProcessGroup(
                _communicator_for(rank, size, getattr(options, "store", None)),
                owns_communicator=True,
                timeout=options.timeout,
            )
            _groups[id(pg)] = pg
            return pg
        if not ranks or len(ranks) == world.size():
            return ReductionServerProcessGroup(timeout=options.timeout, _share=world)
        group = Group(world.communicator, ranks, f"torch:{options.group_id}")
        return ReductionServerProcessGroup(group, owns_communicator=True, timeout=options.timeout)
