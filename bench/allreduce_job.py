"""One rank of a timed all-reduce job: `python -m reduction_server.bench.allreduce_job BACKEND
--mib 1,4,64 --iters N [--dtype float16]`. Rank 0 prints one JSON line per size: the mean
seconds per all-reduce of a float32 (or float16) buffer of that many MiB, after a warm-up,
between barriers, and its own CPU seconds (all its threads) per all-reduce.

BACKEND: rs (this project, from RS_* variables), gloo (torch.distributed, from RANK/WORLD_SIZE/
MASTER_ADDR/MASTER_PORT), mpi (mpi4py under mpirun).
"""

import argparse
import json
import time

import numpy as np

from reduction_server.tools.reducer_load import process_cpu_seconds


def _rs():
    import reduction_server.client as rs

    comm = rs.Communicator.from_env()
    return comm.rank, lambda x: comm.all_reduce(x, out=x), comm.barrier, comm.close


def _gloo():
    import torch
    import torch.distributed as dist

    from reduction_server.bench.gloo_exit import exit_now

    dist.init_process_group("gloo")

    def all_reduce(x: np.ndarray) -> None:
        dist.all_reduce(torch.from_numpy(x))

    def close() -> None:
        dist.destroy_process_group()
        exit_now()

    return dist.get_rank(), all_reduce, dist.barrier, close


def _mpi():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD

    def all_reduce(x: np.ndarray) -> None:
        comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)

    return comm.Get_rank(), all_reduce, comm.Barrier, lambda: None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=["rs", "gloo", "mpi"])
    parser.add_argument("--mib", default="1,4,16,64")
    parser.add_argument("--iters", type=int, default=0, help="per size; 0: more for small sizes")
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    args = parser.parse_args()
    rank, all_reduce, barrier, close = {"rs": _rs, "gloo": _gloo, "mpi": _mpi}[args.backend]()
    for mib in [float(m) for m in args.mib.split(",")]:
        dtype = np.dtype(args.dtype)
        x = np.ones(max(1, int(mib * (1 << 20)) // dtype.itemsize), dtype)
        iters = args.iters or max(3, min(50, int(256 / mib)))
        all_reduce(x)  # warm-up: connections and buffers
        barrier()
        cpu, start = process_cpu_seconds(), time.perf_counter()
        for _ in range(iters):
            all_reduce(x)
        barrier()
        seconds = (time.perf_counter() - start) / iters
        cpu_s = (process_cpu_seconds() - cpu) / iters
        if rank == 0:
            print(json.dumps({"bytes": x.nbytes, "seconds": seconds, "iters": iters, "cpu_s": cpu_s}), flush=True)
    close()


if __name__ == "__main__":
    main()
