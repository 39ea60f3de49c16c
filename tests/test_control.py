"""
Tests for the broker link (spec §3, §4): JSON-RPC 2.0 over newline-delimited
JSON, unit-tested with a fake target, then against a real nvproxy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.control import ControlLink, split_address
from nvproxy.scheduler import SchedulerSnapshot
from nvproxy.testing.harness import facade_url, free_port, proxy_config
from tests.test_forwarding import ProxyTestCase


class FakeTarget:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail_enable = False

    def enable_facade(
        self,
        engine: str,
        port: int,
        aliases: Sequence[tuple[str, int]],
        ignore_persisted: bool,
    ) -> Deferred[int]:
        self.calls.append(("enable", engine, port, list(aliases), ignore_persisted))
        if self.fail_enable:
            return fail(OSError("Address already in use"))
        return succeed(port or 11435)

    def disable_facade(self, engine: str) -> Deferred[None]:
        self.calls.append(("disable", engine))
        return succeed(None)

    def select(self, engine: str, node: str | None) -> Mapping[str, Any]:
        self.calls.append(("select", engine, node))
        return {"engine": engine, "selected": node}

    def set_port(self, engine: str, port: int) -> Deferred[Mapping[str, Any]]:
        self.calls.append(("set-port", engine, port))
        return succeed({"engine": engine, "port": port, "persisted": True})

    def apply_priority(self, snapshot: SchedulerSnapshot) -> bool:
        self.calls.append(("priority", snapshot.generation, snapshot.priority))
        return True

    def set_log_level(self, level: str) -> None:
        self.calls.append(("level", level))


class LinkTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.target = FakeTarget()
        self.closed: list[bool] = []
        self.link = ControlLink(self.target, lambda: self.closed.append(True))
        self.transport = StringTransport()
        self.link.makeConnection(self.transport)

    def send(self, message: object) -> list[dict[str, Any]]:
        self.transport.clear()
        self.link.dataReceived(json.dumps(message).encode() + b"\n")
        return [json.loads(line) for line in self.transport.value().splitlines()]

    def test_enable(self) -> None:
        out = self.send(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "facade/enable",
                "params": {
                    "engine": "ollama",
                    "port": 0,
                    "aliases": ["127.0.0.2:11434"],
                },
            }
        )
        self.assertEqual(
            out,
            [
                {"jsonrpc": "2.0", "method": "ollama:ready", "params": {"port": 11435}},
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "result": {"engine": "ollama", "port": 11435},
                },
            ],
        )
        self.assertEqual(
            self.target.calls, [("enable", "ollama", 0, [("127.0.0.2", 11434)], False)]
        )

    def test_enable_bind_failure(self) -> None:
        self.target.fail_enable = True
        out = self.send(
            {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "facade/enable",
                "params": {"engine": "vllm", "port": 8000},
            }
        )
        self.assertEqual(out[0]["method"], "vllm:error")
        self.assertEqual(out[0]["params"]["kind"], "bind")
        self.assertEqual(out[1]["id"], 2)
        self.assertEqual(out[1]["error"]["code"], -32000)

    def test_bad_params(self) -> None:
        for params in (
            {"engine": "tgi", "port": 1},
            {"engine": "ollama", "port": 70000},
            {"engine": "ollama", "port": 1, "aliases": ["nope"]},
        ):
            out = self.send(
                {"jsonrpc": "2.0", "id": 3, "method": "facade/enable", "params": params}
            )
            self.assertEqual(out[-1]["error"]["code"], -32602, params)
        self.assertEqual(self.target.calls, [])

    def test_addressing(self) -> None:
        """
        Facade-scoped methods need an engine address; an unaddressed one
        resolves to no facade (spec §4).
        """
        out = self.send(
            {
                "jsonrpc": "2.0",
                "id": 4,
                "method": "node/select",
                "params": {"nodeId": "a"},
            }
        )
        self.assertEqual(out[0]["error"]["code"], -32602)
        out = self.send(
            {
                "jsonrpc": "2.0",
                "id": 5,
                "method": "lmstudio:node/select",
                "params": {"nodeId": "gpu-2"},
            }
        )
        self.assertEqual(out[0]["result"], {"engine": "lmstudio", "selected": "gpu-2"})
        self.assertEqual(self.target.calls, [("select", "lmstudio", "gpu-2")])

    def test_split_address(self) -> None:
        self.assertEqual(split_address("ollama:node/select"), ("ollama", "node/select"))
        self.assertEqual(split_address("errors:report"), (None, "errors:report"))
        self.assertEqual(split_address("workload:started"), (None, "workload:started"))

    def test_priority(self) -> None:
        out = self.send(
            {
                "jsonrpc": "2.0",
                "id": 6,
                "method": "node/set-priority",
                "params": {
                    "generation": 7,
                    "priority": ["b", "a"],
                    "pending": {"a": 2},
                    "gpuPressure": {"b": 0.5},
                },
            }
        )
        self.assertEqual(
            out, [{"jsonrpc": "2.0", "id": 6, "result": {"applied": True}}]
        )
        self.assertEqual(self.target.calls, [("priority", 7, ("b", "a"))])

    def test_errors(self) -> None:
        self.transport.clear()
        self.link.dataReceived(b"{not json\n")
        self.assertEqual(json.loads(self.transport.value())["error"]["code"], -32700)
        out = self.send({"jsonrpc": "2.0", "id": 8, "method": "frobnicate"})
        self.assertEqual(out[0]["error"]["code"], -32601)
        out = self.send({"id": 9, "method": "log/set-level"})
        self.assertEqual(out[0]["error"]["code"], -32600)
        # A notification with an error gets no answer.
        out = self.send({"jsonrpc": "2.0", "method": "frobnicate"})
        self.assertEqual(out, [])

    def test_close(self) -> None:
        self.link.connectionLost(None)
        self.assertEqual(self.closed, [True])


class ServiceLinkTests(ProxyTestCase):
    async def test_broker_enables_facades_and_gets_events(self) -> None:
        """
        With the link, nvproxy starts with no facade; facade/enable starts
        one, reports ready, and workload events flow to the broker.
        """
        from attrs import evolve

        fake = await self.engine("openai", ["m"])
        config = evolve(
            proxy_config(self.mktemp(), {"lmstudio": fake.url}), control="stdio"
        )
        from nvproxy.service import build

        proxy = build(config, reactor, hostname="local")
        assert proxy.link is not None
        transport = StringTransport()
        proxy.link.makeConnection(transport)
        proxy._link_closed = lambda: None  # type: ignore[method-assign]
        proxy.startService()
        self.addCleanup(proxy.stopService)
        self.assertEqual(proxy.listeners, {})
        port = free_port()
        proxy.link.dataReceived(
            json.dumps(
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "facade/enable",
                    "params": {"engine": "lmstudio", "port": port},
                }
            ).encode()
            + b"\n"
        )
        for _ in range(50):
            if b'"id":1' in transport.value():
                break
            await _tick()
        lines = [json.loads(line) for line in transport.value().splitlines()]
        self.assertIn(
            {"jsonrpc": "2.0", "method": "lmstudio:ready", "params": {"port": port}},
            lines,
        )
        await proxy.polling.poll()
        transport.clear()
        code, _, _ = await self.post(
            facade_url(proxy, "lmstudio") + "/v1/completions", {"model": "m"}
        )
        self.assertEqual(code, 200)
        methods = [
            json.loads(line)["method"] for line in transport.value().splitlines()
        ]
        self.assertEqual(
            methods,
            [
                "workload:submitted",
                "workload:submitted",
                "workload:started",
                "workload:completed",
            ],
        )
        # A snapshot is applied once; a redelivery is not.
        for expected in (True, False):
            transport.clear()
            proxy.link.dataReceived(
                b'{"jsonrpc":"2.0","id":2,"method":"node/set-priority",'
                b'"params":{"generation":3,"priority":["local"]}}\n'
            )
            self.assertEqual(
                json.loads(transport.value())["result"], {"applied": expected}
            )


async def _tick() -> None:
    from twisted.internet.task import deferLater

    await deferLater(reactor, 0.02, lambda: None)
