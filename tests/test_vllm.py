# -*- test-case-name: tests.test_vllm -*-
"""
Tests for L{nvproxy.vllm}: the registry, the per-service wake/sleep machine
driven against L{FakeVLLM} over C{StubTreq} on a C{Clock}, the waking
dispatch target and the admin routes (FD §10 cases 1-15 as far as they are
about the backend).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import treq
from prometheus_client import CollectorRegistry
from treq.testing import StubTreq
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest
from zope.interface import implementer

from nvproxy.config import VllmHold, VllmServiceConfig
from nvproxy.dispatch import AttemptFailed, Committed, FailureKind, StreamEnd
from nvproxy.testing.fakevllm import EngineState, FakeVLLM
from nvproxy.vllm import (
    STATE_FILE,
    Depth,
    ManagerStopped,
    ModelRequired,
    Refused,
    UnknownModel,
    UnknownService,
    VllmManager,
    VllmRegistry,
    WakeFailed,
    Waking,
    WakingTarget,
    waking_503_body,
)
from nvproxy.vllm._client import BadAnswer, NoAnswer, SleepApiClient
from nvproxy.vllm._poll import Observed, parse_sleep_state

TEXT = VllmServiceConfig(
    name="text",
    url="http://text.test:8001",
    model="Qwen3.6-35B-A3B-FP8",
    aliases=("qwen3.6-35b-a3b-fp8", "qwen"),
    default_for=("/v1/chat/completions", "/v1/completions"),
    idle_sleep=60,
    idle_offload=180,
)
OCR = VllmServiceConfig(
    name="ocr",
    url="http://ocr.test:8002",
    model="OvisOCR2",
    default_for=("multipart:/v1/chat/completions",),
    idle_sleep=0,
    idle_offload=0,
)
EMBED = VllmServiceConfig(
    name="embed",
    url="http://embed.test:8003/",
    model="Qwen3-Embedding-8B",
    default_for=("/v1/embeddings",),
    idle_sleep=0,
    idle_offload=0,
)
SERVICES = (TEXT, OCR, EMBED)
HOSTS = {"text": b"text.test", "ocr": b"ocr.test", "embed": b"embed.test"}
PATHS = {"text": "/v1/chat/completions", "ocr": "/v1/chat/completions"}
PATHS["embed"] = "/v1/embeddings"

CHECK = ("GET", "/is_sleeping")
WAKE = [
    ("GET", "/is_sleeping"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"),
    ("GET", "/health"),
]

# a retried wake that got past /wake_up: it is awake, the reload is pending
RELOAD = [
    ("GET", "/is_sleeping"),
    ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"),
    ("GET", "/health"),
]


class RegistryTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.registry = VllmRegistry(SERVICES)

    def test_model_and_alias_case_insensitive(self) -> None:
        resolve = self.registry.resolve
        path = "/v1/chat/completions"
        self.assertIs(resolve("Qwen3.6-35B-A3B-FP8", path, False), TEXT)
        self.assertIs(resolve("QWEN3.6-35b-a3b-fp8", path, False), TEXT)
        self.assertIs(resolve("Qwen", path, False), TEXT)
        self.assertIs(resolve("ovisocr2", path, True), OCR)

    def test_unknown_model(self) -> None:
        with self.assertRaises(UnknownModel) as caught:
            self.registry.resolve("gpt-4", "/v1/chat/completions", False)
        self.assertEqual(caught.exception.model, "gpt-4")

    def test_defaults(self) -> None:
        resolve = self.registry.resolve
        self.assertIs(resolve(None, "/v1/chat/completions", False), TEXT)
        self.assertIs(resolve("", "/v1/completions", False), TEXT)
        # FD §6.2 step 1: multipart chat without a model is the OCR service
        self.assertIs(resolve(None, "/v1/chat/completions", True), OCR)
        self.assertIs(resolve(None, "/v1/completions", True), TEXT)
        with self.assertRaises(ModelRequired) as caught:
            resolve(None, "/v1/rerank", False)
        self.assertEqual(caught.exception.path, "/v1/rerank")

    def test_embeddings_regardless_of_body(self) -> None:
        resolve = self.registry.resolve
        self.assertIs(resolve(None, "/v1/embeddings", False), EMBED)
        self.assertIs(resolve("Qwen", "/v1/embeddings", False), EMBED)
        self.assertIs(resolve("nonsense", "/v1/embeddings?x=1", False), EMBED)

    def test_embeddings_without_default(self) -> None:
        registry = VllmRegistry([TEXT])
        self.assertIs(registry.resolve("qwen", "/v1/embeddings", False), TEXT)
        self.assertRaises(ModelRequired, registry.resolve, None, "/v1/embeddings", 0)

    def test_models(self) -> None:
        self.assertEqual(
            [m["id"] for m in self.registry.models()],
            ["Qwen3.6-35B-A3B-FP8", "OvisOCR2", "Qwen3-Embedding-8B"],
        )
        self.assertEqual(self.registry.models(7)[0]["created"], 7)
        self.assertEqual(self.registry.models()[0]["object"], "model")

    def test_unknown_service(self) -> None:
        self.assertRaises(UnknownService, self.registry.service, "nope")
        self.assertIs(self.registry.service("embed"), EMBED)


@implementer(IResource)
class _Hosts:
    """Routes each request to the fake named by its Host header."""

    isLeaf: ClassVar[bool] = True

    def __init__(self, fakes: dict[bytes, FakeVLLM]) -> None:
        self.fakes = fakes
        self.gated: set[str] = set()
        """Paths whose requests wait for L{release} (an answer in flight)."""
        self.waiting: list[Any] = []

    def getChildWithDefault(self, name: bytes, request: IRequest) -> IResource:
        return self

    def putChild(self, path: bytes, child: IResource) -> None:
        raise NotImplementedError()

    def render(self, request: Any) -> Any:
        if request.path.decode() in self.gated:
            self.waiting.append(request)
            return NOT_DONE_YET
        fake = self.fakes[request.getRequestHostname()]
        return fake.resource().render(request)

    def release(self) -> None:
        """Let the gated requests through now."""
        self.gated.clear()
        waiting, self.waiting = self.waiting, []
        for request in waiting:
            self.fakes[request.getRequestHostname()].resource().render(request)


class _Client:
    """The part of L{nvproxy.proxy.attempt.ClientSide} the waking target uses."""

    def __init__(self) -> None:
        self.request = DummyRequest([b""])
        self.gone = False


class _StubAttempt:
    """An inner attempt: the inference request sent to a fake over StubTreq."""

    def __init__(self, case: _Harness, name: str, body: dict[str, Any]) -> None:
        self.result: Deferred[Committed | AttemptFailed] = Deferred()
        self.done: Deferred[StreamEnd] = Deferred()
        self.body = b""
        self.committed_at: float | None = None
        self._case = case
        url = "http://" + HOSTS[name].decode() + ":1" + PATHS[name]
        stub: Any = case.stub
        self._d: Deferred[Any] = stub.post(url, json=body, unbuffered=True)
        self._d.addCallbacks(self._response, self._failed)

    def _failed(self, failure: Failure) -> None:
        if not self.result.called:
            self.result.callback(AttemptFailed("node", FailureKind.TRANSPORT))

    def _response(self, response: Any) -> None:
        self.committed_at = self._case.clock.seconds()
        self.result.callback(Committed("node", response.code, self.done))
        collect: Deferred[bytes] = treq.content(response)

        def got(body: bytes) -> None:
            self.body = body
            self.done.callback(StreamEnd.COMPLETE)

        collect.addCallbacks(got, lambda f: self.done.callback(StreamEnd.TRUNCATED))

    def cancel(self) -> None:
        self._d.cancel()

    def abort(self) -> None:
        self._d.cancel()


class _StubTarget:
    node_id = "node"

    def __init__(self, case: _Harness, name: str, body: dict[str, Any]) -> None:
        self.case = case
        self.name = name
        self.body = body
        self.attempts: list[_StubAttempt] = []

    def start(self, final: bool) -> _StubAttempt:
        attempt = _StubAttempt(self.case, self.name, self.body)
        self.attempts.append(attempt)
        return attempt


class _Budget(dict[str, int]):
    """
    Scripted answers that stop after 200 lookups: a busy loop against them
    fails its test instead of hanging it.
    """

    lookups = 0

    def get(self, key: str, default: Any = None) -> Any:
        self.lookups += 1
        if self.lookups > 200:
            return default
        return super().get(key, default)


class _Harness(SynchronousTestCase):
    """Fakes for every service on one Clock, reached through one StubTreq."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.fakes = {
            s.name: FakeVLLM(clock=self.clock, model=s.model) for s in SERVICES
        }
        self.hosts = _Hosts({HOSTS[name]: fake for name, fake in self.fakes.items()})
        self.stub = StubTreq(self.hosts)
        self.state_dir = self.mktemp()
        self.managers: list[VllmManager] = []
        self.addCleanup(self._no_leftovers)

    def manager(
        self,
        services: tuple[VllmServiceConfig, ...] = SERVICES,
        hold: VllmHold | None = None,
        start: bool = True,
        keep_checks: bool = False,
        **kwargs: Any,
    ) -> VllmManager:
        self.metrics = CollectorRegistry()
        manager = VllmManager(
            services,
            hold or VllmHold(),
            self.stub,  # type: ignore[arg-type]
            self.clock,
            self.state_dir,
            metrics=self.metrics,
            **kwargs,
        )
        self.managers.append(manager)
        before = {name: len(fake.calls) for name, fake in self.fakes.items()}
        if start:
            manager.startService()
        self.pump()
        if not keep_checks:
            # the startup check (one GET /is_sleeping) is tested on its own
            for name, fake in self.fakes.items():
                new = [(m, p) for _, m, p in fake.calls[before[name] :]]
                if new == [CHECK]:
                    del fake.calls[before[name] :]
        return manager

    def _no_leftovers(self) -> None:
        for manager in self.managers:
            if manager.running:
                manager.stopService()
        self.pump()
        for fake in self.fakes.values():
            self.assertEqual(fake.violations, [])
            fake.stop()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def pump(self) -> None:
        for _ in range(30):
            self.stub.flush()

    def advance(self, seconds: float, step: float = 0.25) -> None:
        while seconds > 1e-9:
            dt = min(step, seconds)
            self.clock.advance(dt)
            self.pump()
            seconds -= dt

    def control(self, name: str) -> list[tuple[str, str]]:
        """The sleep-API calls a fake saw, in order."""
        return [
            (method, path.split("?")[0] if path.startswith("/is_") else path)
            for _, method, path in self.fakes[name].calls
            if not path.startswith("/v1/")
        ]

    def inference(self, name: str) -> list[float]:
        return [t for t, _, path in self.fakes[name].calls if path.startswith("/v1/")]

    def target(
        self,
        manager: VllmManager,
        name: str = "text",
        stream: bool = False,
    ) -> tuple[WakingTarget, _StubTarget, _Client]:
        body: dict[str, Any] = {"model": self.fakes[name].model}
        if name == "embed":
            body["input"] = "hello"
        else:
            body["messages"] = [{"role": "user", "content": "hi"}]
            body["stream"] = stream
        inner = _StubTarget(self, name, body)
        client = _Client()
        return WakingTarget(inner, manager, name, client), inner, client  # type: ignore[arg-type]

    def serve(self, manager: VllmManager, name: str = "text") -> Committed:
        """One request through a waking target, to its end."""
        target, inner, _ = self.target(manager, name)
        attempt = target.start(final=True)
        self.pump()
        result = self.successResultOf(attempt.result)
        assert isinstance(result, Committed)
        self.pump()
        self.assertEqual(self.successResultOf(result.done), StreamEnd.COMPLETE)
        return result


