"""One rank of the reducer suite's load: `python -m reduction_server.bench.reducer_job MIB ITERS
[COMPRESSION]`. All-reduces a float32 buffer ITERS times between barriers (with `compression=`
COMPRESSION, default "none"). Rank 0 says READY on stdout once every
rank is warmed up and waits for a line on stdin before the timed loop (the suite reads the
reducer's CPU clocks in between), then says DONE with the loop's seconds and waits again."""

import json
import sys
import time

import numpy as np

import reduction_server.client as rs


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
        start = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x, out=x, compression=compression)
        comm.barrier()
        if comm.rank == 0:
            print("DONE " + json.dumps({"seconds": time.perf_counter() - start}), flush=True)
            sys.stdin.readline()
        comm.barrier()


if __name__ == "__main__":
    main()
