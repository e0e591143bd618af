"""The copy limit of a reducer host (issue 18): what receiving a GiB over the reducers' transport
(ZeroMQ over tcp), sending one, and adding one in place cost here at the least, in CPU-seconds,
measured in the same run as the reducer so that the two compare on one machine and load.

Run as `python -m reduction_server.bench.copy_limit recv MESSAGES BYTES` (it prints the port it
listens on) and `... send PORT MESSAGES BYTES`: each side prints the CPU time of its whole process
(libzmq's I/O thread included) over the measured messages, as JSON."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Dict

import numpy as np
import zmq

_GIB = 1 << 30
_WARMUP = 8  # messages before the clock starts: connection, buffers


def _recv(messages: int) -> None:
    sock = zmq.Context(io_threads=1).socket(zmq.PULL)
    print(json.dumps({"port": sock.bind_to_random_port("tcp://127.0.0.1")}), flush=True)
    for _ in range(_WARMUP):
        sock.recv(copy=False)
    start = time.process_time()
    for _ in range(messages):
        sock.recv(copy=False)  # as the reducer takes a chunk: a frame, not a copy into Python bytes
    print(json.dumps({"cpu_s": time.process_time() - start}), flush=True)


def _send(port: int, messages: int, size: int) -> None:
    sock = zmq.Context(io_threads=1).socket(zmq.PUSH)
    sock.connect(f"tcp://127.0.0.1:{port}")
    payload = np.ones(size, np.uint8)
    for _ in range(_WARMUP):
        sock.send(payload, copy=False)
    start = time.process_time()
    for _ in range(messages):
        sock.send(payload, copy=False)
    sock.close(linger=-1)  # everything delivered before the clock stops
    print(json.dumps({"cpu_s": time.process_time() - start}), flush=True)


def sockets(gib: float, message_bytes: int) -> Dict[str, float]:
    """CPU-seconds per GiB to receive and to send `gib` GiB in messages of `message_bytes`,
    one process on each side."""
    messages = max(1, int(gib * _GIB) // message_bytes)
    job = [sys.executable, "-m", "reduction_server.bench.copy_limit"]
    receiver = subprocess.Popen([*job, "recv", str(messages)], stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        port = json.loads(receiver.stdout.readline())["port"]
        sender = subprocess.run([*job, "send", str(port), str(messages), str(message_bytes)], capture_output=True,
                                text=True, timeout=600, cwd="/")
        received = json.loads(receiver.stdout.readline())
        receiver.wait(timeout=60)
    finally:
        receiver.kill()
    if sender.returncode != 0:
        raise RuntimeError(f"the sending side failed: {sender.stderr[-2000:]}")
    moved = messages * message_bytes / _GIB
    return {"recv": received["cpu_s"] / moved, "send": json.loads(sender.stdout)["cpu_s"] / moved}


def add(gib: float, buffer_mib: float = 64) -> float:
    """CPU-seconds per GiB of an in-place float32 add (NumPy's, one thread), over `gib` GiB."""
    acc = np.ones(int(buffer_mib * (1 << 20)) // 4, np.float32)
    other = np.ones_like(acc)
    rounds = max(1, int(gib * _GIB / acc.nbytes))
    np.add(acc, other, out=acc)  # warm-up: pages
    start = time.process_time()
    for _ in range(rounds):
        np.add(acc, other, out=acc)
    return (time.process_time() - start) / (rounds * acc.nbytes / _GIB)


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        _recv(int(sys.argv[2]))
    else:
        _send(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