class WakeTests(_Harness):
    def test_all_asleep_request_wakes_then_served(self) -> None:
        """
        FD §10 case 1: the wake sequence runs in order, and the request
        reaches the engine only after /health answers 200.
        """
        for fake in self.fakes.values():
            fake.force_sleep(1)
        text = self.fakes["text"]
        text.wake_latency = 2.0
        text.health_delay = 1.0
        manager = self.manager()
        target, inner, _ = self.target(manager)
        attempt = target.start(final=True)
        self.pump()
        self.assertNoResult(attempt.result)
        self.assertEqual(manager.status()[0]["state"], "waking")
        self.assertEqual(manager.status()[0]["active_requests"], 1)
        self.advance(5)
        result = self.successResultOf(attempt.result)
        assert isinstance(result, Committed)
        self.assertEqual(result.status, 200)
        self.assertEqual(self.successResultOf(result.done), StreamEnd.COMPLETE)
        self.assertIn(b"fake", inner.attempts[0].body)
        control = self.control("text")
        self.assertEqual(control[:5], WAKE[:5])
        self.assertEqual(set(control[5:]), {("GET", "/health")})
        self.assertGreater(len(control), 6)  # health was polled while 503
        self.assertEqual(text.wake_sequences, 1)
        self.assertEqual(self.control("embed"), [])
        self.assertEqual(self.control("ocr"), [])
        self.assertTrue(manager.is_awake("text"))
        self.assertEqual(manager.status()[0]["active_requests"], 0)

    def test_awake_costs_no_http_per_request(self) -> None:
        """
        An awake service is checked once; then requests within the state
        TTL of each other add no control call.  After a quiet spell
        longer than the TTL the next request re-checks once.
        """
        manager = self.manager()
        self.serve(manager)
        self.assertEqual(self.control("text"), [WAKE[0], WAKE[-1]])
        for _ in range(20):
            self.serve(manager)
            self.advance(0.5)
        self.assertEqual(self.control("text"), [WAKE[0], WAKE[-1]])
        self.assertEqual(len(self.inference("text")), 21)
        self.advance(11)  # the default state_ttl is 10 s
        self.serve(manager)
        self.assertEqual(self.control("text"), [WAKE[0], WAKE[-1]] * 2)

    def test_embed_wakes_independently(self) -> None:
        """FD §10 case 2: text awake, embed asleep: only embed is woken."""
        self.fakes["embed"].force_sleep(2)
        manager = self.manager()
        self.serve(manager, "text")
        self.serve(manager, "embed")
        self.assertEqual(self.control("text"), [WAKE[0], WAKE[-1]])
        self.assertEqual(self.control("embed"), WAKE)
        self.assertEqual(self.fakes["text"].wake_calls, 0)
        self.assertEqual(self.fakes["embed"].wake_sequences, 1)
        self.assertEqual(self.fakes["embed"].state, EngineState.AWAKE)
        self.serve(manager, "text")
        self.assertEqual(len(self.inference("text")), 2)

    def test_unknown_model_triggers_nothing(self) -> None:
        """FD §10 case 6."""
        for fake in self.fakes.values():
            fake.force_sleep(2)
        manager = self.manager()
        self.assertRaises(
            UnknownModel,
            manager.registry.resolve,
            "no-such-model",
            "/v1/chat/completions",
            False,
        )
        self.assertRaises(UnknownService, manager.ensure_awake, "no-such-service")
        self.pump()
        for fake in self.fakes.values():
            self.assertEqual(fake.calls, [])

    def test_streaming_held_until_health(self) -> None:
        """
        FD §10 case 5: a streaming request held during the wake is sent
        only after /health answers 200, then streams unbuffered.
        """
        text = self.fakes["text"]
        text.force_sleep(2)
        text.wake_latency = 4.0
        text.health_delay = 2.0
        text.chunk_interval = 0.5
        manager = self.manager()
        target, inner, _ = self.target(manager, stream=True)
        attempt = target.start(final=True)
        self.advance(5.5)
        self.assertNoResult(attempt.result)
        self.assertEqual(self.inference("text"), [])
        self.advance(1.5)
        result = self.successResultOf(attempt.result)
        assert isinstance(result, Committed)
        health = [t for t, _, p in text.calls if p == "/health"]
        sent = self.inference("text")[0]
        self.assertGreaterEqual(sent, 6.0)  # awake at 4 + 2 s health delay
        self.assertEqual(sent, health[-1])
        self.assertNoResult(result.done)  # still streaming
        self.advance(5)
        self.assertEqual(self.successResultOf(result.done), StreamEnd.COMPLETE)
        self.assertIn(b"data: [DONE]", inner.attempts[0].body)

    def test_concurrent_callers_one_wake(self) -> None:
        """FD §10 case 9: ten requests while sleeping -> one wake sequence."""
        text = self.fakes["text"]
        text.force_sleep(1)
        text.wake_latency = 3.0
        manager = self.manager()
        waits = [manager.ensure_awake("text") for _ in range(10)]
        self.pump()
        self.assertEqual(manager.status()[0]["held_requests"], 10)
        self.assertEqual(
            self.metrics.get_sample_value(
                "nvproxy_vllm_held_requests", {"service": "text"}
            ),
            10,
        )
        self.advance(4)
        for d in waits:
            self.assertIsNone(self.successResultOf(d))
        self.assertEqual(text.wake_sequences, 1)
        self.assertEqual(text.wake_calls, 1)
        self.assertEqual(self.control("text"), WAKE)
        self.assertEqual(
            self.metrics.get_sample_value(
                "nvproxy_vllm_wakes_total", {"service": "text", "depth": "offloaded"}
            ),
            1,
        )
        self.assertEqual(
            self.metrics.get_sample_value(
                "nvproxy_vllm_wake_seconds_count",
                {"service": "text", "depth": "offloaded"},
            ),
            1,
        )

    def test_two_services_waking_concurrently(self) -> None:
        """FD §10 case 13: no cross-talk between the services' wakes."""
        self.fakes["text"].force_sleep(2)
        self.fakes["text"].wake_latency = 10.0
        self.fakes["embed"].force_sleep(1)
        self.fakes["embed"].wake_latency = 2.0
        manager = self.manager()
        text = manager.ensure_awake("text")
        embed = manager.ensure_awake("embed")
        self.advance(3)
        self.successResultOf(embed)
        self.assertNoResult(text)
        self.assertEqual(manager.status()[0]["state"], "waking")
        self.assertEqual(manager.status()[2]["state"], "awake")
        self.advance(8)
        self.successResultOf(text)
        self.assertEqual(self.control("text"), WAKE)
        self.assertEqual(self.control("embed"), WAKE)
        self.assertEqual(self.fakes["text"].wake_sequences, 1)
        self.assertEqual(self.fakes["embed"].wake_sequences, 1)

    def test_failed_wake_retried_once(self) -> None:
        text = self.fakes["text"]
        text.force_sleep(1)
        text.wake_failures = 1
        manager = self.manager()
        d = manager.ensure_awake("text")
        self.advance(1)
        self.successResultOf(d)
        self.assertEqual(text.wake_sequences, 2)
        self.assertEqual(text.state, EngineState.AWAKE)

    def test_failed_wake_twice_is_an_error(self) -> None:
        """FD §6.6: retry once, then the depth-aware 503; never half-awake."""
        text = self.fakes["text"]
        text.force_sleep(2)
        text.wake_failures = 2
        manager = self.manager()
        target, inner, client = self.target(manager)
        attempt = target.start(final=True)
        self.advance(1)
        result = self.successResultOf(attempt.result)
        self.assertEqual(result, Committed("node", 503, result.done))
        self.assertEqual(inner.attempts, [])
        self.assertEqual(text.wake_sequences, 2)
        self.assertEqual(client.request.responseCode, 503)
        self.assertEqual(
            client.request.responseHeaders.getRawHeaders(b"retry-after"), [b"60"]
        )
        body = json.loads(b"".join(client.request.written))
        self.assertEqual(body["error"]["code"], "model_waking")
        self.assertEqual(body["error"]["sleep_depth"], "offloaded")
        self.assertIn("failed to wake", body["error"]["message"])
        status = manager.status()[0]
        self.assertEqual(
            (status["state"], status["sleep_depth"]), ("asleep", "unknown")
        )
        self.assertEqual(status["active_requests"], 0)
        # the next request wakes it
        self.serve(manager)
        self.assertEqual(text.wake_sequences, 3)

    def test_wake_answering_early(self) -> None:
        """
        An old vLLM answers /wake_up before it is awake: the weights are
        reloaded only once /is_sleeping says false.
        """
        text = self.fakes["text"]
        text.force_sleep(2)
        text.wake_answers_early = True
        text.wake_latency = 3.0
        manager = self.manager()
        self.serve_later = manager.ensure_awake("text")
        self.advance(4)
        self.successResultOf(self.serve_later)
        self.serve(manager)
        rpc = [t for t, _, p in text.calls if p == "/collective_rpc"]
        self.assertGreaterEqual(rpc[0], 3.0)

    def test_retry_after_failed_reload_reloads(self) -> None:
        """
        The first attempt got past /wake_up, then /collective_rpc failed:
        the retry finds the service awake and still reloads the weights
        and resets the prefix cache before anything is forwarded.
        """
        text = self.fakes["text"]
        text.force_sleep(2)
        text.rpc_failures = 1
        manager = self.manager()
        d = manager.ensure_awake("text")
        self.advance(1)
        self.successResultOf(d)
        self.serve(manager)
        self.assertEqual(self.control("text"), [*WAKE[:4], *RELOAD])
        self.assertEqual(text.wake_sequences, 1)
        self.assertEqual(len(self.inference("text")), 1)
        with open(f"{self.state_dir}/{STATE_FILE}") as f:
            saved = json.load(f)["services"]["text"]
        self.assertEqual(saved["reload_pending"], False)

    def test_attempt_bounded_by_wake_timeout(self) -> None:
        """
        Every call of an attempt gets at most what is left of the attempt's
        wake_timeout: a slow /wake_up then a stalled /collective_rpc fail
        the attempt at wake_timeout, not wake_timeout later.
        """
        text = self.fakes["text"]
        text.force_sleep(2)
        text.wake_latency = 8
        text.rpc_latency = 100
        manager = self.manager(wake_timeout=10)
        d = manager.wake("text")
        self.advance(19.5)
        self.assertNoResult(d)
        self.advance(1)
        self.failureResultOf(d, WakeFailed)
        rpc = [t for t, _, p in text.calls if p == "/collective_rpc"]
        self.assertEqual(rpc, [8.0, 10.0])
        # the next request finishes the pending reload
        text.rpc_latency = 0
        before = len(self.control("text"))
        self.serve(manager)
        self.assertEqual(self.control("text")[before:], RELOAD)


