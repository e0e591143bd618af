"""End to end: real reducer processes, real worker processes, every dtype and op, W x R."""

import json

import pytest

from helpers.cluster import reducers, run_workers
from helpers.reference import DTYPES, OPS

# Small chunks so that modest sizes still make many chunks, several per reducer, with a tail.
CHUNK = 65536
SIZES = [1, 7, 1000, 3 * (CHUNK // 4) + 5]


def cases(sizes, seed=0):
    return [
        {"dtype": d, "op": o, "count": n, "seed": seed + i}
        for i, (d, o, n) in enumerate((d, o, n) for d in DTYPES for o in OPS for n in sizes)
    ]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("num_reducers", [1, 2, 3])
def test_every_dtype_and_op(world, num_reducers):
    spec = {
        "sequential": cases(SIZES),
        "concurrent": cases([5, 40_000], seed=1000)[:24],
        "broadcast": [1, 70_000],
    }
    with reducers(num_reducers, workers=world) as group:
        results = run_workers(
            world, group, "allreduce_worker.py", [json.dumps(spec)], extra_env={"RS_CHUNK_BYTES": str(CHUNK)}
        )
        assert group.alive(), "a reducer died during the job"
    expected = len(spec["sequential"]) + len(spec["concurrent"]) + 2 * world
    for result in results:
        assert result["failures"] == []
        assert result["done"] == expected


@pytest.mark.parametrize("world,num_reducers", [(4, 2), (2, 3)])
def test_64_mib_buffers(world, num_reducers):
    """64 MiB of float32 and a tail (not a multiple of the chunk size); at W=2 also float16 and
    int32 of as many elements (each rank's NumPy reference of W such buffers is most of the cost)."""
    count = 16 * 1024 * 1024 + 3
    spec = {
        "sequential": [
            {"dtype": "float32", "op": "sum", "count": count, "seed": 7},
            {"dtype": "float16", "op": "avg", "count": count, "seed": 8},
            {"dtype": "int32", "op": "max", "count": count, "seed": 9},
        ][: 3 if world == 2 else 1]
    }
    with reducers(num_reducers, workers=world) as group:
        results = run_workers(world, group, "allreduce_worker.py", [json.dumps(spec)])
    for result in results:
        assert result["failures"] == []
        assert result["done"] == len(spec["sequential"])
