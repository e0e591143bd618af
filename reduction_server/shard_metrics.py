"""The metrics of a sharded reducer (`serve --shards N`, reducer/shards.py) on its one metrics port.

Each shard serves its own metrics (metrics.py) on a port of the loopback that the kernel picks,
and says which when it tells its supervisor it listens. The supervisor serves RS_METRICS_PORT
itself: when Prometheus scrapes it, it reads every shard's page and serves their union, each
series with a `shard` label, beside `shard_up` and `shard_restarts_total` for each shard. So a
sharded reducer is one scrape target, as one process is, and no shard's page is exposed.
"""
from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any, Dict, Iterator, List, Optional

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from .metrics import PREFIX, MetricsServer

#: a shard that does not answer a scrape within this long counts as down for that scrape
SCRAPE_TIMEOUT_S = 2.0


def _page(port: Optional[int]) -> Optional[str]:
    """A shard's metrics page, or None when it has none or does not answer."""
    if port is None:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as reply:
            return reply.read().decode()
    except (OSError, urllib.error.URLError, ValueError):
        return None


class _ShardsCollector:
    """Every shard's series, labelled with its shard, read at scrape time (in the HTTP thread)."""

    def __init__(self, supervisor: Any) -> None:  # a shards.Supervisor: shards.py imports this module lazily
        self.supervisor = supervisor

    def describe(self) -> List[Metric]:
        return []  # the names come from the shards, at scrape time: nothing for the registry to check

    def collect(self) -> Iterator[Metric]:
        index = str(self.supervisor.index)
        families: Dict[str, Metric] = {}
        up = GaugeMetricFamily(f"{PREFIX}_shard_up", "1 if the shard's process answered this scrape, else 0 "
                               "(dead, restarting or too slow).", labels=["reducer", "shard"])
        restarts = CounterMetricFamily(f"{PREFIX}_shard_restarts", "Times the supervisor started the shard "
                                       "again after it died.", labels=["reducer", "shard"])
        for shard in list(self.supervisor.shards):
            running = shard.proc is not None and shard.proc.poll() is None
            page = _page(shard.metrics_port) if running else None
            number = str(shard.number)
            up.add_metric([index, number], 0 if page is None else 1)
            restarts.add_metric([index, number], shard.restarts)
            for family in text_string_to_metric_families(page or ""):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                merged.samples += [s._replace(labels={**s.labels, "shard": number}) for s in family.samples]
        yield from families.values()
        yield up
        yield restarts


class ShardMetrics(MetricsServer):
    """The supervisor's metrics server: its shards' metrics on one port."""

    def __init__(self, supervisor: Any) -> None:
        super().__init__(CollectorRegistry(auto_describe=True))
        self.registry.register(_ShardsCollector(supervisor))