class HoldTests(_Harness):
    def _waking(self, level: int) -> tuple[Waking, Any]:
        """Slept by the manager at C{level} (depth known), woken by a request."""
        text = self.fakes["text"]
        manager = self.manager(hold=VllmHold(sleeping=1, offloaded=1, restarting=1))
        self.serve(manager)
        self.successResultOf(manager.sleep("text", level))
        text.wake_latency = 5.0
        target, inner, client = self.target(manager)
        attempt = target.start(final=True)
        d = manager.ensure_awake("text")
        self.advance(1)
        error = self.failureResultOf(d, Waking).value
        assert isinstance(error, Waking)
        result = self.successResultOf(attempt.result)
        assert isinstance(result, Committed)
        self.assertEqual(result.status, 503)
        self.assertEqual(self.successResultOf(result.done), StreamEnd.COMPLETE)
        self.assertEqual(inner.attempts, [])
        # the wake keeps going in the background
        self.assertEqual(manager.status()[0]["state"], "waking")
        self.advance(5)
        self.assertTrue(manager.is_awake("text"))
        self.assertEqual(text.wake_sequences, 1)
        return error, client.request

    def test_level1_hold(self) -> None:
        """FD §10 case 10, level 1: 503, Retry-After 10, "sleeping"."""
        error, request = self._waking(1)
        self.assertEqual((error.depth, error.retry_after), (Depth.SLEEPING, 10))
        self.assertEqual(request.responseCode, 503)
        self.assertEqual(request.responseHeaders.getRawHeaders(b"retry-after"), [b"10"])
        body = json.loads(b"".join(request.written))["error"]
        self.assertEqual(body["type"], "model_waking")
        self.assertEqual(body["code"], "model_waking")
        self.assertEqual(body["sleep_depth"], "sleeping")
        self.assertEqual(body["estimated_wake_seconds"], 5)  # 6 s default - 1 s
        self.assertEqual(
            body["message"],
            "Model 'Qwen3.6-35B-A3B-FP8' is waking from sleep; retry shortly",
        )
        self.assertEqual(
            self.metrics.get_sample_value(
                "nvproxy_vllm_waking_503_total",
                {"service": "text", "depth": "sleeping"},
            ),
            1,
        )

    def test_level2_hold(self) -> None:
        """FD §10 case 10, level 2: 503, Retry-After 60, "offloaded"."""
        error, request = self._waking(2)
        self.assertEqual((error.depth, error.retry_after), (Depth.OFFLOADED, 60))
        self.assertEqual(request.responseHeaders.getRawHeaders(b"retry-after"), [b"60"])
        body = json.loads(b"".join(request.written))["error"]
        self.assertEqual(body["sleep_depth"], "offloaded")
        self.assertEqual(body["estimated_wake_seconds"], 44)
        self.assertIn("waking from offload", body["message"])

    def test_estimate_learns(self) -> None:
        """
        The estimate moves from the FD §6.2.1 seed towards each measured
        wake of that depth: 6 + 0.3 * (5 - 6) = 5.7 s, 4.7 s left after 1 s.
        """
        self._waking(1)  # measured: 5 s
        manager = self.managers[0]
        self.successResultOf(manager.sleep("text", 1))
        d = manager.ensure_awake("text")
        self.advance(1)
        error = self.failureResultOf(d, Waking).value
        assert isinstance(error, Waking)
        self.assertEqual(error.estimated_wake_seconds, 5)
        self.advance(5)

    def test_not_final_is_retryable_status(self) -> None:
        """DESIGN §5: a depth-aware 503 is retryable elsewhere."""
        manager = self.manager()
        self.serve(manager)
        self.successResultOf(manager.sleep("text", 1))
        self.fakes["text"].wake_latency = 60
        target, inner, client = self.target(manager)
        attempt = target.start(final=False)
        self.advance(30)
        self.assertEqual(
            self.successResultOf(attempt.result),
            AttemptFailed("node", FailureKind.STATUS, 503),
        )
        self.assertEqual(client.request.written, [])
        self.assertEqual(manager.status()[0]["active_requests"], 0)
        self.advance(31)

    def test_unknown_depth_is_offloaded(self) -> None:
        """No record of the depth (first use): the offloaded hold."""
        self.fakes["text"].force_sleep(1)
        self.fakes["text"].wake_latency = 300
        manager = self.manager()
        d = manager.ensure_awake("text")
        self.advance(179.5, step=10)
        self.assertNoResult(d)
        self.advance(0.5)
        error = self.failureResultOf(d, Waking).value
        assert isinstance(error, Waking)
        self.assertEqual(error.depth, Depth.OFFLOADED)
        self.assertEqual(error.retry_after, 60)
        self.advance(121, step=5)
        self.assertTrue(manager.is_awake("text"))

    def test_cancel_and_abort_while_held(self) -> None:
        """
        Cancelling or aborting a held attempt ends the wait, not the wake;
        the active count comes back down.
        """
        self.fakes["text"].force_sleep(1)
        self.fakes["text"].wake_latency = 10
        manager = self.manager()
        target, inner, _ = self.target(manager)
        one = target.start(final=False)
        two = target.start(final=True)
        self.pump()
        self.assertEqual(manager.status()[0]["held_requests"], 2)
        one.cancel()
        self.assertEqual(
            self.successResultOf(one.result),
            AttemptFailed("node", FailureKind.TARGET_LOST),
        )
        two.abort()
        self.assertEqual(
            self.successResultOf(two.result),
            AttemptFailed("node", FailureKind.TRANSPORT),
        )
        one.abort()
        two.cancel()
        status = manager.status()[0]
        self.assertEqual((status["held_requests"], status["active_requests"]), (0, 0))
        self.assertEqual(status["state"], "waking")
        self.advance(11)
        self.assertTrue(manager.is_awake("text"))
        self.assertEqual(inner.attempts, [])

    def test_waking_503_body(self) -> None:
        error = Waking("ocr", "OvisOCR2", Depth.OFFLOADED, 45)
        self.assertEqual(
            json.loads(waking_503_body("OvisOCR2", error)),
            {
                "error": {
                    "type": "model_waking",
                    "code": "model_waking",
                    "message": "Model 'OvisOCR2' is waking from offload; retry shortly",
                    "sleep_depth": "offloaded",
                    "estimated_wake_seconds": 45,
                }
            },
        )
        failed = WakeFailed("ocr", "OvisOCR2", Depth.RESTARTING, 300)
        self.assertEqual(failed.retry_after, 600)
        self.assertEqual(
            json.loads(waking_503_body("x", failed))["error"]["sleep_depth"],
            "restarting",
        )


