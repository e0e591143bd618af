"""Shared test setup: the suite tests the installed package, never the source tree.

`python -m pytest` puts the working directory first on sys.path, and in a checkout that is the
uncompiled tree (no native extension, no client package): it is taken off here, before any test
imports reduction_server. The tests then run from tests/, which holds no reduction_server, so a
child process that a test starts as `python -m reduction_server` imports the installed package too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

from helpers import ports
from helpers.source_tree import ROOT  # imports nothing of reduction_server

sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT]
# pytest-xdist tells a worker who it is in its environment; the processes tests start are no
# workers (pytest-benchmark times nothing in a process that says it is one). The worker's share
# of the ports is fixed here and the variables go.
_WORKER = os.environ.pop("PYTEST_XDIST_WORKER", "")
ports.share_out(int(_WORKER.removeprefix("gw") or 0), int(os.environ.pop("PYTEST_XDIST_WORKER_COUNT", "1")))
# One process per reducer unless a test asks for shards (test_shards.py, test_failover.py); a test
# of one reducer process itself pins it (helpers.cluster.ONE_PROCESS), and one that stops or kills
# a reducer signals its shards too (Reducers.signal). RS_SHARDS=2 python -m pytest runs every
# other reducer sharded, as `serve` runs by default on a host of several cores.
os.environ.setdefault("RS_SHARDS", "1")

import reduction_server.client as rs  # noqa: E402  (after the tree left sys.path)
from helpers import base_rootfs  # noqa: E402
from helpers.cluster import Reducers, reducers  # noqa: E402
from helpers.jobs import connect, new_job  # noqa: E402
from reduction_server import _native  # noqa: E402

collect_ignore_glob = ["fixtures/*"]  # third-party test files, run by the test modules that vendor them


def pytest_collection_finish(session) -> None:
    """The Docker tests' base file system is made while the other tests run (helpers/base_rootfs.py).
    Under pytest-xdist every worker collects every test but only one runs the Docker tests: that
    one makes it when they start."""
    if _WORKER or session.config.option.collectonly:
        return
    if any(item.path.name == "test_docker.py" for item in session.items):
        base_rootfs.start()


def pytest_sessionfinish(session) -> None:
    base_rootfs.discard()


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--torch-suite",
        choices=("ci", "all"),
        default="ci",
        help="test_torch_suite.py: torch's distributed tests in CI's selection (ci), or all of them",
    )


@pytest.fixture(scope="session", autouse=True)
def _away_from_the_tree() -> Iterator[None]:
    previous = os.getcwd()
    os.chdir(ROOT / "tests")
    try:
        yield
    finally:
        os.chdir(previous)


@pytest.fixture(scope="module")
def group() -> Iterator[Reducers]:
    """Two reducers on loopback for a module's tests (job token helpers.cluster.TOKEN); each
    must outlive every test of the module."""
    with reducers(2) as g:
        yield g
        assert g.alive(), "a reducer died during the tests"


@pytest.fixture(scope="module", params=["shared-memory", "frames"])
def transport_group(request) -> Iterator[Reducers]:
    """Two reducers, once with chunks in shared-memory slots (they share this host with the test's
    ranks) and once with RS_SHM=0 on them, through the sockets as between hosts."""
    with reducers(2, extra_env={"RS_SHM": "0"} if request.param == "frames" else None) as g:
        yield g
        assert g.alive(), "a reducer died during the tests"


@pytest.fixture
def solo(group: Reducers) -> Iterator[rs.Communicator]:
    """A one-rank communicator over `group`: enough for argument checks and single-rank results."""
    with connect(group, 0, 1, new_job()) as comm:
        yield comm


@pytest.fixture(params=_native.available_isas())
def isa(request) -> Iterator[str]:
    """Each instruction-set level this CPU supports, selected in the kernels for one test."""
    previous = _native._select_isa(request.param)
    assert _native.isa() == request.param
    yield request.param
    _native._select_isa(previous)
