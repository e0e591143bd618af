"""How `serve` resolves a reducer's settings (reduction_server/reducer/options.py), in this
process and without starting a reducer: argument > discovered place > environment > default, and
each ConfigError in the words `serve` prints.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import pytest

from helpers.cluster_specs import vertex
from reduction_server.config import settings
from reduction_server.errors import ConfigError
from reduction_server.reducer.options import ReducerConfig
from reduction_server.reducer.shards import usable_cores


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No variable of the registry set (the suite's conftest sets RS_SHARDS=1, a developer's shell
    may set others): each test sets those it is about."""
    for variable in settings.VARIABLES:
        monkeypatch.delenv(variable.name, raising=False)
    # Most tests resolve the default host, 0.0.0.0, without a token: allowed explicitly here, and
    # refused in the tests of that refusal (which unset it).
    monkeypatch.setenv("RS_ALLOW_NO_TOKEN", "1")
    yield


def test_defaults_without_arguments_or_environment():
    config = ReducerConfig.resolve()
    assert (config.host, config.port, config.index, config.workers) == ("0.0.0.0", 0, 0, None)
    assert (config.token, config.deterministic, config.encrypt, config.metrics_port) == ("", False, False, 0)
    assert config.shards == min(usable_cores(), settings.MAX_SHARDS) and config.shard is None
    assert config.max_chunk_bytes == settings.DEFAULT_MAX_CHUNK_BYTES
    assert config.max_accumulator_bytes == settings.DEFAULT_MAX_ACCUMULATOR_BYTES // config.shards
    assert (config.max_peer_bytes, config.max_rounds) == (settings.DEFAULT_MAX_PEER_BYTES, settings.DEFAULT_MAX_ROUNDS)
    assert (config.round_timeout, config.heartbeat_interval, config.liveness_timeout) == (
        settings.DEFAULT_TIMEOUT,
        settings.DEFAULT_HEARTBEAT_INTERVAL,
        settings.DEFAULT_LIVENESS_TIMEOUT,
    )
    assert config.sndbuf == settings.SNDBUF_AUTO


def test_the_environment_wins_over_the_defaults(monkeypatch: pytest.MonkeyPatch):
    for name, value in {
        "RS_WORLD_SIZE": "6",
        "RS_JOB_TOKEN": "secret",
        "RS_DETERMINISTIC": "1",
        "RS_METRICS_PORT": "9100",
        "RS_SHARDS": "2",
        "RS_MAX_CHUNK_BYTES": str(1 << 20),
        "RS_MAX_ACCUMULATOR_BYTES": str(8 << 20),
        "RS_MAX_PEER_BYTES": str(4 << 20),
        "RS_MAX_ROUNDS": "7",
        "RS_TIMEOUT": "12",
        "RS_HEARTBEAT_INTERVAL": "0.5",
        "RS_LIVENESS_TIMEOUT": "3",
        "RS_SNDBUF": "0",
        "RS_SHM": "0",
    }.items():
        monkeypatch.setenv(name, value)
    config = ReducerConfig.resolve()
    assert (config.workers, config.token, config.deterministic, config.metrics_port) == (6, "secret", True, 9100)
    assert (config.shards, config.max_chunk_bytes, config.max_accumulator_bytes) == (2, 1 << 20, 4 << 20)
    assert (config.max_peer_bytes, config.max_rounds, config.round_timeout) == (4 << 20, 7, 12.0)
    assert (config.heartbeat_interval, config.liveness_timeout, config.sndbuf, config.shared) == (0.5, 3.0, 0, False)


def test_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch):
    for name, value in {
        "RS_WORLD_SIZE": "6",
        "RS_DETERMINISTIC": "1",
        "RS_METRICS_PORT": "9100",
        "RS_SHARDS": "4",
    }.items():
        monkeypatch.setenv(name, value)
    config = ReducerConfig.resolve(
        host="127.0.0.1", port=5555, index=2, workers=3, deterministic=False, metrics_port=0, shards="2", shard=1
    )
    assert (config.host, config.port, config.index, config.workers) == ("127.0.0.1", 5555, 2, 3)
    assert (config.deterministic, config.metrics_port, config.shards, config.shard) == (False, 0, 2, 1)