class DownTests(_Harness):
    def test_killed_service_holds_then_recovers(self) -> None:
        """
        FD §10 case 8: a service that is down is held for the restarting
        hold, then 503 Retry-After 600 while the wake keeps polling, and
        serves once it is back.
        """
        text = self.fakes["text"]
        text.set_down()
        manager = self.manager()
        target, inner, client = self.target(manager)
        attempt = target.start(final=True)
        self.advance(299, step=1)
        self.assertNoResult(attempt.result)
        status = manager.status()[0]
        self.assertEqual(
            (status["state"], status["sleep_depth"]), ("waking", "restarting")
        )
        self.advance(1, step=1)
        result = self.successResultOf(attempt.result)
        assert isinstance(result, Committed)
        self.assertEqual(result.status, 503)
        self.assertEqual(
            client.request.responseHeaders.getRawHeaders(b"retry-after"), [b"600"]
        )
        body = json.loads(b"".join(client.request.written))["error"]
        self.assertEqual(body["sleep_depth"], "restarting")
        self.assertEqual(
            body["message"], "Model 'Qwen3.6-35B-A3B-FP8' is restarting; retry shortly"
        )
        self.advance(100, step=1)
        self.successResultOf(text.set_up(ready_after=30))
        later = manager.ensure_awake("text")
        self.advance(29, step=1)
        self.assertNoResult(later)
        self.advance(2, step=0.5)
        self.successResultOf(later)
        self.assertEqual(text.wake_calls, 0)  # it booted awake
        self.serve(manager)

    def test_down_past_wake_timeout(self) -> None:
        """Still down at the end of the wake attempt: state down; a later
        request starts over."""
        text = self.fakes["text"]
        text.set_down()
        manager = self.manager(wake_timeout=60)
        d = manager.ensure_awake("text")
        self.advance(61, step=1)
        error = self.failureResultOf(d, WakeFailed).value
        assert isinstance(error, WakeFailed)
        self.assertEqual(error.depth, Depth.RESTARTING)
        status = manager.status()[0]
        self.assertEqual(
            (status["state"], status["sleep_depth"]), ("down", "restarting")
        )
        self.assertEqual(self.clock.getDelayedCalls(), [])
        text.set_up()
        self.serve(manager)

    def test_backend_restart(self) -> None:
        """
        FD §10 case 15 as a backend restart: a request fails at the
        transport, the next one re-checks, waits out the cold start
        (vLLM boots awake: no wake call) and is served.
        """
        text = self.fakes["text"]
        manager = self.manager()
        self.serve(manager)
        text.set_down()
        target, inner, _ = self.target(manager)
        failed = target.start(final=False)
        self.pump()
        self.assertEqual(
            self.successResultOf(failed.result),
            AttemptFailed("node", FailureKind.TRANSPORT),
        )
        target, inner, _ = self.target(manager)
        attempt = target.start(final=True)
        self.advance(60, step=1)
        self.assertNoResult(attempt.result)
        self.assertEqual(manager.status()[0]["sleep_depth"], "restarting")
        self.successResultOf(text.set_up(ready_after=20))
        self.advance(21, step=0.5)
        result = self.successResultOf(attempt.result)
        assert isinstance(result, Committed)
        self.assertEqual(result.status, 200)
        self.assertEqual(text.wake_calls, 0)
        self.pump()

    def test_host_reboot(self) -> None:
        """All services cold-start awake: unknown state, no wake calls."""
        for fake in self.fakes.values():
            fake.set_down()
        manager = self.manager()
        waits = {name: manager.ensure_awake(name) for name in self.fakes}
        self.advance(10, step=1)
        for name, fake in self.fakes.items():
            self.successResultOf(fake.set_up(ready_after=5 * len(name)))
        self.advance(30, step=0.5)
        for name in self.fakes:
            self.successResultOf(waits[name])
            self.assertEqual(self.fakes[name].wake_calls, 0)
            self.serve(manager, name)

    def test_is_sleeping_unanswered_health_ok(self) -> None:
        """
        /is_sleeping answers 503 while /health answers 200: the probe
        polls at health_poll and gives up at the deadline (retried once),
        and the failed wake leaves the depth unknown, not restarting.
        """
        text = self.fakes["text"]
        text.answer_instead = _Budget({"/is_sleeping": 503})
        manager = self.manager(wake_timeout=10)
        d = manager.ensure_awake("text")
        self.pump()
        self.assertLessEqual(len(text.calls), 4)  # no busy loop at t=0
        self.advance(21)
        error = self.failureResultOf(d, WakeFailed).value
        assert isinstance(error, WakeFailed)
        self.assertEqual(error.depth, Depth.OFFLOADED)  # /health answered
        self.assertLessEqual(len(text.calls), 2 * 2 * (10 / 0.5 + 2))
        status = manager.status()[0]
        self.assertEqual(
            (status["state"], status["sleep_depth"]), ("asleep", "unknown")
        )
        del text.answer_instead["/is_sleeping"]
        self.serve(manager)
        self.assertEqual(text.wake_calls, 0)

    def test_recheck_with_active_stream_not_down(self) -> None:
        """
        The re-check of an awake service after state_ttl fails (/health
        unreachable) while a stream runs: the held caller gets the 503, the
        service stays awake, the stream completes, the next request checks
        again.
        """
        text = self.fakes["text"]
        text.chunk_interval = 10.0  # 60 s
        manager = self.manager(wake_timeout=5)
        self.assertEqual(manager.state_ttl, 10.0)
        target, inner, _ = self.target(manager, stream=True)
        attempt = target.start(final=True)
        self.pump()
        result = self.successResultOf(attempt.result)
        assert isinstance(result, Committed)
        self.advance(15)
        text.answer_instead["/health"] = 0
        d = manager.ensure_awake("text")
        self.advance(6)
        self.failureResultOf(d, WakeFailed)
        status = manager.status()[0]
        self.assertEqual((status["state"], status["active_requests"]), ("awake", 1))
        self.assertTrue(manager.is_awake("text"))
        self.advance(50)
        self.assertEqual(self.successResultOf(result.done), StreamEnd.COMPLETE)
        del text.answer_instead["/health"]
        text.chunk_interval = 0
        self.advance(11)
        before = len(self.control("text"))
        self.serve(manager)
        self.assertEqual(self.control("text")[before:], [WAKE[0], WAKE[-1]])


class IdleTests(_Harness):
    def test_tiers_and_auto_wake(self) -> None:
        """
        FD §10 case 4 with shortened timers: level 1 after idle_sleep,
        level 2 after idle_offload, auto-wake from both.
        """
        text = self.fakes["text"]
        manager = self.manager()
        self.serve(manager)
        self.advance(59.5, step=0.5)
        self.assertEqual(text.state, EngineState.AWAKE)
        self.advance(0.5)
        self.assertEqual(text.state, EngineState.ASLEEP)
        self.assertEqual(text.sleep_level, 1)
        self.assertEqual(self.control("text")[-1], ("POST", "/sleep?level=1&mode=wait"))
        status = manager.status()[0]
        self.assertEqual(
            (status["state"], status["sleep_depth"]), ("asleep", "sleeping")
        )
        self.advance(120, step=1)
        self.assertEqual(text.sleep_level, 2)
        self.assertEqual(self.control("text")[-1], ("POST", "/sleep?level=2&mode=wait"))
        self.assertEqual(manager.status()[0]["sleep_depth"], "offloaded")
        self.assertEqual(
            self.metrics.get_sample_value(
                "nvproxy_vllm_sleeps_total", {"service": "text", "level": "2"}
            ),
            1,
        )
        # auto-wake from level 2 (reload_weights: no violation)
        before = len(text.calls)
        self.serve(manager)
        self.assertEqual(
            [(m, p.split("?")[0]) for _, m, p in text.calls[before:]],
            [*WAKE, ("POST", "/v1/chat/completions")],
        )
        # and from level 1
        self.advance(60, step=1)
        self.assertEqual(text.sleep_level, 1)
        self.serve(manager)
        self.assertEqual(text.state, EngineState.AWAKE)
        self.assertEqual(text.wake_sequences, 2)

    def test_idle_due_at_a_rounding_edge(self) -> None:
        """
        The idle timer sleeps the service when it fires, also when the idle
        time, computed back from the clock, rounds to just below the tier
        ((4.1 + 60) - 4.1 < 60): it is not re-armed for 0 s again and again.
        """
        spins: list[float] = []
        call_later = self.clock.callLater

        def counted(delay: float, f: Any, *args: Any, **kwargs: Any) -> Any:
            if delay == 0:
                spins.append(self.clock.seconds())
                if len(spins) > 100:
                    raise AssertionError("a timer re-armed for 0 s, forever")
            return call_later(delay, f, *args, **kwargs)

        self.clock.callLater = counted  # type: ignore[method-assign]
        self.clock.advance(4.1)
        only1 = VllmServiceConfig(
            name="text", url=TEXT.url, model=TEXT.model, idle_sleep=60, idle_offload=0
        )
        manager = self.manager(services=(only1,))
        self.assertEqual(manager.status()[0]["last_activity"], 4.1)
        self.clock.advance(60)
        self.pump()
        self.assertEqual(self.fakes["text"].state, EngineState.ASLEEP)
        self.assertEqual(manager.status()[0]["state"], "asleep")

    def test_tier_disabled(self) -> None:
        """idle_sleep 0: straight to level 2 at idle_offload; both 0: never."""
        only2 = VllmServiceConfig(
            name="text", url=TEXT.url, model=TEXT.model, idle_sleep=0, idle_offload=30
        )
        manager = self.manager(services=(only2, EMBED))
        self.serve(manager)
        self.serve(manager, "embed")
        self.advance(30, step=1)
        self.assertEqual(self.fakes["text"].sleep_level, 2)
        self.assertEqual(self.fakes["embed"].state, EngineState.AWAKE)
        self.assertEqual(self.control("embed"), [WAKE[0], WAKE[-1]])

    def test_long_stream_not_slept(self) -> None:
        """A stream longer than idle_sleep is never put to sleep mid-flight;
        the idle clock restarts at its end."""
        text = self.fakes["text"]
        text.chunk_interval = 10.0  # 7 chunks: 60 s
        manager = self.manager()
        target, inner, _ = self.target(manager, stream=True)
        attempt = target.start(final=True)
        self.pump()
        result = self.successResultOf(attempt.result)
        assert isinstance(result, Committed)
        self.advance(100, step=1)
        self.assertEqual(self.successResultOf(result.done), StreamEnd.COMPLETE)
        self.assertNotIn(("POST", "/sleep?level=1&mode=wait"), self.control("text"))
        ended = self.clock.seconds() - 40  # the stream ended at ~60 s
        self.advance(ended + 60 - self.clock.seconds() - 0.5, step=1)
        self.assertEqual(text.state, EngineState.AWAKE)
        self.advance(1)
        self.assertEqual(text.state, EngineState.ASLEEP)

    def test_request_at_the_timer_before_it(self) -> None:
        """
        FD §10 case 11: a request that starts at the very instant the idle
        timer is due, ordered before it: no sleep while it is active.
        """
        text = self.fakes["text"]
        text.first_chunk_latency = 5.0
        manager = self.manager(start=False)
        attempts: list[Any] = []

        def request() -> None:
            target, inner, _ = self.target(manager)
            attempts.append(target.start(final=True))

        self.clock.callLater(60, request)
        manager.startService()
        self.successResultOf(manager.ensure_awake("text"))  # unknown -> awake
        self.pump()
        self.advance(60, step=0.5)
        self.advance(10)
        result = self.successResultOf(attempts[0].result)
        assert isinstance(result, Committed)
        self.assertEqual(result.status, 200)
        self.assertEqual(text.state, EngineState.AWAKE)
        self.assertNotIn(("POST", "/sleep?level=1&mode=wait"), self.control("text"))
        self.advance(60)
        self.assertEqual(text.state, EngineState.ASLEEP)

    def test_request_at_the_timer_after_it(self) -> None:
        """
        FD §10 case 11, the other order: the sleep starts first; the
        request waits for it, then wakes the service and is served.
        """
        manager = self.manager()
        self.serve(manager)
        attempts: list[Any] = []

        def request() -> None:
            target, inner, _ = self.target(manager)
            attempts.append(target.start(final=True))

        self.clock.callLater(60, request)
        self.advance(60)
        self.advance(1)
        result = self.successResultOf(attempts[0].result)
        assert isinstance(result, Committed)
        self.assertEqual(result.status, 200)
        self.assertEqual(
            self.control("text")[-7:],
            [("POST", "/sleep?level=1&mode=wait"), *WAKE],
        )

    def test_escalation_fallback(self) -> None:
        """escalate_by_wake: level 1 -> 2 by wake, then sleep at level 2."""
        text = self.fakes["text"]
        manager = self.manager(escalate_by_wake=True)
        self.serve(manager)
        self.advance(180, step=1)
        self.assertEqual(text.sleep_level, 2)
        self.assertEqual(
            self.control("text")[-3:],
            [
                ("POST", "/sleep?level=1&mode=wait"),
                ("POST", "/wake_up"),
                ("POST", "/sleep?level=2&mode=wait"),
            ],
        )
        self.serve(manager)

    def test_first_start_arms_idle_timer(self) -> None:
        """
        No state file: each service is looked at once without waking it;
        an awake one gets its idle timer and sleeps with no request at all.
        """
        text = self.fakes["text"]
        self.fakes["embed"].force_sleep(1)
        manager = self.manager(keep_checks=True)
        self.assertEqual(
            [s["state"] for s in manager.status()], ["awake"] * 2 + ["asleep"]
        )
        self.assertEqual(manager.status()[2]["sleep_depth"], "unknown")
        self.advance(59.5)
        self.assertEqual(text.state, EngineState.AWAKE)
        self.advance(0.5)
        self.assertEqual(text.sleep_level, 1)
        self.assertEqual(
            self.control("text"), [CHECK, ("POST", "/sleep?level=1&mode=wait")]
        )
        for name in ("ocr", "embed"):
            self.assertEqual(self.control(name), [CHECK])

    def test_failed_sleep_checked_until_settled(self) -> None:
        """
        A sleep that fails (the service went away) leaves the state
        unknown; it is looked at again (no wake) on the first idle tier
        until it answers, then the idle tiers apply again.
        """
        text = self.fakes["text"]
        manager = self.manager()
        self.serve(manager)
        text.set_down()
        self.advance(60)
        self.assertEqual(manager.status()[0]["state"], "unknown")
        self.advance(40)
        self.successResultOf(text.set_up())
        self.advance(20)  # the second look, at 120 s
        self.assertEqual(manager.status()[0]["state"], "awake")
        self.advance(60)
        self.assertEqual(text.sleep_level, 1)
        sleep = ("POST", "/sleep?level=1&mode=wait")
        self.assertEqual(
            self.control("text"), [WAKE[0], WAKE[-1], sleep, CHECK, CHECK, sleep]
        )
        self.assertEqual(text.wake_calls, 0)

    def test_idle_timer_rearmed_at_request_end(self) -> None:
        """The end of the last active request moves the idle timer."""
        text = self.fakes["text"]
        manager = self.manager()
        self.serve(manager)
        self.advance(10)
        manager.request_started("text")
        self.advance(20)
        manager.request_finished("text")
        self.assertEqual([c.getTime() for c in self.clock.getDelayedCalls()], [90.0])
        self.advance(59.5)
        self.assertEqual(text.state, EngineState.AWAKE)
        self.advance(0.5)
        self.assertEqual(text.state, EngineState.ASLEEP)


