"""One rank of a failure test (tests/jobs/test_failures.py). argv[1] is JSON: {"mode": ..., ...}.

Every mode prints progress lines ("ready", ...) as JSON as it goes and one JSON summary line
last. Times are wall-clock (time.time()), to compare with the test's own clock on this machine.

- loop: all-reduce a large buffer until a collective fails (a worker or reducer was killed);
  then try one more collective (it must fail too, at once). {"count", "ready_after", "progress":
  say {"done": i} after each collective}
- restart: like loop (without the one more), then wait for the file "go" to exist and run "after" collectives, which
  must succeed on the same communicator (the reducer was restarted at the same address).
- between: run "before" collectives, say ready, wait for the file "go" (a reducer is killed, and
  maybe restarted, in between), then run one more collective; report whether it worked and how long it took.
- straggler: rank "slow" sleeps "delay" seconds first; every rank then all-reduces once.
- drain: "collectives" all-reduces of "count" elements, each result checked against NumPy's,
  saying {"done": i} after each (a reducer drains meanwhile); then it reports what its failover did.
- close: every rank runs "before" collectives; rank "closer" then closes its communicator and
  exits; the others start one more collective, which must fail naming the closer.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from report import report  # noqa: E402

import reduction_server.client as rs  # noqa: E402
from reduction_server import CollectiveError  # noqa: E402


def say(**fields) -> None:
    report(fields)


def step(comm, x: np.ndarray, i: int) -> None:
    """One all-reduce whose result is checked exactly (small integers in float32)."""
    x.fill(comm.rank + i % 7)
    y = comm.all_reduce(x, "sum", out=x)
    expected = sum(r + i % 7 for r in range(comm.world_size))
    if not (y[0] == expected and y[-1] == expected):
        raise AssertionError(f"collective {i}: got {y[0]}, {y[-1]}, expected {expected}")


def wait_for_go(go: Path) -> None:
    deadline = time.time() + 60
    while not go.exists():
        if time.time() > deadline:
            raise AssertionError("the test never said go")
        time.sleep(0.05)


def fail_loop(comm, spec) -> dict:
    x = np.zeros(spec.get("count", 1 << 20), np.float32)
    i = 0
    while True:
        try:
            step(comm, x, i)
        except CollectiveError as exc:
            return {"error": str(exc), "error_at": time.time(), "iterations": i}
        i += 1
        if i == spec.get("ready_after", 3):
            say(rank=comm.rank, ready=True)
        if spec.get("progress"):
            say(rank=comm.rank, done=i)
        if i > 100000:
            raise AssertionError("no failure came")


def drain_loop(comm, spec) -> dict:
    failover = comm._engine.failover
    x = np.zeros(spec.get("count", 1 << 18), np.float32)
    base = np.arange(len(x), dtype=np.float32) % 97
    for i in range(spec["collectives"]):
        x[:] = base + comm.rank + i % 7
        y = comm.all_reduce(x, "sum", out=x)
        expected = np.sum([base + r + i % 7 for r in range(comm.world_size)], axis=0)
        if not np.array_equal(y, expected):
            raise AssertionError(f"collective {i}: {np.flatnonzero(y != expected).size} elements differ")
        say(rank=comm.rank, done=i)
    return {
        "collectives": i + 1,
        "drains": failover.drains,
        "losses": failover.losses,
        "finals": failover.finals,
        "moved": failover.moved_chunks,
        "drain_moved": failover.drain_moved,
        "lost": sorted(failover.lost),
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    mode = spec["mode"]
    comm = rs.Communicator.from_env()
    rank = comm.rank
    out = {"rank": rank}
    if mode in ("loop", "restart"):
        out.update(fail_loop(comm, spec))
        if mode == "loop":
            start = time.time()
            try:
                step(comm, np.zeros(1024, np.float32), 1)
                out["next"] = "ok"
            except CollectiveError as exc:
                out["next"] = str(exc)
            out["next_took"] = time.time() - start
        else:
            say(rank=rank, waiting=True, error=out["error"])
            wait_for_go(Path(spec["go"]))
            x = np.zeros(spec.get("count", 1 << 20), np.float32)
            for i in range(spec.get("after", 5)):
                step(comm, x, 100 + i)
            out["after"] = spec.get("after", 5)
    elif mode == "between":
        x = np.zeros(spec.get("count", 1 << 20), np.float32)
        for i in range(spec.get("before", 3)):
            step(comm, x, i)
        say(rank=rank, ready=True)
        wait_for_go(Path(spec["go"]))
        start = time.time()
        try:
            step(comm, x, 50)
            out["error"] = None
        except CollectiveError as exc:
            out["error"] = str(exc)
        out["took"] = time.time() - start
    elif mode == "drain":
        out.update(drain_loop(comm, spec))
    elif mode == "straggler":
        t0 = time.time()
        if rank == spec["slow"]:
            time.sleep(spec["delay"])
        start = time.time()
        try:
            comm.all_reduce(np.ones(spec.get("count", 16), np.float32))
            out["error"] = None
        except CollectiveError as exc:
            out["error"] = str(exc)
        out["took"] = time.time() - start
        # the next collective works again on every rank (once the straggler has caught up)
        if rank != spec["slow"]:
            time.sleep(max(0.0, t0 + spec["delay"] + 0.5 - time.time()))
        out["next"] = comm.all_reduce(np.full(4, rank, np.float32)).tolist()
    elif mode == "close":
        x = np.zeros(spec.get("count", 1 << 16), np.float32)
        for i in range(spec.get("before", 5)):
            step(comm, x, i)
        if rank == spec["closer"]:
            time.sleep(0.2)  # the others are inside their next collective by now
            comm.close()
            out["closed_at"] = time.time()
        else:
            try:
                step(comm, x, 99)
                out["error"] = None
            except CollectiveError as exc:
                out["error"] = str(exc)
                out["error_at"] = time.time()
    else:
        raise SystemExit(f"unknown mode {mode}")
    comm.close()
    report(out)
    os._exit(0)  # skip interpreter teardown: nothing is left to flush


if __name__ == "__main__":
    main()
