"""Prometheus metrics of one reducer, served over HTTP when `--metrics-port` / RS_METRICS_PORT is set.

The reducer's loop is one Python thread that handles every chunk, so its counters are plain
integer attributes of the Reducer and its rooms (bytes, rounds, admissions), bumped for the stop summary
whether or not metrics are served, and read here only when Prometheus scrapes: a scrape costs
the loop nothing. The timings (kernel time, round latency, per-rank arrival lag) are observed
only when metrics are on, into plain lists that this module turns into Prometheus histograms
and summaries at scrape time: about a microsecond per contribution.

Every reducer has its own CollectorRegistry (never the process-global one), so several reducers
in one process, and tests, do not clash; every series carries a `reducer` label with its index.

The same port answers the probes of an orchestrator (Kubernetes' httpGet probes): HEALTH_PATH
says the process is alive (200 whenever it answers at all), READY_PATH says it serves: 200 once
it listens, 503 with the reason while it starts, while a shard is down, or once it stops.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from itertools import accumulate
from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.process_collector import ProcessCollector

from ..errors import ConfigError

PREFIX = "reduction_server"
#: the probes' paths on the metrics port: alive, and ready to serve workers
HEALTH_PATH, READY_PATH = "/healthz", "/readyz"
# One contribution folded into an accumulator: 64 KiB takes microseconds, 64 MiB about 10 ms.
KERNEL_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25)
# A round, first contribution to result sent: from sub-millisecond to RS_TIMEOUT.
LATENCY_BUCKETS = (
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


class _ReducerCollector:
    """Counters and gauges read from the reducer's own attributes at scrape time.

    Runs in the HTTP server's thread while the reducer's loop mutates its dicts: list() over a
    dict's values is one C-level call under the GIL, so it never sees a dict change size."""

    def __init__(self, reducer: Any) -> None:  # a reducer.Reducer: the reducer imports this module, not back
        self.reducer = reducer
        self.label = str(reducer.index)

    def collect(self) -> Iterator[Metric]:
        r, label = self.reducer, [self.label]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["reducer"])
            family.add_metric(label, value)
            return family

        def gauge(
            name: str, doc: str, samples: List[Tuple[List[str], float]], extra: Tuple[str, ...] = ()
        ) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["reducer", *extra])
            for values, value in samples:
                family.add_metric(label + values, value)
            return family

        yield counter(
            "received_bytes", "Payload bytes of chunk contributions (DATA) received from workers.", r.bytes_in
        )
        yield counter("sent_bytes", "Payload bytes of reduced chunks (RESULT) sent to workers.", r.rounds.bytes_out)
        yield counter(
            "shared_memory_bytes",
            "Of the received and sent bytes, those that went through "
            "shared-memory slots of workers on this host (DATA_SHM, RESULT_SHM, RESULT_SHARED).",
            r.bytes_shared,
        )
        yield counter(
            "shared_results",
            "Results sent to workers on this host as one result slot that several of "
            "them read, written once (RESULT_SHARED): one per worker told.",
            r.rounds.delivery.results_shared,
        )
        yield counter(
            "rounds_completed",
            "Rounds completed: one chunk of one collective, summed over every rank and sent back to all of them.",
            r.rounds.completed,
        )
        failed = CounterMetricFamily(
            f"{PREFIX}_rounds_failed",
            "Rounds failed, by error code (every rank of a failed round gets an ERROR naming the cause).",
            labels=["reducer", "code"],
        )
        for code, count in sorted(r.rounds.failed_codes.items()):
            failed.add_metric([self.label, code], count)
        yield failed
        rounds = list(r.rounds.rounds.values())
        yield gauge(
            "rounds_in_flight",
            "Rounds that have contributions but not yet all of them.",
            [([], sum(1 for rnd in rounds if rnd.error is None))],
        )
        pool = r.pool
        yield gauge(
            "accumulator_bytes",
            "Accumulator memory: in_use (lent to rounds or being sent), held "
            "(received frames kept: adopted as accumulators, or for a rank-ordered fold), "
            "free (kept for reuse).",
            [(["in_use"], pool.in_use_bytes), (["held"], pool.held_bytes), (["free"], pool.free_bytes)],
            extra=("state",),
        )
        yield gauge(
            "accumulator_budget_bytes", "Accumulator memory limit (RS_MAX_ACCUMULATOR_BYTES).", [([], pool.max_bytes)]
        )
        yield gauge(
            "peers_connected",
            "Workers admitted and connected now.",
            [([], sum(1 for peer in list(r.peers.values()) if peer.admitted))],
        )
        yield counter(
            "peers_admitted", "Handshakes completed (a worker that reconnects counts again).", r.admission.admissions
        )


