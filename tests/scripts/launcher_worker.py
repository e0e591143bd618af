"""A worker command for tests/jobs/test_launcher.py: `python launcher_worker.py MODE [options]`.

Modes:
  env     print the job variables as `ENV {json}`, TCP-connect to every RS_REDUCERS address
          (`CONNECTED host:port`); rank 0 also prints `REDUCER {json}` for each reducer process.
  output  print to stdout and stderr, bytes that are not UTF-8, and a partial last line.
  hold    record this process, a grandchild and the reducers in DIR/rank<N>.json, then exit
          with --code / kill itself with --signal (on --rank only, once every rank has
          recorded itself), kill reducer 0 (--kill-reducer, rank 0), or sleep --sleep seconds.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil

JOB_VARS = (
    "RS_REDUCERS",
    "RS_RANK",
    "RS_WORLD_SIZE",
    "RS_JOB_TOKEN",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PYTHONUNBUFFERED",
    "CLUSTER_SPEC",
    "TF_CONFIG",
    "RS_TEST_PASSTHROUGH",
    "RS_REDUCER_INDEX",
    "RS_PIPELINE_DEPTH",
)
RANK = int(os.environ["RS_RANK"])


def reducer_processes():
    """The reducers: the launcher's live children that run `serve`, ordered by --index."""
    found = []
    for proc in psutil.Process(os.getppid()).children():
        try:
            argv = proc.cmdline()
        except psutil.Error:  # already gone, or a zombie
            continue
        if "serve" in argv:
            found.append((int(flag(argv, "--index")), proc))
    return [proc for _, proc in sorted(found, key=lambda pair: pair[0])]


def flag(argv, name):
    return argv[argv.index(name) + 1]


def connect(address, deadline):
    host, port = address.rsplit(":", 1)
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def env_mode(args):
    print("ENV " + json.dumps({name: os.environ.get(name) for name in JOB_VARS}))
    deadline = time.monotonic() + 30
    for address in os.environ["RS_REDUCERS"].split(","):
        connect(address, deadline)
        print("CONNECTED " + address)
    if RANK == 0:
        for proc in reducer_processes():
            env = proc.environ()
            print(
                "REDUCER "
                + json.dumps(
                    {
                        "index": flag(proc.cmdline(), "--index"),
                        "port": flag(proc.cmdline(), "--port"),
                        "host": flag(proc.cmdline(), "--host"),
                        "workers": flag(proc.cmdline(), "--workers"),
                        **{name: env.get(name) for name in JOB_VARS},
                    }
                )
            )


def output_mode(args):
    for i in range(args.lines):
        print(f"out {RANK} {i} " + "x" * 100)
        print(f"err {RANK} {i} " + "y" * 100, file=sys.stderr)
    sys.stdout.flush()
    sys.stdout.buffer.write(b"junk \xff\xfe " + str(RANK).encode() + b"\n")
    sys.stdout.buffer.write(f"partial {RANK}".encode())
    sys.stdout.flush()


def hold_mode(args):
    record = {"pid": os.getpid(), "grandchildren": [], "reducers": [p.pid for p in reducer_processes()]}
    if args.grandchild:
        # Same process group as this worker, as a shell pipeline's members would be.
        record["grandchildren"].append(subprocess.Popen(["sleep", str(args.sleep + 60)]).pid)
    path = os.path.join(args.dir, f"rank{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # the test never sees a half-written record
    if RANK == args.rank or (args.kill_reducer and RANK == 0):
        wait_for_records(args.dir, int(os.environ["WORLD_SIZE"]))
        if args.kill_reducer:
            os.kill(record["reducers"][0], signal.SIGKILL)
        elif args.signal:
            os.kill(os.getpid(), args.signal)
        else:
            sys.exit(args.code)
    time.sleep(args.sleep)


def wait_for_records(directory, world_size):
    deadline = time.monotonic() + 30
    while sum(name.endswith(".json") for name in os.listdir(directory)) < world_size:
        if time.monotonic() > deadline:
            sys.exit("not every rank recorded itself")
        time.sleep(0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["env", "output", "hold"])
    parser.add_argument("--lines", type=int, default=3)
    parser.add_argument("--dir")
    parser.add_argument("--grandchild", action="store_true")
    parser.add_argument("--sleep", type=float, default=120)
    parser.add_argument("--rank", type=int, default=-1, help="the rank that exits with --code or --signal")
    parser.add_argument("--code", type=int, default=0)
    parser.add_argument("--signal", type=int, default=0)
    parser.add_argument("--kill-reducer", action="store_true")
    args = parser.parse_args()
    {"env": env_mode, "output": output_mode, "hold": hold_mode}[args.mode](args)


if __name__ == "__main__":
    main()