class AdminTests(_Harness):
    def test_sleep_and_wake(self) -> None:
        manager = self.manager()
        self.serve(manager)
        d = manager.sleep("text", 2)
        self.pump()
        self.successResultOf(d)
        self.assertEqual(self.fakes["text"].sleep_level, 2)
        self.assertFalse(manager.is_awake("text"))
        # already that deep: nothing to do
        self.successResultOf(manager.sleep("text", 1))
        d = manager.wake("text")
        self.pump()
        self.successResultOf(d)
        self.assertTrue(manager.is_awake("text"))
        self.assertRaises(ValueError, manager.sleep, "text", 3)

    def test_sleep_refused(self) -> None:
        manager = self.manager()
        self.serve(manager)
        manager.request_started("text")
        self.failureResultOf(manager.sleep("text", 1), Refused)
        manager.request_finished("text")
        self.fakes["embed"].force_sleep(1)
        self.fakes["embed"].wake_latency = 5
        waiting = manager.ensure_awake("embed")
        self.pump()
        self.failureResultOf(manager.sleep("embed", 1), Refused)
        self.advance(5)
        self.successResultOf(waiting)

    def test_depth_tracking_from_admin(self) -> None:
        """After an admin sleep at level 1 the hold is the sleeping one."""
        manager = self.manager(hold=VllmHold(sleeping=2, offloaded=50))
        self.serve(manager)
        self.successResultOf(manager.sleep("text", 1))
        self.fakes["text"].wake_latency = 10
        d = manager.ensure_awake("text")
        self.advance(2)
        self.assertEqual(self.failureResultOf(d, Waking).value.depth, Depth.SLEEPING)
        self.advance(10)

    def test_status(self) -> None:
        manager = self.manager()
        self.serve(manager)
        manager.request_started("text")
        self.assertEqual(
            manager.status()[0],
            {
                "name": "text",
                "model": TEXT.model,
                "url": TEXT.url,
                "state": "awake",
                "sleep_depth": None,
                "sleep_level": None,
                "active_requests": 1,
                "held_requests": 0,
                "last_activity": 0.0,
                "wake_in_progress": False,
                "readiness": "awake",
                "wake_estimates": {
                    "sleeping": 6.0,
                    "offloaded": 45.0,
                    "restarting": 300.0,
                },
            },
        )
        self.assertEqual(manager.status()[1]["state"], "awake")  # startup check
        manager.request_finished("text")


class RestartTests(_Harness):
    def test_restart_mid_wake(self) -> None:
        """
        FD §10 case 12: nvproxy restarts while a wake runs; the new
        instance joins the wake at the service instead of doubling it.
        """
        text = self.fakes["text"]
        text.force_sleep(2)
        text.wake_latency = 20.0
        first = self.manager()
        held = first.ensure_awake("text")
        self.advance(5)
        with open(f"{self.state_dir}/{STATE_FILE}") as f:
            saved = json.load(f)
        self.assertEqual(
            saved["services"]["text"],
            {"intent": "waking", "level": None, "reload_pending": True},
        )
        first.stopService()
        self.failureResultOf(held, ManagerStopped)
        self.pump()
        self.assertEqual(self.clock.getDelayedCalls(), [text._wake.timer])  # type: ignore[union-attr]
        second = self.manager()
        self.assertEqual(second.status()[0]["state"], "waking")
        d = second.ensure_awake("text")
        self.advance(20)
        self.successResultOf(d)
        self.assertEqual(text.wake_sequences, 1)
        self.serve(second)
        with open(f"{self.state_dir}/{STATE_FILE}") as f:
            self.assertEqual(json.load(f)["services"]["text"]["intent"], "awake")

    def test_restart_awake_service_found_asleep(self) -> None:
        """Intent awake, but the service sleeps now (someone slept it): wake."""
        manager = self.manager()
        self.serve(manager)
        manager.stopService()
        self.fakes["text"].force_sleep(1)
        second = self.manager()
        self.advance(1)
        self.assertTrue(second.is_awake("text"))
        self.assertEqual(self.fakes["text"].wake_sequences, 1)
        self.assertEqual(self.control("embed"), [WAKE[0], WAKE[-1]])  # no wake

    def test_restart_keeps_depth(self) -> None:
        manager = self.manager(hold=VllmHold(sleeping=2, offloaded=50))
        self.serve(manager)
        self.successResultOf(manager.sleep("text", 1))
        manager.stopService()
        second = self.manager(hold=VllmHold(sleeping=2, offloaded=50), keep_checks=True)
        status = second.status()[0]
        self.assertEqual(
            (status["state"], status["sleep_depth"]), ("asleep", "sleeping")
        )
        # one look at start (found asleep: the persisted level is the depth)
        self.assertEqual(len(self.fakes["text"].calls), 5)
        self.assertEqual(self.control("text")[-1], CHECK)
        # the level-2 tier still applies after the restart
        self.advance(180, step=1)
        self.assertEqual(self.fakes["text"].sleep_level, 2)

    def test_restart_between_wake_up_and_reload(self) -> None:
        """
        nvproxy stops after /wake_up, before the reload (intent waking,
        level 2): the new instance finds the service awake and still
        reloads the weights before anything is forwarded.
        """
        text = self.fakes["text"]
        text.force_sleep(2)
        text.wake_latency = 20.0
        first = self.manager()
        held = first.ensure_awake("text")
        self.advance(5)
        first.stopService()
        self.failureResultOf(held, ManagerStopped)
        self.advance(20)  # the wake finishes at the service, nobody reloads
        self.assertEqual(text.state, EngineState.AWAKE)
        before = len(self.control("text"))
        second = self.manager()
        self.advance(1)
        self.assertTrue(second.is_awake("text"))
        self.serve(second)
        self.assertEqual(self.control("text")[before:], RELOAD)
        self.assertEqual(text.wake_sequences, 1)

    def test_persisted_asleep_but_rebooted(self) -> None:
        """
        FD §6.6: a rebooted vLLM boots awake whatever we persisted; the
        startup look finds it awake and its idle timer runs.
        """
        import os

        os.makedirs(self.state_dir)
        with open(f"{self.state_dir}/{STATE_FILE}", "w") as f:
            json.dump(
                {"version": 1, "services": {"text": {"intent": "asleep", "level": 2}}},
                f,
            )
        manager = self.manager(keep_checks=True)
        status = manager.status()[0]
        self.assertEqual((status["state"], status["sleep_level"]), ("awake", None))
        self.advance(60)
        self.assertEqual(self.fakes["text"].sleep_level, 1)
        self.assertEqual(
            self.control("text"), [CHECK, ("POST", "/sleep?level=1&mode=wait")]
        )

    def test_restart_same_manager(self) -> None:
        """stopService then startService again: fresh machines, recovered
        from the state file like a new process."""
        manager = self.manager()
        self.serve(manager)
        manager.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        manager.startService()
        self.pump()
        self.assertTrue(manager.is_awake("text"))
        self.serve(manager)
        self.successResultOf(manager.sleep("text", 1))
        manager.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_unreadable_state_file(self) -> None:
        import os

        os.makedirs(self.state_dir)
        with open(f"{self.state_dir}/{STATE_FILE}", "w") as f:
            f.write("{not json")
        manager = self.manager(keep_checks=True)
        # no intent to trust: each service is looked at once, not woken
        self.assertEqual({s["state"] for s in manager.status()}, {"awake"})
        for name in self.fakes:
            self.assertEqual(self.control(name), [CHECK])

    def test_stop_mid_everything(self) -> None:
        """stopService cancels wakes, sleeps, holds and timers."""
        self.fakes["text"].force_sleep(1)
        self.fakes["text"].wake_latency = 50
        manager = self.manager()
        self.serve(manager, "embed")
        # a request that bypasses nvproxy: /sleep?mode=wait waits for it
        self.fakes["embed"].first_chunk_latency = 100
        stub: Any = self.stub
        direct = stub.post(
            "http://embed.test/v1/chat/completions",
            json={"model": EMBED.model, "messages": []},
        )
        direct.addErrback(lambda f: None)
        self.pump()
        held = manager.ensure_awake("text")
        admin = manager.wake("text")
        sleep = manager.sleep("embed", 1)
        self.pump()
        self.assertEqual(manager.status()[2]["state"], "sleeping")
        manager.stopService()
        self.failureResultOf(held, ManagerStopped)
        self.failureResultOf(admin, ManagerStopped)
        self.failureResultOf(sleep, ManagerStopped)
        self.failureResultOf(manager.ensure_awake("text"), ManagerStopped)
        self.failureResultOf(manager.sleep("text", 1), ManagerStopped)
        self.pump()
        for name in ("text", "embed"):
            self.fakes[name].stop()
        self.assertEqual(self.clock.getDelayedCalls(), [])