class _Histogram:
    """Bucket counts and a sum, observed by the reducer's loop (their only writer) without a lock:
    prometheus_client's Histogram takes a lock per observation, several microseconds a chunk."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # Prometheus buckets are `le`: inclusive
        self.total += value

    def family(self, name: str, doc: str, label: str) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.total  # one consistent copy: count == +Inf bucket
        buckets = [(repr(bound), count) for bound, count in zip(self.bounds, accumulate(counts))]
        buckets.append(("+Inf", sum(counts)))
        family = HistogramMetricFamily(f"{PREFIX}_{name}", doc, labels=["reducer"])
        family.add_metric([label], buckets, total)
        return family


class MetricsServer:
    """A registry served at http://HOST:PORT/metrics from a daemon thread, beside the probes.

    `not_ready` says why the process does not serve workers now (a line for READY_PATH's 503),
    or None when it does; the process sets it once it knows (until then: starting)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.not_ready: Callable[[], Optional[str]] = lambda: "starting"
        self._server: Optional[WSGIServer] = None

    def serve(self, host: str, port: int) -> int:
        """Start serving (port 0: one the kernel picks); the port served. ConfigError when it is taken."""
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port} (--metrics-port / RS_METRICS_PORT): {exc}"
            ) from None
        self._server.set_app(self._with_probes(self._server.get_app()))
        return self._server.server_port

    def _with_probes(self, metrics: Callable) -> Callable:
        """The WSGI app that answers the probes' paths and hands every other to `metrics`."""

        def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path not in (HEALTH_PATH, READY_PATH):
                return metrics(environ, start_response)
            why = None if path == HEALTH_PATH else self.not_ready()
            start_response("200 OK" if why is None else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [f"{'not ready: ' + why if why else 'ok'}\n".encode()]

        return app

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class ReducerMetrics(MetricsServer):
    """The timings the reducer observes when metrics are on, and the registry they are served from."""

    def __init__(self, reducer: Any) -> None:  # a reducer.Reducer
        self.kernel = _Histogram(KERNEL_BUCKETS)
        self.latency = _Histogram(LATENCY_BUCKETS)
        self.lag_count: List[int] = []  # by rank
        self.lag_sum: List[float] = []
        super().__init__(CollectorRegistry())
        self.registry.register(_ReducerCollector(reducer))
        self.registry.register(self)
        ProcessCollector(registry=self.registry)  # CPU seconds, resident memory, open fds
        self._label = str(reducer.index)

    def contributed(self, rank: int, started: float, arrived: float) -> None:
        """A contribution of `rank` that arrived at `arrived` (time.monotonic()) and has just been
        folded, to a round whose first contribution arrived at `started`."""
        self.kernel.observe(time.monotonic() - arrived)
        if rank >= len(self.lag_count):
            grow = rank + 1 - len(self.lag_count)
            self.lag_count += [0] * grow
            self.lag_sum += [0.0] * grow
        self.lag_count[rank] += 1
        self.lag_sum[rank] += arrived - started

    def finished(self, started: float) -> None:
        """A round whose first contribution arrived at `started` has sent its result."""
        self.latency.observe(time.monotonic() - started)

    def collect(self) -> Iterator[Metric]:
        yield self.kernel.family(
            "reduce_seconds",
            "Time in the native kernel per contribution (loading the first unless it is adopted, summing the others).",
            self._label,
        )
        yield self.latency.family(
            "round_latency_seconds", "Round latency: first contribution received to result sent.", self._label
        )
        lag = SummaryMetricFamily(
            f"{PREFIX}_arrival_lag_seconds",
            "How long after a round's first "
            "contribution each rank's contribution arrived (a straggler has the "
            "largest mean).",
            labels=["reducer", "rank"],
        )
        for rank, (count, total) in enumerate(zip(list(self.lag_count), list(self.lag_sum))):
            if count:
                lag.add_metric([self._label, str(rank)], count_value=count, sum_value=total)
        yield lag
