"""One rank of tests/jobs/test_horovod_timeline.py: Horovod's dynamic timeline API
(hvd.start_timeline / hvd.stop_timeline) as Horovod's own test_timeline_api drives it, which
Horovod's file skips (its issue 2496). Prints each file's events as rank 0 read them."""

import json
import sys
import time

import torch
from report import report

import reduction_server.client.horovod.torch as hvd


def main() -> None:
    directory = sys.argv[1]
    torch.set_num_threads(1)
    hvd.init()
    files = {}
    for i, mark_cycles in enumerate([True, True, False, True]):
        path = f"{directory}/timeline{i}.json"
        hvd.start_timeline(path, mark_cycles=mark_cycles)
        time.sleep(0.1)
        hvd.allreduce(torch.tensor([1, 2, 3], dtype=torch.float32), name="test_allreduce")
        time.sleep(0.1)
        hvd.stop_timeline()
        if hvd.rank() == 0:
            with open(path) as f:
                files[path] = {"mark_cycles": mark_cycles, "events": json.load(f)}  # complete JSON once stopped
    rank = hvd.rank()
    hvd.shutdown()
    report({"rank": rank, "files": files})


if __name__ == "__main__":
    main()
