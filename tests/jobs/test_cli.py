"""What the command line says and refuses (issue 39, items 4 and 5): a reducer without a job token
beyond the loopback refuses to start unless told so explicitly; a CLI error is one line (its
traceback only with --debug or RS_LOG_LEVEL=DEBUG); `run` checks its ports before it starts
anything; a missing extra is named; a reducer's start is one short line at the default level.
Each test asserts what the user sees."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest

from helpers.cluster import child_env, cli
from helpers.ports import free_port_range

pytestmark = pytest.mark.timeout(120)

REFUSAL = "refusing to listen on 0.0.0.0 without a job token"


def first_line_then_stop(args: List[str], env: Dict[str, str]) -> Tuple[str, str, str]:
    """Start `reduction-server ARGS`, read its first stdout line, stop it with SIGTERM: (that line,
    the rest of stdout, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "reduction_server", *args],
        env=child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
    finally:
        proc.terminate()
        rest, err = proc.communicate(timeout=30)
    return line, rest, err


# --- item 4: no token beyond the loopback ------------------------------------------------------


@pytest.mark.parametrize("shards", ["1", "2"])
def test_serve_without_a_token_on_every_address_refuses_in_one_line(shards):
    proc = cli("serve", "--port", "0", "--shards", shards)  # the default host: 0.0.0.0
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"reduction-server serve: {REFUSAL}: anyone who reaches the port"), line
    # what to do: a token, the loopback, or the explicit override
    for words in (
        "set RS_JOB_TOKEN",
        "openssl rand -hex 16",
        "--host 127.0.0.1",
        "--insecure-no-token",
        "RS_ALLOW_NO_TOKEN=1",
    ):
        assert words in line, (words, line)


def test_a_discovered_reducer_without_a_token_refuses_too():
    """A reducer that finds its place in RS_REDUCERS binds RS_BIND_HOST, 0.0.0.0 by default."""
    port = free_port_range(1)
    proc = cli("serve", RS_REDUCERS=f"10.0.0.1:{port}", RS_REDUCER_INDEX="0")
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"reduction-server serve: {REFUSAL}: ") and "--insecure-no-token" in line, line


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_the_explicit_override_starts_it_and_says_auth_none(how):
    args = ["serve", "--port", "0", "--shards", "1"] + (["--insecure-no-token"] if how == "flag" else [])
    env = {"RS_ALLOW_NO_TOKEN": "1"} if how == "variable" else {}
    line, _, err = first_line_then_stop(args, env)
    assert line.startswith("reducer 0 listening on tcp://0.0.0.0:") and line.rstrip().endswith(" auth=none"), (
        line,
        err,
    )
    assert "Traceback" not in err


def test_the_loopback_or_a_token_needs_no_override():
    line, _, err = first_line_then_stop(["serve", "--host", "127.0.0.1", "--port", "0", "--shards", "1"], {})
    assert "listening on tcp://127.0.0.1:" in line and " auth=none" in line, (line, err)
    line, _, err = first_line_then_stop(["serve", "--port", "0", "--shards", "1"], {"RS_JOB_TOKEN": "t0ken"})
    assert "listening on tcp://0.0.0.0:" in line and " auth=token" in line, (line, err)


def test_a_bad_override_value_is_named():
    proc = cli("serve", "--port", "0", "--shards", "1", RS_ALLOW_NO_TOKEN="perhaps")
    assert proc.returncode == 2
    [line] = proc.stderr.splitlines()
    assert line.startswith("reduction-server serve: RS_ALLOW_NO_TOKEN='perhaps' is not a switch; use 1 or 0"), line


def test_a_busy_port_names_the_process_that_holds_it():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = cli("serve", "--host", "127.0.0.1", "--port", str(port), "--shards", "1")
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    assert f"cannot listen on tcp://127.0.0.1:{port}: the port is already in use (by pid {os.getpid()} (" in line, line
    assert line.endswith("stop it, or choose another port (--port; 0 picks a free one)"), line


# --- item 4: `run` checks its ports before it starts anything ---------------------------------


