"""Mutual authentication: a worker trusts a reducer only once the reducer has proved the job
token (docs/protocol.md, "Handshake"). A reducer with another job's token, or with none, at an
address in RS_REDUCERS is refused by name; it receives no AUTH, no shared-memory offer and no
DATA, and no collective completes through it (a real one with another token or none does not
even let the worker's connection through: gate.py). Real reducer processes, and a recording fake
(one that lets any connection through) for what a rogue would see on the wire."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from typing import List

import numpy as np
import pytest
import zmq

import reduction_server.client as rs
from helpers.cluster import child_env, reducers, run_ranks
from reduction_server import CollectiveError
from reduction_server.wire import auth, gate, protocol
from reduction_server.wire.protocol import MsgType

pytestmark = pytest.mark.timeout(120)

TOKEN = "the-jobs-token"
ROGUES = {"another job's token": "another-jobs-token", "no token": ""}
WHY = {
    "another job's token": "the job tokens differ",
    "no token": "it has no job token (it was started without RS_JOB_TOKEN)",
}


def stopped_summary(log: str) -> dict:
    """The fields of a reducer's `stopped` log line."""
    fields = re.search(r" NOTICE reduction_server\.reducer stopped (.*)$", log, re.M).group(1)
    return dict(field.split("=", 1) for field in fields.split())


