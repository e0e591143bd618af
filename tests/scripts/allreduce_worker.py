"""One rank of a test job: run the cases given as JSON, check each against the reference
computed from every rank's deterministic inputs, print one JSON summary line."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from report import report  # noqa: E402

import reduction_server.client as rs  # noqa: E402
from helpers.reference import check, make_input  # noqa: E402


def main() -> None:
    spec = json.loads(sys.argv[1])
    failures, done = [], 0
    with rs.Communicator.from_env() as comm:
        world, rank = comm.world_size, comm.rank

        def inputs(case):
            return [make_input(case["dtype"], case["op"], case["count"], case["seed"], r) for r in range(world)]

        # Many collectives in a row, alternating out-of-place and in-place.
        for i, case in enumerate(spec.get("sequential", [])):
            xs = inputs(case)
            mine = xs[rank].copy()
            if i % 2:
                result = comm.all_reduce(mine, op=case["op"], out=mine)
                assert result is mine
            else:
                result = comm.all_reduce(mine, op=case["op"])
                if not np.array_equal(mine.view(np.uint8), xs[rank].view(np.uint8)):
                    failures.append(f"{case}: input was modified by an out-of-place all_reduce")
            error = check(result, xs, case["dtype"], case["op"])
            if error:
                failures.append(f"{case}: {error}")
            done += 1
        # Several in flight at once.
        batch = spec.get("concurrent", [])
        handles = []
        for case in batch:
            xs = inputs(case)
            handles.append((case, xs, comm.all_reduce_async(xs[rank].copy(), op=case["op"])))
        for case, xs, handle in handles:
            error = check(handle.wait(), xs, case["dtype"], case["op"])
            if error:
                failures.append(f"concurrent {case}: {error}")
            done += 1
        for count in spec.get("broadcast", []):
            for root in range(world):
                x = np.full(count, rank, dtype=np.float32) + np.arange(count, dtype=np.float32)
                comm.broadcast(x, root=root)
                if not np.array_equal(x, np.full(count, root, np.float32) + np.arange(count, dtype=np.float32)):
                    failures.append(f"broadcast of {count} from root {root} gave {x[:4]}")
                done += 1
        comm.barrier()
    report({"rank": rank, "done": done, "failures": failures[:20]})


if __name__ == "__main__":
    main()
