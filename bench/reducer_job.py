"""One rank of the reducer suite's load: `python -m reduction_server.bench.reducer_job MIB ITERS
[COMPRESSION]`. All-reduces a float32 buffer ITERS times between barriers (with `compression=`
COMPRESSION, default "none"). Rank 0 says READY on stdout once every
rank is warmed up and waits for a line on stdin before the timed loop (the suite reads the
reducer's CPU clocks in between), then says DONE with the loop's seconds and its own CPU seconds
over it (all its threads), and waits again."""

import json
import sys
import time

import numpy as np

import reduction_server.client as rs
from reduction_server.tools.reducer_load import process_cpu_seconds


def main() -> None:
    mib, iters = float(sys.argv[1]), int(sys.argv[2])
    compression = sys.argv[3] if len(sys.argv) > 3 else "none"
    with rs.Communicator.from_env() as comm:
        x = np.ones(int(mib * (1 << 20)) // 4, np.float32)
        comm.all_reduce(x, out=x, compression=compression)  # warm-up: connections, buffers, the reducer's pool
        comm.barrier()
        if comm.rank == 0:
            print("READY", flush=True)
            sys.stdin.readline()
        comm.barrier()
        cpu, start = process_cpu_seconds(), time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x, out=x, compression=compression)
        comm.barrier()
        if comm.rank == 0:
            timed = {"seconds": time.perf_counter() - start, "cpu_s": process_cpu_seconds() - cpu}
            print("DONE " + json.dumps(timed), flush=True)
            sys.stdin.readline()
        comm.barrier()


if __name__ == "__main__":
    main()
