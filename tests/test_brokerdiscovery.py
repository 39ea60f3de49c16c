"""
Tests for L{nvproxy.brokerdiscovery}: inventory fed and watched over the
broker link.
"""

from __future__ import annotations

import json
from typing import Any

from attrs import evolve
from twisted.internet import reactor
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.brokerdiscovery import BrokerDiscovery, SnapshotError
from nvproxy.discovery import Discovery, Endpoint, NodeEntry
from nvproxy.testing.harness import facade_url, free_port, proxy_config
from tests.test_forwarding import ProxyTestCase


def _polled_entry(node: str, engine: str, model: str) -> NodeEntry:
    endpoint = Endpoint(node, engine, "local", "http://127.0.0.1:1")
    return NodeEntry(node, "local", {model: endpoint}, (endpoint,))


class _Parts:
    def __init__(self) -> None:
        self.clock = Clock()
        self.polled = Discovery()
        self.discovery = Discovery()
        self.sent: list[tuple[str, Any]] = []
        self.counts: dict[str, int] = {}
        self.broker = BrokerDiscovery(
            self.polled, self.discovery, "me", self._peer, self.clock
        )
        self.broker.attach(lambda m, p: self.sent.append((m, p)), lambda: self.counts)

    @staticmethod
    def _peer(engine: str, peer: str) -> str | None:
        return "https://10.0.0.9:11435" if peer == "node-b" else None


class BrokerDiscoveryTests(SynchronousTestCase):
    def test_feed_replaces_one_engine(self) -> None:
        """
        A snapshot replaces the polled view of its engine only, and stays in
        force while polling publishes; the link closing restores polling.
        """
        p = _Parts()
        p.polled.publish(
            {
                "ollama": {"me": _polled_entry("me", "ollama", "a:latest")},
                "vllm": {"me": _polled_entry("me", "vllm", "q")},
            }
        )
        result = p.broker.feed(
            "ollama",
            {
                "nodes": [
                    {
                        "nodeId": "gpu-2",
                        "url": "http://10.0.0.2:11434",
                        "models": ["llama3"],
                    },
                    {"nodeId": "node-b", "peer": "node-b", "models": ["m:7b"]},
                ]
            },
        )
        self.assertEqual(result, {"engine": "ollama", "nodes": 2})
        current = p.discovery.current
        self.assertEqual(sorted(current.engines["ollama"]), ["gpu-2", "node-b"])
        gpu2 = current.engines["ollama"]["gpu-2"]
        self.assertEqual(
            (gpu2.kind, sorted(gpu2.models)), ("direct", ["llama3:latest"])
        )
        peer = current.engines["ollama"]["node-b"]
        self.assertEqual(
            (peer.kind, peer.endpoints[0].base_url),
            ("peer", "https://10.0.0.9:11435"),
        )
        self.assertEqual(sorted(current.engines["vllm"]), ["me"])
        p.polled.publish({"ollama": {}, "vllm": {}})
        self.assertEqual(
            sorted(p.discovery.current.engines["ollama"]), ["gpu-2", "node-b"]
        )
        p.broker.detach()
        self.assertEqual(p.discovery.current.engines["ollama"], {})

    def test_bad_snapshots(self) -> None:
        p = _Parts()
        for params, message in [
            ({}, "nodes must be a list"),
            ({"nodes": [3]}, "nodes[0] must be an object"),
            ({"nodes": [{"models": []}]}, "nodes[0].nodeId must be a non-empty string"),
            (
                {"nodes": [{"nodeId": "x"}]},
                "nodes[0] needs a url (http or https) or a peer",
            ),
            (
                {"nodes": [{"nodeId": "x", "peer": "zz"}]},
                "nodes[0].peer 'zz' is not a pinned peer",
            ),
            (
                {"nodes": [{"nodeId": "x", "url": "http://a", "models": [1]}]},
                "nodes[0].models must be a list of strings",
            ),
        ]:
            with self.assertRaises(SnapshotError) as caught:
                p.broker.feed("ollama", params)
            self.assertEqual(str(caught.exception), message)
        self.assertEqual(p.discovery.current.generation, 0)

    def test_subscribe(self) -> None:
        """
        A subscription sends the engine's view at once and on every change
        of that engine, not on another engine's change.
        """
        p = _Parts()
        self.assertEqual(
            p.broker.subscribe("ollama"), {"engine": "ollama", "subscribed": True}
        )
        self.assertEqual(
            p.sent, [("ollama:discovery:nodes", {"generation": 0, "nodes": []})]
        )
        p.polled.publish({"ollama": {"me": _polled_entry("me", "ollama", "a:latest")}})
        p.polled.publish(
            {
                "ollama": {"me": _polled_entry("me", "ollama", "a:latest")},
                "vllm": {"me": _polled_entry("me", "vllm", "q")},
            }
        )
        self.assertEqual(
            p.sent[1:],
            [
                (
                    "ollama:discovery:nodes",
                    {
                        "generation": 1,
                        "nodes": [
                            {
                                "nodeId": "me",
                                "kind": "local",
                                "models": ["a:latest"],
                                "url": "http://127.0.0.1:1",
                            }
                        ],
                    },
                )
            ],
        )

    def test_node_activity(self) -> None:
        """
        In-flight counts are reported once per turn, on change only, once
        the broker subscribed.
        """
        p = _Parts()
        p.broker.activity_changed()
        self.assertEqual(p.clock.getDelayedCalls(), [])
        p.broker.subscribe("ollama")
        p.sent.clear()
        p.counts = {"me": 2}
        p.broker.activity_changed()
        p.broker.activity_changed()
        p.clock.advance(0)
        p.broker.activity_changed()
        p.clock.advance(0)
        self.assertEqual(p.sent, [("discovery:node-activity", {"nodes": {"me": 2}})])


