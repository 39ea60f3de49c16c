"""
Integration tests for dispatch with the real listener: failover between
three nodes, streaming and not, in both dialects; what the client gets when
the budget runs out; panic containment (spec §3.2, §5.1-5.4).
"""

from __future__ import annotations

import json

from twisted.internet import reactor

from nvproxy.testing.fakeengine import Behaviour, FakeEngine
from nvproxy.testing.harness import facade_url, free_port
from tests.test_accounting import _inference
from tests.test_forwarding import ProxyTestCase


class FailoverTests(ProxyTestCase):
    async def three(self, dialect: str, model: str) -> list[FakeEngine]:
        return [await self.engine(dialect, [model]) for _ in range(3)]

    async def check_failover(self, dialect: str, engine: str, stream: bool) -> None:
        """
        Node 1 answers 503, node 2 resets the connection, node 3 serves: the
        client gets node 3's answer, intact, after one round.
        """
        model = "m:latest" if dialect == "ollama" else "m"
        a, b, c = await self.three(dialect, model)
        a.default = Behaviour(status=503)
        b.default = Behaviour(refuse=True)
        c.default = Behaviour(chunks=7)
        proxy = await self.proxy(
            {engine: a.url},
            nodes={"gpu-2": {engine: b.url}, "gpu-3": {engine: c.url}},
        )
        path = "/api/chat" if dialect == "ollama" else "/v1/chat/completions"
        code, _, body = await self.post(
            facade_url(proxy, engine) + path,
            {"model": "m", "stream": stream, "messages": []},
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(
            [len(_inference(e)) for e in (a, b, c)], [1, 1, 1], "one attempt each"
        )
        if stream and dialect == "ollama":
            lines = body.splitlines()
            self.assertEqual(len(lines), 8)
            self.assertTrue(json.loads(lines[-1])["done"])
        elif stream:
            self.assertTrue(body.rstrip().endswith(b"data: [DONE]"))
        else:
            json.loads(body)

    async def test_ollama_streaming(self) -> None:
        await self.check_failover("ollama", "ollama", True)

    async def test_ollama_non_streaming(self) -> None:
        await self.check_failover("ollama", "ollama", False)

    async def test_openai_streaming(self) -> None:
        await self.check_failover("openai", "lmstudio", True)

    async def test_openai_non_streaming(self) -> None:
        await self.check_failover("openai", "vllm", False)

    async def test_large_body_is_sent_again_on_retry(self) -> None:
        """
        A body too large to hold in memory (spooled to a file) reaches every
        attempt whole: a retry re-reads it from the start.
        """
        fake = await self.engine("openai", ["m"])
        fake.script(Behaviour(status=503), Behaviour(status=503))
        proxy = await self.proxy({"lmstudio": fake.url}, backoff=(0.01,))
        prompt = "x" * (3 * 1024 * 1024)
        code, _, _ = await self.post(
            facade_url(proxy, "lmstudio") + "/v1/completions",
            {"model": "m", "prompt": prompt},
        )
        self.assertEqual(code, 200)
        bodies = [r.body for r in fake.requests if r.path == "/v1/completions"]
        self.assertEqual(len(bodies), 3)
        self.assertEqual({len(b) for b in bodies}, {len(bodies[0])})
        self.assertEqual(json.loads(bodies[-1])["prompt"], prompt)

    async def test_final_attempt_answers_for_itself(self) -> None:
        """
        Five fast 503s: the fifth one's status and body reach the client
        unchanged (§5.4).
        """
        fake = await self.engine("openai", ["m"])
        fake.default = Behaviour(
            status=503, body=b'{"error":"engine busy #5"}', retry_after=7
        )
        proxy = await self.proxy({"lmstudio": fake.url}, backoff=(0.01,))
        code, headers, body = await self.post(
            facade_url(proxy, "lmstudio") + "/v1/chat/completions", {"model": "m"}
        )
        self.assertEqual((code, body), (503, b'{"error":"engine busy #5"}'))
        self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"7"])
        self.assertEqual(len(_inference(fake)), 5)

    async def test_transport_failure_on_final_is_502(self) -> None:
        fake = await self.engine("ollama", ["m:latest"])
        fake.default = Behaviour(refuse=True)
        proxy = await self.proxy({"ollama": fake.url}, backoff=(0.01,), max_attempts=2)
        code, _, body = await self.post(
            facade_url(proxy, "ollama") + "/api/generate", {"model": "m"}
        )
        self.assertEqual(code, 502)
        self.assertIn("error", json.loads(body))
        self.assertEqual(len(_inference(fake)), 2)

    async def test_headers_then_silence_504(self) -> None:
        """
        An engine that sends headers and then nothing is retried; on the
        final attempt the answer is 504 (§5.2).
        """
        fake = await self.engine("openai", ["m"])
        fake.default = Behaviour(headers_then_silence=True)
        proxy = await self.proxy(
            {"vllm": fake.url},
            backoff=(0.01,),
            max_attempts=2,
            response_header_timeout=0.2,
        )
        code, _, body = await self.post(
            facade_url(proxy, "vllm") + "/v1/chat/completions", {"model": "m"}
        )
        self.assertEqual(code, 504)
        self.assertEqual(json.loads(body)["error"]["code"], 504)
        self.assertEqual(len(_inference(fake)), 2)

    async def test_pull_never_started_twice(self) -> None:
        """
        A non-inference route is tried once per candidate: a failing
        POST /api/pull is not retried on the same node (§5.1).
        """
        fake = await self.engine("ollama", ["m:latest"])
        fake.script(Behaviour(status=500), path="/api/pull")
        proxy = await self.proxy({"ollama": fake.url})
        code, _, _ = await self.post(
            facade_url(proxy, "ollama") + "/api/pull", {"model": "phi"}
        )
        self.assertEqual(code, 500)
        self.assertEqual(fake.pulls, ["phi"])

    async def test_owner_dies_mid_stream(self) -> None:
        """
        After commit there is no retry: a stream cut by the node dying is
        the client's to finish with, and the other node is never asked.
        """
        a = await self.engine("ollama", ["m:latest"])
        b = await self.engine("ollama", ["m:latest"])
        a.default = Behaviour(chunks=10, die_after_chunks=3)
        b.default = Behaviour(chunks=10, die_after_chunks=3)
        proxy = await self.proxy({"ollama": a.url}, nodes={"gpu-2": {"ollama": b.url}})
        from twisted.web.client import ResponseFailed

        with self.assertRaises(ResponseFailed):
            await self.post(
                facade_url(proxy, "ollama") + "/api/chat",
                {"model": "m", "messages": []},
            )
        self.assertEqual(len(_inference(a)) + len(_inference(b)), 1)
        outcomes = proxy.workloads.recent(1)[0]["workloadInfo"]
        self.assertEqual(outcomes["state"], "completed")


