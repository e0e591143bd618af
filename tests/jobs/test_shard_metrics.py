"""A sharded reducer's one metrics port (reduction_server/reducer/shard_metrics.py), against stand-in
shards: real metrics pages beside a shard that is dead, one that never answers, one that answers
something that is not HTTP, and one whose page stops halfway. Every page that can be read is
served, labelled with its shard; every other shard is down for that scrape, and nothing else is
lost. The whole path with real shard processes is in test_shards.py."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from typing import Iterator, List, Optional

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from helpers.metrics import scrape, value
from reduction_server.reducer.shard_metrics import ShardMetrics, read_page

pytestmark = pytest.mark.timeout(60)


@dataclass
class _Proc:
    code: Optional[int] = None  # None: running

    def poll(self) -> Optional[int]:
        return self.code


@dataclass
class _Shard:
    number: int
    metrics_port: Optional[int]
    proc: _Proc
    restarts: int = 0


@dataclass
class _Supervisor:
    index: int
    shards: List[_Shard]

    @property
    def count(self) -> int:
        return len(self.shards)


def _page(received: float) -> tuple:
    """A reducer-like metrics page on the loopback: (server, port)."""
    registry = CollectorRegistry()
    Counter("reduction_server_received_bytes", "bytes", ["reducer"], registry=registry).labels("0").inc(received)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    return server, server.server_port


def _listener(answer: Optional[bytes]) -> tuple:
    """A TCP listener that sends `answer` to each connection and closes it (None: says nothing,
    holds it open)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    held: List[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.recv(4096)
            if answer is None:
                held.append(conn)
            else:
                conn.sendall(answer)
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return sock, held


@pytest.fixture
def stand_ins() -> Iterator[_Supervisor]:
    good = [_page(1000.0), _page(2000.0)]
    garbage, _ = _listener(b"not a metrics page at all\r\n\r\n")
    cut, _ = _listener(b"HTTP/1.0 200 OK\r\nContent-Length: 1000\r\n\r\n# HELP x y\n")
    silent, held = _listener(None)
    dead = _page(5.0)
    shards = [
        _Shard(0, good[0][1], _Proc()),
        _Shard(1, good[1][1], _Proc(), restarts=2),
        _Shard(2, garbage.getsockname()[1], _Proc()),
        _Shard(3, cut.getsockname()[1], _Proc()),
        _Shard(4, silent.getsockname()[1], _Proc()),
        _Shard(5, None, _Proc()),
        _Shard(6, dead[1], _Proc(code=-9)),
    ]  # its page still answers: its port is not its own now
    try:
        yield _Supervisor(3, shards)
    finally:
        for server, _ in [*good, dead]:
            server.shutdown()
            server.server_close()
        for sock in (garbage, cut, silent, *held):
            sock.close()


def test_every_readable_shard_is_served_with_its_label_and_the_rest_are_down(stand_ins, monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # a proxy that is not there: never used
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    metrics = ShardMetrics(stand_ins)
    port = metrics.serve("127.0.0.1", 0)
    try:
        samples = scrape(port)
    finally:
        metrics.stop()
    received = {s: value(samples, "reduction_server_received_bytes_total", reducer="0", shard=str(s)) for s in (0, 1)}
    assert received == {0: 1000.0, 1: 2000.0}
    assert not [
        key
        for key in samples
        if dict(key[1]).get("shard") in ("2", "3", "4", "5", "6") and not key[0].startswith("reduction_server_shard_")
    ], "a down shard's series were served"
    up = {s: value(samples, "reduction_server_shard_up", reducer="3", shard=str(s)) for s in range(7)}
    assert up == {0: 1, 1: 1, 2: 0, 3: 0, 4: 0, 5: 0, 6: 0}
    assert value(samples, "reduction_server_shard_restarts_total", reducer="3", shard="1") == 2
    assert samples[("process_cpu_seconds_total", (("shard", "supervisor"),))] > 0  # its own, labelled


def test_a_page_is_read_only_from_a_port_that_serves_one(stand_ins):
    good, garbage, cut = (s.metrics_port for s in stand_ins.shards[:1] + stand_ins.shards[2:4])
    assert "reduction_server_received_bytes" in [f.name for f in read_page(good)]
    assert read_page(garbage) is None and read_page(cut) is None and read_page(None) is None
