"""A training loop for tests/jobs/test_failover.py: `python failover_worker.py STEPS EXACT`.

Every step each rank all-reduces gradients of three float32 tensors (several chunks each, on
every reducer) and an int32 one, and every tenth step broadcasts a tensor from a rotating root;
each result is checked against a NumPy reference computed from every rank's inputs: bitwise
(the rank-order float32 sum of deterministic mode) when EXACT is 1, else to float32 rounding;
the int32 sums and the broadcasts always bitwise. The parameters take a plain SGD step. Rank 0
prints `STEP n OUT` as it goes (OUT: the reducers it does not use now, comma-separated, or -);
every rank ends with one JSON line: its mismatches, a digest of its final parameters, and what
its failover did."""

import hashlib
import json
import sys

import numpy as np

from reduction_server.client import Communicator

SIZES = (1_000, 70_000, 300_000)
INTS = 5_000
BROADCAST = 50_000


def gradient(step: int, rank: int, i: int, n: int) -> np.ndarray:
    return (np.random.default_rng((step, rank, i)).standard_normal(n) * 0.01).astype(np.float32)


def main() -> None:
    steps, exact = int(sys.argv[1]), sys.argv[2] == "1"
    mismatches = []
    with Communicator.from_env() as comm:
        world, rank = comm.world_size, comm.rank
        params = [np.ones(n, np.float32) for n in SIZES]
        failover = comm._engine.failover
        ends = comm._engine.endpoints  # failover counts each shard of a reducer (RS_SHARDS) apart
        for step in range(steps):
            grads = [gradient(step, rank, i, n) for i, n in enumerate(SIZES)]
            ints = np.full(INTS, step * world + rank, np.int32)
            handles = [comm.all_reduce_async(g) for g in grads] + [comm.all_reduce_async(ints)]
            root = step % world
            shared = (
                np.full(BROADCAST, -1.0, np.float32) if rank != root else np.arange(BROADCAST, dtype=np.float32) + step
            )
            if step % 10 == 0:
                handles.append(comm.broadcast_async(shared, root))
            results = [h.wait() for h in handles]
            for i, n in enumerate(SIZES):
                want = gradient(step, 0, i, n)
                for r in range(1, world):
                    want += gradient(step, r, i, n)  # rank order, as the reducers fold in deterministic mode
                same = (
                    np.array_equal(results[i], want) if exact else np.allclose(results[i], want, rtol=1e-5, atol=1e-6)
                )
                if not same:
                    mismatches.append(f"step {step} tensor {i}: max diff {np.abs(results[i] - want).max()}")
                params[i] -= 0.1 * results[i]
            if not np.array_equal(results[len(SIZES)], np.full(INTS, sum(step * world + r for r in range(world)))):
                mismatches.append(f"step {step}: int32 sum wrong")
            if step % 10 == 0 and not np.array_equal(shared, np.arange(BROADCAST, dtype=np.float32) + step):
                mismatches.append(f"step {step}: broadcast from {root} wrong")
            if rank == 0:
                out = sorted({ends[e].reducer for e in failover.lost if not failover.since.get(e)})
                print(f"STEP {step} {','.join(map(str, out)) or '-'}", flush=True)
        digest = hashlib.sha256(b"".join(p.tobytes() for p in params)).hexdigest()
        print(
            json.dumps(
                {
                    "rank": rank,
                    "mismatches": mismatches[:5],
                    "mismatch_count": len(mismatches),
                    "digest": digest,
                    "lost": sorted({ends[e].reducer for e in failover.lost}),
                    "lost_endpoints": sorted(failover.lost),
                    "endpoints": len(ends),
                    "moved": failover.moved_chunks,
                    "finals": failover.finals,
                    "joins": failover.joins,
                    "rejoined_chunks": failover.rejoined_chunks,
                    "results_read": comm._engine.slots.results_read,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