METRICS = ("GET", "/metrics")
AWAKE_GAUGE = b"""\
# HELP vllm:engine_sleep_state Engine sleep state
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 0.0
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 0.0
"""


class SleepApiClientTests(_Harness):
    """L{SleepApiClient}: what each failure of a call looks like."""

    def client(self) -> SleepApiClient:
        return SleepApiClient(
            self.stub,  # type: ignore[arg-type]
            self.clock,
            TEXT.url,
            "text",
            timeout=5,
        )

    def test_cancel_is_cancel(self) -> None:
        """
        A cancelled call fails with CancelledError (twisted.web says
        ResponseNeverReceived), never NoAnswer: a stop is not an outage.
        """
        self.hosts.gated.add("/is_sleeping")
        d = self.client().is_sleeping()
        self.pump()
        self.assertNoResult(d)
        d.cancel()
        self.pump()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(self.clock.getDelayedCalls(), [])  # its timeout too

    def test_timeout_is_no_answer(self) -> None:
        self.hosts.gated.add("/health")
        d = self.client().health()
        self.advance(5)
        self.failureResultOf(d, NoAnswer)

    def test_answers(self) -> None:
        """Statuses as the machine reads them."""
        text = self.fakes["text"]
        client = self.client()
        text.answer_instead["/is_sleeping"] = 503
        self.pump()
        self.failureResultOf(client.is_sleeping(), NoAnswer)
        text.answer_instead["/is_sleeping"] = 404
        d = client.is_sleeping()
        self.pump()
        self.assertIs(self.successResultOf(d), False)  # no dev mode: awake
        text.answer_instead["/is_sleeping"] = 500
        d = client.is_sleeping()
        self.pump()
        self.assertEqual(self.failureResultOf(d, BadAnswer).value.code, 500)
        text.answer_instead["/sleep"] = 409
        d = client.sleep(2)
        self.pump()
        self.assertEqual(self.failureResultOf(d, BadAnswer).value.code, 409)
        del text.answer_instead["/sleep"]
        d = client.sleep(2)
        self.pump()
        self.successResultOf(d)
        self.assertEqual(text.calls[-1][1:], ("POST", "/sleep?level=2&mode=wait"))
        d = client.wake_up(["weights", "kv_cache"])
        self.pump()
        self.successResultOf(d)
        self.assertEqual(
            text.calls[-1][1:], ("POST", "/wake_up?tags=weights&tags=kv_cache")
        )
        text.set_down()
        d = client.health()
        self.pump()
        self.failureResultOf(d, NoAnswer)


class SleepStateGaugeTests(SynchronousTestCase):
    """L{parse_sleep_state}: the C{vllm:engine_sleep_state} exposition."""

    def states(self, awake: float, level1: float, level2: float) -> bytes:
        return (
            AWAKE_GAUGE.replace(b'"awake"} 1.0', b'"awake"} %r' % awake)
            .replace(b'offloaded"} 0.0', b'offloaded"} %r' % level1)
            .replace(b'discard_all"} 0.0', b'discard_all"} %r' % level2)
        )

    def test_fake_exposition(self) -> None:
        """The fake's /metrics in each state (the format real vLLM uses)."""
        clock = Clock()
        fake = FakeVLLM(clock=clock)
        stub = StubTreq(fake.resource())

        def look() -> Observed | None:
            d = stub.get("http://fake/metrics")
            stub.flush()
            body = self.successResultOf(treq.content(self.successResultOf(d)))
            return parse_sleep_state(body)

        self.assertEqual(look(), Observed(False))
        fake.force_sleep(1)
        self.assertEqual(look(), Observed(True, 1))
        fake.force_sleep(2)
        self.assertEqual(look(), Observed(True, 2))
        fake.force_wake()
        self.assertEqual(look(), Observed(False))
        fake.sleep_state_gauge = False
        self.assertIsNone(look())

    def test_values(self) -> None:
        self.assertEqual(parse_sleep_state(AWAKE_GAUGE), Observed(False))
        self.assertEqual(
            parse_sleep_state(self.states(0.0, 1.0, 0.0)), Observed(True, 1)
        )
        self.assertEqual(
            parse_sleep_state(self.states(0.0, 0.0, 1.0)), Observed(True, 2)
        )
        # asleep, level not told: unknown (counted as offloaded)
        self.assertEqual(
            parse_sleep_state(self.states(0.0, 0.0, 0.0)), Observed(True, None)
        )

    def test_absent_or_unreadable(self) -> None:
        for text in (
            b"",
            b'vllm:num_requests_running{engine="0"} 0.0\n',
            b"# HELP vllm:engine_sleep_state x\n# TYPE vllm:engine_sleep_state gauge\n",
            b'vllm:engine_sleep_state_total{sleep_state="awake"} 1.0\n',
            b'vllm:engine_sleep_state{sleep_state="awake"} NaN\n',
            b'vllm:engine_sleep_state{engine="0"} 1.0\n',
            b'vllm:engine_sleep_state{sleep_state="awake"} one\n',
            b'# vllm:engine_sleep_state{sleep_state="discard_all"} 1.0\n',
        ):
            self.assertIsNone(parse_sleep_state(text), text)

    def test_format_variants(self) -> None:
        """Label order, spacing, timestamps, quoted braces, CRLF."""
        variants = [
            b'vllm:engine_sleep_state{sleep_state="discard_all",engine="0"} 1\n',
            b'vllm:engine_sleep_state{model_name="a}b\\"c",sleep_state="discard_all"}'
            b" 1.0 1700000000000\n",
            b'vllm:engine_sleep_state{ sleep_state = "discard_all" }\t1e0\r\n',
        ]
        for text in variants:
            self.assertEqual(parse_sleep_state(text), Observed(True, 2), text)

    def test_several_engines(self) -> None:
        """Data parallel: one sleeping engine makes it asleep, deepest wins."""
        one = self.states(1.0, 0.0, 0.0).replace(b'engine="0"', b'engine="1"')
        self.assertEqual(parse_sleep_state(AWAKE_GAUGE + one), Observed(False))
        two = self.states(0.0, 1.0, 0.0).replace(b'engine="0"', b'engine="1"')
        self.assertEqual(parse_sleep_state(AWAKE_GAUGE + two), Observed(True, 1))
        three = self.states(0.0, 0.0, 1.0).replace(b'engine="0"', b'engine="2"')
        self.assertEqual(
            parse_sleep_state(AWAKE_GAUGE + two + three), Observed(True, 2)
        )


