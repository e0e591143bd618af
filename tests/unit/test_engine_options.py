"""How a worker resolves its settings (client/engine/options.py), in this process and without
reducers: argument > discovered place > environment > default, and each ConfigError in the words
the Communicator raises.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator, List

import numpy as np
import pytest

import reduction_server.client.communicator as communicator_module
from reduction_server.client import Communicator
from reduction_server.client.engine.options import EngineOptions
from reduction_server.config import settings
from reduction_server.config.discovery import job_id_from
from reduction_server.errors import ConfigError
from reduction_server.wire import shared_memory

ONE = ["127.0.0.1:5555"]
TWO = ["127.0.0.1:5555", "127.0.0.1:5556"]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No variable of the registry set (a developer's shell may set some): each test sets those it is about."""
    for variable in settings.VARIABLES:
        monkeypatch.delenv(variable.name, raising=False)
    yield


def _setenv(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)


# -- precedence ----------------------------------------------------------------------------
def test_defaults_without_arguments_or_environment():
    o = EngineOptions.resolve(ONE, 0, 1)
    assert (o.reducers, o.rank, o.world_size) == (("127.0.0.1:5555",), 0, 1)
    assert (o.job_token, o.job_id, o.generation) == ("", 0, 0)
    assert (o.chunk_bytes, o.window, o.pipeline_depth) == (
        settings.DEFAULT_CHUNK_BYTES,
        settings.DEFAULT_WINDOW,
        settings.DEFAULT_PIPELINE_DEPTH,
    )
    assert (o.timeout, o.connect_timeout, o.io_threads) == (
        settings.DEFAULT_TIMEOUT,
        settings.DEFAULT_CONNECT_TIMEOUT,
        1,
    )
    assert (o.encrypt, o.shared_memory, o.send_buffer) == (False, shared_memory.SUPPORTED, settings.SNDBUF_AUTO)
    assert (o.failover, o.spares, o.active_reducers) == (True, 0, 1)
    assert (o.heartbeat_interval, o.liveness_timeout) == (
        settings.DEFAULT_HEARTBEAT_INTERVAL,
        settings.DEFAULT_LIVENESS_TIMEOUT,
    )


def test_the_environment_wins_over_the_defaults(monkeypatch: pytest.MonkeyPatch):
    _setenv(
        monkeypatch,
        RS_JOB_TOKEN="secret",
        RS_CHUNK_BYTES=str(1 << 20),
        RS_WINDOW="3",
        RS_PIPELINE_DEPTH="5",
        RS_TIMEOUT="7",
        RS_CONNECT_TIMEOUT="9",
        RS_IO_THREADS="2",
        RS_ENCRYPT="1",
        RS_SHM="0",
        RS_SNDBUF="16384",
        RS_FAILOVER="1",
        RS_SPARE_REDUCERS="1",
        RS_HEARTBEAT_INTERVAL="0.5",
        RS_LIVENESS_TIMEOUT="3",
    )
    o = EngineOptions.resolve(TWO, 1, 2)
    assert (o.job_token, o.job_id) == ("secret", job_id_from("secret"))
    assert (o.chunk_bytes, o.window, o.pipeline_depth) == (1 << 20, 3, 5)
    assert (o.timeout, o.connect_timeout, o.io_threads) == (7.0, 9.0, 2)
    assert (o.encrypt, o.shared_memory, o.send_buffer) == (True, False, 16384)
    assert (o.failover, o.spares, o.active_reducers) == (True, 1, 1)
    assert (o.heartbeat_interval, o.liveness_timeout) == (0.5, 3.0)


def test_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch):
    _setenv(
        monkeypatch,
        RS_JOB_TOKEN="secret",
        RS_CHUNK_BYTES=str(1 << 20),
        RS_WINDOW="3",
        RS_PIPELINE_DEPTH="5",
        RS_TIMEOUT="7",
        RS_CONNECT_TIMEOUT="9",
        RS_IO_THREADS="2",
        RS_ENCRYPT="1",
        RS_SHM="0",
        RS_SNDBUF="16384",
        RS_FAILOVER="1",
        RS_SPARE_REDUCERS="1",
    )
    o = EngineOptions.resolve(
        TWO,
        0,
        1,
        job_token="",
        job_id=42,
        generation=4,
        chunk_bytes=4096,
        window=8,
        pipeline_depth=16,
        timeout=1.5,
        connect_timeout=2.5,
        io_threads=4,
        encrypt=False,
        shared_memory=True,
        send_buffer="auto",
        failover=False,
        spares=0,
    )
    assert (o.job_token, o.job_id, o.generation) == ("", 42, 4)
    assert (o.chunk_bytes, o.window, o.pipeline_depth) == (4096, 8, 16)
    assert (o.timeout, o.connect_timeout, o.io_threads) == (1.5, 2.5, 4)
    assert (o.encrypt, o.shared_memory, o.send_buffer) == (False, True, settings.SNDBUF_AUTO)
    assert (o.failover, o.spares, o.active_reducers) == (False, 0, 2)


