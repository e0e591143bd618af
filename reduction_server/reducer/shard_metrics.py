"""The metrics of a sharded reducer (`serve --shards N`, reducer/shards.py) on its one metrics port.

Each shard serves its own metrics (metrics.py) on a port of the loopback that the kernel picks,
and says which when it tells its supervisor it listens. The supervisor serves RS_METRICS_PORT
itself: when Prometheus scrapes it, it reads every shard's page (all at once, within
SCRAPE_TIMEOUT_S) and serves their union, each series with a `shard` label, beside `shard_up`
and `shard_restarts_total` for each shard and its own process metrics (`shard="supervisor"`). So
a sharded reducer is one scrape target, as one process is, and no shard's page is exposed. A
shard that is down, slow, or answers something that is not a metrics page only loses its own
series for that scrape.
"""

from __future__ import annotations

import http.client
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Dict, Iterable, Iterator, List, Optional

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.process_collector import ProcessCollector

from .metrics import PREFIX, MetricsServer

#: a shard whose page has not come within this long of the scrape counts as down for that scrape
SCRAPE_TIMEOUT_S = 2.0
_MAX_READERS = 64  # threads reading shards' pages at once (one per shard, up to this)


def read_page(port: Optional[int], timeout: float = SCRAPE_TIMEOUT_S) -> Optional[List[Metric]]:
    """The metric families a shard serves on the loopback at `port`, or None when it has no page,
    does not answer, or answers something else. Straight to 127.0.0.1: never through a proxy that
    the environment (http_proxy) names."""
    if port is None:
        return None
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", "/metrics")
        reply = connection.getresponse()
        if reply.status != 200:
            return None
        return list(text_string_to_metric_families(reply.read().decode()))
    except (OSError, http.client.HTTPException, ValueError):  # ValueError: a page that does not parse
        return None
    finally:
        connection.close()


def _labelled(families: Iterable[Metric], shard: str, into: Dict[str, Metric]) -> None:
    """Add families' samples, with the label shard=`shard`, to the families of the same name in `into`."""
    for family in families:
        merged = into.get(family.name)
        if merged is None:
            merged = into[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
        merged.samples += [s._replace(labels={**s.labels, "shard": shard}) for s in family.samples]


class _ShardsCollector:
    """Every shard's series, labelled with its shard, read at scrape time (in the HTTP thread)."""

    def __init__(self, supervisor: Any) -> None:  # a shards.Supervisor: shards.py imports this module lazily
        self.supervisor = supervisor
        self.readers = ThreadPoolExecutor(
            max_workers=max(1, min(_MAX_READERS, supervisor.count)), thread_name_prefix="shard-metrics"
        )
        self.own = ProcessCollector(registry=None)

    def describe(self) -> List[Metric]:
        return []  # the names come from the shards, at scrape time: nothing for the registry to check

    def collect(self) -> Iterator[Metric]:
        index = str(self.supervisor.index)
        shards = list(self.supervisor.shards)
        # A running process's port: a dead one's may be another program's by now.
        pages = [
            self.readers.submit(read_page, s.metrics_port if s.proc is not None and s.proc.poll() is None else None)
            for s in shards
        ]
        wait(pages, timeout=SCRAPE_TIMEOUT_S)
        families: Dict[str, Metric] = {}
        up = GaugeMetricFamily(
            f"{PREFIX}_shard_up",
            "1 if the shard's process answered this scrape, else 0 (dead, restarting, or slower than 2 s).",
            labels=["reducer", "shard"],
        )
        restarts = CounterMetricFamily(
            f"{PREFIX}_shard_restarts",
            "Times the supervisor tried to start the shard again after it died.",
            labels=["reducer", "shard"],
        )
        for shard, page in zip(shards, pages):
            got = page.result() if page.done() and page.exception() is None else None
            number = str(shard.number)
            up.add_metric([index, number], 0 if got is None else 1)
            restarts.add_metric([index, number], shard.restarts)
            _labelled(got or [], number, families)
        _labelled(self.own.collect(), "supervisor", families)
        yield from families.values()
        yield up
        yield restarts

    def close(self) -> None:
        self.readers.shutdown(wait=False, cancel_futures=True)


class ShardMetrics(MetricsServer):
    """The supervisor's metrics server: its shards' metrics on one port."""

    def __init__(self, supervisor: Any) -> None:
        super().__init__(CollectorRegistry())
        self.collector = _ShardsCollector(supervisor)
        self.registry.register(self.collector)

    def stop(self) -> None:
        super().stop()
        self.collector.close()
