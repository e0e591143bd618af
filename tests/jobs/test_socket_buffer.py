"""RS_SNDBUF: the kernel send buffer of every data connection, on the worker's end and the
reducer's, checked on real reducer processes through the kernel's own view of the sockets (ss):
a fixed size, the kernel's autotuning (0), and `auto`, the default, where each connection's
buffer, a worker's and a reducer's, follows its segments and what it measures
(reduction_server/wire/send_buffers.py): loopback keeps autotuning, a connection over a shaped
Ethernet link gets a few segments' worth on both ends."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import reduction_server.client as rs
from helpers.cluster import SCRIPTS, TOKEN, child_env, reducers, run_ranks
from reduction_server.config.settings import SNDBUF_AUTO, socket_send_buffer
from reduction_server.errors import ConfigError
from reduction_server.wire import send_buffers as sizing

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or shutil.which("ss") is None,
        reason="reads the sockets' buffers with iproute2's ss, on Linux",
    ),
]

REQUESTED = 24576


def send_buffers(ports):
    """sk_sndbuf (ss's `tb`) of every TCP socket with one end on one of `ports`."""
    query = " or ".join(f"sport = :{p} or dport = :{p}" for p in ports)
    out = subprocess.run(["ss", "-tmnH", f"( {query} )"], capture_output=True, text=True, check=True).stdout
    return [int(tb) for tb in re.findall(r"\btb(\d+)", out)]


def test_rs_sndbuf_sets_both_ends_of_every_connection(monkeypatch):
    monkeypatch.setenv("RS_SNDBUF", str(REQUESTED))  # the workers read it here, the reducers from their env
    x = np.arange(1 << 18, dtype=np.float32)
    with reducers(2, extra_env={"RS_SNDBUF": str(REQUESTED), "RS_SHM": "0"}) as group:
        ports = [a.rsplit(":", 1)[1] for a in group.addresses]

        def body(comm, rank):
            y = comm.all_reduce(x * (rank + 1))
            buffers = send_buffers(ports)  # every connection is up and has carried chunks
            comm.barrier()
            return y, buffers

        def make(rank: int) -> rs.Communicator:
            return rs.Communicator(group.addresses, rank, 2, job_token=TOKEN, timeout=10, connect_timeout=10)

        for y, buffers in run_ranks(2, make, body):
            np.testing.assert_array_equal(y, x * 3)
            # 2 ranks x 2 reducers, each connection seen from both ends; Linux doubles what is asked
            assert buffers == [2 * REQUESTED] * 8, buffers


@pytest.mark.parametrize("setting", ["", "auto", "0"])
def test_loopback_connections_keep_the_kernels_autotuning(monkeypatch, setting: str):
    """0 leaves autotuning alone, and so does `auto` on loopback (64 KiB segments: eleven of them
    are more than a connection starts with): a connection that carried megabytes has grown its
    buffer past what RS_SNDBUF asks for above, so the first test sees the setting, not a default."""
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        if int(f.read().split()[2]) <= 2 * REQUESTED:
            pytest.skip("this host's tcp_wmem lets no send buffer grow past what the first test asks for")
    monkeypatch.setenv("RS_SNDBUF", setting)
    x = np.ones(4 << 20, dtype=np.float32)
    with reducers(1, extra_env={"RS_SHM": "0"}) as group:
        ports = [a.rsplit(":", 1)[1] for a in group.addresses]
        with rs.Communicator(group.addresses, 0, 1, job_token=TOKEN, timeout=10, connect_timeout=10) as comm:
            started = time.monotonic()
            while time.monotonic() - started < 4 * sizing.MEASURE_S:  # past SETTLE_BYTES and a few of its turns
                comm.all_reduce(x)
            buffers = send_buffers(ports)
            chosen = comm._engine.connections.send_buffers
            if setting != "0":
                assert chosen.locked == {} and sizing._route_mtu(chosen.peers[0]) >= 65535, chosen.locked
            else:
                assert chosen is None
    assert len(buffers) == 2 and min(buffers) > 2 * REQUESTED, buffers


def test_what_a_connection_wants_follows_its_bandwidth_delay_product():
    assert sizing.want(1448, 3e6, 100) == 16384  # a share of a shaped link: the floor, 11 segments
    assert sizing.want(1448, 25e6, 4000) == 262144  # 2 x 100 KB in flight, rounded up
    assert sizing.want(65483, 1e9, 20) == 1 << 20  # loopback: 11 of its segments, over LOCK_MAX
    assert sizing.want(1448, 1.25e9, 50) > sizing.LOCK_MAX  # 10 Gbit/s over 50 us: autotuned


def test_a_reducer_gives_each_accepted_connection_its_floor_by_the_descriptor_it_is_told():
    """AcceptedBuffers.accepted(fd), as the reducer's socket monitor calls it: a connection of
    Ethernet-sized segments (the client's TCP_MAXSEG) gets the floor; a loopback-sized one keeps
    autotuning; a descriptor that is closed or is another port's by now is left alone."""
    with socket.create_server(("127.0.0.1", 0)) as listener, socket.create_server(("127.0.0.1", 0)) as other:
        port = listener.getsockname()[1]
        buffers = sizing.AcceptedBuffers(port)
        small = socket.socket()
        small.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1400)
        small.connect(("127.0.0.1", port))
        large = socket.create_connection(("127.0.0.1", port))
        stranger = socket.create_connection(other.getsockname())
        (a, a_peer), (b, _), (c, _) = listener.accept(), listener.accept(), other.accept()
        closed = socket.socket()
        gone = closed.detach()
        os.close(gone)
        try:
            before = b.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            for fd in (a.fileno(), b.fileno(), c.fileno(), gone):
                buffers.accepted(fd)
            assert buffers.locked == {a_peer: 16384} and buffers.fds == {a_peer: a.fileno()}
            assert a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * 16384  # Linux doubles it
            assert b.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == before
        finally:
            for sock in (small, large, stranger, a, b, c):
                sock.close()
    buffers.measure()  # the connection is gone: so is what was measured on it
    assert buffers.locked == {} and buffers.fds == {}


