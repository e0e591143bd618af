"""A reducer started without --index (issue 39, item 3) takes its place from RS_REDUCERS: the one
entry whose port is the port it binds and whose host names an address it binds (a name that
resolves to it counts; on 0.0.0.0 any address of this host does). Reducers started by hand, the
CLI as a user runs it, serve a real job in the order RS_REDUCERS gives, not the order they were
started in; an entry that is ambiguous or absent is named; --index still wins."""

from __future__ import annotations

import subprocess
import sys
from typing import Iterator, List

import numpy as np
import pytest

import reduction_server.client as rs
from helpers.cluster import TOKEN, child_env, cli, run_ranks
from helpers.ports import free_port_range

pytestmark = pytest.mark.timeout(120)
NOT_HERE = "192.0.2.1"  # TEST-NET-1: an address of no host here


def _serve(args: List[str], reducers: str, **env: str) -> subprocess.Popen:
    """`reduction-server serve ARGS` with RS_REDUCERS=`reducers` and no index; its first line read."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "reduction_server", "serve", *args],
        env=child_env({"RS_REDUCERS": reducers, "RS_JOB_TOKEN": TOKEN, **env}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.line = proc.stdout.readline() or proc.communicate(timeout=30)[1]
    return proc


@pytest.fixture
def started() -> Iterator[List[subprocess.Popen]]:
    procs: List[subprocess.Popen] = []
    yield procs
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.communicate(timeout=30)


def test_reducers_started_by_hand_find_their_index_in_RS_REDUCERS_and_serve_a_job(started):
    """Two reducers at ports a and b, listed as `127.0.0.1:b,localhost:a`: the one at a is
    reducer 1 (by the name, which resolves to the address it binds), the one at b reducer 0, and
    two ranks all-reduce through them; a third, bound to every address with no port given, finds
    its entry (and so its port) beside an address of no host here."""
    a = free_port_range(3, reuse=True)
    b, c = a + 1, a + 2
    listed = f"127.0.0.1:{b},localhost:{a}"
    started += [_serve(["--host", "127.0.0.1", "--port", str(port)], listed) for port in (a, b)]
    assert started[0].line.startswith(f"reducer 1 listening on tcp://127.0.0.1:{a} "), started[0].line
    assert started[1].line.startswith(f"reducer 0 listening on tcp://127.0.0.1:{b} "), started[1].line

    def make(rank: int) -> rs.Communicator:
        return rs.Communicator(listed.split(","), rank, 2, job_token=TOKEN, connect_timeout=20, timeout=20)

    def body(comm: rs.Communicator, rank: int) -> bool:
        return np.array_equal(comm.all_reduce(np.full(300_000, rank + 1, np.int64)), np.full(300_000, 3))

    assert run_ranks(2, make, body, limit=60) == [True, True]
    started.append(_serve([], f"{NOT_HERE}:{c},127.0.0.1:{c}"))
    assert started[-1].line.startswith(f"reducer 1 listening on tcp://0.0.0.0:{c} "), started[-1].line


def test_index_still_wins(started):
    a = free_port_range(2, reuse=True)
    started.append(
        _serve(["--host", "127.0.0.1", "--port", str(a), "--index", "0"], f"127.0.0.1:{a + 1},127.0.0.1:{a}")
    )
    assert started[0].line.startswith(f"reducer 0 listening on tcp://127.0.0.1:{a} "), started[0].line


@pytest.mark.parametrize(
    "args, listed, words",
    [
        (
            ["--host", "127.0.0.1"],
            "127.0.0.1:{a},localhost:{b}",
            "RS_REDUCERS lists 2 addresses of 127.0.0.1 (0: 127.0.0.1:{a}, 1: localhost:{b}): give --index, "
            "this reducer's position in RS_REDUCERS, or --port, its own entry's port",
        ),
        (
            ["--host", "127.0.0.1", "--port", "{a}"],
            f"{NOT_HERE}:{{a}},127.0.0.1:{{b}}",
            f"none of the 2 address(es) of RS_REDUCERS (0: {NOT_HERE}:{{a}}, 1: 127.0.0.1:{{b}}) is 127.0.0.1's "
            "at port {a}: give --index",
        ),
        (["--port", "{a}"], f"{NOT_HERE}:{{a}}", "is this host's at port {a}: give --index"),
    ],
    ids=["two-of-this-host", "none-at-its-port", "none-of-this-host"],
)
def test_an_ambiguous_or_absent_entry_is_named_in_one_line(args: List[str], listed: str, words: str):
    a = free_port_range(2, reuse=True)
    fill = lambda text: text.format(a=a, b=a + 1)  # noqa: E731
    proc = cli("serve", *map(fill, args), RS_REDUCERS=fill(listed), RS_JOB_TOKEN=TOKEN)
    assert proc.returncode != 0 and fill(words) in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