class PollTests(_Harness):
    """
    The state poll (C{poll_interval}): a service slept or woken behind
    nvproxy's back is noticed without a round trip per request.
    """

    def looks(self, name: str) -> list[tuple[str, str]]:
        """The sleep-API calls a fake saw, without the polls."""
        return [call for call in self.control(name) if call != METRICS]

    def direct(self, name: str, path: str) -> None:
        """Call a fake's own route, as vllmctl or cron would."""
        stub: Any = self.stub
        d = stub.post("http://" + HOSTS[name].decode() + path)
        self.pump()
        self.assertEqual(self.successResultOf(d).code, 200)

    def status(self, manager: VllmManager, name: str = "text") -> dict[str, Any]:
        return next(s for s in manager.status() if s["name"] == name)

    def test_external_sleep_noticed_then_woken(self) -> None:
        """
        Slept directly at level 1: within one poll interval the status says
        asleep / sleeping, without any wake; the next request is held and
        woken through the single-flight wake, and nothing reaches the engine
        while it sleeps.
        """
        text = self.fakes["text"]
        manager = self.manager(poll_interval=2)
        self.serve(manager)
        self.advance(2)
        self.assertEqual(self.control("text")[-1], METRICS)
        self.direct("text", "/sleep?level=1")
        self.advance(1.75)
        self.assertEqual(self.status(manager)["state"], "awake")
        self.advance(0.25)
        status = self.status(manager)
        self.assertEqual(
            (status["state"], status["sleep_depth"], status["sleep_level"]),
            ("asleep", "sleeping", 1),
        )
        self.assertEqual(text.wake_calls, 0)
        self.assertFalse(manager.is_awake("text"))
        before = len(self.looks("text"))
        text.wake_latency = 1
        target, inner, _ = self.target(manager)
        one = target.start(final=True)
        two = target.start(final=True)
        self.pump()
        self.assertEqual(inner.attempts, [])  # held, not forwarded
        self.advance(1)
        for attempt in (one, two):
            result = self.successResultOf(attempt.result)
            assert isinstance(result, Committed)
            self.assertEqual(result.status, 200)
        self.assertEqual(self.looks("text")[before:], WAKE)
        self.assertEqual(text.wake_sequences, 1)
        with open(f"{self.state_dir}/{STATE_FILE}") as f:
            self.assertEqual(json.load(f)["services"]["text"]["intent"], "awake")

    def test_external_offload_and_unknown_depth(self) -> None:
        """
        The gauge tells level 2 (offloaded); without the gauge
        (/is_sleeping) the level is unknown: offloaded holds and 503s.
        """
        text = self.fakes["text"]
        manager = self.manager(poll_interval=2)
        self.serve(manager)
        text.force_sleep(2)
        self.advance(2)
        status = self.status(manager)
        self.assertEqual(
            (status["state"], status["sleep_depth"]), ("asleep", "offloaded")
        )
        self.assertEqual(status["sleep_level"], 2)
        self.serve(manager)
        text.sleep_state_gauge = False
        text.force_sleep(1)
        self.advance(2)
        self.assertEqual(self.control("text")[-2:], [METRICS, CHECK])
        status = self.status(manager)
        self.assertEqual(
            (status["state"], status["sleep_depth"]), ("asleep", "unknown")
        )
        text.wake_latency = 500
        d = manager.ensure_awake("text")
        self.advance(179.75, step=5)
        self.assertNoResult(d)
        self.advance(0.25)
        error = self.failureResultOf(d, Waking).value
        assert isinstance(error, Waking)
        self.assertEqual((error.depth, error.retry_after), (Depth.OFFLOADED, 60))
        self.advance(330, step=10)
        self.assertTrue(manager.is_awake("text"))

    def test_metrics_failing_falls_back(self) -> None:
        """/metrics answering 500 or dropped: /is_sleeping is asked."""
        text = self.fakes["text"]
        manager = self.manager(poll_interval=2)
        self.serve(manager)
        text.answer_instead["/metrics"] = 500
        text.force_sleep(1)
        self.advance(2)
        self.assertEqual(self.control("text")[-2:], [METRICS, CHECK])
        self.assertEqual(self.status(manager)["state"], "asleep")
        text.answer_instead["/metrics"] = 0
        text.force_wake()
        self.advance(2)
        self.assertEqual(self.control("text")[-2:], [METRICS, CHECK])
        self.assertEqual(self.status(manager)["state"], "awake")

    def test_external_wake_noticed_idle_timer_armed(self) -> None:
        """
        Asleep (nvproxy slept it), woken directly: awake within one poll,
        and put back to sleep idle_sleep after that.
        """
        text = self.fakes["text"]
        manager = self.manager(poll_interval=2)
        self.serve(manager)
        self.successResultOf(manager.sleep("text", 1))
        self.advance(10)
        text.force_wake()
        self.advance(2)
        self.assertEqual(self.status(manager)["state"], "awake")
        self.assertEqual(self.status(manager)["sleep_depth"], None)
        noticed = self.clock.seconds()
        # the idle clock runs from the notice; polls are not activity
        self.advance(59.75)
        self.assertEqual(text.state, EngineState.AWAKE)
        self.advance(0.25)
        self.assertEqual(text.sleep_level, 1)
        self.assertEqual(self.looks("text")[-1], ("POST", "/sleep?level=1&mode=wait"))
        self.assertEqual(self.status(manager)["last_activity"], noticed)
        self.assertEqual(text.wake_calls, 0)

    def test_polls_never_wake_and_are_not_activity(self) -> None:
        """
        Polls through the idle tiers: the sleeps happen on time, nothing is
        woken, last_activity stays at the last request.
        """
        text = self.fakes["text"]
        manager = self.manager(poll_interval=2)
        self.serve(manager)
        served = self.clock.seconds()
        self.advance(59.75)
        self.assertEqual(text.state, EngineState.AWAKE)
        self.advance(0.25)
        self.assertEqual(text.sleep_level, 1)
        self.advance(120)
        self.assertEqual(text.sleep_level, 2)
        self.advance(600, step=2)
        self.assertEqual(text.wake_calls, 0)
        self.assertEqual(self.status(manager)["last_activity"], served)
        polls = self.control("text").count(METRICS)
        self.assertGreater(polls, 300)
        self.assertEqual(
            self.looks("text"),
            [
                WAKE[0],
                WAKE[-1],
                ("POST", "/sleep?level=1&mode=wait"),
                ("POST", "/sleep?level=2&mode=wait"),
            ],
        )

    def test_poll_refreshes_evidence(self) -> None:
        """While polls answer, an awake service is never re-checked."""
        manager = self.manager(poll_interval=2)
        self.serve(manager)
        for _ in range(5):
            self.advance(30, step=1)
            self.serve(manager)
        self.assertEqual(self.looks("text"), [WAKE[0], WAKE[-1]])

    def test_failing_polls_then_ttl(self) -> None:
        """
        Polls unanswered: the evidence ages; past state_ttl the next
        request re-checks first (GET /is_sleeping, /health).
        """
        text = self.fakes["text"]
        manager = self.manager(poll_interval=2, state_ttl=5)
        self.serve(manager)  # the first request re-checks (startup look)
        text.answer_instead.update({"/metrics": 0, "/is_sleeping": 503})
        self.advance(4)
        self.serve(manager)  # 4 s old: trusted
        self.assertEqual(self.looks("text"), [WAKE[0], WAKE[-1], CHECK, CHECK])
        self.advance(6)
        text.answer_instead.clear()
        self.serve(manager)  # 6 s old: re-checked first
        self.assertEqual(
            self.looks("text"), [WAKE[0], WAKE[-1], *[CHECK] * 5, WAKE[0], WAKE[-1]]
        )

    def test_in_flight_request_woken(self) -> None:
        """
        A request forwarded just after a direct sleep (before the poll saw
        it) waits inside the engine; the poll finds the service asleep with
        that request in flight and wakes it, so the engine completes it.
        """
        text = self.fakes["text"]
        text.crash_on_request_while_asleep = False  # vLLM 0.32: it waits
        manager = self.manager(poll_interval=2)
        self.serve(manager)
        self.advance(1)
        text.force_sleep(1)
        target, inner, _ = self.target(manager)
        attempt = target.start(final=True)
        self.pump()
        self.assertEqual(len(inner.attempts), 1)  # forwarded: nvproxy did not know
        self.assertNoResult(attempt.result)
        self.assertEqual(text.active, 1)
        self.advance(1)
        self.assertEqual(self.status(manager)["state"], "awake")  # woken already
        result = self.successResultOf(attempt.result)
        assert isinstance(result, Committed)
        self.assertEqual(result.status, 200)
        self.pump()
        self.assertEqual(self.successResultOf(result.done), StreamEnd.COMPLETE)
        self.assertEqual(text.wake_sequences, 1)
        self.assertEqual(self.looks("text")[-len(WAKE) :], WAKE)
        status = self.status(manager)
        self.assertEqual((status["held_requests"], status["active_requests"]), (0, 0))
        self.assertEqual([v.kind for v in text.violations], ["request_while_asleep"])
        del text.violations[:]

    def test_recheck_holds_forwarded(self) -> None:
        """
        Without polls: a request forwarded to a directly slept service is
        held too when a later request's re-check (state_ttl passed) finds
        the service asleep; one wake answers both.
        """
        text = self.fakes["text"]
        text.crash_on_request_while_asleep = False
        manager = self.manager()
        self.serve(manager)
        text.force_sleep(1)
        text.wake_latency = 5
        target, inner, _ = self.target(manager)
        first = target.start(final=True)
        self.pump()
        self.assertEqual(len(inner.attempts), 1)
        self.advance(11)
        self.assertNoResult(first.result)
        second = target.start(final=True)
        self.pump()
        self.assertEqual(self.status(manager)["held_requests"], 2)
        self.advance(5)
        for attempt in (first, second):
            result = self.successResultOf(attempt.result)
            assert isinstance(result, Committed)
            self.assertEqual(result.status, 200)
        self.assertEqual(text.wake_sequences, 1)
        self.assertEqual(len(text.violations), 1)
        del text.violations[:]

    def _stuck(
        self, final: bool, wake: float = 100, **hold: float
    ) -> tuple[Any, Any, Any, VllmManager]:
        """A request forwarded to a directly slept service, a slow wake."""
        text = self.fakes["text"]
        text.crash_on_request_while_asleep = False
        manager = self.manager(poll_interval=2, hold=VllmHold(**hold))
        self.serve(manager)
        text.force_sleep(1)
        text.wake_latency = wake
        target, inner, client = self.target(manager)
        attempt = target.start(final=final)
        self.pump()
        self.assertEqual(len(inner.attempts), 1)
        return attempt, inner, client, manager

    def test_in_flight_bounded_by_hold(self) -> None:
        """
        The wake takes longer than the level-1 hold: the forwarded request
        ends at the hold deadline (counted from when it was forwarded) as
        the depth-aware 503, its upstream request given up; the wake goes on.
        """
        text = self.fakes["text"]
        attempt, inner, client, manager = self._stuck(True, sleeping=5)
        self.advance(2)
        status = self.status(manager)
        self.assertEqual((status["state"], status["held_requests"]), ("waking", 1))
        self.advance(2.75)
        self.assertNoResult(attempt.result)
        self.assertEqual(text.active, 1)
        self.advance(0.25)
        result = self.successResultOf(attempt.result)
        assert isinstance(result, Committed)
        self.assertEqual(result.status, 503)
        self.assertEqual(self.successResultOf(result.done), StreamEnd.COMPLETE)
        request = client.request
        self.assertEqual(request.responseCode, 503)
        self.assertEqual(request.responseHeaders.getRawHeaders(b"retry-after"), [b"10"])
        body = json.loads(b"".join(request.written))["error"]
        self.assertEqual(
            (body["code"], body["sleep_depth"]), ("model_waking", "sleeping")
        )
        self.assertEqual(text.active, 0)  # the engine lost the client
        status = self.status(manager)
        self.assertEqual(
            (status["state"], status["held_requests"], status["active_requests"]),
            ("waking", 0, 0),
        )
        self.assertEqual(
            self.metrics.get_sample_value(
                "nvproxy_vllm_waking_503_total",
                {"service": "text", "depth": "sleeping"},
            ),
            1,
        )
        self.advance(100, step=5)
        self.assertTrue(manager.is_awake("text"))
        self.assertEqual(text.wake_sequences, 1)
        self.assertEqual(len(text.violations), 1)
        del text.violations[:]

    def test_in_flight_not_final_retryable(self) -> None:
        """Not the final attempt: a retryable 503, nothing written."""
        text = self.fakes["text"]
        attempt, inner, client, manager = self._stuck(False, sleeping=5)
        self.advance(5)
        self.assertEqual(
            self.successResultOf(attempt.result),
            AttemptFailed("node", FailureKind.STATUS, 503),
        )
        self.assertEqual(client.request.written, [])
        self.advance(100, step=5)
        del text.violations[:]

    def test_in_flight_wake_failed(self) -> None:
        """The wake fails twice: the forwarded request gets the 503 then."""
        text = self.fakes["text"]
        attempt, inner, client, manager = self._stuck(True)
        text.wake_latency = 1
        text.wake_failures = 2
        self.advance(3)
        self.assertNoResult(attempt.result)
        self.advance(1)
        result = self.successResultOf(attempt.result)
        assert isinstance(result, Committed)
        self.assertEqual(result.status, 503)
        body = json.loads(b"".join(client.request.written))["error"]
        self.assertIn("failed to wake", body["message"])
        self.assertEqual(self.status(manager)["state"], "asleep")
        del text.violations[:]

    def test_in_flight_answered_before_hold(self) -> None:
        """
        The engine answers within the hold: the hold is dropped, nothing
        fires later; a second direct sleep holds the next one anew.
        """
        text = self.fakes["text"]
        attempt, inner, client, manager = self._stuck(True, wake=10, sleeping=30)
        self.advance(2)
        self.assertEqual(self.status(manager)["held_requests"], 1)
        self.advance(10)
        result = self.successResultOf(attempt.result)
        assert isinstance(result, Committed)
        self.assertEqual(result.status, 200)
        self.assertEqual(self.status(manager)["held_requests"], 0)
        self.pump()
        self.successResultOf(result.done)
        # slept directly again, with a new request in flight: held anew
        second, _, _ = self.target(manager)
        self.advance(2)
        text.force_sleep(1)
        text.wake_latency = 100
        again = second.start(final=True)
        self.pump()
        self.advance(2)
        self.assertEqual(self.status(manager)["held_requests"], 1)
        self.advance(28)
        result = self.successResultOf(again.result)
        assert isinstance(result, Committed)
        self.assertEqual(result.status, 503)
        self.advance(100, step=5)
        self.assertEqual(len(text.violations), 2)
        del text.violations[:]

    def test_status_from_admin_route(self) -> None:
        """GET /admin/status-like routes read status(): one poll later."""
        manager = self.manager(poll_interval=2)
        self.serve(manager)
        self.fakes["embed"].force_sleep(2)
        self.advance(2)
        states = {s["name"]: (s["state"], s["sleep_depth"]) for s in manager.status()}
        self.assertEqual(
            states,
            {
                "text": ("awake", None),
                "ocr": ("awake", None),
                "embed": ("asleep", "offloaded"),
            },
        )

    def test_poll_settles_unknown_and_down(self) -> None:
        """
        A service whose startup look failed (no idle tier to retry on) and a
        service that went down are set right by the poll.
        """
        ocr = self.fakes["ocr"]
        ocr.answer_instead["/is_sleeping"] = 500
        manager = self.manager(poll_interval=2, wake_timeout=3)
        self.assertEqual(self.status(manager, "ocr")["state"], "unknown")
        del ocr.answer_instead["/is_sleeping"]
        self.advance(2)
        self.assertEqual(self.status(manager, "ocr")["state"], "awake")
        embed = self.fakes["embed"]
        embed.set_down()
        d = manager.wake("embed")
        d.addErrback(lambda f: None)
        self.advance(4)
        self.assertEqual(self.status(manager, "embed")["state"], "down")
        embed.set_up()
        embed.force_sleep(1)
        self.advance(2)
        status = self.status(manager, "embed")
        self.assertEqual(
            (status["state"], status["sleep_depth"]), ("asleep", "sleeping")
        )

    def test_stale_answer_dropped(self) -> None:
        """
        A poll answer that arrives after nvproxy changed the state itself
        (here: its own sleep) is dropped, not applied.
        """
        text = self.fakes["text"]
        manager = self.manager(poll_interval=2)
        self.serve(manager)
        self.hosts.gated.add("/metrics")
        self.advance(2)  # the polls are sent, their answers wait
        hosts = [r.getRequestHostname() for r in self.hosts.waiting]
        self.assertEqual(sorted(hosts), sorted(HOSTS.values()))
        core = manager._cores["text"]
        epoch = core.epoch
        self.successResultOf(manager.sleep("text", 1))
        self.assertGreater(core.epoch, epoch)
        text.force_wake()  # so the late answer says "awake"
        self.hosts.release()
        self.pump()
        self.assertEqual(self.control("text")[-1], METRICS)
        self.assertEqual(self.status(manager)["state"], "asleep")
        # the next poll is applied
        self.advance(2)
        self.assertEqual(self.status(manager)["state"], "awake")

    def test_stop_waits_for_poll_in_flight(self) -> None:
        """stopService fires once the poll in flight ended (at most 1 s)."""
        manager = self.manager(poll_interval=2)
        self.hosts.gated.add("/metrics")
        self.advance(2)
        stopped = manager.stopService()
        self.assertNoResult(stopped)
        self.hosts.release()
        self.pump()
        self.successResultOf(stopped)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        manager.startService()
        self.pump()
        self.hosts.gated.add("/metrics")
        self.advance(2)  # sent, never answered
        stopped = manager.stopService()
        self.clock.advance(0.75)
        self.assertNoResult(stopped)
        self.clock.advance(0.25)
        self.successResultOf(stopped)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.hosts.release()