@pytest.mark.skipif(os.geteuid() != 0, reason="the emulated network needs root (namespaces, veth links, tc)")
@pytest.mark.timeout(180)
def test_auto_gives_connections_over_a_shaped_link_a_few_segments():
    """Two worker hosts and two reducer hosts on 100 Mbit/s links (bench/netem.py's network):
    every worker connection starts with 16 KiB (eleven 1448-byte segments on a 1500-byte route)
    and stays within twice that, its measured bandwidth-delay product being smaller (it shares
    its host's link with the other); each reducer gives its two accepted connections the same
    as it admits them, and at most LOCK_MAX after; the kernel holds twice what it was given; and
    every all-reduce is right.
    The engine found each connection among its descriptors."""
    from reduction_server.bench.emulated_network import EmulatedNetwork

    token, world = os.urandom(16).hex(), 2
    env = child_env({"RS_JOB_TOKEN": token, "RS_SHARDS": "1", "RS_SNDBUF": "auto"})
    with EmulatedNetwork(4, 100) as net:
        servers = [
            net.spawn(
                world + j,
                [
                    sys.executable,
                    "-m",
                    "reduction_server",
                    "serve",
                    "--host",
                    net.address(world + j),
                    "--port",
                    "5555",
                    "--workers",
                    str(world),
                    "--index",
                    str(j),
                ],
                env,
            )
            for j in range(2)
        ]
        for proc in servers:
            assert "listening on" in proc.stdout.readline()
        reducers_spec = ",".join(f"{net.address(world + j)}:5555" for j in range(2))
        workers = [
            net.spawn(
                i,
                [sys.executable, str(SCRIPTS / "send_buffer_job.py"), "4", "8", "3"],
                dict(env, RS_REDUCERS=reducers_spec, RS_RANK=str(i), RS_WORLD_SIZE=str(world)),
            )
            for i in range(world)
        ]
        lines = [next(line for line in proc.stdout if line.startswith("{")) for proc in workers]
        ends = [
            subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    net.namespace(world + j),
                    "ss",
                    "-tmnH",
                    "state",
                    "established",
                    "( sport = :5555 )",
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for j in range(2)
        ]
        for proc in workers:
            proc.communicate(timeout=120)
        net.stop(servers)
    for line in lines:
        res = json.loads(line)
        assert res["right"] and res["found"] == 2, line
        addresses = reducers_spec.split(",")
        assert sorted(res["locked"]) == sorted(addresses) and set(res["locked"].values()) <= {16384, 32768}, line
        assert [res["kernel"][a] for a in addresses] == [2 * res["locked"][a] for a in addresses], line
    # Each reducer's two accepted connections, given 16 KiB and then what they measure, doubled by
    # the kernel. A reducer's connection has measured more than its share of the link (64 KiB, once
    # in about 25 runs), so up to LOCK_MAX; autotuning would give megabytes.
    for out in ends:
        sizes = [int(tb) for tb in re.findall(r"\btb(\d+)", out)]
        assert len(sizes) == 2 and set(sizes) <= {32768, 65536, 2 * sizing.LOCK_MAX}, out


def test_a_reducer_refuses_a_bad_rs_sndbuf():
    serve = [sys.executable, "-m", "reduction_server", "serve", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.run(serve, env=child_env({"RS_SNDBUF": "1000"}), capture_output=True, text=True, timeout=30)
    assert (
        proc.returncode == 2 and "RS_SNDBUF=1000 must be `auto`, 0 (the kernel's autotuning) or 4096" in proc.stderr
    ), proc.stderr


def test_send_buffer_takes_auto_or_integers_of_any_kind_and_nothing_else(monkeypatch):
    assert socket_send_buffer(np.int64(16384)) == 16384 and socket_send_buffer(0) == 0
    assert socket_send_buffer("auto") == SNDBUF_AUTO
    monkeypatch.delenv("RS_SNDBUF", raising=False)
    assert socket_send_buffer() == SNDBUF_AUTO  # the default
    monkeypatch.setenv("RS_SNDBUF", "Auto")
    assert socket_send_buffer() == SNDBUF_AUTO
    for bad in ("16384", 16384.0, 4095, -1):
        with pytest.raises(ConfigError, match="send_buffer"):
            socket_send_buffer(bad)
