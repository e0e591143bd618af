"""RS_SNDBUF: the kernel send buffer of every data connection, on the worker's end and the
reducer's, checked on real reducer processes through the kernel's own view of the sockets (ss)."""
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import reduction_server.client as rs
from helpers.cluster import TOKEN, child_env, reducers, run_ranks
from reduction_server.errors import ConfigError
from reduction_server.settings import socket_send_buffer

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("ss") is None,
                                 reason="reads the sockets' buffers with iproute2's ss, on Linux")]

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

        make = lambda rank: rs.Communicator(group.addresses, rank, 2, job_token=TOKEN, timeout=10,
                                            connect_timeout=10)
        for y, buffers in run_ranks(2, make, body):
            np.testing.assert_array_equal(y, x * 3)
            # 2 ranks x 2 reducers, each connection seen from both ends; Linux doubles what is asked
            assert buffers == [2 * REQUESTED] * 8, buffers


def test_without_rs_sndbuf_the_kernel_tunes_the_buffers(monkeypatch):
    """The default leaves autotuning alone: a connection that carried megabytes has grown its
    buffer past what RS_SNDBUF asks for above, so the first test sees the setting, not a default."""
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        if int(f.read().split()[2]) <= 2 * REQUESTED:
            pytest.skip("this host's tcp_wmem lets no send buffer grow past what the first test asks for")
    monkeypatch.delenv("RS_SNDBUF", raising=False)
    x = np.ones(4 << 20, dtype=np.float32)
    with reducers(1, extra_env={"RS_SHM": "0"}) as group:
        ports = [a.rsplit(":", 1)[1] for a in group.addresses]
        with rs.Communicator(group.addresses, 0, 1, job_token=TOKEN, timeout=10, connect_timeout=10) as comm:
            comm.all_reduce(x)
            buffers = send_buffers(ports)
    assert len(buffers) == 2 and min(buffers) > 2 * REQUESTED, buffers


def test_a_reducer_refuses_a_bad_rs_sndbuf():
    serve = [sys.executable, "-m", "reduction_server", "serve", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.run(serve, env=child_env({"RS_SNDBUF": "1000"}), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "RS_SNDBUF=1000 must be 0 (the kernel's autotuning) or 4096" in proc.stderr, proc.stderr


def test_send_buffer_takes_integers_of_any_kind_and_nothing_else():
    assert socket_send_buffer(np.int64(16384)) == 16384 and socket_send_buffer(0) == 0
    for bad in ("16384", 16384.0, 4095, -1):
        with pytest.raises(ConfigError, match="send_buffer"):
            socket_send_buffer(bad)
