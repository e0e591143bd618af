"""One rank: DDP through the reduction_server backend on a model of several buckets, recording
in one sequence when each bucket's all-reduce is handed to the Communicator and when the first
layer's weight gradient (the last one backward computes) is computed. Prints the order."""

import sys
import threading

import torch
import torch.distributed as dist
from report import report
from torch.nn.parallel import DistributedDataParallel as DDP

import reduction_server.client.torch  # noqa: F401  (registers the backend)

LAYERS, WIDTH = 6, 256  # each layer's weight is 256 KiB: one bucket each at bucket_cap_mb=0.25


def main(bucket_cap_mb=0.25):
    dist.init_process_group("reduction_server")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(LAYERS)]
    )
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    events, lock = [], threading.Lock()
    comm = dist.distributed_c10d._get_default_group().communicator
    submit = comm.all_reduce_async

    def recording_submit(x, op="sum", out=None, **options):
        with lock:
            events.append(["allreduce", int(x.numel())])
        return submit(x, op, out, **options)

    comm.all_reduce_async = recording_submit  # an instance attribute: every collective passes here

    def first_grad(grad):
        with lock:
            events.append(["first_layer_grad", int(grad.numel())])
        return grad

    model[0][0].weight.register_hook(first_grad)
    x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(rank))
    iterations = []
    for _ in range(3):
        with lock:
            events.clear()
        ddp(x).square().mean().backward()
        with lock:
            iterations.append(list(events))
    dist.destroy_process_group()
    return {"rank": rank, "iterations": iterations}


if __name__ == "__main__":
    report(main(float(sys.argv[1]) if len(sys.argv) > 1 else 0.25))