def test_the_discovered_place_fills_in_what_the_arguments_leave_out(monkeypatch: pytest.MonkeyPatch):
    for name, value in vertex("workerpool2", 1, RS_BIND_HOST="10.1.2.3").items():
        monkeypatch.setenv(name, value)
    config = ReducerConfig.resolve(shards=1)
    # The spec's second reducer, its port, and its three worker hosts.
    assert (config.host, config.port, config.index, config.workers) == ("10.1.2.3", 2222, 1, 3)
    config = ReducerConfig.resolve(host="127.0.0.1", port=5555, shards=1)
    assert (config.host, config.port, config.index, config.workers) == ("127.0.0.1", 5555, 1, 3)


def test_with_host_port_and_index_given_the_place_is_not_discovered(monkeypatch: pytest.MonkeyPatch):
    # A shard is started by its supervisor with all three: it does not read the spec again (its
    # world size then comes from RS_WORLD_SIZE or --workers alone).
    monkeypatch.setenv("RS_REDUCER_INDEX", "5")  # and no RS_REDUCERS: discovery would fail
    config = ReducerConfig.resolve(host="127.0.0.1", port=5555, index=0, shards=1)
    assert (config.index, config.workers) == (0, None)


def test_the_healthcheck_probes_where_serve_listens(monkeypatch: pytest.MonkeyPatch):
    """The image's healthcheck (Dockerfile) asks listening_address(): the discovered place, or,
    with no index anywhere, this reducer's own entry in RS_REDUCERS."""
    from reduction_server.reducer.options import listening_address

    for name, value in vertex("workerpool2", 1, RS_BIND_HOST="10.1.2.3").items():
        monkeypatch.setenv(name, value)
    assert listening_address() == ("10.1.2.3", 2222)
    for name in ("CLUSTER_SPEC", "RS_BIND_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RS_REDUCERS", "198.18.0.1:7001,127.0.0.1:7002")  # only the second is this host's
    assert listening_address() == ("0.0.0.0", 7002)


def test_a_sharded_reducer_supervises_and_its_shards_serve():
    supervisor = ReducerConfig.resolve(shards=2)
    assert supervisor.supervises and supervisor.shard_number == 0
    assert not ReducerConfig.resolve(shards=1).supervises
    shard = ReducerConfig.resolve(shards=2, shard=1)
    assert not shard.supervises and shard.shard_number == 1


def test_the_config_is_frozen():
    config = ReducerConfig.resolve(shards=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]


# --- what is refused, in serve's words ----------------------------------------------------------


@pytest.mark.parametrize("port", [-1, 65536])
def test_a_metrics_port_argument_outside_the_port_range(port: int):
    with pytest.raises(ConfigError, match=f"^--metrics-port {port} is outside 0-65535$"):
        ReducerConfig.resolve(metrics_port=port, shards=1)


