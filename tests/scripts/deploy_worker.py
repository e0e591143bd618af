"""One worker of a deployment test: finds its place from CLUSTER_SPEC / TF_CONFIG (as on Vertex
AI), all-reduces deterministic inputs through the reducers (in containers, in tests/jobs/test_docker.py)
and checks every result against NumPy. Prints one JSON line: rank, world, reducers, checks, failures.

EXPECT_RANK and EXPECT_WORLD, when set, are what discovery must have found.
"""

import os
import sys

import numpy as np
from report import report

import reduction_server.client as rs
from reduction_server.config.discovery import discover_worker

# (dtype, op, element count): small and multi-chunk buffers (RS_CHUNK_BYTES is set small by the
# test, so the larger ones are spread over every reducer).
CASES = [
    ("float32", "sum", 1),
    ("float32", "sum", 1000),
    ("float32", "sum", 300_001),
    ("float32", "avg", 65_536),
    ("float64", "max", 50_000),
    ("float64", "min", 50_000),
    ("int32", "sum", 100_003),
    ("int64", "prod", 4_097),
    ("float16", "sum", 70_000),
]


def make_input(dtype: str, op: str, count: int, case: int, rank: int) -> np.ndarray:
    rng = np.random.default_rng([case, rank])
    if np.dtype(dtype).kind == "i":
        low, high = (-3, 4) if op == "prod" else (-1000, 1000)
        return rng.integers(low, high, count).astype(dtype)
    values = rng.uniform(0.5, 1.5, count) if op == "prod" else rng.uniform(-100, 100, count)
    return values.astype(np.float32).astype(dtype)


def expected(inputs, dtype: str, op: str) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "i":
        stack = np.stack(inputs)
        return {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](stack, axis=0).astype(dt)
    stack = np.stack([x.astype(np.float64) for x in inputs])
    result = {"sum": np.sum, "avg": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](stack, axis=0)
    return (result / len(inputs) if op == "avg" else result).astype(dt)


def main() -> None:
    place = discover_worker()
    failures = []
    for name, value in (("EXPECT_RANK", place.rank), ("EXPECT_WORLD", place.world_size)):
        if os.environ.get(name) is not None and int(os.environ[name]) != value:
            failures.append(f"discovery gave {name[7:].lower()} {value}, expected {os.environ[name]}")
    checks = 0
    with rs.Communicator.from_env() as comm:
        for case, (dtype, op, count) in enumerate(CASES):
            inputs = [make_input(dtype, op, count, case, r) for r in range(comm.world_size)]
            got = comm.all_reduce(inputs[comm.rank], op=op)
            want = expected(inputs, dtype, op)
            rtol = 2.0**-9 if dtype == "float16" else 1e-6
            if got.dtype != want.dtype or got.shape != want.shape:
                failures.append(f"{dtype} {op} {count}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
            elif np.dtype(dtype).kind == "i" and not np.array_equal(got, want):
                failures.append(f"{dtype} {op} {count}: {np.count_nonzero(got != want)} elements differ")
            elif np.dtype(dtype).kind == "f" and not np.allclose(
                got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=1e-3 if dtype == "float16" else 1e-9
            ):
                failures.append(f"{dtype} {op} {count}: not close to NumPy's result")
            checks += 1
        x = np.full(1000, comm.rank, np.float32)
        comm.broadcast(x, root=comm.world_size - 1)
        if not np.array_equal(x, np.full(1000, comm.world_size - 1, np.float32)):
            failures.append("broadcast from the last rank gave the wrong values")
        checks += 1
        comm.barrier()
        report(
            {
                "rank": comm.rank,
                "world": comm.world_size,
                "reducers": list(comm.reducers),
                "source": place.source,
                "checks": checks,
                "failures": failures,
            }
        )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