def test_a_zero_size_or_time_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch):
    """chunk_bytes, the two timeouts and io_threads take 0 for "not given", as None."""
    _setenv(monkeypatch, RS_CHUNK_BYTES="4096", RS_TIMEOUT="7", RS_CONNECT_TIMEOUT="9", RS_IO_THREADS="2")
    o = EngineOptions.resolve(ONE, 0, 1, chunk_bytes=0, timeout=0, connect_timeout=0, io_threads=0)
    assert (o.chunk_bytes, o.timeout, o.connect_timeout, o.io_threads) == (4096, 7.0, 9.0, 2)


def test_the_job_id_comes_from_the_token_unless_given():
    assert EngineOptions.resolve(ONE, 0, 1, job_token="t").job_id == job_id_from("t")
    assert EngineOptions.resolve(ONE, 0, 1, job_token="t", job_id=7).job_id == 7


def test_reducers_rank_and_world_are_normalised():
    o = EngineOptions.resolve(" 127.0.0.1:5555 , [::1]:5556,", np.int64(1), np.int32(2))
    assert o.reducers == ("127.0.0.1:5555", "[::1]:5556")
    assert (o.rank, o.world_size) == (1, 2) and type(o.rank) is int and type(o.world_size) is int


def test_options_are_frozen_and_keep_the_token_out_of_repr():
    o = EngineOptions.resolve(ONE, 0, 1, job_token="very-secret")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.window = 2  # type: ignore[misc]
    assert "very-secret" not in repr(o)


class _Engine:
    """An engine that connects to nothing: what the Communicator hands it is all that is looked at."""

    made: List[EngineOptions] = []

    def __init__(self, options: EngineOptions) -> None:
        self.made.append(options)
        self.active = options.active_reducers

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[List[EngineOptions]]:
    """The options of each engine a Communicator makes meanwhile (none connects)."""
    monkeypatch.setattr(_Engine, "made", [])
    monkeypatch.setattr(communicator_module, "Engine", _Engine)
    yield _Engine.made


