"""The first hour of a new user: what the command line and a worker say when something is off,
as torchrun and horovodrun users expect. Each test asserts the message the user sees."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from helpers.capture import CapturingSocket
from helpers.cluster import ROOT, child_env, cli
from helpers.handshake import hello_payload
from helpers.ports import free_port_range
from reduction_server.cli import build_parser
from reduction_server.config import settings
from reduction_server.reducer import Reducer

pytestmark = pytest.mark.timeout(120)


def test_a_worker_waiting_for_reducers_says_which_and_why():
    """Pointed at an address where nothing listens, a worker says so every few seconds, at the
    default log level, instead of looking hung for RS_CONNECT_TIMEOUT."""
    port = free_port_range(1)
    script = (
        f"import reduction_server.client as rs\nrs.Communicator(['127.0.0.1:{port}'], 0, 1, connect_timeout=12.5)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    waiting = [line for line in proc.stderr.splitlines() if "waiting_for_reducers" in line]
    assert 1 <= len(waiting) <= 2, proc.stderr  # at about 5 and 10 s
    for line in waiting:
        assert re.search(
            r" NOTICE reduction_server\.client waiting_for_reducers rank=0 waited_s=\d+ "
            rf'connect_timeout_s=12\.5 waiting="reducer 0 \(127\.0\.0\.1:{port}\): connection refused: '
            r"nothing listens there \(is `reduction-server serve` running there, and the port in "
            r'RS_REDUCERS right\?\)"$',
            line,
        ), line
    assert (
        "CollectiveError: rank 0: no reducer admitted this worker within 12.5 s (RS_CONNECT_TIMEOUT): "
        f"reducer 0 (127.0.0.1:{port}): connection refused: nothing listens there"
    ) in proc.stderr


def test_a_worker_waiting_for_a_silent_peer_says_it_is_connected():
    """A listener that never answers HELLO (not a reducer) is told apart from no listener."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        script = (
            f"import reduction_server.client as rs\nrs.Communicator(['127.0.0.1:{port}'], 0, 1, connect_timeout=6)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", script], env=child_env(), capture_output=True, text=True, timeout=60
        )
    assert proc.returncode == 1
    assert f"reducer 0 (127.0.0.1:{port}): connected, but no answer to HELLO yet (is it a reducer?)" in proc.stderr


@pytest.mark.parametrize("port", ["99999", "-5", "65536", "http"])
def test_serve_refuses_a_port_outside_the_range(port):
    proc = cli("serve", "--port", port)
    assert proc.returncode == 2
    expected = "is outside 0-65535" if port != "http" else "is not a port number"
    assert (
        f"reduction-server serve: error: argument --port: {port if port != 'http' else repr(port)} {expected}"
        in proc.stderr
    ), proc.stderr
    assert proc.stdout == ""  # nothing listened


@pytest.mark.parametrize("shards", ["1", "2"])
def test_serve_on_a_busy_port_says_so_in_one_line(shards):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = cli("serve", "--host", "127.0.0.1", "--port", str(port), "--shards", shards)
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()  # naming who holds the port: this test's process
    assert line.startswith(
        f"reduction-server serve: cannot listen on tcp://127.0.0.1:{port}: the port is already "
        f"in use (by pid {os.getpid()} ("
    ), line
    assert line.endswith("); stop it, or choose another port (--port; 0 picks a free one)"), line
    assert proc.stdout == ""


@pytest.mark.parametrize("shards", ["1", "2"])
@pytest.mark.parametrize("port", ["0", "5555"])
def test_serve_on_an_address_of_another_host_says_so_in_one_line(port, shards):
    proc = cli("serve", "--host", "198.18.0.77", "--port", port, "--shards", shards, RS_JOB_TOKEN="t0ken")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"reduction-server serve: cannot listen on tcp://198.18.0.77:{'*' if port == '0' else port}: 198.18.0.77 is "
        "not an address of this host (--host / RS_BIND_HOST; 0.0.0.0 listens on all of them)"
    ], proc.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0"])
def test_size_refuses_bandwidths_that_are_not_positive_and_finite(value):
    proc = cli("size", "--workers", "8", f"--worker-gbps={value}", "--reducer-gbps", "32")
    assert proc.returncode == 2
    assert proc.stderr.startswith(
        "reduction-server size: bandwidths must be positive, finite Gbit/s, got "
        f"--worker-gbps {float(value):g} --reducer-gbps 32"
    ), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "verb, readers, example",
    [
        ("serve", [settings.REDUCERS], "reduction-server serve --port 5555"),
        ("run", [settings.LAUNCHER], "reduction-server run -np 4 --reducers 2 -- python train.py"),
        ("size", [], "reduction-server size --workers 8"),
        ("bench", [settings.BENCH], "reduction-server bench loopback --quick"),
    ],
)
def test_each_subcommand_help_has_a_summary_an_example_and_its_variables(verb, readers, example):
    proc = cli(verb, "--help")
    assert proc.returncode == 0
    text = proc.stdout
    summary = build_parser()._subparsers._group_actions[0].choices[verb].description
    assert summary.endswith(".") and "\n" not in summary and summary in text
    assert "example:\n  " in text and example in text
    names = [v.name for v in settings.variables_read_by(*readers)]
    listed = re.findall(r"^  ([A-Z][A-Z0-9_]+) ", text.split("environment variables it reads:", 1)[1], re.M)
    assert listed == names and (names or "none of its own" in text)


