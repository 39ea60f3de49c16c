"""
The admin API and C{nvproxyctl}, persisted ports (spec §8), aliases (§7)
and client limits, on loopback.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any
from unittest import SkipTest

import treq
from attrs import evolve
from prometheus_client import CollectorRegistry
from treq.testing import StubTreq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.admin import admin_app
from nvproxy.config import VllmServiceConfig
from nvproxy.ports import PortStore
from nvproxy.service import build
from nvproxy.testing.harness import (
    facade_url,
    free_port,
    nvproxyctl,
    proxy_config,
    start_proxy,
)
from nvproxy.vllm import Depth, ManagerStopped, Refused, VllmRegistry, Waking
from tests.test_forwarding import ProxyTestCase
from tests.test_service import operations_over, service_config


class AdminTests(ProxyTestCase):
    async def test_set_port_moves_persists_and_restores(self) -> None:
        """
        set-port moves the live facade, persists the port, and a restart
        comes back on it ahead of the configured port (§8).
        """
        fake = await self.engine("ollama", ["m:latest"])
        state = os.path.abspath(self.mktemp())
        config = proxy_config(state, {"ollama": fake.url}, admin=True)
        proxy = await start_proxy(reactor, config)
        admin = f"http://127.0.0.1:{proxy.admin.bound_port()}"
        new = free_port()
        code, _, body = await self.client.request(
            "PUT",
            admin + "/admin/engines/ollama/port",
            data=json.dumps({"port": new}).encode(),
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(proxy.listeners["ollama"].bound_port(), new)
        code, _, _ = await self.client.request(
            "GET", f"http://127.0.0.1:{new}/api/tags"
        )
        self.assertEqual(code, 200)
        self.assertEqual(PortStore(state).get("ollama"), new)
        await proxy.stopService()

        restarted = await start_proxy(reactor, config)
        self.addCleanup(restarted.stopService)
        self.assertEqual(restarted.listeners["ollama"].bound_port(), new)

    async def test_set_port_errors(self) -> None:
        fake = await self.engine("ollama", ["m:latest"])
        proxy = await self.proxy({"ollama": fake.url}, admin=True)
        admin = f"http://127.0.0.1:{proxy.admin.bound_port()}"
        blocker = reactor.listenTCP(0, Factory(), interface="127.0.0.1")
        self.addCleanup(blocker.stopListening)
        taken = blocker.getHost().port
        cases = [
            ("ollama", {"port": 70000}, 400),
            ("ollama", {"port": "x"}, 400),
            ("tgi", {"port": 9000}, 404),
            ("lmstudio", {"port": 9000}, 404),
            ("ollama", {"port": taken}, 409),
        ]
        before = proxy.listeners["ollama"].bound_port()
        for engine, body, expected in cases:
            code, _, answer = await self.client.request(
                "PUT",
                admin + f"/admin/engines/{engine}/port",
                data=json.dumps(body).encode(),
            )
            self.assertEqual(code, expected, (engine, body, answer))
            self.assertIn("error", json.loads(answer))
        # A failed move leaves the facade where it was, nothing persisted.
        self.assertEqual(proxy.listeners["ollama"].bound_port(), before)
        self.assertIsNone(PortStore(proxy.config.state_dir).get("ollama"))

    async def test_nvproxyctl(self) -> None:
        """
        The console script talks to the admin API: status, select, set-port.
        """
        fake = await self.engine("ollama", ["m:latest"])
        proxy = await self.proxy({"ollama": fake.url}, admin=True)
        address = f"127.0.0.1:{proxy.admin.bound_port()}"

        def ctl(*argv: str) -> Any:
            return nvproxyctl(address, *argv)

        code, out = await ctl("--json", "status")
        self.assertEqual(code, 0, out)
        status = json.loads(out)
        self.assertEqual(status["node_id"], "local")
        self.assertEqual(status["nodes"], {"local": {"ollama": ["m:latest"]}})
        code, out = await ctl("--json", "select", "ollama", "local")
        self.assertEqual((code, json.loads(out)["selected"]), (0, "local"))
        self.assertEqual(proxy.pins, {"ollama": "local"})
        code, out = await ctl("select", "ollama", "--clear")
        self.assertEqual(code, 0, out)
        self.assertEqual(proxy.pins, {})
        code, out = await ctl("set-port", "nope", "9999")
        self.assertEqual(code, 1, out)
        code, out = await ctl("--admin", "127.0.0.1:1", "status")
        self.assertEqual(code, 2)
        self.assertIn("cannot reach the admin API", out)

    async def test_status_process(self) -> None:
        """
        C{/admin/status} reports the process's open fds, pending DelayedCalls
        and RSS, for a harness outside the process to watch for leaks.
        """
        if not os.path.isdir("/proc/self/fd"):
            raise SkipTest("needs /proc")
        fake = await self.engine("ollama", ["m:latest"])
        proxy = await self.proxy({"ollama": fake.url}, admin=True)
        admin = f"http://127.0.0.1:{proxy.admin.bound_port()}"
        code, _, body = await self.client.request("GET", admin + "/admin/status")
        self.assertEqual(code, 200, body)
        process = json.loads(body)["process"]
        self.assertEqual(sorted(process), ["delayed_calls", "open_fds", "rss_bytes"])
        # The daemon runs in this process: the same fd table, reactor, memory.
        fds = len(os.listdir("/proc/self/fd"))
        self.assertLessEqual(abs(process["open_fds"] - fds), 5)
        self.assertGreaterEqual(process["delayed_calls"], 1)  # discovery polling
        self.assertLessEqual(
            process["delayed_calls"], len(reactor.getDelayedCalls()) + 5
        )
        with open("/proc/self/statm", "rb") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        self.assertLess(abs(process["rss_bytes"] - rss), 16 << 20)

    def test_ctl_usage(self) -> None:
        from nvproxy.ctl import main

        out = io.StringIO()
        with self.assertRaises(SystemExit):
            main(["frobnicate"], out)


class _Hold(Protocol):
    """
    An HTTP client that starts a request and never finishes it.
    """

    def __init__(self) -> None:
        self.data = b""

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(b"GET /v1/models HTTP/1.1\r\n")

    def dataReceived(self, data: bytes) -> None:
        self.data += data


class LimitTests(ProxyTestCase):
    async def test_connection_limit_fast_503(self) -> None:
        fake = await self.engine("openai", ["m"])
        proxy = await self.proxy({"lmstudio": fake.url})
        proxy.sites["lmstudio"].max_connections = 2
        port = proxy.listeners["lmstudio"].bound_port()
        held = []
        for _ in range(2):
            protocol = _Hold()
            await connectProtocol(
                TCP4ClientEndpoint(reactor, "127.0.0.1", port), protocol
            )
            self.addCleanup(protocol.transport.loseConnection)  # type: ignore[union-attr]
            held.append(protocol)
        await deferLater(reactor, 0.05, lambda: None)
        code, headers, body = await self.client.request(
            "GET", facade_url(proxy, "lmstudio") + "/v1/models"
        )
        self.assertEqual(code, 503)
        self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"1"])
        self.assertIn("too many connections", json.loads(body)["error"]["message"])


class AliasTests(ProxyTestCase):
    async def test_alias_serves_and_occupied_alias_is_contained(self) -> None:
        """
        An alias address enters the same routing path; an occupied alias is
        a warning and leaves the primary listener up (§7).
        """
        fake = await self.engine("ollama", ["m:latest"])
        config = proxy_config(self.mktemp(), {"ollama": fake.url})
        alias_port, taken_port = free_port("127.0.0.2"), free_port("127.0.0.2")
        blocker = reactor.listenTCP(taken_port, Factory(), interface="127.0.0.2")
        self.addCleanup(blocker.stopListening)
        engines = dict(config.engines)
        engines["ollama"] = evolve(
            engines["ollama"],
            aliases=(("127.0.0.2", alias_port), ("127.0.0.2", taken_port)),
        )
        proxy = await start_proxy(reactor, evolve(config, engines=engines))
        self.addCleanup(proxy.stopService)
        self.assertEqual(
            [a.listening is not None for a in proxy.aliases], [True, False]
        )
        self.assertIsNotNone(proxy.listeners["ollama"].listening)
        code, _, body = await self.post(
            f"http://127.0.0.2:{alias_port}/api/generate",
            {"model": "m", "stream": False},
        )
        self.assertEqual(code, 200, body)
        code, _, _ = await self.client.request(
            "GET", facade_url(proxy, "ollama") + "/api/tags"
        )
        self.assertEqual(code, 200)


class FakeManager:
    """
    The part of L{nvproxy.vllm.VllmManager} the wake and sleep operations
    use: one service, C{text}, answering with C{wake_result} and
    C{sleep_result}.
    """

    def __init__(self) -> None:
        self.registry = VllmRegistry(
            [VllmServiceConfig("text", "http://127.0.0.1:1", "m")]
        )
        self.wake_result: Deferred[None] = succeed(None)
        self.sleep_result: Deferred[None] = succeed(None)
        self.calls: list[tuple[Any, ...]] = []

    def wake(self, name: str) -> Deferred[None]:
        self.calls.append(("wake", name))
        return self.wake_result

    def sleep(self, name: str, level: int) -> Deferred[None]:
        self.calls.append(("sleep", name, level))
        return self.sleep_result

    def status(self) -> list[dict[str, Any]]:
        return []


class VllmAdminTests(SynchronousTestCase):
    """
    C{POST /admin/wake/<service>} and C{/admin/sleep/<service>} (FD §6.5):
    the admin app over the operations, in memory.
    """

    def setUp(self) -> None:
        self.manager = FakeManager()
        proxy = build(service_config(self), MemoryReactorClock(), hostname="x")
        ops = operations_over(proxy, self.manager)
        self.stub = StubTreq(admin_app(ops, CollectorRegistry(), vllm=True).resource())

    def post(self, path: str, stub: StubTreq | None = None) -> tuple[int, Any, Any]:
        client: Any = stub or self.stub
        d = client.post("http://admin" + path)
        client.flush()
        response = self.successResultOf(d)
        body = self.successResultOf(treq.json_content(response))
        retry = response.headers.getRawHeaders(b"retry-after")
        return response.code, retry, body

    def test_wake(self) -> None:
        self.assertEqual(
            self.post("/admin/wake/text"),
            (200, None, {"service": "text", "state": "awake"}),
        )
        self.assertEqual(self.manager.calls, [("wake", "text")])

    def test_wake_fails_depth_aware(self) -> None:
        error = Waking("text", "m", Depth.OFFLOADED, 40)
        self.manager.wake_result = fail(error)
        self.assertEqual(
            self.post("/admin/wake/text"),
            (
                503,
                [b"%d" % Depth.OFFLOADED.retry_after],
                {"error": str(error), "sleep_depth": "offloaded"},
            ),
        )

    def test_stopping(self) -> None:
        self.manager.wake_result = fail(ManagerStopped())
        self.manager.sleep_result = fail(ManagerStopped())
        for path in ("/admin/wake/text", "/admin/sleep/text"):
            self.assertEqual(
                self.post(path), (503, None, {"error": "shutting down"}), path
            )

    def test_unknown_service(self) -> None:
        for path in ("/admin/wake/nope", "/admin/sleep/nope?level=2"):
            self.assertEqual(
                self.post(path),
                (404, None, {"error": "unknown vLLM service 'nope'"}),
                path,
            )
        self.assertEqual(self.manager.calls, [])

    def test_sleep(self) -> None:
        self.assertEqual(
            self.post("/admin/sleep/text?level=2"),
            (200, None, {"service": "text", "state": "asleep", "level": 2}),
        )
        self.assertEqual(self.post("/admin/sleep/text")[2]["level"], 1)
        self.assertEqual(
            self.manager.calls, [("sleep", "text", 2), ("sleep", "text", 1)]
        )

    def test_sleep_bad_level(self) -> None:
        for level in ("3", "x", "0"):
            self.assertEqual(
                self.post(f"/admin/sleep/text?level={level}"),
                (400, None, {"error": "level must be 1 or 2"}),
            )
        self.assertEqual(self.manager.calls, [])

    def test_sleep_refused_and_failed(self) -> None:
        self.manager.sleep_result = fail(Refused("1 active request"))
        self.assertEqual(
            self.post("/admin/sleep/text"),
            (409, None, {"error": "refused: 1 active request"}),
        )
        self.manager.sleep_result = fail(RuntimeError("HTTP 500"))
        self.assertEqual(
            self.post("/admin/sleep/text"),
            (502, None, {"error": "sleep failed: HTTP 500"}),
        )

    def test_wake_internal_error(self) -> None:
        self.manager.wake_result = fail(RuntimeError("bug"))
        self.assertEqual(
            self.post("/admin/wake/text"), (500, None, {"error": "internal error"})
        )
        self.flushLoggedErrors(RuntimeError)

    def test_no_vllm(self) -> None:
        """A node with no vLLM service has no wake or sleep route."""
        proxy = build(service_config(self), MemoryReactorClock(), hostname="x")
        stub = StubTreq(admin_app(proxy.ops, CollectorRegistry()).resource())
        for path in ("/admin/wake/text", "/admin/sleep/text?level=3"):
            self.assertEqual(
                self.post(path, stub), (404, None, {"error": "not found"}), path
            )


class LoopbackOriginTests(SynchronousTestCase):
    """The admin API refuses rebound names and cross-origin changes."""

    def render(
        self, method: bytes, host: bytes | None, origin: bytes | None = None
    ) -> tuple[int | None, list[bytes]]:
        from twisted.web.resource import Resource
        from twisted.web.test.requesthelper import DummyRequest

        from nvproxy.admin import LoopbackOrigin

        served: list[bytes] = []

        class Inner(Resource):
            isLeaf = True

            def render(self, request: Any) -> bytes:
                served.append(request.method)
                return b"ok"

        refused: list[str] = []

        def forbid(request: Any, reason: str) -> None:
            refused.append(reason)
            request.setResponseCode(403)

        request = DummyRequest([b"admin", b"drain"])
        request.method = method
        if host is not None:
            request.requestHeaders.setRawHeaders(b"host", [host])
        if origin is not None:
            request.requestHeaders.setRawHeaders(b"origin", [origin])
        LoopbackOrigin(Inner(), forbid).render(request)
        return (403 if refused else 200), served

    def test_loopback_hosts(self) -> None:
        for host in (b"127.0.0.1:8010", b"127.0.0.2", b"[::1]:8010", b"localhost:8010"):
            self.assertEqual(self.render(b"GET", host), (200, [b"GET"]), host)

    def test_rebound_name_refused(self) -> None:
        for host in (b"evil.example:8010", b"10.0.0.1:8010", None):
            self.assertEqual(self.render(b"GET", host), (403, []), host)

    def test_cross_origin_change_refused(self) -> None:
        host = b"127.0.0.1:8010"
        self.assertEqual(self.render(b"POST", host, b"http://evil.example"), (403, []))
        self.assertEqual(
            self.render(b"POST", host, b"http://127.0.0.1:8010"), (200, [b"POST"])
        )
        self.assertEqual(self.render(b"POST", host), (200, [b"POST"]), "no Origin")
        self.assertEqual(
            self.render(b"GET", host, b"http://evil.example"), (200, [b"GET"])
        )
