"""
The vLLM facade end to end on loopback: nvproxy in-process, fake vLLM
services with the real sleep/wake API shape, real sockets (FD §6, §10).
"""

from __future__ import annotations

import json
from typing import Any

from attrs import evolve
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.task import deferLater

from nvproxy.config import VllmHold, VllmServiceConfig
from nvproxy.service import NvProxy
from nvproxy.testing.fakevllm import FakeVLLM
from nvproxy.testing.harness import facade_url, nvproxyctl, proxy_config, start_proxy
from tests.test_forwarding import ProxyTestCase

HIDDEN = [
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/v1/../sleep",
    "/v1%2f..%2fsleep",
    "/v1%2F..%2Fsleep",
    "//sleep",
    "/./sleep",
    "/SLEEP",
    "/%2573leep",
    "/admin/status",
    "/admin/sleep/text",
]


def engine_calls(fake: FakeVLLM) -> list[tuple[str, str]]:
    """What a fake saw, without nvproxy's state polls (GET /metrics)."""
    return [(m, p) for _, m, p in fake.calls if (m, p) != ("GET", "/metrics")]


class VllmFacadeTests(ProxyTestCase):
    async def start(
        self, nodes: dict[str, dict[str, str]] | None = None, **hold: float
    ) -> tuple[NvProxy, FakeVLLM, FakeVLLM, FakeVLLM]:
        text = FakeVLLM(reactor, model="Qwen3-Text")
        embed = FakeVLLM(reactor, model="Embed-8B")
        ocr = FakeVLLM(reactor, model="OvisOCR2")
        for fake in (text, embed, ocr):
            fake.listen(reactor)
            self.addCleanup(fake.stop)
        services = (
            VllmServiceConfig(
                "text",
                text.url,
                "Qwen3-Text",
                aliases=("qwen-text",),
                default_for=("/v1/chat/completions", "/v1/completions"),
            ),
            VllmServiceConfig(
                "embed", embed.url, "Embed-8B", default_for=("/v1/embeddings",)
            ),
            VllmServiceConfig(
                "ocr",
                ocr.url,
                "OvisOCR2",
                default_for=("multipart:/v1/chat/completions",),
            ),
        )
        config = proxy_config(
            self.mktemp(), {"vllm": text.url}, admin=True, nodes=nodes
        )
        engines = dict(config.engines)
        engines["vllm"] = evolve(
            engines["vllm"], services=services, hold=VllmHold(**hold)
        )
        proxy = await start_proxy(reactor, evolve(config, engines=engines))
        self.addCleanup(proxy.stopService)
        # the startup look at each service (one GET /is_sleeping, no wake)
        assert proxy.vllm is not None
        for _ in range(200):
            if all(s["state"] != "unknown" for s in proxy.vllm.status()):
                break
            await deferLater(reactor, 0.01, lambda: None)
        for fake in (text, embed, ocr):
            self.assertEqual(engine_calls(fake), [("GET", "/is_sleeping")])
            del fake.calls[:]
        return proxy, text, embed, ocr

    async def noticed(self, proxy: NvProxy, name: str, state: str) -> None:
        """Wait until the state poll has seen service C{name} in C{state}."""
        assert proxy.vllm is not None
        for _ in range(200):
            status = {s["name"]: s for s in proxy.vllm.status()}
            if status[name]["state"] == state:
                return
            await deferLater(reactor, 0.01, lambda: None)
        self.fail(f"{name} not {state}: {status[name]}")

    def admin(self, proxy: NvProxy) -> str:
        return f"http://127.0.0.1:{proxy.admin.bound_port()}"

    async def test_wakes_sleeping_service_then_serves(self) -> None:
        """
        FD §10 case 1: a request for a sleeping model wakes it (one wake
        sequence, in order) and is served only once it is healthy; nothing
        ever reaches the service while it sleeps.
        """
        proxy, text, _, _ = await self.start()
        text.force_sleep(1)
        await self.noticed(proxy, "text", "asleep")
        code, _, body = await self.post(
            facade_url(proxy, "vllm") + "/v1/chat/completions",
            {"model": "qwen-text", "messages": [{"role": "user", "content": "hi"}]},
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(json.loads(body)["model"], "Qwen3-Text")
        self.assertEqual(text.wake_sequences, 1)
        self.assertEqual(text.violations, [])
        paths = [path.split("?")[0] for _, _, path in text.calls]
        for step in ("/wake_up", "/collective_rpc", "/reset_prefix_cache", "/health"):
            self.assertIn(step, paths)
        self.assertLess(paths.index("/wake_up"), paths.index("/v1/chat/completions"))

    async def test_concurrent_requests_one_wake(self) -> None:
        """
        FD §10 case 9: ten concurrent requests while asleep, one wake.
        """
        proxy, text, _, _ = await self.start()
        text.force_sleep(2)
        text.wake_latency = 0.2
        await self.noticed(proxy, "text", "asleep")
        url = facade_url(proxy, "vllm") + "/v1/completions"
        answers = await gatherResults(
            [Deferred.fromCoroutine(self.post(url, {"prompt": "x"})) for _ in range(10)]
        )
        self.assertEqual([code for code, _, _ in answers], [200] * 10)
        self.assertEqual(text.wake_sequences, 1)
        self.assertEqual(text.violations, [])

    async def test_streaming_during_wake(self) -> None:
        """
        FD §10 case 5: a streaming request held during the wake gets its
        whole stream after it.
        """
        proxy, text, _, _ = await self.start()
        text.force_sleep(1)
        text.wake_latency = 0.2
        await self.noticed(proxy, "text", "asleep")
        code, headers, body = await self.post(
            facade_url(proxy, "vllm") + "/v1/chat/completions",
            {"model": "Qwen3-Text", "stream": True, "messages": []},
        )
        self.assertEqual(code, 200)
        self.assertTrue(body.rstrip().endswith(b"data: [DONE]"))
        self.assertEqual(text.violations, [])

    async def test_unknown_model_404_no_wake(self) -> None:
        """
        FD §10 case 6.
        """
        proxy, text, embed, ocr = await self.start()
        text.force_sleep(1)
        code, _, body = await self.post(
            facade_url(proxy, "vllm") + "/v1/chat/completions",
            {"model": "gpt-9", "messages": []},
        )
        self.assertEqual(code, 404)
        error = json.loads(body)["error"]
        self.assertEqual(error["code"], "model_not_found")
        self.assertEqual(text.wake_calls, 0)

    async def test_routing_defaults(self) -> None:
        """
        Embeddings go to the embed service whatever the body says; a
        multipart chat with no model goes to the OCR service (FD §6.2).
        """
        proxy, text, embed, ocr = await self.start()
        url = facade_url(proxy, "vllm")
        code, _, _ = await self.post(url + "/v1/embeddings", {"input": "x"})
        self.assertEqual(code, 200)
        self.assertIn("/v1/embeddings", [p for _, _, p in embed.calls])
        boundary = "b0und"
        body = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                f'filename="scan.png"\r\n\r\n'
            ).encode()
            + b"\x89PNG" * 1000
            + f"\r\n--{boundary}--\r\n".encode()
        )
        code, _, answer = await self.client.request(
            "POST",
            url + "/v1/chat/completions",
            data=body,
            headers={"Content-Type": [f"multipart/form-data; boundary={boundary}"]},
        )
        # Routed to the OCR service by the multipart default, body untouched
        # (whatever that service then makes of it).
        self.assertIn("/v1/chat/completions", [p for _, _, p in ocr.calls])
        self.assertNotIn("/v1/chat/completions", [p for _, _, p in text.calls])

    async def test_models_listed_without_waking(self) -> None:
        proxy, text, embed, ocr = await self.start()
        for fake in (text, embed, ocr):
            fake.force_sleep(2)
        code, _, body = await self.client.request(
            "GET", facade_url(proxy, "vllm") + "/v1/models"
        )
        self.assertEqual(code, 200)
        ids = sorted(m["id"] for m in json.loads(body)["data"])
        self.assertEqual(ids, ["Embed-8B", "OvisOCR2", "Qwen3-Text"])
        self.assertEqual([engine_calls(f) for f in (text, embed, ocr)], [[], [], []])

    async def test_hidden_endpoints(self) -> None:
        """
        FD §10 cases 7 and 14: dev endpoints and /admin/* answer 404 on the
        public port however the path is spelled, and never reach vLLM.
        """
        proxy, text, _, _ = await self.start()
        url = facade_url(proxy, "vllm")
        for path in HIDDEN:
            for method in ("GET", "POST"):
                code, _, _ = await self.client.request(method, url + path)
                self.assertEqual(code, 404, f"{method} {path}")
        self.assertEqual(engine_calls(text), [])

    async def test_depth_aware_503_when_down(self) -> None:
        """
        FD §10 case 8 with the hold shortened: a restarting service holds
        the request, then answers 503 with Retry-After 600 and the
        model_waking body.
        """
        proxy, text, _, _ = await self.start(
            sleeping=0.3, offloaded=0.3, restarting=0.3
        )
        text.set_down()
        code, headers, body = await self.post(
            facade_url(proxy, "vllm") + "/v1/chat/completions",
            {"model": "Qwen3-Text", "messages": []},
        )
        self.assertEqual(code, 503)
        self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"600"])
        error = json.loads(body)["error"]
        self.assertEqual(
            (error["type"], error["code"], error["sleep_depth"]),
            ("model_waking", "model_waking", "restarting"),
        )
        self.assertIn("estimated_wake_seconds", error)

    async def test_external_sleep_and_wake_noticed(self) -> None:
        """
        The service is slept and woken directly on its own port, as vllmctl
        or a cron job would: a request sent at once is answered (woken
        through nvproxy, never left waiting inside the engine), and the
        admin status follows each change within a poll interval.
        """
        proxy, text, _, _ = await self.start()
        assert proxy.vllm is not None
        self.assertEqual(proxy.vllm.poll_interval, 0.05)  # discovery.poll_interval
        text.crash_on_request_while_asleep = False  # vLLM 0.32: it waits
        code, _, _ = await self.client.request("POST", text.url + "/sleep?level=1")
        self.assertEqual(code, 200)
        code, _, body = await self.post(
            facade_url(proxy, "vllm") + "/v1/chat/completions",
            {"model": "Qwen3-Text", "messages": []},
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(text.wake_sequences, 1)
        # forwarded before the poll saw the sleep, or held after: either way
        self.assertIn([v.kind for v in text.violations], ([], ["request_while_asleep"]))
        del text.violations[:]
        code, _, _ = await self.client.request("POST", text.url + "/sleep?level=2")
        self.assertEqual(code, 200)
        await self.noticed(proxy, "text", "asleep")
        status = await self._status(proxy)
        text_status = next(s for s in status["vllm"] if s["name"] == "text")
        self.assertEqual(
            (text_status["state"], text_status["sleep_depth"]), ("asleep", "offloaded")
        )
        for path in ("/wake_up", "/collective_rpc", "/reset_prefix_cache"):
            code, _, _ = await self.post(text.url + path, {"method": "reload_weights"})
            self.assertEqual(code, 200)
        await self.noticed(proxy, "text", "awake")
        self.assertEqual(text.wake_sequences, 2)
        self.assertEqual(text.violations, [])

    async def test_admin_sleep_and_wake(self) -> None:
        proxy, text, _, _ = await self.start()
        admin = self.admin(proxy)
        code, _, body = await self.client.request(
            "POST", admin + "/admin/sleep/text?level=2"
        )
        self.assertEqual(code, 200, body)
        self.assertTrue(text.is_sleeping)
        status = await self._status(proxy)
        text_status = next(s for s in status["vllm"] if s["name"] == "text")
        self.assertEqual(text_status["sleep_depth"], "offloaded")
        code, _, _ = await self.client.request("POST", admin + "/admin/wake/text")
        self.assertEqual(code, 200)
        self.assertFalse(text.is_sleeping)
        code, _, _ = await self.client.request("POST", admin + "/admin/sleep/nope")
        self.assertEqual(code, 404)
        code, _, _ = await self.client.request(
            "POST", admin + "/admin/sleep/text?level=3"
        )
        self.assertEqual(code, 400)

    async def _status(self, proxy: NvProxy) -> Any:
        code, _, body = await self.client.request(
            "GET", self.admin(proxy) + "/admin/status"
        )
        self.assertEqual(code, 200)
        return json.loads(body)

    async def test_awake_owner_before_sleeping_one(self) -> None:
        """
        DESIGN §4: with an awake owner elsewhere, a sleeping local service is
        not woken; once no awake owner has the model, it is.
        """
        other = FakeVLLM(reactor, model="Qwen3-Text")
        other.listen(reactor)
        self.addCleanup(other.stop)
        proxy, text, _, _ = await self.start(nodes={"gpu-2": {"vllm": other.url}})
        self.assertEqual(
            [e.node_id for e in proxy.discovery.current.owners("vllm", "Qwen3-Text")],
            ["local", "gpu-2"],
        )
        assert proxy.vllm is not None
        await proxy.vllm.sleep("text", 1)  # known asleep, as the idle timer does
        url = facade_url(proxy, "vllm") + "/v1/completions"
        code, _, _ = await self.post(url, {"model": "Qwen3-Text", "prompt": "x"})
        self.assertEqual(code, 200)
        self.assertIn("/v1/completions", [p for _, _, p in other.calls])
        self.assertEqual(text.wake_calls, 0)
        other.set_down()
        await proxy.polling.poll()
        code, _, _ = await self.post(url, {"model": "Qwen3-Text", "prompt": "x"})
        self.assertEqual(code, 200)
        self.assertEqual(text.wake_sequences, 1)
        self.assertEqual(text.violations, [])

    async def test_nvproxyctl_wake_sleep_status(self) -> None:

        proxy, text, _, _ = await self.start()
        address = f"127.0.0.1:{proxy.admin.bound_port()}"

        def ctl(*argv: str) -> Any:
            return nvproxyctl(address, *argv)

        code, out = await ctl("sleep", "text", "--level", "1")
        self.assertEqual(code, 0, out)
        self.assertTrue(text.is_sleeping)
        code, out = await ctl("--json", "status")
        services = {s["name"]: s for s in json.loads(out)["vllm"]}
        self.assertEqual(services["text"]["sleep_depth"], "sleeping")
        code, out = await ctl("wake", "text")
        self.assertEqual(code, 0, out)
        self.assertFalse(text.is_sleeping)
        code, out = await ctl("wake", "nope")
        self.assertEqual(code, 1, out)

    async def test_nvproxyctl_wake_wait(self) -> None:
        """
        C{wake --wait} shows the state changes with the time elapsed until
        awake; C{--timeout} covers the whole wake, and running out of it is
        said as such (exit 1), not as an unreachable daemon.
        """
        proxy, text, _, _ = await self.start()
        address = f"127.0.0.1:{proxy.admin.bound_port()}"
        code, out = await nvproxyctl(address, "sleep", "text", "--level", "1")
        self.assertEqual(code, 0, out)
        text.wake_latency = 1.2
        code, out = await nvproxyctl(address, "wake", "text", "--wait")
        self.assertEqual(code, 0, out)
        lines = out.splitlines()
        self.assertRegex(lines[0], r"^ +\d+\.\ds  (asleep|waking) \(sleeping\)$")
        self.assertRegex(lines[-1], r"^text is awake after \d+\.\ds$")
        self.assertTrue(any("waking" in line for line in lines), out)
        await nvproxyctl(address, "sleep", "text", "--level", "1")
        text.wake_latency = 3.0
        code, out = await nvproxyctl(address, "--timeout", "0.5", "wake", "text")
        self.assertEqual(code, 1, out)
        self.assertIn("text is not awake after 0.5s; the wake goes on", out)

    async def test_modelless_routes_never_wake(self) -> None:
        """
        /health is the front door's own (FD §6.2) and a route naming no
        model goes only to an awake service: pollers keep nothing awake.
        """
        proxy, text, embed, ocr = await self.start()
        assert proxy.vllm is not None
        for name in ("text", "embed", "ocr"):
            await proxy.vllm.sleep(name, 1)  # known asleep, as the idle timer does
        url = facade_url(proxy, "vllm")
        code, _, body = await self.client.request("GET", url + "/health")
        self.assertEqual(code, 200)
        health = json.loads(body)
        self.assertEqual(health["status"], "ok")
        self.assertEqual(
            sorted(s["name"] for s in health["services"]), ["embed", "ocr", "text"]
        )
        code, _, _ = await self.client.request("GET", url + "/version")
        self.assertEqual(code, 502)
        self.assertEqual([f.wake_calls for f in (text, embed, ocr)], [0, 0, 0])
        # Once a service is awake, such a route reaches it, still unwoken.
        await self.post(url + "/v1/embeddings", {"input": "x"})
        code, _, _ = await self.client.request("GET", url + "/version")
        self.assertEqual(code, 200)
        self.assertIn("/version", [p for _, _, p in embed.calls])
        self.assertEqual(text.wake_calls, 0)


class VllmFacadeMetricsTests(ProxyTestCase):
    """
    C{/metrics} on the vLLM front door is a 404 in its dialect: no one
    service's metrics pass for the front door's, and a sleeping fleet does
    not turn it into a 502.  nvproxy's own metrics stay on the admin
    listener.
    """

    async def test_metrics_not_found(self) -> None:
        text = FakeVLLM(reactor, model="Qwen3-Text")
        text.listen(reactor)
        self.addCleanup(text.stop)
        config = proxy_config(self.mktemp(), {"vllm": text.url}, admin=True)
        engines = dict(config.engines)
        engines["vllm"] = evolve(
            engines["vllm"],
            services=(VllmServiceConfig("text", text.url, "Qwen3-Text"),),
        )
        proxy = await start_proxy(reactor, evolve(config, engines=engines))
        self.addCleanup(proxy.stopService)
        assert proxy.vllm is not None
        url = facade_url(proxy, "vllm")
        for asleep in (False, True):
            if asleep:
                await proxy.vllm.sleep("text", 1)
            for path in ("/metrics", "//metrics", "/v1/../metrics"):
                code, _, body = await self.client.request("GET", url + path)
                self.assertEqual(code, 404, (path, asleep))
                error = json.loads(body)["error"]
                self.assertEqual(
                    (error["type"], error["code"]), ("not_found_error", 404)
                )
                self.assertIn("admin listener", error["message"])
        # (The answers are nvproxy's own, so none was the engine's; nvproxy
        # itself may read the engine's /metrics for its sleep state.)
        self.assertEqual(text.wake_calls, 0)
        admin = f"http://127.0.0.1:{proxy.admin.bound_port()}/metrics"
        code, _, body = await self.client.request("GET", admin)
        self.assertEqual(code, 200)
        self.assertIn(b"# TYPE", body)
