"""
The facade in memory: L{nvproxy.proxy.facade.Facade} and L{PeerFacade}
behind C{StubTreq}, forwarding through a C{RequestTraversalAgent} to fake
engines, all on a C{task.Clock} (routing, classification, dialect errors,
hidden paths, inventory, the two personalities).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from treq.client import HTTPClient
from treq.testing import RequestTraversalAgent, StubTreq
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock, Cooperator
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.accounting import Accounting
from nvproxy.discovery import Discovery, Endpoint, NodeEntry
from nvproxy.dispatch import Dispatcher, DispatchPolicy
from nvproxy.engines import ENGINES
from nvproxy.metrics import Metrics
from nvproxy.proxy.attempt import AttemptSettings
from nvproxy.proxy.backends import HttpBackend
from nvproxy.proxy.facade import Facade, FacadeParts, PeerFacade, personalities
from nvproxy.proxy.upstream import TreqInventoryClient
from nvproxy.scheduler import ReservationMap
from nvproxy.testing.fakeengine import Behaviour, FakeEngine
from nvproxy.workload import RingSink, WorkloadRecorder


class _Engines:
    """
    One in-memory agent for every fake engine: requests are routed by host
    (``http://n1/...`` reaches the engine registered as ``n1``).
    """

    def __init__(self, engines: Mapping[str, FakeEngine]) -> None:
        self.agents = {
            name: RequestTraversalAgent(engine.resource())
            for name, engine in engines.items()
        }

    def request(
        self, method: bytes, uri: bytes, headers: Any = None, body: Any = None
    ) -> Deferred[Any]:
        host = uri.split(b"/")[2].decode()
        return self.agents[host].request(method, uri, headers, body)

    def flush(self) -> None:
        for agent in self.agents.values():
            agent.flush()


class FacadeCase(SynchronousTestCase):
    engine_id = "lmstudio"
    dialect = "openai"
    model = "m"

    def setUp(self) -> None:
        self.clock = Clock()
        self.fakes = {
            "n1": FakeEngine(self.dialect, [self.model], self.clock),  # type: ignore[arg-type]
            "n2": FakeEngine(self.dialect, [self.model], self.clock),  # type: ignore[arg-type]
        }
        self.upstream = _Engines(self.fakes)
        self.discovery = Discovery()
        self.engine = ENGINES[self.engine_id]
        self.publish("n1", "n2")
        self.workloads = RingSink(maxlen=10)
        self.accounting = Accounting(
            self.clock,
            ReservationMap(),
            WorkloadRecorder(self.clock, [self.workloads], "run"),
            Metrics(CollectorRegistry()),
            {},
        )
        self.dispatcher = Dispatcher(
            self.clock, DispatchPolicy(backoff=(0.5,)), random=lambda: 0.5
        )
        self.settings = AttemptSettings(
            agent=self.upstream,
            clock=self.clock,
            cooperator=Cooperator(scheduler=lambda f: self.clock.callLater(0, f)),
            response_timeout=30.0,
        )
        self.backend = HttpBackend(
            self.engine, self.discovery, "n1", [self.endpoint("n1")]
        )
        parts = FacadeParts(
            self.backend, self.dispatcher, self.accounting, self.settings
        )
        facade = Facade(
            parts,
            discovery=self.discovery,
            inventory=TreqInventoryClient(HTTPClient(self.upstream), self.clock),
        )
        peer = PeerFacade(
            parts, peer_of=lambda request: "peer-1" if self.pinned else None
        )
        self.pinned = True
        self.client = StubTreq(personalities(facade, peer))

    def endpoint(self, node: str) -> Endpoint:
        kind = "local" if node == "n1" else "direct"
        return Endpoint(node, self.engine_id, kind, f"http://{node}")  # type: ignore[arg-type]

    def publish(self, *nodes: str) -> None:
        entries = {}
        for node in nodes:
            endpoint = self.endpoint(node)
            entries[node] = NodeEntry(
                node,
                endpoint.kind,
                {self.engine.normalize_model(self.model): endpoint},
                (endpoint,),
            )
        self.discovery.publish({self.engine_id: entries})

    def pump(self) -> None:
        for _ in range(20):
            self.upstream.flush()
            self.client.flush()
            self.clock.advance(0)

    def call(
        self,
        method: str,
        path: str,
        body: object = None,
        scheme: str = "http",
        raw: bytes | None = None,
    ) -> tuple[int, Any, bytes]:
        data = raw if raw is not None else (None if body is None else json.dumps(body))
        d = self.client.request(
            method,
            f"{scheme}://facade{path}",
            data=data,
            headers={"content-type": ["application/json"]},
        )
        self.pump()
        response = self.successResultOf(d)
        content = self.client.content(response)
        self.pump()
        return response.code, response.headers, self.successResultOf(content)

    def inference(self, fake: str) -> list[Any]:
        return [r for r in self.fakes[fake].requests if r.model is not None]


class FacadeTests(FacadeCase):
    def test_inference_goes_to_an_owner(self) -> None:
        code, _, body = self.call("POST", "/v1/chat/completions", {"model": "m"})
        self.assertEqual(code, 200, body)
        self.assertIn("choices", json.loads(body))
        self.assertEqual(len(self.inference("n1")) + len(self.inference("n2")), 1)
        (workload,) = self.workloads.recent(1)
        self.assertEqual(workload["workloadInfo"]["state"], "completed")

    def test_retryable_status_fails_over(self) -> None:
        """The local node (ordered first) answers 503; the other serves."""
        self.fakes["n1"].default = Behaviour(status=503)
        code, _, _ = self.call("POST", "/v1/chat/completions", {"model": "m"})
        self.assertEqual(code, 200)
        self.assertEqual((len(self.inference("n1")), len(self.inference("n2"))), (1, 1))

    def test_no_owner_is_502_in_the_dialect(self) -> None:
        code, _, body = self.call("POST", "/v1/chat/completions", {"model": "nope"})
        self.assertEqual(code, 502)
        error = json.loads(body)["error"]
        self.assertIn("nope", error["message"])
        self.assertEqual(self.inference("n1") + self.inference("n2"), [])

    def test_missing_model_is_400(self) -> None:
        code, _, body = self.call("POST", "/v1/chat/completions", {"messages": []})
        self.assertEqual(code, 400)
        self.assertEqual(json.loads(body)["error"]["message"], "model is required")

    def test_malformed_body_is_400(self) -> None:
        code, _, body = self.call("POST", "/v1/chat/completions", raw=b"{nope")
        self.assertEqual(code, 400)
        self.assertIn("error", json.loads(body))

    def test_hidden_path_is_404_and_nothing_forwarded(self) -> None:
        for path in ("/sleep", "/v1/../wake_up", "/collective_rpc"):
            code, _, body = self.call("POST", path, {"model": "m"})
            self.assertEqual(code, 404, path)
            self.assertEqual(json.loads(body)["error"]["message"], "not found")
        self.assertEqual(self.fakes["n1"].requests, [])
        self.assertEqual(self.fakes["n2"].requests, [])

    def test_other_route_is_forwarded_once(self) -> None:
        code, _, _ = self.call("GET", "/api/v0/system")
        self.assertIn(code, (200, 404))
        forwarded = [r.path for f in self.fakes.values() for r in f.requests]
        self.assertEqual(forwarded, ["/api/v0/system"])

    def test_inventory_is_merged(self) -> None:
        code, _, body = self.call("GET", "/v1/models")
        self.assertEqual(code, 200)
        listing = json.loads(body)
        self.assertEqual(listing["object"], "list")
        self.assertEqual([m["id"] for m in listing["data"]], ["m"])
        asked = sorted(r.path for f in self.fakes.values() for r in f.requests)
        self.assertEqual(asked, ["/v1/models", "/v1/models"])

    def test_a_bug_answers_500_for_that_request_only(self) -> None:
        original = self.backend.resolve

        def broken(*args: object) -> Any:
            raise RuntimeError("a bug")

        self.backend.resolve = broken  # type: ignore[method-assign]
        code, _, body = self.call("POST", "/v1/chat/completions", {"model": "m"})
        self.assertEqual(code, 500)
        self.assertEqual(json.loads(body)["error"]["message"], "internal proxy error")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.backend.resolve = original  # type: ignore[method-assign]
        code, _, _ = self.call("POST", "/v1/chat/completions", {"model": "m"})
        self.assertEqual(code, 200)


class PeerPersonalityTests(FacadeCase):
    """
    TLS requests (peers) reach the peer personality: straight to this
    node's own engine, once, never re-routed.
    """

    def test_pinned_peer_goes_to_the_local_engine_only(self) -> None:
        self.fakes["n1"].default = Behaviour(status=503)
        code, _, _ = self.call(
            "POST", "/v1/chat/completions", {"model": "m"}, scheme="https"
        )
        self.assertEqual(code, 503, "passed through, not failed over")
        self.assertEqual(len(self.inference("n1")), 1)
        self.assertEqual(self.inference("n2"), [])

    def test_unpinned_peer_is_403(self) -> None:
        self.pinned = False
        code, _, body = self.call(
            "POST", "/v1/chat/completions", {"model": "m"}, scheme="https"
        )
        self.assertEqual(code, 403)
        self.assertIn("not pinned", json.loads(body)["error"]["message"])
        self.assertEqual(self.inference("n1"), [])

    def test_hidden_paths_are_hidden_from_peers_too(self) -> None:
        code, _, _ = self.call("POST", "/sleep", {}, scheme="https")
        self.assertEqual(code, 404)
        self.assertEqual(self.fakes["n1"].requests, [])

    def test_peer_inventory_is_the_local_engines(self) -> None:
        code, _, body = self.call("GET", "/v1/models", scheme="https")
        self.assertEqual(code, 200)
        self.assertEqual([r.path for r in self.fakes["n1"].requests], ["/v1/models"])
        self.assertEqual(self.fakes["n2"].requests, [])
        self.assertEqual(json.loads(body)["data"][0]["id"], "m")


class OllamaFacadeTests(FacadeCase):
    """The same code in another dialect: errors are Ollama's."""

    engine_id = "ollama"
    dialect = "ollama"
    model = "llama3:latest"

    def test_implicit_tag_is_normalized(self) -> None:
        code, _, _ = self.call(
            "POST", "/api/chat", {"model": "llama3", "stream": False}
        )
        self.assertEqual(code, 200)

    def test_no_owner_error_is_ollamas(self) -> None:
        code, _, body = self.call("POST", "/api/chat", {"model": "nope"})
        self.assertEqual(code, 502)
        self.assertIsInstance(json.loads(body)["error"], str)