class PanicTests(ProxyTestCase):
    async def test_bug_answers_500_only_for_that_request(self) -> None:
        fake = await self.engine("openai", ["m"])
        proxy = await self.proxy({"lmstudio": fake.url, "vllm": fake.url})
        backend = proxy.facades["lmstudio"].backend
        original = backend.resolve

        def broken(*args: object) -> str:
            raise RuntimeError("a bug")

        backend.resolve = broken  # type: ignore[method-assign,assignment]
        code, _, body = await self.post(
            facade_url(proxy, "lmstudio") + "/v1/chat/completions", {"model": "m"}
        )
        self.assertEqual(code, 500)
        self.assertEqual(json.loads(body)["error"]["message"], "internal proxy error")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        backend.resolve = original  # type: ignore[method-assign]
        for engine in ("lmstudio", "vllm"):
            code, _, _ = await self.post(
                facade_url(proxy, engine) + "/v1/chat/completions", {"model": "m"}
            )
            self.assertEqual(code, 200)


class RefusedTests(ProxyTestCase):
    async def test_dead_owner_fails_over_fast(self) -> None:
        """
        An owner whose port refuses connections costs one failed attempt,
        not a dial timeout (600 s here: waiting for it would time the test
        out).
        """
        alive = await self.engine("ollama", ["m:latest"])
        dead = FakeEngine("ollama", ["m:latest"], reactor)
        await dead.listen(reactor, port=free_port())
        proxy = await self.proxy(
            {"ollama": dead.url},
            nodes={"gpu-2": {"ollama": alive.url}},
            dial_timeout=600.0,
        )
        await dead.stop()
        code, _, _ = await self.post(
            facade_url(proxy, "ollama") + "/api/generate",
            {"model": "m", "stream": False},
        )
        self.assertEqual(code, 200)
        self.assertEqual(len(_inference(alive)), 1)
