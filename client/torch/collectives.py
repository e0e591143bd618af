"""torch.distributed's collectives, each composed of the Communicator's two primitives: an
all-reduce (reduce, reduce_scatter) and a broadcast relayed by the reducers (all_gather, gather,
scatter, all_to_all), on host tensors staged as tensors.py describes.

Every rank composes a collective into the same primitives in the same order, so the chunk
plans agree. Where a rank cannot know the sizes another rank sends (all_to_all with uneven
splits), the ranks first all-reduce a matrix of counts, waiting for it before the data goes.
Each call submits everything at once and hands the Pipeline a finish() that copies results out.
"""

from typing import Any, Callable, List, Optional, Sequence, Union

import numpy as np
import torch  # the real torch: imports are absolute

from reduction_server.wire.protocol import ReduceOp

from ..communicator import Communicator, Handle
from .pipeline import Pipeline, Started
from .tensors import Staged, as_wire, check_device, devices_of

Factor = Optional[Union[float, torch.Tensor]]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1)


def _pieces(flat: torch.Tensor, counts: Sequence[int]) -> List[torch.Tensor]:
    """flat cut into consecutive pieces of `counts` elements (views)."""
    return list(torch.split(flat, list(counts)))


def _scratch_like(tensor: torch.Tensor, count: Optional[int] = None) -> torch.Tensor:
    """A host buffer for a piece this rank receives and drops (or copies out)."""
    return torch.empty(tensor.numel() if count is None else count, dtype=tensor.dtype, device="cpu")


