"""CurveZMQ encryption (RS_ENCRYPT=1) with keys derived from RS_JOB_TOKEN: a real job gets the
right results over encrypted connections (and the bytes on the wire are not the plain protocol);
a worker whose encryption setting or token differs from the reducers' is refused with a clear
error well within its connect timeout, and the reducer keeps serving the job it serves. And the
integrity-only mode (RS_INTEGRITY=1, wire/integrity.py): an altered, replayed or dropped message
is refused by name, a mismatch is named on both sides, and results are those of plain mode."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Tuple

import numpy as np
import pytest

import reduction_server.client as rs
from helpers.cluster import ONE_PROCESS, SCRIPTS, TOKEN, child_env, reducers, run_ranks, run_workers
from helpers.handshake import auth_payload, hello_payload
from helpers.jobs import check_sum_works
from helpers.peers import JOB as JOB_ID
from helpers.peers import Peer
from reduction_server import CollectiveError
from reduction_server.errors import ConfigError
from reduction_server.wire import encryption, integrity, protocol
from reduction_server.wire.protocol import ErrorCode, MsgType

pytestmark = pytest.mark.timeout(120)

ENCRYPT = {"RS_ENCRYPT": "1"}
INTEGRITY = {"RS_INTEGRITY": "1"}
#: each mode's reducer environment and worker options
MODES = {
    "plain": ({}, {}),
    "encrypted": (ENCRYPT, {"encrypt": True}),
    "integrity": (INTEGRITY, {"integrity": True}),
}
CONNECT_TIMEOUT = 20.0  # a refusal must come long before this
JOB = json.dumps(
    {
        "sequential": [
            {"dtype": "float32", "op": "sum", "count": 300_000, "seed": 1},
            {"dtype": "bfloat16", "op": "avg", "count": 5000, "seed": 2},
            {"dtype": "int64", "op": "max", "count": 70_001, "seed": 3},
        ],
        "concurrent": [{"dtype": "float64", "op": "min", "count": 20_000, "seed": 4}] * 3,
        "broadcast": [1000],
    }
)


def communicator(addresses: List[str], rank: int, world: int, **options) -> rs.Communicator:
    options.setdefault("job_token", TOKEN)
    return rs.Communicator(addresses, rank, world, timeout=20, connect_timeout=CONNECT_TIMEOUT, **options)


def refused(addresses: List[str], **options) -> str:
    """The error of a worker the reducers refuse; it must come well within the connect timeout."""
    start = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        communicator(addresses, 1, 2, **options)
    assert time.monotonic() - start < CONNECT_TIMEOUT / 2, "refused only by the connect timeout"
    text = str(info.value)
    assert "did not admit this worker within" not in text, text
    return text


class Tap:
    """A TCP relay in front of a reducer that keeps a copy of every byte sent each way, and
    with `flip_at` alters one: byte `flip_at` of each connection's stream from the reducer (or,
    `upstream`, to it)."""

    def __init__(self, target: str, flip_at: Optional[int] = None, upstream: bool = False) -> None:
        self.target = target.rsplit(":", 1)
        self.flip_at = flip_at
        self.upstream = upstream
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.1)  # the accept loop looks at `closed` this often
        self.closed = False
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.seen = bytearray()
        self.lock = threading.Lock()
        self.threads: List[threading.Thread] = []
        self.sockets: List[socket.socket] = []
        self._start(self._accept)

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except socket.timeout:
                continue
            client.settimeout(None)
            upstream = socket.create_connection((self.target[0], int(self.target[1])))
            self.sockets += [client, upstream]
            self._start(self._pipe, client, upstream, self.flip_at if self.upstream else None)
            self._start(self._pipe, upstream, client, None if self.upstream else self.flip_at)

    def _pipe(self, src: socket.socket, dst: socket.socket, flip_at: Optional[int] = None) -> None:
        relayed = 0
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if flip_at is not None and relayed <= flip_at < relayed + len(data):
                    altered = bytearray(data)
                    altered[flip_at - relayed] ^= 0x40
                    data = bytes(altered)
                relayed += len(data)
                with self.lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.threads[0].join(5)
        self.server.close()
        for s in self.sockets:
            s.close()
        for thread in self.threads:
            thread.join(5)


def test_an_encrypted_job_gets_correct_results():
    with reducers(2, extra_env={**ENCRYPT, "RS_LOG_LEVEL": "INFO"}) as group:  # INFO: the full started line
        results = run_workers(3, group, "allreduce_worker.py", [JOB], extra_env=ENCRYPT)
        assert [r["failures"] for r in results] == [[], [], []]
        assert all(r["done"] == 3 + 3 + 3 for r in results)
        assert group.alive()
        logs = group.stop()
    assert "encrypt=True" in logs[0]  # the reducer's start line says so


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_the_bytes_on_the_wire_are_encrypted(encrypt):
    """Through a relay that records the TCP stream: plain ZMTP shows the protocol's magic
    number in every header and the payload's bytes; CurveZMQ shows neither."""
    payload = np.frombuffer(b"GRADIENT" * 4096, np.float64).copy()  # a pattern easy to spot
    magic = protocol.MAGIC.to_bytes(4, "little")
    # One process: the tap relays one port, and a sharded reducer's shards listen on the next ones.
    with reducers(1, extra_env={**(ENCRYPT if encrypt else {}), **ONE_PROCESS}) as group:
        tap = Tap(group.addresses[0])
        try:
            # Frames, not shared-memory slots: the payload must cross the (tapped) wire.
            results = run_ranks(
                2,
                lambda r: communicator([tap.address], r, 2, encrypt=encrypt, shared_memory=False),
                lambda comm, r: comm.all_reduce(payload, "max"),
                limit=30,
            )
        finally:
            tap.close()
    for y in results:
        np.testing.assert_array_equal(y, payload)
    seen = bytes(tap.seen)
    assert len(seen) > 2 * payload.nbytes  # both ways, both ranks
    if encrypt:
        assert b"CURVE" in seen[:200] and magic not in seen and b"GRADIENT" not in seen
    else:
        # PLAIN: a job token's credential in the handshake (gate.py), then nothing but ZMTP frames
        assert b"PLAIN" in seen[:200] and magic in seen and b"GRADIENT" * 8 in seen


