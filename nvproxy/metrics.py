# -*- test-case-name: tests.test_accounting -*-
"""
Prometheus metrics, served at C{GET /metrics} on the admin listener.

One L{Metrics} per process, on its own registry (never the global one, so
tests and several instances do not collide).  Per-request updates happen in
the job observer (L{RequestMetrics}), a handful of times per request and
never per chunk.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import attrs
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
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


class _Value:
    """A counter's or gauge's series: a float, no lock (one thread)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


class _Buckets:
    """A histogram's series: a count per bucket (the last is C{+Inf}), a sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        # The first bucket whose upper bound is >= amount ("le").
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.sum += amount


_S = TypeVar("_S", _Value, _Buckets)


class _Family(Generic[_S]):
    """
    A labelled metric updated on the request path.  prometheus_client's
    own take a lock, check their state and (histograms) walk every bucket
    on each update: 5 % of a request's instructions for a dozen updates.
    These are plain fields, exposed through L{_Families} at scrape time in
    the same text (without the client's C{_created} series).
    """

    def __init__(
        self,
        kind: str,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        new: Callable[[], _S],
    ) -> None:
        self.kind = kind
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._new: Callable[[], _S] = new
        self.series: dict[tuple[str, ...], _S] = {}

    def labels(self, *values: str) -> _S:
        found = self.series.get(values)
        if found is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
            key = tuple(str(v) for v in values)  # as the client converts them
            found = self.series.get(key)
            if found is None:
                found = self.series[key] = self._new()
        return found


def _counter(
    name: str, documentation: str, labelnames: Sequence[str]
) -> _Family[_Value]:
    return _Family("counter", name, documentation, labelnames, _Value)


def _gauge(name: str, documentation: str, labelnames: Sequence[str]) -> _Family[_Value]:
    return _Family("gauge", name, documentation, labelnames, _Value)


def _histogram(
    name: str,
    documentation: str,
    labelnames: Sequence[str],
    buckets: tuple[float, ...],
) -> _Family[_Buckets]:
    return _Family(
        "histogram", name, documentation, labelnames, lambda: _Buckets(buckets)
    )


class _Families(Collector):
    """Exposes L{_Family} metrics, in the order given, series in creation order."""

    def __init__(self, families: Sequence[_Family[Any]]) -> None:
        self._families = families

    def describe(self) -> list[Metric]:
        return [self._family(family, False) for family in self._families]

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield self._family(family, True)

    def _family(self, family: _Family[Any], samples: bool) -> Metric:
        labels = family.labelnames
        out: Metric
        if family.kind == "histogram":
            histogram = HistogramMetricFamily(
                family.name, family.documentation, labels=labels
            )
            for values, series in family.series.items() if samples else ():
                bounds = [*map(floatToGoString, series._bounds), "+Inf"]
                total, cumulative = 0.0, []
                for bound, count in zip(bounds, series.counts, strict=True):
                    total += count
                    cumulative.append((bound, total))
                histogram.add_metric(list(values), cumulative, series.sum)
            return histogram
        maker = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
        out = maker(family.name, family.documentation, labels=labels)
        for values, series in family.series.items() if samples else ():
            out.add_metric(list(values), series.value)
        return out


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
        self.requests = _counter(
            "nvproxy_requests",
            "Requests finished, by engine, route class, outcome, model, node and"
            " API key name",
            ["engine", "route", "outcome", "model", "node", "key"],
        )
        self.attempts = _counter(
            "nvproxy_dispatch_attempts",
            "Upstream dispatches started",
            ["engine"],
        )
        self.failovers = _counter(
            "nvproxy_failovers",
            "Dispatches after the first one of a request",
            ["engine"],
        )
        self.upstream_errors = _counter(
            "nvproxy_upstream_errors",
            "Failed attempts by kind (status, transport, no_content, target_lost)",
            ["engine", "kind"],
        )
        self.ttfb = _histogram(
            "nvproxy_time_to_first_byte_seconds",
            "From admission to the first body byte relayed (the commit)",
            ["engine"],
            _LATENCY_BUCKETS,
        )
        self.duration = _histogram(
            "nvproxy_request_duration_seconds",
            "From admission to the end of the response",
            ["engine", "model", "node"],
            _LATENCY_BUCKETS,
        )
        self.inflight = _gauge(
            "nvproxy_inflight_requests",
            "Requests being dispatched or streamed",
            ["engine"],
        )
        self.node_inflight = _gauge(
            "nvproxy_node_inflight_requests",
            "Requests dispatched to a node and not finished, from this process",
            ["engine", "node"],
        )
        self.ttft = _histogram(
            "nvproxy_time_to_first_token_seconds",
            "From admission to the first body byte of a committed inference"
            " answer below 400",
            ["engine", "model", "node"],
            _LATENCY_BUCKETS,
        )
        self.prompt_tokens = _counter(
            "nvproxy_prompt_tokens",
            "Prompt tokens of completed inference answers, as the engine reported",
            ["engine", "model", "node"],
        )
        self.completion_tokens = _counter(
            "nvproxy_completion_tokens",
            "Completion tokens of inference answers; estimated=true when counted"
            " from stream events for want of a usage report",
            ["engine", "model", "node", "estimated"],
        )
        self.tokens_per_second = _histogram(
            "nvproxy_tokens_per_second",
            "Decode rate of an inference answer (completion tokens per second"
            " after the first one)",
            ["engine", "model", "node"],
            _TOKENS_PER_SECOND_BUCKETS,
        )
        registry.register(
            _Families(
                [
                    self.requests,
                    self.attempts,
                    self.failovers,
                    self.upstream_errors,
                    self.ttfb,
                    self.duration,
                    self.inflight,
                    self.node_inflight,
                    self.ttft,
                    self.prompt_tokens,
                    self.completion_tokens,
                    self.tokens_per_second,
                ]
            )
        )
        self._engine_children: dict[str, _EngineChildren] = {}
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
    attempts: _Value
    failovers: _Value
    inflight: _Value
    ttfb: _Buckets


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
        self._node_gauge: _Value | None = None
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
        self._node_gauge = metrics.node_inflight.labels(self._engine, node_id)
        self._node_gauge.inc()

    def between_attempts(self) -> None:
        self._leave_node()

    def committed(self, node_id: str, status: int) -> None:
        elapsed = self._clock.seconds() - self._started
        self._children.ttfb.observe(elapsed)
        self._node = node_id
        if self._model and status < 400:
            metrics = self._metrics
            metrics.ttft.labels(self._engine, self._model, node_id).observe(elapsed)

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
        metrics.requests.labels(
            engine,
            self._route,
            label,
            model,
            node,
            self._key,
        ).inc()
        elapsed = self._clock.seconds() - self._started
        metrics.duration.labels(engine, model, node).observe(elapsed)
        if stats is not None and model:
            if stats.promptTokens is not None:
                metrics.prompt_tokens.labels(engine, model, node).inc(
                    stats.promptTokens
                )
            if stats.completionTokens is not None:
                estimated = "true" if stats.estimated else "false"
                metrics.completion_tokens.labels(engine, model, node, estimated).inc(
                    stats.completionTokens
                )
            if stats.tokensPerSecond is not None:
                metrics.tokens_per_second.labels(engine, model, node).observe(
                    stats.tokensPerSecond
                )

    def _leave_node(self) -> None:
        gauge, self._node_gauge = self._node_gauge, None
        if gauge is not None:
            gauge.dec()
