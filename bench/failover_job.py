"""One rank of the job of `reduction-server bench failover`: `python -m
reduction_server.bench.failover_job rs --mib S --steps N [--kill-at K --victim-pid PID [--signal TERM]]`.

Each step is one all-reduce of S MiB of float32, its result checked; rank 0 times each step and
prints one JSON line per step (`{"step": i, "seconds": t}`). With --kill-at, rank 0 SIGKILLs the
reducer process PID a moment into step K, while its chunks are on the wire: that step's time is
the cost of the failover, and the steps after it run on the reducers left. With --signal TERM it
sends SIGTERM instead: the reducer drains (docs/reliability.md), and that step is a drain's cost.
"""

import argparse
import json
import os
import signal
import time

import numpy as np

from reduction_server.client import Communicator

#: how far into the step the reducer dies: its chunks are in flight by then
KILL_DELAY_S = 0.005


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=["rs"])
    parser.add_argument("--mib", type=float, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--victim-pid", type=int, default=0)
    parser.add_argument("--signal", choices=["KILL", "TERM"], default="KILL")
    args = parser.parse_args()
    with Communicator.from_env() as comm:
        count = int(args.mib * (1 << 20)) // 4
        x = np.full(count, comm.rank + 1, np.float32)
        want = comm.world_size * (comm.world_size + 1) / 2
        for step in range(args.steps):
            comm.barrier()
            started = time.perf_counter()
            handle = comm.all_reduce_async(x)
            if step == args.kill_at and comm.rank == 0 and args.victim_pid:
                time.sleep(KILL_DELAY_S)
                os.kill(args.victim_pid, signal.Signals[f"SIG{args.signal}"])
            out = handle.wait()
            seconds = time.perf_counter() - started
            if not (out == want).all():
                raise SystemExit(f"rank {comm.rank}: step {step}: wrong sum")
            if comm.rank == 0:
                print(json.dumps({"step": step, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
