# -*- test-case-name: tests.test_accounting -*-
"""
Prometheus metrics, served at C{GET /metrics} on the admin listener.

One L{Metrics} per process, on its own registry (never the global one, so
tests and several instances do not collide).  Per-request updates happen in
the job observer (L{RequestMetrics}), a handful of times per request and
never per chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.internet.interfaces import IReactorTime

from nvproxy.dispatch import JobOutcome
from nvproxy.outliers import OutlierTable

_LATENCY_BUCKETS = (
    0.005,
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
    180.0,
    600.0,
    1800.0,
)


class _Reservations(Collector):
    def __init__(self, loads: Callable[[], Mapping[str, int]]) -> None:
        self._loads = loads

    def collect(self) -> Any:
        family = GaugeMetricFamily(
            "nvproxy_reservations",
            "In-flight dispatches this process counts against each node (spec §6)",
            labels=["node"],
        )
        for node, count in sorted(self._loads().items()):
            family.add_metric([node], count)
        yield family


class _Ejections(Collector):
    """
    Outlier ejection, read from the table at scrape time (an ejection ends
    by time passing, with no event to update a gauge on).
    """

    def __init__(self, outliers: OutlierTable) -> None:
        self._outliers = outliers

    def collect(self) -> Any:
        ejected = GaugeMetricFamily(
            "nvproxy_node_ejected",
            "Whether a node's engine is ejected now (ordered last after a"
            " transport failure)",
            labels=["engine", "node"],
        )
        ejections = CounterMetricFamily(
            "nvproxy_node_ejections",
            "Times a node's engine was ejected after a transport failure",
            labels=["engine", "node"],
        )
        now = {(e.engine, e.node) for e in self._outliers.ejected()}
        for (engine, node), total in sorted(self._outliers.totals().items()):
            ejected.add_metric([engine, node], 1 if (engine, node) in now else 0)
            ejections.add_metric([engine, node], total)
        yield ejected
        yield ejections


class Metrics:
    """
    Every nvproxy metric.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        reservations: Callable[[], Mapping[str, int]] | None = None,
        outliers: OutlierTable | None = None,
    ) -> None:
        self.registry = registry
        self.requests = Counter(
            "nvproxy_requests",
            "Requests finished, by engine, route class, outcome and API key name",
            ["engine", "route", "outcome", "key"],
            registry=registry,
        )
        self.attempts = Counter(
            "nvproxy_dispatch_attempts",
            "Upstream dispatches started",
            ["engine"],
            registry=registry,
        )
        self.failovers = Counter(
            "nvproxy_failovers",
            "Dispatches after the first one of a request",
            ["engine"],
            registry=registry,
        )
        self.upstream_errors = Counter(
            "nvproxy_upstream_errors",
            "Failed attempts by kind (status, transport, no_content, target_lost)",
            ["engine", "kind"],
            registry=registry,
        )
        self.ttfb = Histogram(
            "nvproxy_time_to_first_byte_seconds",
            "From admission to the first body byte relayed (the commit)",
            ["engine"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "nvproxy_request_duration_seconds",
            "From admission to the end of the response",
            ["engine"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.inflight = Gauge(
            "nvproxy_inflight_requests",
            "Requests being dispatched or streamed",
            ["engine"],
            registry=registry,
        )
        if reservations is not None:
            registry.register(_Reservations(reservations))
        if outliers is not None:
            registry.register(_Ejections(outliers))

    def observer(
        self, clock: IReactorTime, engine: str, route: str, key: str | None = None
    ) -> RequestMetrics:
        return RequestMetrics(self, clock, engine, route, key)


class RequestMetrics:
    """
    A job observer feeding L{Metrics} for one request.
    """

    def __init__(
        self,
        metrics: Metrics,
        clock: IReactorTime,
        engine: str,
        route: str,
        key: str | None = None,
    ) -> None:
        self._metrics = metrics
        self._key = key or ""
        self._clock = clock
        self._engine = engine
        self._route = route
        self._started = clock.seconds()
        self._dispatches = 0
        metrics.inflight.labels(engine).inc()

    def admitted(self) -> None:
        pass

    def dispatching(self, node_id: str, attempt: int) -> None:
        self._dispatches += 1
        self._metrics.attempts.labels(self._engine).inc()
        if self._dispatches > 1:
            self._metrics.failovers.labels(self._engine).inc()

    def between_attempts(self) -> None:
        pass

    def committed(self, node_id: str, status: int) -> None:
        elapsed = self._clock.seconds() - self._started
        self._metrics.ttfb.labels(self._engine).observe(elapsed)

    def failed_attempt(self, kind: str) -> None:
        self._metrics.upstream_errors.labels(self._engine, kind).inc()

    def finished(self, outcome: JobOutcome) -> None:
        metrics = self._metrics
        metrics.inflight.labels(self._engine).dec()
        # A committed stream cut short is its own outcome (its workload
        # state stays "completed", spec §1.1).
        label = "truncated" if outcome.reason == "truncated" else outcome.state
        metrics.requests.labels(self._engine, self._route, label, self._key).inc()
        elapsed = self._clock.seconds() - self._started
        metrics.duration.labels(self._engine).observe(elapsed)
