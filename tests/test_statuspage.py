"""
The live status page on the admin listener (C{GET /}, its assets) and its
event stream (C{GET /admin/events}): snapshot then updates, slow clients
dropped, nothing left behind after a disconnect.
"""

from __future__ import annotations

import json
import re
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers

from nvproxy.statuspage import ASSETS, READINESS, SECTIONS, StatusFeed, view
from nvproxy.testing.fakeengine import Behaviour
from nvproxy.testing.fleetstatus import FleetStatus
from nvproxy.testing.harness import facade_url
from tests.test_forwarding import MemoryProxyTestCase


def parse_events(data: bytes) -> list[tuple[str, Any]]:
    """The (event, data) pairs of an SSE byte stream (comments skipped)."""
    events = []
    for block in data.decode().split("\n\n"):
        kind, payload = "message", None
        for line in block.split("\n"):
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                payload = json.loads(line[len("data: ") :])
        if payload is not None:
            events.append((kind, payload))
    return events


class _Transport:
    def __init__(self) -> None:
        self.aborted = False

    def abortConnection(self) -> None:
        self.aborted = True


class _Channel:
    def __init__(self) -> None:
        self.transport = _Transport()


class FakeStreamRequest:
    """
    The part of C{twisted.web.server.Request} an event stream uses: writes
    are recorded; the connection can pause the producer or go away.
    """

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.responseHeaders = Headers()
        self.channel = _Channel()
        self.producer: Any = None
        self._finished: list[Deferred[None]] = []

    def setHeader(self, name: bytes, value: bytes) -> None:
        self.responseHeaders.setRawHeaders(name, [value])

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer

    def notifyFinish(self) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        self._finished.append(d)
        return d

    def loseConnection(self) -> None:
        self.lost()

    def lost(self) -> None:
        for d in self._finished:
            d.errback(Failure(ConnectionError("gone")))
        self._finished = []

    def events(self) -> list[tuple[str, Any]]:
        return parse_events(b"".join(self.written))


class _Source:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {
            "node_id": "a",
            "nodes": {"a": {"ollama": ["m1"]}},
            "vllm": [],
            "inflight": 0,
            "reservations": {"a": 0},
            "facades": [],
        }
        self.workloads: list[Any] = []
        self.calls = 0

    def status(self) -> dict[str, Any]:
        self.calls += 1
        return json.loads(json.dumps(self.state))

    def recent_workloads(self, limit: int) -> list[Any]:
        return self.workloads[:limit]


class FeedTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.source = _Source()
        self.feed = StatusFeed(
            self.source, self.clock, interval=1.0, buffer_bytes=4096, keepalive=5.0
        )

    def test_snapshot_then_updates(self) -> None:
        """
        A client gets the whole view first, then only the sections that
        changed; nothing when nothing changed.
        """
        request = FakeStreamRequest()
        d = self.feed.connect(request)
        self.assertEqual(
            request.responseHeaders.getRawHeaders(b"content-type"),
            [b"text/event-stream; charset=utf-8"],
        )
        [(kind, first)] = request.events()
        self.assertEqual(kind, "snapshot")
        self.assertEqual(set(first["view"]), set(SECTIONS))
        self.assertEqual(first["view"]["nodes"][0]["id"], "a")
        self.clock.advance(1)
        self.assertEqual(len(request.events()), 1)
        self.source.state["inflight"] = 3
        self.clock.advance(1)
        kind, update = request.events()[-1]
        self.assertEqual(kind, "update")
        self.assertEqual(update["changed"], {"inflight": 3})
        self.assertEqual(update["seq"], first["seq"] + 1)
        self.assertEqual(update["now"], 2000)
        request.lost()
        self.assertNoResult(d)
        self.assertEqual(self.feed.clients, 0)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_keepalive(self) -> None:
        request = FakeStreamRequest()
        self.feed.connect(request)
        self.clock.advance(5)
        self.assertEqual(request.written[-1], b": keepalive\n\n")
        request.lost()

    def test_cancel_removes_client(self) -> None:
        """
        Klein cancels the route's Deferred when the client disconnects: the
        client is gone and the poll stops.
        """
        d = self.feed.connect(FakeStreamRequest())
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(self.feed.clients, 0)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        polls = self.source.calls
        self.clock.advance(10)
        self.assertEqual(self.source.calls, polls)

    def test_slow_client_dropped(self) -> None:
        """
        While the connection takes nothing, events wait in the client's
        buffer; past its bound the client is disconnected, and the others
        keep streaming.
        """
        slow, fast = FakeStreamRequest(), FakeStreamRequest()
        self.feed.connect(slow)
        self.feed.connect(fast)
        slow.producer.pauseProducing()
        written = len(slow.written)
        for n in range(20):
            self.source.state["nodes"]["a"]["ollama"] = [f"m{n}-{'x' * 200}"]
            self.clock.advance(1)
            if slow.channel.transport.aborted:
                break
        self.assertTrue(slow.channel.transport.aborted)
        self.assertEqual(len(slow.written), written)
        self.assertEqual(self.feed.clients, 1)
        before = len(fast.events())
        self.source.state["inflight"] = 9
        self.clock.advance(1)
        self.assertEqual(len(fast.events()), before + 1)
        fast.lost()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_paused_client_catches_up(self) -> None:
        """
        A client paused briefly gets what was buffered, in order, on resume.
        """
        request = FakeStreamRequest()
        self.feed.connect(request)
        request.producer.pauseProducing()
        self.source.state["inflight"] = 1
        self.clock.advance(1)
        self.source.state["inflight"] = 2
        self.clock.advance(1)
        self.assertEqual(len(request.events()), 1)
        request.producer.resumeProducing()
        changes = [e["changed"]["inflight"] for _k, e in request.events()[1:]]
        self.assertEqual(changes, [1, 2])
        request.lost()

    def test_late_client_consistent(self) -> None:
        """
        A client connecting between polls gets the current view, and the
        clients already there get the change as an update.
        """
        early = FakeStreamRequest()
        self.feed.connect(early)
        self.source.state["inflight"] = 5
        late = FakeStreamRequest()
        self.feed.connect(late)
        self.assertEqual(late.events()[0][1]["view"]["inflight"], 5)
        self.assertEqual(early.events()[-1][1]["changed"], {"inflight": 5})
        self.source.state["inflight"] = 0
        self.clock.advance(1)
        self.assertEqual(late.events()[-1][1]["changed"], {"inflight": 0})
        early.lost()
        late.lost()
        self.assertEqual(self.clock.getDelayedCalls(), [])


class ViewTests(SynchronousTestCase):
    def test_derived_readiness(self) -> None:
        """
        Without node records, this node's vLLM services give readiness by
        state and every other model is awake.
        """
        status = {
            "node_id": "a",
            "nodes": {
                "a": {"vllm": ["big", "small"], "ollama": ["o"]},
                "b": {"ollama": ["o"]},
            },
            "vllm": [
                {
                    "name": "s1",
                    "model": "big",
                    "state": "asleep",
                    "sleep_depth": "offloaded",
                },
                {
                    "name": "s2",
                    "model": "small",
                    "state": "waking",
                    "sleep_depth": "sleeping",
                },
            ],
            "reservations": {"a": 1, "b": 0},
        }
        v = view(status, [])
        where = {
            (m["name"], w["node"]): w["readiness"]
            for m in v["models"]
            for w in m["where"]
        }
        self.assertEqual(
            where,
            {
                ("big", "a"): "offloaded",
                ("small", "a"): "waking",
                ("o", "a"): "awake",
                ("o", "b"): "awake",
            },
        )
        self.assertEqual([n["id"] for n in v["nodes"]], ["a", "b"])
        self.assertTrue(v["nodes"][0]["self"])
        self.assertEqual(v["nodes"][0]["reservations"], 1)

    def test_records(self) -> None:
        """
        Node records, when the status has them, give readiness and wake
        estimates, draining and in-flight counts.
        """
        status = {
            "node_id": "node-a",
            "records": [
                {
                    "version": 1,
                    "node": "node-a",
                    "generation": 17,
                    "draining": True,
                    "engines": {
                        "vllm": {
                            "port": 8000,
                            "in_flight": 2,
                            "models": {
                                "Qwen3-8B": {
                                    "readiness": "sleeping",
                                    "wake_estimate_s": 12.5,
                                }
                            },
                        }
                    },
                }
            ],
        }
        v = view(status, [])
        self.assertTrue(v["draining"])
        self.assertEqual(
            v["models"],
            [
                {
                    "name": "Qwen3-8B",
                    "engine": "vllm",
                    "where": [
                        {
                            "node": "node-a",
                            "readiness": "sleeping",
                            "wake_estimate_s": 12.5,
                        }
                    ],
                }
            ],
        )
        self.assertEqual(v["nodes"][0]["engines"]["vllm"]["in_flight"], 2)

    def test_fleet_fixture(self) -> None:
        """
        The 20-node, 50-model fixture fills every section.
        """
        fleet = FleetStatus(Clock(), nodes=20, models=50)
        v = view(fleet.status(), fleet.recent_workloads(50))
        self.assertEqual(len(v["nodes"]), 20)
        self.assertEqual(len(v["models"]), 50)
        self.assertEqual(len(v["workloads"]), 40)
        self.assertTrue(v["services"])
        seen = {w["readiness"] for m in v["models"] for w in m["where"]}
        self.assertLessEqual(seen, set(READINESS))
        self.assertGreater(len(seen), 2)


