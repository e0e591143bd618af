"""A training loop that checkpoints and resumes, for `reduction-server run --max-restarts`
(tests/jobs/test_launcher.py): `python restart_worker.py DIR STEPS KILL_STEP`.

Each step all-reduces (rank + 1) * ones and adds the sum to the state; after each step rank 0
saves (step, state) to DIR/checkpoint.json, and every rank of a restarted group (its
TORCHELASTIC_RESTART_COUNT > 0) resumes from that file, as training scripts do. On the first
attempt rank 1 kills itself (SIGKILL) before contributing to step KILL_STEP. Each rank prints
`RUN attempt run-id` (RS_RUN_ID, the launcher's) at its start and `RESULT {json}` at the end.
"""

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np

from reduction_server.client import Communicator


def main() -> None:
    directory, steps, kill_step = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"RUN {attempt} {os.environ['RS_RUN_ID']}", flush=True)
    checkpoint = directory / "checkpoint.json"
    start, state = 0, np.zeros(4, np.float64)
    if attempt > 0:
        saved = json.loads(checkpoint.read_text())
        start, state = saved["step"], np.array(saved["state"])
    with Communicator.from_env() as comm:
        for step in range(start, steps):
            if attempt == 0 and comm.rank == 1 and step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            state += comm.all_reduce(np.full(4, comm.rank + 1.0))
            if comm.rank == 0:
                tmp = checkpoint.with_suffix(".tmp")
                tmp.write_text(json.dumps({"step": step + 1, "state": state.tolist()}))
                tmp.replace(checkpoint)  # whole or not at all
        print(
            "RESULT "
            + json.dumps(
                {
                    "rank": comm.rank,
                    "attempt": attempt,
                    "resumed_from": start,
                    "generation": comm.generation,
                    "state": state.tolist(),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
