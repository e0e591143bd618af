"""The copy limit of a reducer host (issue 18): what receiving a GiB over the reducers' transport
(ZeroMQ over tcp), sending one, and adding one in place cost here at the least, in CPU-seconds,
measured in the same run as the reducer so that the two compare on one machine and load.

Two forms of the socket part:
- one way (`sockets`): a PUSH/PULL pair, each side's process CPU per GiB: receiving and sending
  apart, each message consumed while its bytes are still in cache;
- both ways at once (`duplex`): N processes (as a reducer has shards) that return every message
  to its sender, under W peers each keeping `window` messages in flight to each: the reducer's
  own traffic (every byte in goes back out, on the same connections, with the same chunks and
  window) without the reduction. On tcp loopback that costs well above receive + send apart
  (bench/RESULTS.md: the copies take about twice the cycles per byte once chunks are in flight
  both ways). A reducer sends each sum W times from one buffer where this sends W buffers once
  each, so a reducer may come out a little below it.

Run as `python -m reduction_server.bench.copy_limit recv MESSAGES` or `... reflect W MESSAGES`
(each prints the port it listens on) and `... send PORT MESSAGES BYTES` or `... peer PORTS
MESSAGES BYTES WINDOW` (PORTS joined by commas; MESSAGES to each): a listening side prints the CPU time of its
whole process (libzmq's I/O thread included) over the measured messages, as JSON, and the
one-way sender its own."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Dict, List

import numpy as np
import zmq

from reduction_server.children import AWAY_FROM_SOURCE

_GIB = 1 << 30
_WARMUP = 8  # messages (per peer) before the clock starts: connection, buffers
_TIMEOUT_MS = 60_000  # a side that waits this long for a message gives up (exits with zmq.Again)
_JOB = [sys.executable, "-m", "reduction_server.bench.copy_limit"]


def _listen(kind: int) -> zmq.Socket:
    sock = zmq.Context(io_threads=1).socket(kind)
    sock.rcvtimeo = _TIMEOUT_MS
    print(json.dumps({"port": sock.bind_to_random_port("tcp://127.0.0.1")}), flush=True)
    return sock


def _recv(messages: int) -> None:
    sock = _listen(zmq.PULL)
    for _ in range(_WARMUP):
        sock.recv(copy=False)
    start = time.process_time()
    for _ in range(messages):
        sock.recv(copy=False)  # as the reducer takes a chunk: a frame, not a copy into Python bytes
    print(json.dumps({"cpu_s": time.process_time() - start}), flush=True)


def _reflect(world: int, messages: int) -> None:
    sock = _listen(zmq.ROUTER)

    def once() -> None:
        identity = sock.recv(copy=False)
        payload = sock.recv(copy=False)
        sock.send(identity, zmq.SNDMORE, copy=False)
        sock.send(payload, copy=False)

    for _ in range(world * _WARMUP):
        once()
    start = time.process_time()
    for _ in range(world * messages):
        once()
    print(json.dumps({"cpu_s": time.process_time() - start}), flush=True)


def _send(port: str, messages: int, size: int) -> None:
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


def _peer(ports: str, messages: int, size: int, window: int) -> None:
    context = zmq.Context(io_threads=1)
    socks = []
    poller = zmq.Poller()
    for port in ports.split(","):
        sock = context.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        poller.register(sock, zmq.POLLIN)
        socks.append(sock)
    payload = np.ones(size, np.uint8)
    total = messages + _WARMUP  # to each listener: one back for each sent, at most `window` ahead
    sent, received = dict.fromkeys(socks, 0), dict.fromkeys(socks, 0)
    while sum(received.values()) < total * len(socks):
        for sock in socks:
            while sent[sock] < total and sent[sock] - received[sock] < window:
                sock.send(payload, copy=False)
                sent[sock] += 1
        ready = poller.poll(_TIMEOUT_MS)
        if not ready:
            raise TimeoutError(f"no message back in {_TIMEOUT_MS / 1000:g} s")
        for sock, _ in ready:
            sock.recv(copy=False)
            received[sock] += 1
    for sock in socks:
        sock.close(linger=-1)


def _measure(listeners: List[List[str]], senders: List[List[str]], timeout: float = 600) -> Dict:
    """Start the listening sides, then `senders` (each given the listeners' ports, joined by
    commas, as its first argument); the listeners' JSON results and the senders' outputs. Every
    process is gone when it returns or raises (after `timeout` seconds in all at the most)."""
    deadline = time.monotonic() + timeout
    started = [
        subprocess.Popen([*_JOB, *args], stdout=subprocess.PIPE, text=True, cwd=AWAY_FROM_SOURCE) for args in listeners
    ]
    procs: List[subprocess.Popen] = []
    try:
        ports = ",".join(str(json.loads(proc.stdout.readline())["port"]) for proc in started)
        procs = [
            subprocess.Popen(
                [*_JOB, args[0], ports, *args[1:]],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=AWAY_FROM_SOURCE,
            )
            for args in senders
        ]
        outputs = [proc.communicate(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
        for proc, (_, err) in zip(procs, outputs):
            if proc.returncode != 0:
                raise RuntimeError(f"a sending side failed: {err[-2000:]}")
        results = [json.loads(proc.stdout.readline()) for proc in started]
        for proc in started:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in [*started, *procs]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return {"listeners": results, "senders": [out for out, _ in outputs]}


def sockets(gib: float, message_bytes: int) -> Dict[str, float]:
    """CPU-seconds per GiB to receive and to send `gib` GiB in messages of `message_bytes`,
    one process on each side."""
    messages = max(1, int(gib * _GIB) // message_bytes)
    got = _measure([["recv", str(messages)]], [["send", str(messages), str(message_bytes)]])
    moved = messages * message_bytes / _GIB
    return {"recv": got["listeners"][0]["cpu_s"] / moved, "send": json.loads(got["senders"][0])["cpu_s"] / moved}


def duplex(gib: float, message_bytes: int, world: int, window: int, processes: int = 1) -> float:
    """CPU-seconds per GiB received of `processes` processes that return every message to its
    sender (a reducer of that many shards, without the reduction), while `world` peers send `gib`
    GiB in all, in messages of `message_bytes`, the same number to each, `window` in flight to each."""
    messages = max(1, int(gib * _GIB) // (message_bytes * world * processes))
    got = _measure(
        [["reflect", str(world), str(messages)]] * processes,
        [["peer", str(messages), str(message_bytes), str(window)]] * world,
    )
    return sum(r["cpu_s"] for r in got["listeners"]) / (world * processes * messages * message_bytes / _GIB)


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
    role, args = sys.argv[1], sys.argv[2:]
    if role in ("send", "peer"):  # their first argument is the listeners' ports
        {"send": _send, "peer": _peer}[role](args[0], *map(int, args[1:]))
    else:
        {"recv": _recv, "reflect": _reflect}[role](*map(int, args))