def test_the_communicator_resolves_once_and_hands_the_engine_its_options(
    engines: List[EngineOptions], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("RS_WINDOW", "3")
    comm = Communicator(TWO, np.int64(1), 2, job_token="t", pipeline_depth=4, spares=1)
    [o] = engines
    assert o == EngineOptions.resolve(TWO, 1, 2, job_token="t", pipeline_depth=4, spares=1)
    assert (o.window, o.pipeline_depth) == (3, 4)
    assert (comm.rank, comm.world_size, comm.reducers, comm.job_id) == (1, 2, tuple(TWO), job_id_from("t"))
    assert (comm.chunk_bytes, comm.pipeline_depth, comm.active_reducers, comm.active_endpoints) == (
        settings.DEFAULT_CHUNK_BYTES,
        4,
        1,
        1,
    )
    comm.close()


def test_the_discovered_place_wins_over_the_environment(engines: List[EngineOptions], monkeypatch: pytest.MonkeyPatch):
    """from_env's environ says where the worker sits; the process's own RS_JOB_TOKEN does not override it."""
    monkeypatch.setenv("RS_JOB_TOKEN", "the-shell's")
    place = {
        "RS_REDUCERS": ",".join(TWO),
        "RS_RANK": "1",
        "RS_WORLD_SIZE": "3",
        "RS_JOB_TOKEN": "the-job's",
        "RS_GENERATION": "2",
    }
    Communicator.from_env(place, incarnation=1, timeout=4.0).close()
    [o] = engines
    assert (o.reducers, o.rank, o.world_size) == (tuple(TWO), 1, 3)
    assert (o.job_token, o.job_id, o.generation, o.timeout) == ("the-job's", job_id_from("the-job's"), 3, 4.0)


# -- each ConfigError ----------------------------------------------------------------------
def _refused(message: str, *args: Any, **kwargs: Any) -> None:
    """resolve(*args, **kwargs) raises a ConfigError that says exactly `message`."""
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        EngineOptions.resolve(*args, **kwargs)


@pytest.mark.parametrize("reducers", [[], "", " , "])
def test_no_reducers(reducers: Any):
    _refused("no reducers given (reducers=[...] or RS_REDUCERS)", reducers, 0, 1)


def test_a_reducer_that_is_no_address():
    _refused("reducers: '127.0.0.1' is not a host:port address: no :port", ["127.0.0.1"], 0, 1)


def test_a_reducer_listed_twice():
    _refused(
        "reducers lists host.example:5555 twice (positions 0 and 2)",
        ["Host.example:5555", "127.0.0.1:1", " host.example:5555"],
        0,
        1,
    )


@pytest.mark.parametrize(
    "rank, world, message",
    [
        (0, 0, "world_size must be a positive integer, got 0"),
        (0, "2", "world_size must be a positive integer, got '2'"),
        (2, 2, "rank 2 is out of range for world size 2"),
        (-1, 2, "rank -1 is out of range for world size 2"),
        (0.0, 2, "rank 0.0 is out of range for world size 2"),
    ],
)
def test_rank_and_world(rank: Any, world: Any, message: str):
    _refused(message, ONE, rank, world)


@pytest.mark.parametrize(
    "spares, failover, message",
    [
        (2, True, "RS_SPARE_REDUCERS=2: spares must leave at least one of the 2 reducers in use"),
        (-1, True, "RS_SPARE_REDUCERS=-1: spares must leave at least one of the 2 reducers in use"),
        (1, False, "RS_SPARE_REDUCERS=1 needs RS_FAILOVER=1: spares take a lost reducer's chunks"),
    ],
)
def test_spares(spares: int, failover: bool, message: str):
    _refused(message, TWO, 0, 1, spares=spares, failover=failover)


def test_spares_from_the_environment_need_failover_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    _setenv(monkeypatch, RS_SPARE_REDUCERS="1", RS_FAILOVER="0")
    _refused("RS_SPARE_REDUCERS=1 needs RS_FAILOVER=1: spares take a lost reducer's chunks", TWO, 0, 1)


@pytest.mark.parametrize(
    "argument, value, message",
    [
        ("pipeline_depth", 0, "pipeline_depth must be in 1..1024, got 0"),
        ("pipeline_depth", 1025, "pipeline_depth must be in 1..1024, got 1025"),
        ("window", 0, "window must be in 1..256, got 0"),
        ("window", 257, "window must be in 1..256, got 257"),
        ("send_buffer", 100, "send_buffer=100 must be `auto`, 0 (the kernel's autotuning) or 4096..1073741824 bytes"),
        ("send_buffer", "16384", "send_buffer='16384' is neither `auto` nor an integer number of bytes"),
    ],
)
def test_arguments_out_of_range(argument: str, value: Any, message: str):
    _refused(message, ONE, 0, 1, **{argument: value})


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("RS_FAILOVER", "maybe", "RS_FAILOVER='maybe' is not a switch; use 1 or 0 (true/false, yes/no, on/off)"),
        ("RS_SPARE_REDUCERS", "-1", "RS_SPARE_REDUCERS='-1' must be at least 0"),
        ("RS_CHUNK_BYTES", "10", "RS_CHUNK_BYTES='10' must be at least 64"),
        ("RS_PIPELINE_DEPTH", "deep", "RS_PIPELINE_DEPTH='deep' is not a valid int"),
        ("RS_PIPELINE_DEPTH", "1025", "RS_PIPELINE_DEPTH='1025' must be at most 1024"),
        ("RS_WINDOW", "0", "RS_WINDOW='0' must be at least 1"),
        ("RS_TIMEOUT", "0", "RS_TIMEOUT='0' must be at least 0.01"),
        ("RS_CONNECT_TIMEOUT", "soon", "RS_CONNECT_TIMEOUT='soon' is not a valid float"),
        ("RS_IO_THREADS", "0", "RS_IO_THREADS='0' must be at least 1"),
        ("RS_ENCRYPT", "maybe", "RS_ENCRYPT='maybe' is not a switch; use 1 or 0 (true/false, yes/no, on/off)"),
        ("RS_SHM", "maybe", "RS_SHM='maybe' is not a switch; use 1 or 0 (true/false, yes/no, on/off)"),
        ("RS_SNDBUF", "100", "RS_SNDBUF=100 must be `auto`, 0 (the kernel's autotuning) or 4096..1073741824 bytes"),
        ("RS_SNDBUF", "16k", "RS_SNDBUF='16k' is not a valid int"),
        ("RS_HEARTBEAT_INTERVAL", "0", "RS_HEARTBEAT_INTERVAL='0' must be at least 0.01"),
        ("RS_LIVENESS_TIMEOUT", "0", "RS_LIVENESS_TIMEOUT='0' must be at least 0.05"),
    ],
)
def test_variables_out_of_range(monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str):
    monkeypatch.setenv(variable, value)
    _refused(message, ONE, 0, 1)


def test_encryption_needs_a_token(monkeypatch: pytest.MonkeyPatch):
    message = "RS_ENCRYPT=1 needs RS_JOB_TOKEN: the CurveZMQ keys are derived from the job token"
    _refused(message, ONE, 0, 1, job_token="", encrypt=True)
    monkeypatch.setenv("RS_ENCRYPT", "1")
    _refused(message, ONE, 0, 1)


def test_the_first_wrong_setting_is_the_one_named(monkeypatch: pytest.MonkeyPatch):
    """Reducers, then rank and world, then the rest in the Communicator's order of arguments."""
    monkeypatch.setenv("RS_WINDOW", "0")
    _refused("no reducers given (reducers=[...] or RS_REDUCERS)", [], 5, 1, pipeline_depth=0)
    _refused("rank 5 is out of range for world size 1", ONE, 5, 1, pipeline_depth=0)
    _refused("pipeline_depth must be in 1..1024, got 0", ONE, 0, 1, pipeline_depth=0)
    _refused("RS_WINDOW='0' must be at least 1", ONE, 0, 1)
