"""
Metrics by model and node (TTFT, duration, tokens, tokens/s, in-flight per
node, vLLM service state), checked on the exposition after scripted traffic
through a whole nvproxy on a L{MemoryNetwork}.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.dispatch import JobOutcome
from nvproxy.inferstats import Stats
from nvproxy.metrics import OTHER_MODEL, VLLM_STATES, Metrics
from nvproxy.testing.fakeengine import Behaviour
from nvproxy.testing.harness import facade_url
from tests.test_forwarding import MemoryProxyTestCase

Samples = dict[str, list[tuple[dict[str, str], float]]]


def samples(text: str) -> Samples:
    """Every sample of an exposition, by sample name."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(found: Samples, name: str, **labels: str) -> float | None:
    """The value of the one sample of C{name} whose labels include C{labels}."""
    matching = [
        v
        for have, v in found.get(name, [])
        if all(have.get(k) == want for k, want in labels.items())
    ]
    if not matching:
        return None
    assert len(matching) == 1, (name, labels, matching)
    return matching[0]


def families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


class TrafficMetricsTests(MemoryProxyTestCase):
    def scrape(self, proxy: Any) -> str:
        admin = f"http://127.0.0.1:{proxy.admin.bound_port()}"
        code, _headers, body = self.get(admin + "/metrics")
        self.assertEqual(code, 200)
        text: str = body.decode()
        return text

    def test_model_and_node_labels(self) -> None:
        """
        A completed inference request is counted with its model and the node
        that served it; TTFT, duration, tokens and tokens/s carry the same
        labels, from the same stats as the terminal workload event.
        """
        fake = self.engine("openai", ["m"])
        fake.default = Behaviour(chunks=4)
        proxy = self.proxy({"lmstudio": fake.url}, admin=True)
        code, _h, _b = self.post(
            facade_url(proxy, "lmstudio") + "/v1/chat/completions",
            {"model": "m", "messages": []},
        )
        self.assertEqual(code, 200)
        found = samples(self.scrape(proxy))
        labels = {"engine": "lmstudio", "model": "m", "node": "local"}
        self.assertEqual(
            value(
                found,
                "nvproxy_requests_total",
                route="inference",
                outcome="completed",
                **labels,
            ),
            1.0,
        )
        self.assertEqual(
            value(found, "nvproxy_time_to_first_token_seconds_count", **labels), 1.0
        )
        self.assertEqual(
            value(found, "nvproxy_request_duration_seconds_count", **labels), 1.0
        )
        stats = proxy.ops.recent_workloads(1)[0]["workloadInfo"]["stats"]
        self.assertEqual(
            value(found, "nvproxy_prompt_tokens_total", **labels),
            float(stats["promptTokens"]),
        )
        estimated = "true" if stats.get("estimated") else "false"
        self.assertEqual(
            value(
                found, "nvproxy_completion_tokens_total", estimated=estimated, **labels
            ),
            float(stats["completionTokens"]),
        )
        if "tokensPerSecond" in stats:
            self.assertEqual(
                value(found, "nvproxy_tokens_per_second_count", **labels), 1.0
            )
            self.assertAlmostEqual(
                value(found, "nvproxy_tokens_per_second_sum", **labels) or 0.0,
                stats["tokensPerSecond"],
                places=3,
            )
        # Nothing in flight once the answer was read.
        self.assertEqual(
            value(
                found, "nvproxy_node_inflight_requests", engine="lmstudio", node="local"
            ),
            0.0,
        )
        self.assertEqual(value(found, "nvproxy_reservations", node="local"), 0.0)

    def test_unknown_model_is_other(self) -> None:
        """
        A model no node advertises is counted as C{model="other"}: a client
        sending random names cannot add series.
        """
        fake = self.engine("openai", ["m"])
        proxy = self.proxy({"lmstudio": fake.url}, admin=True)
        url = facade_url(proxy, "lmstudio") + "/v1/chat/completions"
        for n in range(5):
            self.post(url, {"model": f"random-{n}", "messages": []})
        found = samples(self.scrape(proxy))
        models = {labels["model"] for labels, _v in found["nvproxy_requests_total"]}
        self.assertEqual(models, {OTHER_MODEL})
        self.assertEqual(
            value(
                found,
                "nvproxy_requests_total",
                engine="lmstudio",
                model=OTHER_MODEL,
            ),
            5.0,
        )

    def test_inflight_per_node(self) -> None:
        """
        A request being streamed counts in flight against its node, and
        stops counting when it ends.
        """
        fake = self.engine("openai", ["m"])
        fake.default = Behaviour(latency=5.0)
        proxy = self.proxy({"lmstudio": fake.url}, admin=True)
        d = self.start_post(
            facade_url(proxy, "lmstudio") + "/v1/chat/completions",
            {"model": "m", "messages": []},
        )
        self.net.advance(1.0)
        admin = f"http://127.0.0.1:{proxy.admin.bound_port()}/metrics"
        scrape = self.request("GET", admin)
        self.net.advance(0.01)
        _c, _h, body = self.successResultOf(scrape)
        found = samples(body.decode())
        self.assertEqual(
            value(
                found, "nvproxy_node_inflight_requests", engine="lmstudio", node="local"
            ),
            1.0,
        )
        self.drive(d)
        found = samples(self.scrape(proxy))
        self.assertEqual(
            value(
                found, "nvproxy_node_inflight_requests", engine="lmstudio", node="local"
            ),
            0.0,
        )


