"""One rank of the soak test: `python soak_worker.py SECONDS WARMUP_SECONDS`.

Runs collectives of mixed sizes, dtypes and ops (all_reduce in and out of place, async batches,
broadcast), every result checked against tests/helpers/reference.py, until rank 0 has run SECONDS; rank
0's decision travels in a flag all-reduce, so every rank stops after the same collective. Prints
`{"warm": ...}` once WARMUP_SECONDS have passed (its RSS and open files then) and a last JSON line
with the counts, the failures, and its RSS and open files at the end.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
from report import report  # noqa: E402

import reduction_server.client as rs  # noqa: E402
from helpers.reference import DTYPES, OPS, check, make_input  # noqa: E402

COUNTS = [1, 7, 1000, 4099, 65_537, 300_000]  # a fixed set: a training job repeats its sizes


def usage() -> dict:
    me = psutil.Process()
    return {"rss": me.memory_info().rss, "fds": me.num_fds()}


def main() -> None:
    seconds, warmup = float(sys.argv[1]), float(sys.argv[2])
    failures, done = [], 0
    start = time.monotonic()
    warm = None
    with rs.Communicator.from_env() as comm:
        world, rank = comm.world_size, comm.rank
        i = 0
        while True:
            dtype, op, count = DTYPES[i % len(DTYPES)], OPS[(i // 3) % len(OPS)], COUNTS[(i // 7) % len(COUNTS)]
            xs = [make_input(dtype, op, count, i, r) for r in range(world)]
            kind = i % 4
            if kind == 0:
                result = comm.all_reduce(xs[rank], op)
            elif kind == 1:
                mine = xs[rank].copy()
                result = comm.all_reduce(mine, op, out=mine)
            elif kind == 2:  # a batch in flight at once
                handles = [comm.all_reduce_async(xs[rank], op) for _ in range(3)]
                result = [h.wait() for h in handles][-1]
                done += 2
            else:
                root = i % world
                x = xs[rank].copy()
                comm.broadcast(x, root=root)
                if not np.array_equal(x.view(np.uint8), xs[root].view(np.uint8)):
                    failures.append(f"broadcast {i} of {count} x {dtype} from {root}")
                result = None
            if result is not None:
                error = check(result, xs, dtype, op)
                if error:
                    failures.append(f"collective {i} ({op} of {count} x {dtype}): {error}")
            done += 1
            i += 1
            if warm is None and time.monotonic() - start >= warmup:
                warm = usage()
                report({"warm": warm, "done": done})
            if i % 8 == 0:  # every rank stops after the same collective: rank 0's clock decides
                go = np.array([rank == 0 and time.monotonic() - start < seconds], np.int32)
                done += 1
                if comm.all_reduce(go, "max")[0] == 0:
                    break
        end = usage()  # with the communicator still open, like the warm-up figure
    report(
        {
            "rank": rank,
            "done": done,
            "failures": failures[:20],
            "warm": warm,
            "end": end,
            "seconds": time.monotonic() - start,
        }
    )


if __name__ == "__main__":
    main()
