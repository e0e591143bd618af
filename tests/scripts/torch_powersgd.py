"""One rank of the PowerSGD test job: torch's own PowerSGD comm hooks on DDP over gloo and over
the reduction_server backend, and a Future callback that issues and waits on a collective.

Tasks, each on a process group of its own: "<backend>:<hook>" trains the shared small model
with DDP (one bucket per tensor) and powerSGD_hook or batched_powerSGD_hook
(matrix_approximation_rank 1, PowerSGD from the second step, a fixed random_seed) and reports
the final weights. Over gloo each bucket's hook is waited for before the next starts: gloo's
threads run the hooks' callbacks, two at a time, so with several buckets in flight both can
block in callbacks that wait on a collective, and the collectives they issue meet in a
different order on each rank. "then" runs
fut.then(cb) where cb all-reduces another tensor and waits for it, and reports what each saw.
A rank that has not finished after RS_TEST_DEADLINE seconds prints every thread's stack and
exits, so a hang fails its test in bounded time.
"""

import faulthandler
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rank_end import leave  # noqa: E402
from report import report  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch_model import STEPS, batch, make_model, train  # noqa: E402

import reduction_server.client.torch  # noqa: E402, F401 - registers the backend

HOOKS = {"powersgd": powersgd.powerSGD_hook, "batched": powersgd.batched_powerSGD_hook}
_orthogonalize = powersgd._orthogonalize


def _orthogonalize_one(matrices, epsilon=0):
    """torch's _orthogonalize, also of one matrix: batched_powerSGD_hook hands it a 2-D P and Q,
    which the batched function it calls refuses (an AssertionError with every backend), so
    here it gets a batch of one, a view of the same numbers."""
    _orthogonalize(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)


powersgd._orthogonalize = _orthogonalize_one


def one_at_a_time(hook):
    """`hook`, its Future waited for before it returns."""

    def waited(state, bucket):
        future = hook(state, bucket)
        future.wait()
        return future

    return waited


def train_with(hook, rank, world):
    """The final weights after STEPS steps of DDP with `hook` on the default group."""
    model = make_model(seed=1000 + rank)  # DDP's broadcast makes rank 0's weights everyone's
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets: one per tensor
    state = powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=42
    )
    ddp.register_comm_hook(state, HOOKS[hook] if dist.get_backend() != "gloo" else one_at_a_time(HOOKS[hook]))
    x, y = batch(world)
    per = x.shape[0] // world
    train(ddp, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per], STEPS)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def then_waits(rank):
    """fut.then(cb), cb all-reducing another tensor and waiting for it: both sums, in order."""
    outer = torch.full((4,), float(rank + 1))
    inner = torch.full((3,), float(10 * (rank + 1)))

    def callback(fut):
        dist.all_reduce(inner, async_op=True).wait()
        return fut.value()[0].tolist(), inner.tolist()

    chained = dist.all_reduce(outer, async_op=True).get_future().then(callback)
    return list(chained.wait())


def main():
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ["RS_RANK"]), int(os.environ["RS_WORLD_SIZE"])
    faulthandler.dump_traceback_later(float(os.environ.get("RS_TEST_DEADLINE", "60")), exit=True)
    torch.set_num_threads(1)  # ranks and reducers share this machine's cores
    out = {"rank": rank}
    groups = []  # every group lives until leave(): see below
    for task, port in zip(spec["tasks"], spec["master_ports"]):  # a fresh store for every group
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        backend, _, hook = task.partition(":")
        dist.init_process_group("reduction_server" if backend in ("rs", "then") else "gloo")
        out[task] = then_waits(rank) if task == "then" else train_with(hook, rank, world)
        # DDP's reference cycles hold the group: collected here, not by a collection that runs on
        # one of gloo's threads, whose group would then join that very thread and abort
        gc.collect()
        # ...and the group itself is held here: a gloo work item that one of gloo's threads lets
        # go of last would otherwise destroy its group there, which joins that very thread and
        # aborts ("Resource deadlock avoided", seen once in CI while the next group started)
        groups.append(dist.group.WORLD)
        dist.destroy_process_group()
        print(f"rank {rank}: {task} done", file=sys.stderr, flush=True)
    faulthandler.cancel_dump_traceback_later()
    report(out)
    leave()


if __name__ == "__main__":
    main()
