"""One rank of the timeline test: plain all-reduces, one fused step whose tensors arrive in
reverse order, then an all-reduce the ranks disagree on (it fails). Rank 0 closes its
communicator; the others leave the timeline to the exit hook."""

import sys

import numpy as np
from report import report

import reduction_server.client as rs
from reduction_server.client.fusion import FusedAllReduce, FusionPlan, TensorSpec
from reduction_server.wire.protocol import DType

PLAIN = [1000, 300_000]  # one chunk; several chunks
TENSORS = [("w1", 1000), ("b1", 10), ("w2", 2000), ("b2", 20), ("w3", 500)]
THRESHOLD = 4 * 2100  # buckets: [w1, b1], [w2, b2], [w3]


def main() -> None:
    comm = rs.Communicator.from_env()
    for count in PLAIN:
        result = comm.all_reduce(np.ones(count, np.float32))
        assert result[0] == comm.world_size, result[:4]
    plan = FusionPlan([TensorSpec(name, (n,), DType.FLOAT32) for name, n in TENSORS], threshold=THRESHOLD)
    step = FusedAllReduce(comm, plan)
    for name, n in reversed(TENSORS):
        step.ready(name, np.full(n, comm.rank + 1, np.float32))
    out = step.wait()
    expected = sum(range(1, comm.world_size + 1))
    assert all(np.all(out[name] == expected) for name, _ in TENSORS), out
    try:
        comm.all_reduce(np.ones(10 + comm.rank, np.float32))
        raise AssertionError("an all-reduce of different sizes succeeded")
    except rs.CollectiveError:
        pass
    report({"rank": comm.rank, "buckets": [[s.name for s in b.specs] for b in plan.buckets]})
    sys.stdout.flush()
    if comm.rank == 0:
        comm.close()


if __name__ == "__main__":
    main()