class _Outcome:
    def __init__(self, state: str, reason: str | None = None) -> None:
        self.state = state
        self.reason = reason
        self.status = 200


class MetricFamilyTests(SynchronousTestCase):
    """
    nvproxy's lock-free request metrics expose what prometheus_client's own
    Counter, Gauge and Histogram do for the same updates (less the
    client's C{_created} series).
    """

    def exposition(self, registry: CollectorRegistry) -> list[str]:
        return [
            line
            for line in generate_latest(registry).decode().splitlines()
            if "_created" not in line
        ]

    def test_same_text_as_prometheus_client(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        from nvproxy import metrics

        buckets = (0.005, 0.5, 1.0, 60.0)
        theirs, ours = CollectorRegistry(), CollectorRegistry()
        counter = Counter("c", "A counter", ["a", "b"], registry=theirs)
        gauge = Gauge("g", "A gauge", ["a"], registry=theirs)
        histogram = Histogram(
            "h", "A histogram", ["a"], buckets=buckets, registry=theirs
        )
        fast_counter = metrics._counter("c", "A counter", ["a", "b"])
        fast_gauge = metrics._gauge("g", "A gauge", ["a"])
        fast_histogram = metrics._histogram("h", "A histogram", ["a"], buckets)
        ours.register(metrics._Families([fast_counter, fast_gauge, fast_histogram]))
        self.assertEqual(self.exposition(ours), self.exposition(theirs))  # empty
        for labels, amount in ((("x", "y"), 1.0), (("x", "z"), 2.5), (("x", "y"), 3.0)):
            counter.labels(*labels).inc(amount)
            fast_counter.labels(*labels).inc(amount)
        for label, up, down in (("x", 3, 1), ("y", 1, 1)):
            for _ in range(up):
                gauge.labels(label).inc()
                fast_gauge.labels(label).inc()
            for _ in range(down):
                gauge.labels(label).dec()
                fast_gauge.labels(label).dec()
        # On a bound, between bounds, below the first, above the last.
        for label, amount in (("x", 0.005), ("x", 0.7), ("y", 0.0), ("x", 61.0)):
            histogram.labels(label).observe(amount)
            fast_histogram.labels(label).observe(amount)
        self.assertEqual(self.exposition(ours), self.exposition(theirs))

    def test_labels_converted_to_text(self) -> None:
        """
        Label values are text, as the client makes them: a number names the
        same series as its text, every time.
        """
        from nvproxy import metrics

        family = metrics._counter("c", "A counter", ["a"])
        for _ in range(2):
            family.labels(2).inc()  # type: ignore[arg-type]
        family.labels("2").inc()
        self.assertEqual({k: v.value for k, v in family.series.items()}, {("2",): 3.0})

    def test_wrong_label_count_refused(self) -> None:
        from nvproxy import metrics

        family = metrics._counter("c", "A counter", ["a", "b"])
        self.assertRaises(ValueError, family.labels, "x")
        self.assertEqual(family.series, {})


class MetricsUnitTests(SynchronousTestCase):
    def test_estimated_label(self) -> None:
        """
        Completion tokens counted from stream events are labelled
        C{estimated="true"}, reported ones C{"false"}.
        """
        registry = CollectorRegistry()
        metrics = Metrics(registry, known_model=lambda e, m: m == "m")
        clock = Clock()
        for estimated in (True, False):
            observer = metrics.observer(clock, "ollama", "inference", "m")
            observer.dispatching("n1", 1)
            clock.advance(0.5)
            observer.committed("n1", 200)
            clock.advance(1.5)
            stats = Stats(10, 20, 12.5, 500, estimated=estimated)
            outcome: Any = _Outcome("completed")
            observer.finished(outcome, stats)
        found = samples(generate_latest(registry).decode())
        for flag in ("true", "false"):
            self.assertEqual(
                value(
                    found,
                    "nvproxy_completion_tokens_total",
                    model="m",
                    node="n1",
                    estimated=flag,
                ),
                20.0,
            )
        self.assertEqual(
            value(found, "nvproxy_prompt_tokens_total", model="m", node="n1"), 20.0
        )
        self.assertEqual(
            value(found, "nvproxy_time_to_first_token_seconds_sum", model="m"), 1.0
        )
        self.assertEqual(
            value(found, "nvproxy_request_duration_seconds_sum", model="m"), 4.0
        )

    def test_no_known_models_means_other(self) -> None:
        metrics = Metrics(CollectorRegistry())
        self.assertEqual(metrics.model_label("ollama", "m"), OTHER_MODEL)
        self.assertEqual(metrics.model_label("ollama", None), "")

    def test_error_answer_has_no_ttft(self) -> None:
        """
        A committed error answer is not a first token.
        """
        registry = CollectorRegistry()
        metrics = Metrics(registry, known_model=lambda e, m: True)
        observer = metrics.observer(Clock(), "ollama", "inference", "m")
        observer.dispatching("n1", 1)
        observer.committed("n1", 500)
        observer.finished(JobOutcome("failed", 500, "n1", 1, None))
        found = samples(generate_latest(registry).decode())
        self.assertIsNone(
            value(found, "nvproxy_time_to_first_token_seconds_count", model="m")
        )
        self.assertEqual(
            value(
                found, "nvproxy_requests_total", model="m", node="n1", outcome="failed"
            ),
            1.0,
        )

    def test_vllm_service_state(self) -> None:
        """
        One series per service and state; the current state's is 1.
        """
        registry = CollectorRegistry()
        services = [{"name": "text", "state": "asleep"}]
        Metrics(registry, vllm_services=lambda: services)
        found = samples(generate_latest(registry).decode())
        series = {
            labels["state"]: v
            for labels, v in found["nvproxy_vllm_service_state"]
            if labels["service"] == "text"
        }
        self.assertEqual(set(series), set(VLLM_STATES))
        self.assertEqual({s for s, v in series.items() if v == 1}, {"asleep"})
        services[0] = {"name": "text", "state": "waking"}
        found = samples(generate_latest(registry).decode())
        self.assertEqual(
            value(found, "nvproxy_vllm_service_state", service="text", state="waking"),
            1.0,
        )