class RestartDepthTests(_Harness):
    def test_restart_during_wake_from_level1(self) -> None:
        """
        nvproxy restarts during a wake from level 1: the state file keeps
        the level, so the new instance's depth is "sleeping" and its 503
        says Retry-After 10 (not the offloaded 60).
        """
        text = self.fakes["text"]
        hold = VllmHold(sleeping=5, offloaded=50)
        first = self.manager(hold=hold)
        self.serve(first)
        self.successResultOf(first.sleep("text", 1))
        text.wake_latency = 30
        held = first.ensure_awake("text")
        self.advance(1)
        with open(f"{self.state_dir}/{STATE_FILE}") as f:
            self.assertEqual(
                json.load(f)["services"]["text"],
                {"intent": "waking", "level": 1, "reload_pending": True},
            )
        first.stopService()
        self.failureResultOf(held, ManagerStopped)
        second = self.manager(hold=hold)
        status = second.status()[0]
        self.assertEqual(
            (status["state"], status["sleep_depth"], status["sleep_level"]),
            ("waking", "sleeping", 1),
        )
        target, inner, client = self.target(second)
        attempt = target.start(final=True)
        self.advance(5)
        result = self.successResultOf(attempt.result)
        assert isinstance(result, Committed)
        self.assertEqual(result.status, 503)
        request = client.request
        self.assertEqual(request.responseHeaders.getRawHeaders(b"retry-after"), [b"10"])
        body = json.loads(b"".join(request.written))["error"]
        self.assertEqual(body["sleep_depth"], "sleeping")
        self.advance(30, step=1)
        self.assertTrue(second.is_awake("text"))
        self.assertEqual(text.wake_sequences, 1)

    def test_restart_during_wake_unknown_level(self) -> None:
        """No level recorded (asleep at an unknown depth): still offloaded."""
        text = self.fakes["text"]
        text.force_sleep(1)
        text.wake_latency = 30
        first = self.manager()
        held = first.ensure_awake("text")
        self.advance(1)
        first.stopService()
        self.failureResultOf(held, ManagerStopped)
        second = self.manager()
        self.assertEqual(second.status()[0]["sleep_depth"], "offloaded")
        self.advance(30, step=1)
        self.assertTrue(second.is_awake("text"))


class ConfigTests(SynchronousTestCase):
    def test_state_ttl(self) -> None:
        """engines.vllm.state_ttl: a duration, 0 allowed, vLLM only."""
        import os

        from nvproxy.config import ConfigError, load_config

        def load(text: str) -> Any:
            path = self.mktemp()
            with open(path, "w") as f:
                f.write(text)
            home = self.mktemp()
            os.makedirs(home)
            return load_config(path, {"state-dir": home}, {"HOME": home})

        self.assertEqual(load("").engines["vllm"].state_ttl, 10.0)
        config = load('[engines.vllm]\nstate_ttl = "30s"\n')
        self.assertEqual(config.engines["vllm"].state_ttl, 30.0)
        self.assertEqual(
            load('[engines.vllm]\nstate_ttl = "0"\n').engines["vllm"].state_ttl, 0.0
        )
        with self.assertRaises(ConfigError) as caught:
            load('[engines.ollama]\nstate_ttl = "3s"\n')
        self.assertIn("engines.ollama.state_ttl", str(caught.exception))