class BrokerLinkTests(ProxyTestCase):
    async def test_snapshot_routes_requests(self) -> None:
        """
        Through the link of a running daemon: a snapshot naming a node the
        daemon does not poll routes requests there; a subscription gets the
        view; errors:report is logged; node activity follows the request.
        """
        fake = await self.engine("ollama", ["llama3:latest"])
        config = evolve(
            proxy_config(self.mktemp(), {"ollama": "http://127.0.0.1:1"}),
            control="stdio",
        )
        from nvproxy.service import build

        proxy = build(config, reactor, hostname="local")
        assert proxy.link is not None
        transport = StringTransport()
        proxy.link.makeConnection(transport)
        proxy._link_closed = lambda: None  # type: ignore[method-assign]
        proxy.startService()
        self.addCleanup(proxy.stopService)
        port = free_port()

        def send(ident: int, method: str, params: object) -> None:
            line = {"jsonrpc": "2.0", "id": ident, "method": method, "params": params}
            assert proxy.link is not None
            proxy.link.dataReceived(json.dumps(line).encode() + b"\n")

        async def answer(ident: int) -> Any:
            for _ in range(100):
                for line in transport.value().splitlines():
                    message = json.loads(line)
                    if message.get("id") == ident:
                        return message
                await deferLater(reactor, 0.02, lambda: None)
            self.fail(f"no answer to {ident}")

        send(1, "facade/enable", {"engine": "ollama", "port": port})
        await answer(1)
        send(2, "ollama:discovery:subscribe", {})
        self.assertEqual(
            (await answer(2))["result"], {"engine": "ollama", "subscribed": True}
        )
        send(
            3,
            "ollama:discovery:nodes",
            {"nodes": [{"nodeId": "gpu-2", "url": fake.url, "models": ["llama3"]}]},
        )
        self.assertEqual((await answer(3))["result"], {"engine": "ollama", "nodes": 1})
        send(4, "ollama:discovery:nodes", {"nodes": "x"})
        self.assertEqual(
            (await answer(4))["error"],
            {"code": -32602, "message": "discovery:nodes: nodes must be a list"},
        )
        with capturedLogs() as events:
            send(5, "errors:report", {"kind": "crash", "message": "engine died"})
            self.assertEqual((await answer(5))["result"], {"logged": True})
        self.assertIn(
            "broker reported an error: crash: engine died",
            [e.get("log_format", "").format(**e) for e in events],
        )
        code, _, _ = await self.post(
            facade_url(proxy, "ollama") + "/api/generate",
            {"model": "llama3", "prompt": "hi", "stream": False},
        )
        self.assertEqual(code, 200)
        self.assertEqual(len(fake.requests), 1)
        await deferLater(reactor, 0.02, lambda: None)
        notes = [json.loads(line) for line in transport.value().splitlines()]
        views = [
            n["params"]["nodes"]
            for n in notes
            if n.get("method") == "ollama:discovery:nodes"
        ]
        self.assertEqual(
            views[-1],
            [
                {
                    "nodeId": "gpu-2",
                    "kind": "direct",
                    "models": ["llama3:latest"],
                    "url": fake.url,
                }
            ],
        )
        activity = [
            n["params"]["nodes"]
            for n in notes
            if n.get("method") == "discovery:node-activity"
        ]
        self.assertIn({"gpu-2": 1}, activity)
        self.assertEqual(activity[-1], {"gpu-2": 0})