def altered_job(mode: str, upstream: bool) -> Tuple[list, str]:
    """Each of 2 ranks' all-reduce of 1 MiB (one chunk) through a relay that flips one byte of each
    connection's stream past the handshake: of a RESULT, or (`upstream`) of a DATA. Each rank's
    result, or its error's text."""
    env, options = MODES[mode]
    payload = np.arange(1 << 17, dtype=np.float64)
    with reducers(1, extra_env={**env, **ONE_PROCESS}) as group:
        tap = Tap(group.addresses[0], flip_at=600_000, upstream=upstream)  # past the handshake's few hundred bytes
        try:

            def all_reduce(comm, rank):
                try:
                    return comm.all_reduce(payload, "max")
                except CollectiveError as exc:
                    return str(exc)

            results = run_ranks(
                2,
                lambda r: communicator(
                    [tap.address], r, 2, **options, shared_memory=False, failover=False, pipeline_depth=1
                ),
                all_reduce,
                limit=30,
            )
        finally:
            tap.close()
        assert group.alive()  # the reducer is never taken down by it
        logs = group.stop()[0]
    return [(result, payload) for result in results], logs


@pytest.mark.parametrize("mode", list(MODES))
def test_a_relay_that_alters_a_result_is_caught_by_encryption_or_integrity(mode):
    """An on-path relay flips one byte of a RESULT payload on its way to each rank. Without
    RS_ENCRYPT or RS_INTEGRITY the job token proves each peer at the handshake only, so the
    altered result is returned with no error (docs/reliability.md: use one of them where the
    network is not trusted); with either, the rank's collective fails naming the rank, the
    reducer and the alteration, instead of returning it."""
    results, _ = altered_job(mode, upstream=False)
    for rank, (result, payload) in enumerate(results):
        if mode == "plain":
            assert np.count_nonzero(result != payload) == 1, f"rank {rank} got no altered element"
            continue
        assert isinstance(result, str) and f"rank {rank}:" in result, result
        altered = encryption.ALTERED if mode == "encrypted" else integrity.ALTERED
        assert "reducer 0" in result and altered in result, result
        if mode == "integrity":
            assert "RESULT from reducer 0" in result and "failed its integrity check" in result, result


def test_a_relay_that_alters_a_contribution_is_caught_by_integrity_before_it_is_summed():
    """With RS_INTEGRITY the reducer checks each DATA's tag before it folds it: a relay that flips
    a byte of each rank's contribution makes the reducer drop both ranks, and each rank's error
    names itself, the reducer and the alteration; the reducer logs it and stays up."""
    results, logs = altered_job("integrity", upstream=True)
    for rank, (result, _) in enumerate(results):
        assert isinstance(result, str) and f"rank {rank}:" in result, result
        assert "reducer 0" in result and integrity.ALTERED in result, result
    assert "integrity_failed" in logs and "worker->reducer message" in logs, logs[-3000:]


