"""Check a reduction-server job end to end, and report its speed.

Run it under the local launcher (reducers and workers on this machine):

    reduction-server run -np 4 --reducers 2 -- python examples/allreduce_check.py

Every rank all-reduces buffers whose correct sum it can compute by itself, checks the result
for each dtype and op, then times a large float32 all-reduce. Exits non-zero on a wrong result.
"""

import argparse
import sys
import time

import numpy as np

import reduction_server.client as rs


def expected(op: str, world: int, base: np.ndarray) -> np.ndarray:
    """Rank r contributes base * (r + 1); the reduction of that over all ranks."""
    factors = np.arange(1, world + 1, dtype=np.float64)
    value = {
        "sum": factors.sum(),
        "avg": factors.mean(),
        "min": factors.min(),
        "max": factors.max(),
        "prod": factors.prod(),
    }[op]
    return base * value if op != "prod" else base**world * value


def check_every_op(comm: rs.Communicator) -> int:
    """All-reduce each dtype with each op and check the result; how many were wrong."""
    rank, world, errors = comm.rank, comm.world_size, 0
    for dtype in ("float32", "float64", "float16", "int32", "int64"):
        for op in ("sum", "avg", "min", "max", "prod"):
            if op == "avg" and dtype.startswith("int"):
                continue  # integer averages truncate; the float ones are checked exactly
            base = np.ones(100_003) if op == "prod" else np.arange(100_003) % 97
            mine = (base * (rank + 1)).astype(dtype)
            want = expected(op, world, base.astype(np.float64)).astype(dtype)
            got = comm.all_reduce(mine, op=op)
            if not np.array_equal(got, want):
                errors += 1
                print(f"WRONG: {op} of {dtype}: first values {got[:4]} != {want[:4]}", file=sys.stderr)
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64, help="size of the timed float32 all-reduce")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations")
    parser.add_argument("--rounds", type=int, default=1, help="times to run every check (a soak), each reported")
    args = parser.parse_args()

    with rs.Communicator.from_env() as comm:
        rank, world = comm.rank, comm.world_size
        errors = 0
        for round_ in range(1, args.rounds + 1):
            errors += check_every_op(comm)
            if args.rounds > 1:
                print(f"rank {rank}: round {round_} of {args.rounds} checked, {errors} wrong so far", flush=True)
        x = np.full(int(args.mib * (1 << 20)) // 4, rank + 1, dtype=np.float32)
        comm.all_reduce(x)  # warm-up: connections, buffers
        comm.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            y = comm.all_reduce(x)
        elapsed = (time.perf_counter() - start) / args.iters
        if not np.all(y == world * (world + 1) / 2):
            errors += 1
            print("WRONG: timed all-reduce gave a wrong sum", file=sys.stderr)
        print(f"rank {rank}: {'OK' if not errors else f'{errors} WRONG RESULTS'}")
        wrong = int(comm.all_reduce(np.array([errors], dtype=np.int64))[0])  # the verdict covers every rank
        if rank == 0:
            # algbw: the bytes one worker all-reduces over the time it takes (nccl-tests' measure)
            print(
                f"{world} workers, {len(comm.reducers)} reducers: {args.mib:g} MiB float32 all-reduce "
                f"in {elapsed * 1e3:.1f} ms, algbw {x.nbytes / elapsed / 1e9:.2f} GB/s "
                "(algorithm bandwidth: the buffer's bytes over the time)"
            )
            print(
                "PASSED: every result of every rank was right"
                if not wrong
                else f"FAILED: {wrong} wrong results over the ranks"
            )
        return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
