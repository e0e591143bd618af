"""A reducer's Prometheus metrics, scraped over HTTP as Prometheus would, and its probes."""

from __future__ import annotations

import http.client
import urllib.request
from typing import Dict, Tuple

from prometheus_client.parser import text_string_to_metric_families

Samples = Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the loopback, whatever http_proxy says


def scrape(port: int) -> Samples:
    with _DIRECT.open(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"reducer": "0", **labels}.items())))
    assert key in samples, f"{name}{labels} not scraped; have {sorted(n for n, _ in samples)}"
    return samples[key]


def probe(port: int, path: str) -> tuple:
    """(status, body) of GET `path` (/readyz, /healthz) on the loopback at `port`, never through a proxy."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        reply = connection.getresponse()
        return reply.status, reply.read().decode()
    finally:
        connection.close()