@pytest.mark.parametrize("mode", ["encrypted", "integrity"])
def test_an_altered_reducers_chunks_move_to_the_others_with_the_reason_logged(caplog, mode):
    """With failover, the reducer whose frames an on-path relay alters is lost to each rank, its
    chunks move to the other reducer, every result is right, and each rank logs why it lost it."""
    env, options = MODES[mode]
    payload = np.arange(1 << 18, dtype=np.float64)  # 2 MiB a collective, half of it through the relay
    with reducers(2, extra_env={**env, **ONE_PROCESS}) as group:
        tap = Tap(group.addresses[0], flip_at=600_000)  # within the first collective's results
        try:
            results = run_ranks(
                2,
                lambda r: communicator([tap.address, group.addresses[1]], r, 2, **options, shared_memory=False),
                lambda comm, r: [comm.all_reduce(payload, "max") for _ in range(4)],
                limit=60,
            )
        finally:
            tap.close()
    for steps in results:
        for y in steps:
            np.testing.assert_array_equal(y, payload)
    lost = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reducer_lost")]
    assert {m.split()[1] for m in lost} == {"rank=0", "rank=1"}, lost  # (again if it came back meanwhile)
    altered = encryption.ALTERED if mode == "encrypted" else integrity.ALTERED
    assert all("reducer=0" in m and altered in m and "failover=True" in m for m in lost), lost


@pytest.mark.parametrize("reducer_tags", [True, False], ids=["reducer-integrity", "worker-integrity"])
def test_an_integrity_mismatch_is_named_on_both_sides(reducer_tags):
    with reducers(1, workers=2, extra_env=INTEGRITY if reducer_tags else {}) as group:
        text = refused(group.addresses, integrity=not reducer_tags)
        assert "refused this worker" in text and "integrity mismatch" in text and "RS_INTEGRITY" in text, text
        assert group.alive()
        logs = group.stop()[0]
    assert "rejected" in logs and "integrity mismatch" in logs, logs[-2000:]


def test_integrity_results_equal_plain_results_bitwise():
    """Tags change nothing of a sum: a float32 job's results with RS_INTEGRITY are plain mode's, bit for bit."""
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(300_000).astype(np.float32) for _ in range(3)]
    results = {}
    for mode in ("plain", "integrity"):
        env, options = MODES[mode]
        with reducers(2, extra_env={**env, **ONE_PROCESS, "RS_DETERMINISTIC": "1"}) as group:
            results[mode] = run_ranks(
                3,
                lambda r, options=options, group=group: communicator(
                    group.addresses, r, 3, **options, shared_memory=False
                ),
                lambda comm, r: comm.all_reduce(inputs[r]),
                limit=30,
            )
    for plain, tagged in zip(results["plain"], results["integrity"]):
        assert plain.tobytes() == tagged.tobytes()


@pytest.mark.parametrize("fault", ["replayed", "dropped"])
def test_a_replayed_or_dropped_message_is_caught_by_integrity(fault):
    """A peer with the token and tags (as a relay would replay or drop a worker's message): the
    reducer refuses the message out of sequence, names why, and drops the connection's rank."""
    with reducers(1, workers=1, extra_env={**INTEGRITY, **ONE_PROCESS}) as group:
        peer = Peer(group.addresses[0])
        try:
            peer.handshake(0, 1, integrity_tags=True)
            ping = protocol.text_header(MsgType.PING, b"", rank=0, world=1)
            first = peer.tags[0].seal([ping])
            if fault == "replayed":
                peer.send_raw(ping, first)
                peer.send_raw(ping, first)
                words = "(a replay)"
            else:
                peer.send_raw(ping, peer.tags[0].seal([ping]))  # the first never goes
                words = "one was dropped"
            peer.expect_error(ErrorCode.NOT_ADMITTED, "rank 0 is dropped", words, integrity.ALTERED)
        finally:
            peer.close()
        assert group.alive()


def test_a_hello_altered_on_the_way_fails_the_auths_tag():
    """The keys bind the HELLO's bytes: a worker whose HELLO reached the reducer changed (here the
    worker derives its keys from another HELLO than the one sent) has its AUTH refused by name."""
    with reducers(1, workers=1, extra_env={**INTEGRITY, **ONE_PROCESS}) as group:
        peer = Peer(group.addresses[0])
        try:
            ident = dict(rank=0, world=1, job=JOB_ID, generation=0)
            sent = hello_payload(integrity=True, run_id="run-a")
            peer.send(protocol.text_header(MsgType.HELLO, sent, **ident), sent)
            reply = peer.recv()
            assert reply is not None and reply[0].type is MsgType.CHALLENGE, reply
            peer.tags = integrity.channels(TOKEN, sent.replace(b"run-a", b"run-b"), reply[1][:32])
            proof = auth_payload(reply[1], TOKEN, **ident)
            peer.send(protocol.text_header(MsgType.AUTH, proof, **ident), proof)
            reply = peer.recv()
            assert reply is not None and reply[0].type is MsgType.REJECT, reply
            assert b"failed its integrity check" in reply[1], reply[1]
        finally:
            peer.close()
        assert group.alive()