def test_a_metrics_port_variable_outside_the_port_range(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RS_METRICS_PORT", "70000")
    with pytest.raises(ConfigError, match="^RS_METRICS_PORT='70000' must be at most 65535$"):
        ReducerConfig.resolve(shards=1)


@pytest.mark.parametrize("shard", [2, -1])
def test_a_shard_that_is_not_one_of_the_shards(shard: int):
    with pytest.raises(ConfigError, match=rf"^--shard {shard} is not one of the 2 shards \(0\.\.1\)$"):
        ReducerConfig.resolve(shards=2, shard=shard)


@pytest.mark.parametrize(
    "shards, words",
    [
        ("0", "--shards='0' must be `auto` or 1..256"),
        ("lots", "--shards='lots' is neither `auto` nor a number of shards"),
    ],
)
def test_a_bad_shard_count_argument(shards: str, words: str):
    with pytest.raises(ConfigError, match=f"^{words}$"):
        ReducerConfig.resolve(shards=shards)


def test_a_bad_shard_count_variable_names_the_variable(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RS_SHARDS", "0")
    with pytest.raises(ConfigError, match="^RS_SHARDS='0' must be `auto` or 1..256$"):
        ReducerConfig.resolve()


def test_an_accumulator_budget_that_the_shards_cut_below_one_chunk(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RS_MAX_CHUNK_BYTES", str(1 << 20))
    monkeypatch.setenv("RS_MAX_ACCUMULATOR_BYTES", str(3 << 19))  # 1.5 chunks: 0.75 each for 2 shards
    with pytest.raises(ConfigError) as caught:
        ReducerConfig.resolve(shards=2)
    assert str(caught.value) == (
        f"RS_MAX_ACCUMULATOR_BYTES shared by 2 shards leaves each {3 << 18} bytes, less than "
        f"one chunk (RS_MAX_CHUNK_BYTES={1 << 20}): raise it, or run fewer shards "
        "(--shards, RS_SHARDS)"
    )
    # One process, or a budget under one chunk even unshared, is left to refuse each chunk instead.
    assert ReducerConfig.resolve(shards=1).max_accumulator_bytes == 3 << 19
    monkeypatch.setenv("RS_MAX_ACCUMULATOR_BYTES", str(1 << 19))
    assert ReducerConfig.resolve(shards=2).max_accumulator_bytes == 1 << 18


def test_encryption_without_a_token(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RS_ENCRYPT", "1")
    with pytest.raises(ConfigError, match="^RS_ENCRYPT=1 needs RS_JOB_TOKEN: the CurveZMQ keys are derived"):
        ReducerConfig.resolve(shards=1)
    monkeypatch.setenv("RS_JOB_TOKEN", "secret")
    assert ReducerConfig.resolve(shards=1).encrypt


def test_a_bad_switch_names_its_variable(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RS_DETERMINISTIC", "sometimes")
    with pytest.raises(ConfigError, match="^RS_DETERMINISTIC='sometimes' is not a switch"):
        ReducerConfig.resolve(shards=1)
    assert ReducerConfig.resolve(deterministic=True, shards=1).deterministic  # the argument: the variable unread


def test_the_first_bad_setting_is_the_one_named(monkeypatch: pytest.MonkeyPatch):
    # Resolution stops at the first error, in serve's order: the metrics port before the shards.
    monkeypatch.setenv("RS_SHARDS", "lots")
    with pytest.raises(ConfigError, match="^--metrics-port 70000"):
        ReducerConfig.resolve(metrics_port=70000)


# --- no token beyond the loopback (issue 39) ----------------------------------------------------

_REFUSED = (
    r"^refusing to listen on {host} without a job token: .* set RS_JOB_TOKEN .* "
    r"--insecure-no-token \(RS_ALLOW_NO_TOKEN=1\)$"
)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "reducer-0.example", "eth0"])
def test_no_token_beyond_the_loopback_is_refused(monkeypatch: pytest.MonkeyPatch, host: str):
    monkeypatch.delenv("RS_ALLOW_NO_TOKEN")
    with pytest.raises(ConfigError, match=_REFUSED.format(host=host.replace(".", r"\."))):
        ReducerConfig.resolve(host=host, port=5555, index=0, shards=1)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "localhost"])
def test_no_token_on_the_loopback_is_allowed(monkeypatch: pytest.MonkeyPatch, host: str):
    monkeypatch.delenv("RS_ALLOW_NO_TOKEN")
    assert ReducerConfig.resolve(host=host, port=5555, index=0, shards=1).token == ""


def test_a_token_or_the_explicit_override_allows_it(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("RS_ALLOW_NO_TOKEN")
    assert ReducerConfig.resolve(shards=1, insecure_no_token=True).token == ""
    monkeypatch.setenv("RS_ALLOW_NO_TOKEN", "1")
    assert ReducerConfig.resolve(shards=1).host == "0.0.0.0"
    with pytest.raises(ConfigError, match="^refusing to listen on 0"):  # the argument wins
        ReducerConfig.resolve(shards=1, insecure_no_token=False)
    monkeypatch.delenv("RS_ALLOW_NO_TOKEN")
    monkeypatch.setenv("RS_JOB_TOKEN", "secret")
    assert ReducerConfig.resolve(shards=1).token == "secret"


def test_a_shard_leaves_the_check_to_its_supervisor(monkeypatch: pytest.MonkeyPatch):
    """The supervisor was told (--insecure-no-token); its shards are started without the flag."""
    monkeypatch.delenv("RS_ALLOW_NO_TOKEN")
    assert ReducerConfig.resolve(host="0.0.0.0", port=5555, index=0, shards=2, shard=1).shard == 1