class _Stream(Protocol):
    def __init__(self) -> None:
        self.data = b""

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason: Any = None) -> None:
        pass


class PageTests(MemoryProxyTestCase):
    def admin(self, proxy: Any) -> str:
        return f"http://127.0.0.1:{proxy.admin.bound_port()}"

    def test_page_and_assets(self) -> None:
        """
        C{GET /} is the page, under a strict CSP; its script and stylesheet
        come from the same origin, and nothing refers to another.
        """
        proxy = self.proxy({}, admin=True)
        for route in ASSETS:
            code, headers, body = self.get(self.admin(proxy) + route)
            self.assertEqual(code, 200, route)
            csp = headers.getRawHeaders(b"content-security-policy")[0].decode()
            self.assertIn("script-src 'self'", csp)
            self.assertIn("default-src 'none'", csp)
            self.assertNotIn("unsafe-inline", csp)
            text = body.decode()
            # No external asset: the only URL is the SVG namespace name.
            urls = set(re.findall(r"https?://[^\s\"')]+", text))
            self.assertLessEqual(urls, {"http://www.w3.org/2000/svg"}, route)
            if route == "/":
                self.assertIn('<script src="/static/status.js"', text)
                self.assertNotIn("<style", text)
                self.assertNotIn(" style=", text)
                self.assertIsNone(re.search(r"<script>(?!</script>)", text))
        code, _h, _b = self.get(self.admin(proxy) + "/nowhere")
        self.assertEqual(code, 404)

    def test_events_over_http(self) -> None:
        """
        The stream starts with a snapshot; a request through a facade shows
        up as an update of the workloads; after the client leaves nothing is
        left on the clock (checked by the test case's cleanup).
        """
        fake = self.engine("openai", ["m"])
        fake.default = Behaviour(chunks=2)
        proxy = self.proxy({"lmstudio": fake.url}, admin=True)
        self.net.advance(3)  # discovery polled the engine
        response = self.drive(
            self.client.http.request("GET", self.admin(proxy) + "/admin/events")
        )
        self.assertEqual(response.code, 200)
        stream = _Stream()
        response.deliverBody(stream)
        self.net.advance(0.1)
        [(kind, snap)] = parse_events(stream.data)
        self.assertEqual(kind, "snapshot")
        self.assertEqual(snap["view"]["models"][0]["name"], "m")
        self.assertEqual(snap["view"]["workloads"], [])
        self.post(
            facade_url(proxy, "lmstudio") + "/v1/chat/completions",
            {"model": "m", "messages": []},
            {"Content-Type": ["application/json"], "X-Request-Id": ["r-1"]},
        )
        self.net.advance(1.5)
        updates = [e for k, e in parse_events(stream.data) if k == "update"]
        workloads = [
            u["changed"]["workloads"] for u in updates if "workloads" in u["changed"]
        ]
        self.assertTrue(workloads)
        last = workloads[-1][0]
        self.assertEqual(
            (last["model"], last["state"], last["requestId"]), ("m", "completed", "r-1")
        )
        self.assertEqual(proxy.status_page.feed.clients, 1)
        stream.transport.stopProducing()  # type: ignore[attr-defined]
        self.net.advance(0.1)
        self.assertEqual(proxy.status_page.feed.clients, 0)

    def test_stop_ends_streams(self) -> None:
        """
        Stopping nvproxy ends the event streams (they would otherwise keep
        the poll running); the test case's cleanup finds nothing left.
        """
        proxy = self.proxy({}, admin=True)
        response = self.drive(
            self.client.http.request("GET", self.admin(proxy) + "/admin/events")
        )
        stream = _Stream()
        response.deliverBody(stream)
        self.net.advance(0.1)
        self.assertEqual(proxy.status_page.feed.clients, 1)
        self.drive(proxy.stopService())
        self.net.advance(0.1)
        self.assertEqual(proxy.status_page.feed.clients, 0)