def test_the_version_is_printed():
    from reduction_server import __version__

    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"reduction-server {__version__}"


def test_a_normal_job_tears_down_without_warnings():
    """The README's job, three times: not one WARNING from a worker or a reducer."""
    for _ in range(3):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "reduction_server",
                "run",
                "-np",
                "4",
                "--reducers",
                "2",
                "--",
                sys.executable,
                str(ROOT / "examples" / "allreduce_check.py"),
                "--mib",
                "4",
                "--iters",
                "2",
            ],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert " stopped reducer=1 " in proc.stdout  # the reducers' own summaries were read
        warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if " WARNING " in line]
        assert warnings == []


def test_a_send_to_a_worker_that_said_bye_is_no_warning_and_no_loss(caplog):
    """At a job's end libzmq may fail a PING to a worker whose connection has closed before the
    reducer has read that worker's BYE: the BYE, read first, makes it a clean departure."""
    sock = CapturingSocket()
    reducer = Reducer(sock, world_size=2, job_token="")
    for rank in range(2):
        identity, info = b"r%d" % rank, hello_payload()
        ident = dict(rank=rank, world=2, job=3)
        reducer.handle([zmq.Frame(identity), zmq.Frame(_header("HELLO", info, ident)), zmq.Frame(info)])
        reducer.handle([zmq.Frame(identity), zmq.Frame(_header("AUTH", b"", ident))])
        reducer.handle([zmq.Frame(identity), zmq.Frame(_header("PING", b"", ident))])
    sock.gone.add(b"r1")
    logger = logging.getLogger("reduction_server")  # it does not propagate to the root, where caplog listens
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.DEBUG, logger="reduction_server"):
            reducer.members.ping_peers()  # the heartbeat finds rank 1's connection gone
            reducer.handle([zmq.Frame(b"r1"), zmq.Frame(_header("BYE", b"", dict(rank=1, world=2, job=3)))])
            reducer.members.check_unreachable()
    finally:
        logger.removeHandler(caplog.handler)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "closed its communicator (BYE)" in reducer.members.lost[1]  # a departure, not a lost connection
    assert any("send_failed" in r.getMessage() for r in caplog.records)


def _header(kind: str, payload: bytes, ident: dict) -> bytes:
    from reduction_server.wire import protocol
    from reduction_server.wire.protocol import MsgType

    return protocol.text_header(MsgType[kind], payload, **ident)


def _broken_links(page: str) -> list:
    """The relative links of `page` (a markdown file under ROOT) that leave the repository, name no
    file, or name a heading that the markdown file they point to lacks (GitHub's anchors)."""
    path = ROOT / page
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        where = (path.parent / target).resolve() if target else path
        if not where.is_relative_to(ROOT) or not where.exists():
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(f"{target}#{anchor}")
    return broken


def _anchors(markdown: Path) -> set:
    text = re.sub(r"^```.*?^```", "", markdown.read_text(), flags=re.MULTILINE | re.DOTALL)  # no code blocks
    headings = re.findall(r"^#{1,6} +(.+?) *$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_the_readme_links_only_to_files_in_the_repository():
    readme = (ROOT / "README.md").read_text()
    assert "](docs/design.md)" in readme  # the map of the tree
    assert _broken_links("README.md") == [], "README links outside the repository or to nothing"


@pytest.mark.parametrize(
    "page", ["docs/frameworks.md", "docs/configuration.md", "docs/benchmarks.md", "docs/operations.md"]
)
def test_the_docs_pages_the_readme_sends_to_link_only_to_files_in_the_repository(page):
    assert f"]({page})" in (ROOT / "README.md").read_text()
    assert _broken_links(page) == [], f"{page} links outside the repository or to nothing"


def test_the_launcher_refuses_a_port_that_a_stranger_holds():
    """`run --port-base P` with another job's reducer on P: the job stops before any worker
    starts, naming the port, instead of reducing through the stranger."""
    base = free_port_range(2)
    env = {"RS_JOB_TOKEN": "the-strangers-token"}
    stranger = subprocess.Popen(
        [sys.executable, "-m", "reduction_server", "serve", "--host", "127.0.0.1", "--port", str(base), "--index", "0"],
        env=child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "listening" in stranger.stdout.readline()
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
                "--port-base",
                str(base),
                "--",
                sys.executable,
                "-c",
                "print('WORKER RAN')",
            ],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        stranger.terminate()
        _, stranger_log = stranger.communicate(timeout=20)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # Checked before any process starts (issue 39): the port, whose it is, and who holds it.
    [line] = proc.stderr.splitlines()
    assert line.startswith(
        f"reduction-server run: cannot use 127.0.0.1:{base}, reducer 0's port (--port-base): it "
        f"is already in use (by pid {stranger.pid} ("
    ), line
    assert proc.stdout == ""  # no reducer, no worker started
    assert "bytes_in=0" in stranger_log and " admitted " not in stranger_log


def test_the_configuration_page_table_of_variables_is_the_registry():
    """docs/configuration.md holds the table of variables (the README links to it)."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert settings.markdown_table() in page, "regenerate the table in docs/configuration.md: settings.markdown_table()"
