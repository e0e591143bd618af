"""A job that all-reduces steadily for tests/jobs/test_chaos.py: `python steady_worker.py STEPS PAUSE`.
Each step all-reduces (rank + 1) * ones and checks the sum; rank 0 prints `STEP n` as it goes and
`DONE` at the end. A failed collective ends the rank with its error (exit 1)."""

import sys
import time

import numpy as np

from reduction_server.client import Communicator


def main() -> None:
    steps, pause = int(sys.argv[1]), float(sys.argv[2])
    with Communicator.from_env() as comm:
        expected = comm.world_size * (comm.world_size + 1) / 2
        for step in range(steps):
            out = comm.all_reduce(np.full(1 << 16, comm.rank + 1.0, np.float32))
            assert (out == expected).all(), (step, out[:4])
            if comm.rank == 0:
                print(f"STEP {step}", flush=True)
            time.sleep(pause)
        if comm.rank == 0:
            print("DONE", flush=True)


if __name__ == "__main__":
    main()