def test_a_worker_without_encryption_is_refused_and_the_reducer_keeps_serving_its_job():
    with reducers(2, workers=2, extra_env={**ENCRYPT, "RS_LOG_LEVEL": "INFO"}) as group:
        job = [communicator(group.addresses, r, 2, encrypt=True) for r in range(2)]
        check_sum_works(job, seed=1)
        text = refused(group.addresses, encrypt=False)
        assert "refused this worker: encryption mismatch" in text, text
        assert "this side does not encrypt" in text and "RS_ENCRYPT" in text, text
        check_sum_works(job, seed=2)  # the job's connections are untouched
        for comm in job:
            comm.close()
        assert group.alive()
        logs = "".join(group.stop())  # the worker gives up at the first refusal: one reducer may not see it
    # The reducer names the mismatch when it reads the worker's greeting first; when the worker
    # hangs up before that, it sees a handshake dropped for an unknown reason (logged at INFO).
    failures = [line for line in logs.splitlines() if "handshake_failed" in line]
    assert failures, logs
    assert all(
        "this side encrypts (RS_ENCRYPT=1) and the other does not" in line or "certain=False" in line
        for line in failures
    ), failures


def test_an_encrypted_worker_with_another_token_is_refused():
    with reducers(1, workers=2, extra_env=ENCRYPT) as group:
        job = [communicator(group.addresses, r, 2, encrypt=True) for r in range(2)]
        text = refused(group.addresses, encrypt=True, job_token="another-token")
        assert "encrypted (CurveZMQ) handshake failed" in text and "RS_JOB_TOKEN" in text, text
        check_sum_works(job)
        for comm in job:
            comm.close()
        assert group.alive()
        logs = group.stop()
    assert "handshake_failed" in logs[0] and "another RS_JOB_TOKEN" in logs[0]


def test_an_encrypted_worker_is_refused_by_a_plain_reducer():
    with reducers(1, workers=2) as group:
        text = refused(group.addresses, encrypt=True)
        # The mismatch itself, or (when the reducer hangs up before the worker has read its greeting)
        # a failed handshake that names the same setting.
        assert (
            "encryption mismatch: this side encrypts (RS_ENCRYPT=1) and the other does not" in text
            or "handshake failed: the reducer does not encrypt (set RS_ENCRYPT the same" in text
        ), text
        check_sum_works([communicator(group.addresses, r, 2, encrypt=False) for r in range(2)])
        assert group.alive()


def test_encryption_without_a_token_is_a_config_error():
    with pytest.raises(ConfigError, match="RS_ENCRYPT=1 needs RS_JOB_TOKEN"):
        rs.Communicator(["127.0.0.1:1"], 0, 1, job_token="", encrypt=True)
    serve = [sys.executable, "-m", "reduction_server", "serve", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.run(serve, env=child_env(ENCRYPT), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "RS_ENCRYPT=1 needs RS_JOB_TOKEN" in proc.stderr, proc.stderr


def test_the_launcher_passes_rs_encrypt_to_reducers_and_workers():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reduction_server",
            "run",
            "-np",
            "2",
            "--reducers",
            "2",
            "--",
            sys.executable,
            str(SCRIPTS / "allreduce_worker.py"),
            JOB,
        ],
        env=child_env(ENCRYPT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("encrypt=curve") == 2, proc.stdout  # both reducers' listening lines
    assert proc.stdout.count('"failures": []') == 2, proc.stdout


def serve_at(port: int, env: dict) -> tuple:
    """A reducer process at `port` (0: a free one); (process, its port)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reduction_server",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        env=child_env({"RS_JOB_TOKEN": TOKEN, **env}),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, int(line.split("listening on tcp://127.0.0.1:")[1].split()[0])


def test_a_reducer_restarted_without_encryption_is_refused_by_a_running_worker():
    first, port = serve_at(0, ENCRYPT)
    second = None
    try:
        comm = communicator([f"127.0.0.1:{port}"], 0, 1, encrypt=True)
        np.testing.assert_array_equal(comm.all_reduce(np.ones(4, np.float32)), np.ones(4, np.float32))
        first.kill()
        first.wait()
        second, _ = serve_at(port, {})  # the same address, now plain
        with pytest.raises(CollectiveError) as info:
            for _ in range(50):  # until the worker has seen the reducer go and come back (bounded)
                comm.all_reduce(np.ones(4, np.float32))
                time.sleep(0.1)
        text = str(info.value)
        assert "was lost" in text or "came back but refused this worker" in text, text
        with pytest.raises(
            CollectiveError, match="came back but refused this worker: (encryption mismatch|the encrypted)"
        ):
            for _ in range(50):
                comm.all_reduce(np.ones(4, np.float32))
                time.sleep(0.1)
        comm.close()
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait()
