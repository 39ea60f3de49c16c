# -*- test-case-name: tests.test_accounting -*-
"""
Prometheus metrics, served at C{GET /metrics} on the admin listener.

One L{Metrics} per process, on its own registry (never the global one, so
tests and several instances do not collide).  Per-request updates happen in
the job observer (L{RequestMetrics}), a handful of times per request and
never per chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.internet.interfaces import IReactorTime

from nvproxy.dispatch import JobOutcome
from nvproxy.inferstats import Stats
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

_TOKENS_PER_SECOND_BUCKETS = (
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
)

OTHER_MODEL = "other"
"""The C{model} label of a model no node advertises (bounds cardinality)."""

VLLM_STATES = ("unknown", "awake", "asleep", "waking", "sleeping", "down", "stopped")
"""Every value of the C{state} label of C{nvproxy_vllm_service_state}."""

KnownModel = Callable[[str, str], bool]
"""(engine, model) -> whether some node advertises the model."""


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


class _ServiceStates(Collector):
    """
    One series per vLLM service and state, the current one 1, read from the
    services' status at scrape time.
    """

    def __init__(self, services: Callable[[], Sequence[Mapping[str, Any]]]) -> None:
        self._services = services

    def collect(self) -> Any:
        family = GaugeMetricFamily(
            "nvproxy_vllm_service_state",
            "A vLLM service's state: the series of the current state is 1",
            labels=["service", "state"],
        )
        for service in self._services():
            name = str(service["name"])
            current = service["state"]
            for state in VLLM_STATES:
                family.add_metric([name, state], 1 if state == current else 0)
        yield family


class Metrics:
    """
    Every nvproxy metric.

    @param known_model: whether some node advertises a model for an engine;
        any other name is counted as C{model="other"}.  Without it every
        model is C{other}.
    @param vllm_services: this node's vLLM services' status (the
        C{nvproxy_vllm_service_state} gauge), if it has any.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        reservations: Callable[[], Mapping[str, int]] | None = None,
        outliers: OutlierTable | None = None,
        known_model: KnownModel | None = None,
        vllm_services: Callable[[], Sequence[Mapping[str, Any]]] | None = None,
    ) -> None:
        self.registry = registry
        self._known_model = known_model
        self.requests = Counter(
            "nvproxy_requests",
            "Requests finished, by engine, route class, outcome, model, node and"
            " API key name",
            ["engine", "route", "outcome", "model", "node", "key"],
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
            ["engine", "model", "node"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.inflight = Gauge(
            "nvproxy_inflight_requests",
            "Requests being dispatched or streamed",
            ["engine"],
            registry=registry,
        )
        self.node_inflight = Gauge(
            "nvproxy_node_inflight_requests",
            "Requests dispatched to a node and not finished, from this process",
            ["engine", "node"],
            registry=registry,
        )
        self.ttft = Histogram(
            "nvproxy_time_to_first_token_seconds",
            "From admission to the first body byte of a committed inference"
            " answer below 400",
            ["engine", "model", "node"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "nvproxy_prompt_tokens",
            "Prompt tokens of completed inference answers, as the engine reported",
            ["engine", "model", "node"],
            registry=registry,
        )
        self.completion_tokens = Counter(
            "nvproxy_completion_tokens",
            "Completion tokens of inference answers; estimated=true when counted"
            " from stream events for want of a usage report",
            ["engine", "model", "node", "estimated"],
            registry=registry,
        )
        self.tokens_per_second = Histogram(
            "nvproxy_tokens_per_second",
            "Decode rate of an inference answer (completion tokens per second"
            " after the first one)",
            ["engine", "model", "node"],
            buckets=_TOKENS_PER_SECOND_BUCKETS,
            registry=registry,
        )
        self._engine_children: dict[str, _EngineChildren] = {}
        self._labelled: dict[tuple[int, tuple[str, ...]], Any] = {}
        if reservations is not None:
            registry.register(_Reservations(reservations))
        if outliers is not None:
            registry.register(_Ejections(outliers))
        if vllm_services is not None:
            registry.register(_ServiceStates(vllm_services))

    def model_label(self, engine: str, model: str | None) -> str:
        """
        The C{model} label of a request: C{""} without a model, the name if
        some node advertises it, else L{OTHER_MODEL}.
        """
        if model is None:
            return ""
        known = self._known_model
        if known is not None and known(engine, model):
            return model
        return OTHER_MODEL

    def engine_children(self, engine: str) -> _EngineChildren:
        """The per-engine children, made once per engine."""
        children = self._engine_children.get(engine)
        if children is None:
            children = _EngineChildren(
                attempts=self.attempts.labels(engine),
                failovers=self.failovers.labels(engine),
                inflight=self.inflight.labels(engine),
                ttfb=self.ttfb.labels(engine),
            )
            self._engine_children[engine] = children
        return children

    def child(self, metric: Any, *labels: str) -> Any:
        """
        C{metric.labels(*labels)}, looked up once per label set: the
        client's own lookup validates and converts every label on every
        call, several times per request.
        """
        key = (id(metric), labels)
        found = self._labelled.get(key)
        if found is None:
            found = self._labelled[key] = metric.labels(*labels)
        return found

    def observer(
        self,
        clock: IReactorTime,
        engine: str,
        route: str,
        model: str | None = None,
        key: str | None = None,
    ) -> RequestMetrics:
        return RequestMetrics(
            self, clock, engine, route, self.model_label(engine, model), key
        )


@attrs.frozen
class _EngineChildren:
    attempts: Any
    failovers: Any
    inflight: Any
    ttfb: Any


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
        model: str = "",
        key: str | None = None,
    ) -> None:
        self._metrics = metrics
        self._key = key or ""
        self._clock = clock
        self._engine = engine
        self._route = route
        self._model = model
        self._children = metrics.engine_children(engine)
        self._started = clock.seconds()
        self._dispatches = 0
        self._node = ""
        self._node_gauge: Any = None
        self._children.inflight.inc()

    @property
    def node(self) -> str:
        """The node of the last dispatch (C{""} before the first)."""
        return self._node

    def admitted(self) -> None:
        pass

    def dispatching(self, node_id: str, attempt: int) -> None:
        self._dispatches += 1
        self._children.attempts.inc()
        if self._dispatches > 1:
            self._children.failovers.inc()
        self._leave_node()
        self._node = node_id
        metrics = self._metrics
        self._node_gauge = metrics.child(metrics.node_inflight, self._engine, node_id)
        self._node_gauge.inc()

    def between_attempts(self) -> None:
        self._leave_node()

    def committed(self, node_id: str, status: int) -> None:
        elapsed = self._clock.seconds() - self._started
        self._children.ttfb.observe(elapsed)
        self._node = node_id
        if self._model and status < 400:
            metrics = self._metrics
            metrics.child(metrics.ttft, self._engine, self._model, node_id).observe(
                elapsed
            )

    def failed_attempt(self, kind: str) -> None:
        self._metrics.upstream_errors.labels(self._engine, kind).inc()

    def finished(self, outcome: JobOutcome, stats: Stats | None = None) -> None:
        """
        The request ended; C{stats} are the terminal workload event's (the
        same numbers reach both).
        """
        metrics = self._metrics
        self._children.inflight.dec()
        self._leave_node()
        engine, model, node = self._engine, self._model, self._node
        # A committed stream cut short is its own outcome (its workload
        # state stays "completed", spec §1.1).
        label = "truncated" if outcome.reason == "truncated" else outcome.state
        metrics.child(
            metrics.requests,
            engine,
            self._route,
            label,
            model,
            node,
            self._key,
        ).inc()
        elapsed = self._clock.seconds() - self._started
        metrics.child(metrics.duration, engine, model, node).observe(elapsed)
        if stats is not None and model:
            if stats.promptTokens is not None:
                metrics.child(metrics.prompt_tokens, engine, model, node).inc(
                    stats.promptTokens
                )
            if stats.completionTokens is not None:
                estimated = "true" if stats.estimated else "false"
                metrics.child(
                    metrics.completion_tokens, engine, model, node, estimated
                ).inc(stats.completionTokens)
            if stats.tokensPerSecond is not None:
                metrics.child(metrics.tokens_per_second, engine, model, node).observe(
                    stats.tokensPerSecond
                )

    def _leave_node(self) -> None:
        gauge, self._node_gauge = self._node_gauge, None
        if gauge is not None:
            gauge.dec()