class Collectives:
    """The torch collectives of one process group, over its Pipeline's Communicator."""

    def __init__(self, pipeline: Pipeline, comm: Optional[Communicator] = None) -> None:
        self.pipeline = pipeline
        self._comm = comm or pipeline.communicator  # another one: a group of the pipeline's (send/recv pairs)

    @property
    def comm(self) -> Communicator:
        """The communicator of the calling thread's collectives (its lane's, pipeline.py)."""
        return self.pipeline.communicator_for(self._comm)

    @property
    def rank(self) -> int:
        return self._comm.rank  # every lane's communicator has the same ranks

    @property
    def world(self) -> int:
        return self._comm.world_size

    def submit(self, start: Callable[[], Started], tensors: Sequence[torch.Tensor]) -> torch.futures.Future:
        """Hand start() to the Pipeline; a Future for `tensors` (on their CUDA devices, if any)."""
        return self.pipeline.run(start, self.pipeline.future(devices_of(tensors)))

    def _reduce_into(
        self, x: torch.Tensor, out: torch.Tensor, op: ReduceOp, factor: Factor, timeout: Optional[float]
    ) -> Handle:
        """All-reduce host tensor x (times factor) into host tensor out."""
        if factor is not None:
            x = x * factor if x.data_ptr() != out.data_ptr() else x.mul_(factor)
        return self.comm.all_reduce_async(as_wire(x, op), op, out=as_wire(out, op), timeout=timeout)

    def relay(self, host: torch.Tensor, root: int, timeout: Optional[float] = None) -> Handle:
        """Start a broadcast of host tensor `host` from `root` (any dtype, as bytes)."""
        return self.comm.broadcast_async(as_wire(host, None), root, timeout=timeout)

    # -- all-reduce and its relatives -------------------------------------------------------
    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp,
        factor: Factor = None,
        value: Any = None,
        timeout: Optional[float] = None,
    ) -> torch.futures.Future:
        """In-place all-reduce of each tensor; the Future's value is `value` (default: the list)."""

        def start() -> Started:
            staged = [Staged(t, "all_reduce tensor") for t in tensors]
            handles = [self._reduce_into(s.host, s.host, op, factor, timeout) for s in staged]

            def finish():
                for s in staged:
                    s.finish()
                return list(tensors) if value is None else value

            return handles, finish

        return self.submit(start, tensors)

    def reduce(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp,
        root: int,
        factor: Factor = None,
        timeout: Optional[float] = None,
    ) -> torch.futures.Future:
        """Each tensor reduced into the root's; the other ranks' tensors are left as they were."""
        if self.rank == root:
            return self.all_reduce(tensors, op, factor, timeout=timeout)

        def start() -> Started:
            staged = [Staged(t, "reduce tensor") for t in tensors]
            handles = [self._reduce_into(s.host, torch.empty_like(s.host), op, factor, timeout) for s in staged]
            return handles, lambda: list(tensors)

        return self.submit(start, tensors)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: ReduceOp,
        factor: Factor = None,
        timeout: Optional[float] = None,
    ) -> torch.futures.Future:
        """inputs[r] reduced over the ranks into rank r's output: one all-reduce per rank's piece,
        this rank's straight into its output."""
        if len(inputs) != self.world:
            raise ValueError(f"reduce_scatter: {len(inputs)} inputs; the world size is {self.world}")
        mine = inputs[self.rank]
        if mine.numel() != output.numel() or mine.dtype != output.dtype:
            raise ValueError(
                f"reduce_scatter: output {tuple(output.shape)} {output.dtype} does not match this "
                f"rank's input {tuple(mine.shape)} {mine.dtype}"
            )

        def start() -> Started:
            out = Staged(output, "reduce_scatter output", load=False)
            handles = []
            for r, x in enumerate(inputs):
                host = Staged(x, "reduce_scatter input").host
                dst = out.host.reshape(host.shape) if r == self.rank else torch.empty_like(host)
                handles.append(self._reduce_into(host, dst, op, factor, timeout))

            def finish():
                out.finish()
                return [output]

            return handles, finish

        return self.submit(start, [output])

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp,  # noqa: A002
        factor: Factor = None,
        timeout: Optional[float] = None,
    ) -> torch.futures.Future:
        """input, cut into world-size equal pieces, reduce-scattered into output."""
        if input.numel() != output.numel() * self.world or input.dtype != output.dtype:
            raise ValueError(
                f"reduce_scatter_tensor: input {tuple(input.shape)} {input.dtype} must hold world size "
                f"({self.world}) x output {tuple(output.shape)} {output.dtype}"
            )
        return self.reduce_scatter(output, _pieces(_flat(input), [output.numel()] * self.world), op, factor, timeout)

    def barrier(self, timeout: Optional[float] = None) -> torch.futures.Future:
        """A Future that completes once every rank has reached the barrier (a one-element
        all-reduce), or fails past `timeout` seconds."""

        def start() -> Started:
            token = np.zeros(1, np.int32)
            return [self.comm.all_reduce_async(token, ReduceOp.SUM, out=token, timeout=timeout)], lambda: None

        return self.pipeline.run(start, self.pipeline.future())

    # -- relays: each rank's data to the others, broadcast by the reducers -------------------
    def broadcast(
        self, tensors: Sequence[torch.Tensor], root: int, timeout: Optional[float] = None
    ) -> torch.futures.Future:
        """Overwrite each tensor with root's, in place (sent as bytes); the Future's value is the list."""

        def start() -> Started:
            staged = [Staged(t, "broadcast tensor", load=self.rank == root) for t in tensors]
            handles = [self.relay(s.host, root, timeout) for s in staged]

            def finish():
                if self.rank != root:
                    for s in staged:
                        s.finish()
                return list(tensors)

            return handles, finish

        return self.submit(start, tensors)

    def all_gather(
        self,
        outputs: Sequence[Sequence[torch.Tensor]],
        inputs: Sequence[torch.Tensor],
        timeout: Optional[float] = None,
        value: Any = None,
    ) -> torch.futures.Future:
        """Each input into outputs[i][rank] on every rank, as one broadcast per rank; the
        Future's value is `value` (default: the output lists). ValueError for lists or tensors
        that do not match."""
        world, rank = self.world, self.rank
        if len(outputs) != len(inputs):
            raise ValueError(f"allgather: {len(outputs)} output lists for {len(inputs)} inputs")
        for outs, x in zip(outputs, inputs):
            if len(outs) != world:
                raise ValueError(f"allgather: an output list holds {len(outs)} tensors; the world size is {world}")
            if outs[rank].dtype != x.dtype or outs[rank].numel() != x.numel():
                raise ValueError(
                    f"allgather: output {tuple(outs[rank].shape)} {outs[rank].dtype} does not match "
                    f"input {tuple(x.shape)} {x.dtype}"
                )

        def start() -> Started:
            for x in inputs:
                check_device(x, "allgather input")
            staged = []  # everything staged (and checked) before anything is sent
            for outs, x in zip(outputs, inputs):
                with torch.no_grad():
                    outs[rank].copy_(x.reshape(outs[rank].shape))
                for root, o in enumerate(outs):  # W broadcasts, each rank the root of its slot
                    s = Staged(o, "allgather output", load=root == rank)
                    staged.append((root, s))
            handles = [self.relay(s.host, root, timeout) for root, s in staged]

            def finish():
                for root, s in staged:
                    if root != rank:
                        s.finish()
                return [list(outs) for outs in outputs] if value is None else value

            return handles, finish

        return self.submit(start, [o for outs in outputs for o in outs])

    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        timeout: Optional[float] = None,
    ) -> torch.futures.Future:
        """Every rank's input into its piece of output (world size x input), in rank order."""
        if output.numel() != input.numel() * self.world or output.dtype != input.dtype:
            raise ValueError(
                f"all_gather_into_tensor: output {tuple(output.shape)} {output.dtype} must hold world "
                f"size ({self.world}) x input {tuple(input.shape)} {input.dtype}"
            )
        if not output.is_contiguous():
            raise ValueError("all_gather_into_tensor: the output tensor must be contiguous")
        pieces = _pieces(_flat(output), [input.numel()] * self.world)
        return self.all_gather([pieces], [input], timeout, value=output)

    def gather(
        self,
        outputs: Sequence[torch.Tensor],
        input: torch.Tensor,
        root: int,  # noqa: A002
        timeout: Optional[float] = None,
    ) -> torch.futures.Future:
        """Every rank's input into outputs[rank] on the root (outputs is empty elsewhere)."""
        if self.rank != root:
            outputs = [input if r == self.rank else _scratch_like(input) for r in range(self.world)]
        return self.all_gather([list(outputs)], [input], timeout)

    def scatter(
        self, output: torch.Tensor, inputs: Sequence[torch.Tensor], root: int, timeout: Optional[float] = None
    ) -> torch.futures.Future:
        """The root's inputs[r] into rank r's output: one broadcast per other rank."""
        rank = self.rank
        if rank == root and len(inputs) != self.world:
            raise ValueError(f"scatter: the root has {len(inputs)} inputs; the world size is {self.world}")

        def start() -> Started:
            out = Staged(output, "scatter output", load=False)
            handles = []
            for r in range(self.world):
                if r == root:
                    continue  # the root's own piece does not travel
                if rank == root:
                    buf = Staged(inputs[r], "scatter input").host
                else:
                    buf = out.host if r == rank else _scratch_like(out.host)
                handles.append(self.relay(buf, root, timeout))
            if rank == root:
                with torch.no_grad():
                    out.host.copy_(inputs[root].reshape(out.host.shape))

            def finish():
                out.finish()
                return [output]

            return handles, finish

        return self.submit(start, [output])

    def all_to_all(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        even: bool = False,
        timeout: Optional[float] = None,
    ) -> torch.futures.Future:
        """inputs[r] of rank j into outputs[j] of rank r. Each rank broadcasts its inputs as one
        buffer and every rank keeps its pieces; `even` says every piece has one size everywhere,
        else the ranks first exchange their counts."""
        world, rank = self.world, self.rank
        if len(outputs) != world or len(inputs) != world:
            raise ValueError(f"all_to_all: {len(outputs)} outputs and {len(inputs)} inputs; the world size is {world}")
        for j, o in enumerate(outputs):
            if o.dtype != inputs[0].dtype:
                raise ValueError(f"all_to_all: output {j} is {o.dtype} but the inputs are {inputs[0].dtype}")

        def start() -> Started:
            counts = (
                [[outputs[0].numel()] * world] * world
                if even
                else self._counts([x.numel() for x in inputs], [o.numel() for o in outputs])
            )
            sent = (
                torch.cat([_flat(Staged(x, "all_to_all input").host) for x in inputs])
                if world > 1
                else _flat(Staged(inputs[0], "all_to_all input").host)
            )
            outs = [Staged(o, "all_to_all output", load=False) for o in outputs]
            bufs = [sent if j == rank else _scratch_like(sent, sum(counts[j])) for j in range(world)]
            handles = [self.relay(buf, j, timeout) for j, buf in enumerate(bufs)]

            def finish():
                with torch.no_grad():
                    for j, (buf, out) in enumerate(zip(bufs, outs)):
                        piece = _pieces(buf, counts[j])[rank]
                        out.host.copy_(piece.reshape(out.host.shape))
                        out.finish()
                return list(outputs)

            return handles, finish

        return self.submit(start, list(outputs))

    def _counts(self, sends: List[int], receives: List[int]) -> List[List[int]]:
        """counts[j][r]: the elements rank j sends rank r, from every rank's `sends` and
        `receives` (one all-reduce, waited for here). Every rank sees every rank's sizes, so a
        disagreement is the same ValueError on every rank, before any data goes."""
        world = self.world
        both = np.zeros((2, world, world), np.int64)
        both[0, self.rank], both[1, self.rank] = sends, receives
        self.comm.all_reduce(both, out=both)
        wrong = [(j, r) for j in range(world) for r in range(world) if both[0, j, r] != both[1, r, j]]
        if wrong:
            raise ValueError(
                "all_to_all: the ranks disagree on sizes: "
                + "; ".join(
                    f"rank {j} sends rank {r} {both[0, j, r]} elements, rank {r} expects {both[1, r, j]}"
                    for j, r in wrong[:8]
                )
            )
        return both[0].tolist()