def test_run_with_overlapping_reducer_and_metrics_ports_refuses_before_starting_anything():
    base = free_port_range(3)
    proc = cli(
        "run",
        "-np",
        "1",
        "--reducers",
        "2",
        "--port-base",
        str(base),
        "--metrics-port",
        str(base + 1),
        "--",
        sys.executable,
        "-c",
        "print('WORKER RAN')",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""  # no reducer's line, no worker's
    assert proc.stderr.splitlines() == [
        f"reduction-server run: --port-base {base} and --metrics-port {base + 1} with 2 reducer(s) overlap: the "
        f"reducers listen on ports {base}-{base + 1} and serve metrics on ports {base + 1}-{base + 2}; choose "
        f"ranges apart (e.g. --metrics-port {base + 2})"
    ], proc.stderr


@pytest.mark.parametrize("taken", ["reducer", "metrics"])
def test_run_with_a_taken_port_names_its_holder_before_starting_anything(taken):
    base = free_port_range(4)
    port = base + 1 if taken == "reducer" else base + 3  # reducer 1's port, or reducer 1's metrics port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        proc = cli(
            "run",
            "-np",
            "1",
            "--reducers",
            "2",
            "--port-base",
            str(base),
            "--metrics-port",
            str(base + 2),
            "--",
            sys.executable,
            "-c",
            "print('WORKER RAN')",
        )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == ""
    whose = "reducer 1's port (--port-base)" if taken == "reducer" else "reducer 1's metrics port (--metrics-port)"
    [line] = proc.stderr.splitlines()
    assert line.startswith(
        f"reduction-server run: cannot use 127.0.0.1:{port}, {whose}: it is already in use (by pid {os.getpid()} ("
    ), line


# --- item 5: one line per error, tracebacks on demand ------------------------------------------

SIZE = ["size", "--workers", "1", "--worker-gbps", "1", "--reducer-gbps", "1", "--measure"]


def test_a_config_error_is_one_line_without_a_traceback():
    """`size --measure` starts a reducer with the environment's settings: a bad one is said in
    one line, before anything starts (it was a RuntimeError's traceback)."""
    proc = cli(*SIZE, RS_MAX_CHUNK_BYTES="lots")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["reduction-server size: RS_MAX_CHUNK_BYTES='lots' is not a valid int"], (
        proc.stderr
    )
    assert proc.stdout == ""


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback_and_still_the_one_line(where):
    args = ["--debug", *SIZE] if where == "before" else [*SIZE, "--debug"]
    proc = cli(*args, RS_MAX_CHUNK_BYTES="lots")
    assert proc.returncode == 2
    assert proc.stderr.startswith("Traceback (most recent call last):"), proc.stderr
    assert "ConfigError: RS_MAX_CHUNK_BYTES='lots' is not a valid int" in proc.stderr
    assert proc.stderr.splitlines()[-1] == "reduction-server size: RS_MAX_CHUNK_BYTES='lots' is not a valid int"


def test_log_level_debug_shows_the_traceback():
    proc = cli("serve", "--port", "0", "--shards", "1", RS_LOG_LEVEL="DEBUG")
    assert proc.returncode == 2
    assert "Traceback (most recent call last):" in proc.stderr and "ConfigError: " + REFUSAL in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(f"reduction-server serve: {REFUSAL}")


def test_bench_without_its_extra_names_it():
    """As on a plain `pip install reduction-server`: tqdm is not there (None in sys.modules
    makes its import fail as a missing module's does)."""
    script = (
        "import sys\nsys.modules['tqdm'] = None\nfrom reduction_server.cli import main\n"
        "sys.exit(main(['bench', 'kernels', '--quick', '--out', sys.argv[1]]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, "/nonexistent/bench-out"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        'reduction-server bench kernels: needs tqdm, which is not installed: pip install "reduction-server[bench]"'
    ], proc.stderr


# --- item 5: a short start line ----------------------------------------------------------------


@pytest.mark.parametrize("shards", ["1", "2"])
def test_the_start_is_one_short_line_at_the_default_level(shards):
    line, rest, err = first_line_then_stop(
        ["serve", "--host", "127.0.0.1", "--port", "0", "--shards", shards], {"RS_JOB_TOKEN": "t0ken"}
    )
    assert line.startswith("reducer 0 listening on tcp://127.0.0.1:") and " workers=from HELLO auth=token" in line, (
        line,
        err,
    )
    assert len(line.rstrip("\n")) <= 110, line
    assert rest == ""
    # stderr has the summary when it stops (one per shard, and the supervisor's) and nothing at start
    assert [entry.split()[4] for entry in err.splitlines()] == ["stopped"] * (1 if shards == "1" else 3), err


def test_info_has_the_full_configuration():
    _, _, err = first_line_then_stop(
        ["serve", "--host", "127.0.0.1", "--port", "0", "--shards", "1"],
        {"RS_JOB_TOKEN": "t0ken", "RS_LOG_LEVEL": "INFO"},
    )
    [started] = [entry for entry in err.splitlines() if " INFO reduction_server.reducer started " in entry]
    for field in (
        "max_chunk_bytes=",
        "max_accumulator_bytes=",
        "timeout_s=",
        "heartbeat_interval_s=",
        "sndbuf=",
        "metrics=off",
        "pid=",
    ):
        assert field in started, (field, started)