def refusals(addresses: List[str], world: int) -> List[str]:
    """What each of `world` worker ranks says when it starts against `addresses` (they must fail)."""
    errors: List[str] = [""] * world

    def start(rank: int) -> None:
        try:
            rs.Communicator(addresses, rank, world, job_token=TOKEN, connect_timeout=20, timeout=10).close()
        except CollectiveError as exc:
            errors[rank] = str(exc)

    threads = [threading.Thread(target=start, args=(rank,), daemon=True) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a worker hung instead of refusing the reducer"
    return errors


@pytest.mark.parametrize("rogue", list(ROGUES))
def test_a_reducer_that_cannot_prove_the_token_is_refused_and_sent_nothing(rogue):
    with reducers(1, workers=2, token=TOKEN) as good, reducers(1, workers=2, token=ROGUES[rogue], first_index=1) as bad:
        addresses = [*good.addresses, *bad.addresses]
        errors = refusals(addresses, 2)
        for rank, error in enumerate(errors):
            assert error.startswith(f"rank {rank}: reducer 1 ({bad.addresses[0]}) refused this worker: "), error
            assert WHY[rogue] in error, error
        assert bad.alive()
        rogue_log = bad.stop()[0]
        good_log = good.stop()[0]
    summary = stopped_summary(rogue_log)
    assert summary["bytes_in"] == "0" and summary["completed"] == "0" and summary["peers_admitted"] == "0", summary
    assert " admitted " not in rogue_log and "auth_failed" not in rogue_log  # no AUTH ever reached it
    # The reducer that proved itself admitted the workers, but nothing ran: a job needs them all.
    assert stopped_summary(good_log)["completed"] == "0"


class FakeReducer:
    """A ROUTER socket in this process that answers HELLO as told and records every message. Its
    gate lets any connection through: a rogue that got past the workers' credentials."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.context = zmq.Context()
        self.gate = AnyConnection(self.context, TOKEN).start()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.gate.guard(self.socket)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{port}"
        self.received: List[tuple] = []  # (header, payload)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.socket.poll(50):
                continue
            identity, *frames = self.socket.recv_multipart()
            header = protocol.unpack(frames[0])
            payload = frames[1] if len(frames) > 1 else b""
            self.received.append((header, payload))
            if header.type is not MsgType.HELLO:
                continue
            if self.answer in ("forged proof", "a proof for index 1"):
                if self.answer == "forged proof":  # claims a token, proves nothing
                    proof = os.urandom(auth.PROOF_BYTES)
                else:  # knows the token, but proves another index than the one it claims (0)
                    worker_nonce = bytes.fromhex(json.loads(payload)["nonce"])
                    proof = auth.reducer_proof(
                        TOKEN, worker_nonce, index=1, job=header.job, generation=header.generation
                    )
                reply = auth.challenge(auth.new_nonce(), proof)
                header_bytes = protocol.text_header(
                    MsgType.CHALLENGE, reply, rank=0, world=header.world, job=header.job, aux=1
                )
            else:  # "welcome at once": skips the proof altogether
                reply = json.dumps(
                    {"index": 0, "world_size": header.world, "max_chunk_bytes": 1 << 26, "shared_memory": True}
                ).encode()
                header_bytes = protocol.text_header(MsgType.WELCOME, reply, world=header.world, job=header.job)
            self.socket.send_multipart([identity, header_bytes, reply])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.socket.close()
        self.gate.close()
        self.context.term()


class AnyConnection(gate.Gate):
    def check(self, username: bytes, password: bytes) -> None:
        return None


@pytest.mark.parametrize(
    "answer, words",
    [
        ("forged proof", "did not prove the job token (RS_JOB_TOKEN): its RS_JOB_TOKEN is not this worker's"),
        ("a proof for index 1", "did not prove the job token (RS_JOB_TOKEN)"),
        ("welcome at once", "sent WELCOME without proving the job token (RS_JOB_TOKEN) first"),
    ],
)
def test_a_rogue_on_this_host_sees_only_a_hello_without_shared_memory(answer, words):
    """What crosses the wire to a rogue: one HELLO, with no shared-memory segment in it (a reducer
    on this host would be offered one, after proving itself)."""
    fake = FakeReducer(answer)
    try:
        with pytest.raises(CollectiveError) as caught:
            rs.Communicator([fake.address], 0, 1, job_token=TOKEN, connect_timeout=10, timeout=5)
        time.sleep(0.3)  # anything the worker might still send would arrive by now
    finally:
        fake.close()
    assert f"reducer 0 ({fake.address}) {words}" in str(caught.value)
    assert [h.type for h, _ in fake.received] == [MsgType.HELLO], [h.type.name for h, _ in fake.received]
    hello = json.loads(fake.received[0][1])
    assert "shared_memory" not in hello and len(bytes.fromhex(hello["nonce"])) == auth.NONCE_BYTES


def test_a_worker_never_lets_libzmq_reconnect_a_connection():
    """libzmq's own reconnect would carry what is queued or sent next to whatever listens at the
    address by then, with no handshake: each worker socket is one connection, and a new one comes
    with a new socket and a new proof."""
    with reducers(1, workers=1, token=TOKEN) as group:
        with rs.Communicator(group.addresses, 0, 1, job_token=TOKEN) as comm:
            # a socket per shard where the reducer runs several (RS_SHARDS)
            assert {s.getsockopt(zmq.RECONNECT_IVL) for s in comm._engine.connections.sockets} == {-1}


def test_a_genuine_reducer_on_this_host_still_gets_the_shared_memory_offer():
    """The offer moved from HELLO to AUTH; a reducer that proved itself maps it as before."""
    with reducers(1, workers=1, token=TOKEN) as group:

        def body(comm, rank):
            x = np.arange(1 << 18, dtype=np.float32)
            np.testing.assert_array_equal(comm.all_reduce(x), x)
            return comm._engine.chunks_shared

        shared = run_ranks(1, lambda r: rs.Communicator(group.addresses, r, 1, job_token=TOKEN), body)
    assert shared[0] > 0


def test_a_reducer_at_the_wrong_position_in_rs_reducers_is_named():
    with reducers(1, workers=1, token=TOKEN, first_index=1) as group:
        (error,) = refusals(group.addresses, 1)
    assert (
        f"reducer 0 ({group.addresses[0]}) says it is reducer 1, but RS_REDUCERS lists it as reducer 0: each "
        "reducer's --index (RS_REDUCER_INDEX) must be its position in RS_REDUCERS"
    ) in error


def test_a_stranger_restarted_at_a_lost_reducers_address_is_refused(monkeypatch):
    """The reconnect path checks the token too: a reducer that comes back with another token
    (another job's reducer took the port) refuses the worker's connection (gate.py), which says so
    by name, and is never sent a chunk."""
    env = {"RS_LIVENESS_TIMEOUT": "1", "RS_HEARTBEAT_INTERVAL": "0.2"}
    with reducers(1, workers=1, token=TOKEN, extra_env=env) as group:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        comm = rs.Communicator(group.addresses, 0, 1, job_token=TOKEN, timeout=5, connect_timeout=10)
        try:
            x = np.ones(1000, np.float32)
            np.testing.assert_array_equal(comm.all_reduce(x), x)
            group.signal(0, signal.SIGKILL)
            group.restart(0, child_env({"RS_JOB_TOKEN": "another-jobs-token", **env}))
            deadline, error = time.monotonic() + 20, ""
            while "refused this worker" not in error and time.monotonic() < deadline:
                try:
                    comm.all_reduce(x)
                    error = "it completed"
                except CollectiveError as exc:
                    error = str(exc)
                time.sleep(0.2)
        finally:
            comm.close()
        log = group.stop()[0]
    assert re.search(
        r"reducer 0 (shard \d+ )?\(127\.0\.0\.1:\d+\) came back but refused this worker: the job "
        r"tokens differ",
        error,
    ), error
    assert stopped_summary(log)["bytes_in"] == "0"  # the restarted stranger's own summary
