"""One rank of a timed all-reduce job: `python -m reduction_server.bench.allreduce_job BACKEND
--mib 1,4,64 --iters N [--dtype float16|bfloat16] [--compression int8]`. Rank 0 prints one JSON
line per size: the mean seconds per all-reduce of a float32 (or 16-bit) buffer of that many MiB,
after a warm-up, between barriers, and its own CPU seconds (all its threads) per all-reduce.
`--compression` (rs only): the wire format of Communicator.all_reduce (bf16, fp16, int8), the
buffer staying float32; `bytes` is then the float32 buffer's, not what travels.

BACKEND: rs (this project, from RS_* variables), gloo (torch.distributed, from RANK/WORLD_SIZE/
MASTER_ADDR/MASTER_PORT), mpi (mpi4py under mpirun).
"""

import argparse
import json
import time

import numpy as np

from reduction_server.tools.reducer_load import process_cpu_seconds


def _rs(compression: str):
    import reduction_server.client as rs

    comm = rs.Communicator.from_env()
    return comm.rank, lambda x: comm.all_reduce(x, out=x, compression=compression), comm.barrier, comm.close


def _gloo():
    import torch
    import torch.distributed as dist

    from reduction_server.bench.gloo_exit import exit_now

    dist.init_process_group("gloo")

    def all_reduce(x: np.ndarray) -> None:
        tensor = torch.from_numpy(x)
        dist.all_reduce(tensor.view(torch.bfloat16) if x.dtype == _BFLOAT16_BITS else tensor)

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


#: NumPy has no bfloat16: a bfloat16 buffer is held as its bits, and Gloo is given a view of them
_BFLOAT16_BITS = np.dtype(np.uint16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=["rs", "gloo", "mpi"])
    parser.add_argument("--mib", default="1,4,16,64")
    parser.add_argument("--iters", type=int, default=0, help="per size; 0: more for small sizes")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--compression", default="none", help="rs: Communicator.all_reduce's compression=")
    args = parser.parse_args()
    if args.dtype == "bfloat16" and args.backend != "gloo":
        parser.error("--dtype bfloat16 is for gloo (the others take float32 and a --compression)")
    if args.compression != "none" and args.backend != "rs":
        parser.error(f"--compression is for rs: {args.backend} sends the buffer as it is")
    backends = {"rs": lambda: _rs(args.compression), "gloo": _gloo, "mpi": _mpi}
    rank, all_reduce, barrier, close = backends[args.backend]()
    dtype = _BFLOAT16_BITS if args.dtype == "bfloat16" else np.dtype(args.dtype)
    for mib in [float(m) for m in args.mib.split(",")]:
        # ones: their sum is exact in every format, and bfloat16's bits of 1.0 are 0x3F80
        x = np.full(max(1, int(mib * (1 << 20)) // dtype.itemsize), 0x3F80 if dtype == _BFLOAT16_BITS else 1, dtype)
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
