"""
Integration tests on loopback: a real nvproxy in-process, real sockets, fake
engines with scripted behaviour.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import ResponseDone
from twisted.web.iweb import IResponse

from nvproxy.config import Config
from nvproxy.proxy import site
from nvproxy.service import NvProxy
from nvproxy.testing.fakeengine import Behaviour, FakeEngine
from nvproxy.testing.harness import (
    Client,
    MemoryNetwork,
    eventually,
    facade_url,
    free_port,
    proxy_config,
    start_proxy,
)

_T = TypeVar("_T")


class ProxyTestCase(TestCase):
    """
    Helpers to start fake engines and nvproxy, torn down after each test.
    """

    timeout = 30

    def setUp(self) -> None:
        self.client = Client(reactor)
        self.addCleanup(self.client.close)

    async def engine(self, dialect: str, models: list[str]) -> FakeEngine:
        fake = FakeEngine(dialect, models, reactor)  # type: ignore[arg-type]
        await fake.listen(reactor)
        self.addCleanup(fake.stop)
        return fake

    async def proxy(self, backends: dict[str, str], **kwargs: Any) -> NvProxy:
        config = proxy_config(self.mktemp(), backends, **kwargs)
        proxy = await start_proxy(reactor, config)
        self.addCleanup(proxy.stopService)
        return proxy

    async def post(
        self, url: str, body: object, headers: dict[str, list[str]] | None = None
    ) -> tuple[int, Any, bytes]:
        return await self.client.request(
            "POST",
            url,
            data=json.dumps(body).encode(),
            headers=headers or {"Content-Type": ["application/json"]},
        )


class MemoryProxyTestCase(SynchronousTestCase):
    """
    L{ProxyTestCase} on a L{MemoryNetwork}: the same nvproxy and fake
    engines, on simulated time and in-memory TCP.  Nothing happens until the
    test moves the clock (C{self.net.advance}) or runs a request to its end
    (L{drive}, L{post}); each test ends with every connection closed and no
    call left on the clock.
    """

    def setUp(self) -> None:
        self.net = MemoryNetwork()
        self.client = Client(self.net)
        self.addCleanup(self._clean)
        self._stops: list[Callable[[], Deferred[Any] | None]] = []

    def _clean(self) -> None:
        self.drive(self.client.close())
        for stop in reversed(self._stops):
            d = stop()
            if d is not None:
                self.drive(d)
        self.net.settle()
        self.assertEqual(self.net.open_connections, 0, "a connection left open")
        self.assertEqual(self.net.getDelayedCalls(), [], "a call left pending")

    def drive(self, d: Deferred[_T] | Coroutine[Any, Any, _T]) -> _T:
        """Move the clock until C{d} has its result; return it."""
        if not isinstance(d, Deferred):
            d = Deferred.fromCoroutine(d)
        return self.net.run(d)

    def engine(self, dialect: str, models: list[str]) -> FakeEngine:
        fake = FakeEngine(dialect, models, self.net)  # type: ignore[arg-type]
        self.drive(fake.listen(self.net))
        self._stops.append(fake.stop)
        return fake

    def proxy(self, backends: dict[str, str], **kwargs: Any) -> NvProxy:
        config = proxy_config(
            self.mktemp(), backends, port=self.net.free_port, **kwargs
        )
        return self.start(config)

    def start(self, config: Config) -> NvProxy:
        proxy = self.drive(start_proxy(self.net, config))
        self._stops.append(proxy.stopService)
        return proxy

    def request(
        self, method: str, url: str, **kwargs: Any
    ) -> Deferred[tuple[int, Any, bytes]]:
        """Start a request; its Deferred fires as the clock moves."""
        return Deferred.fromCoroutine(self.client.request(method, url, **kwargs))

    def start_post(
        self, url: str, body: object, headers: dict[str, list[str]] | None = None
    ) -> Deferred[tuple[int, Any, bytes]]:
        return self.request(
            "POST",
            url,
            data=json.dumps(body).encode(),
            headers=headers or {"Content-Type": ["application/json"]},
        )

    def post(
        self, url: str, body: object, headers: dict[str, list[str]] | None = None
    ) -> tuple[int, Any, bytes]:
        """POST C{body} as JSON and run the clock until the answer is read."""
        return self.drive(self.start_post(url, body, headers))

    def get(self, url: str) -> tuple[int, Any, bytes]:
        return self.drive(self.request("GET", url))


class _Collect(Protocol):
    def __init__(self, chunks: list[bytes], done: Deferred[None]) -> None:
        self.chunks = chunks
        self.done = done

    def dataReceived(self, data: bytes) -> None:
        self.chunks.append(data)

    def connectionLost(self, reason: Any = None) -> None:
        if reason is not None and not reason.check(ResponseDone):
            self.done.errback(reason)
        else:
            self.done.callback(None)


class ForwardingTests(ProxyTestCase):
    async def generate(self, fake: FakeEngine) -> list[Any]:
        """An Ollama /api/generate stream through a proxy for C{fake}: its records."""
        proxy = await self.proxy({"ollama": fake.url})
        code, headers, body = await self.post(
            facade_url(proxy, "ollama") + "/api/generate",
            {"model": "llama3", "prompt": "hello"},
        )
        self.assertEqual(code, 200)
        return [json.loads(line) for line in body.splitlines()]

    async def test_ollama_streaming(self) -> None:
        """
        An Ollama streaming request passes through chunk by chunk, intact.
        """
        fake = await self.engine("ollama", ["llama3:latest"])
        fake.default = Behaviour(chunks=20)
        lines = await self.generate(fake)
        self.assertEqual(len(lines), 21)
        self.assertTrue(lines[-1]["done"])
        self.assertEqual(lines[-1]["eval_count"], 20)
        # The engine saw the request as sent, model name untouched.
        self.assertEqual(fake.requests[-1].json()["model"], "llama3")

    async def test_paced_stream_sent_at_once(self) -> None:
        """
        Chunks that arrive one read at a time are handed to the client's
        socket at the end of their read (L{nvproxy.proxy.cork}), and the
        stream arrives intact and in order.
        """
        sent: list[bytes] = []
        original = site.send_now

        def spy(transport: object, data: bytes) -> bool:
            taken = original(transport, data)
            if taken:
                sent.append(data)
            return taken

        self.patch(site, "send_now", spy)
        fake = await self.engine("ollama", ["llama3:latest"])
        fake.default = Behaviour(chunks=8, chunk_interval=0.01)
        lines = await self.generate(fake)
        self.assertEqual(len(lines), 9)
        self.assertTrue(lines[-1]["done"])
        # The head with the first part, then each part, in its framing.
        self.assertGreaterEqual(len(sent), 8)
        self.assertTrue(sent[0].startswith(b"HTTP/1.1 200 "))
        self.assertTrue(all(part.endswith(b"\r\n") for part in sent))

    async def test_openai_non_streaming(self) -> None:
        fake = await self.engine("openai", ["qwen"])
        proxy = await self.proxy({"lmstudio": fake.url})
        code, headers, body = await self.post(
            facade_url(proxy, "lmstudio") + "/v1/chat/completions",
            {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]},
        )
        self.assertEqual(code, 200)
        answer = json.loads(body)
        self.assertEqual(answer["object"], "chat.completion")
        self.assertIn("usage", answer)

    async def raw(self, url: str, body: object) -> bytes:
        """POST C{body} to C{url} over a plain socket: the answer's bytes."""
        host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
        data = json.dumps(body).encode()
        chunks: list[bytes] = []
        done: Deferred[None] = Deferred()
        collect = _Collect(chunks, done)
        collect.connectionLost = lambda reason=None: done.callback(None)  # type: ignore[method-assign]
        endpoint = TCP4ClientEndpoint(reactor, host, int(port))
        protocol = await connectProtocol(endpoint, collect)
        protocol.transport.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Connection: close\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(data), data)
        )
        await done
        return b"".join(chunks)

    async def test_answers_framed_as_the_engine_framed_them(self) -> None:
        """
        An engine's answer with a C{Content-Length} reaches the client with
        that length (Twisted's client parser keeps the header to itself), a
        streamed one chunked.
        """
        fake = await self.engine("openai", ["qwen"])
        proxy = await self.proxy({"lmstudio": fake.url})
        url = facade_url(proxy, "lmstudio")
        plain = await self.raw(url, {"model": "qwen", "messages": []})
        head, _, body = plain.partition(b"\r\n\r\n")
        lines = head.lower().split(b"\r\n")
        self.assertIn(b"content-length: %d" % len(body), lines)
        self.assertNotIn(b"transfer-encoding: chunked", lines)
        self.assertEqual(json.loads(body)["object"], "chat.completion")
        fake.default = Behaviour(chunks=3)
        streamed = await self.raw(url, {"model": "qwen", "stream": True})
        head, _, body = streamed.partition(b"\r\n\r\n")
        lines = head.lower().split(b"\r\n")
        self.assertIn(b"transfer-encoding: chunked", lines)
        self.assertFalse(any(line.startswith(b"content-length") for line in lines))
        self.assertTrue(body.endswith(b"\r\n0\r\n\r\n"))

    async def test_openai_streaming_sse(self) -> None:
        fake = await self.engine("openai", ["qwen"])
        fake.default = Behaviour(chunks=30)
        proxy = await self.proxy({"vllm": fake.url})
        code, headers, body = await self.post(
            facade_url(proxy, "vllm") + "/v1/chat/completions",
            {"model": "qwen", "stream": True, "messages": []},
        )
        self.assertEqual(code, 200)
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"text/event-stream"])
        events = [e for e in body.split(b"\n\n") if e]
        self.assertEqual(events[-1], b"data: [DONE]")

    async def test_headers(self) -> None:
        """
        Hop-by-hop headers are dropped, Host is rewritten, the rest kept.
        """
        fake = await self.engine("openai", ["qwen"])
        fake.default = Behaviour(headers=(("X-Engine", "fake"),))
        proxy = await self.proxy({"lmstudio": fake.url})
        url = facade_url(proxy, "lmstudio")
        code, headers, body = await self.post(
            url + "/v1/completions",
            {"model": "qwen", "prompt": "x"},
            headers={
                "Content-Type": ["application/json"],
                "Authorization": ["Bearer s3cret"],
                "Connection": ["keep-alive, X-Drop-Me"],
                "X-Drop-Me": ["1"],
                "Proxy-Authorization": ["Basic x"],
                "X-Custom": ["kept"],
            },
        )
        self.assertEqual(code, 200)
        self.assertEqual(headers.getRawHeaders(b"x-engine"), [b"fake"])
        seen = fake.requests[-1].headers
        lowered = {k.lower(): v for k, v in seen.items()}
        self.assertEqual(lowered["host"], f"127.0.0.1:{fake.port}")
        self.assertEqual(lowered["authorization"], "Bearer s3cret")
        self.assertEqual(lowered["x-custom"], "kept")
        self.assertNotIn("x-drop-me", lowered)
        self.assertNotIn("proxy-authorization", lowered)

    async def test_engine_error_passes_through(self) -> None:
        """
        A non-retryable engine answer is the client's answer, body intact.
        """
        fake = await self.engine("openai", ["qwen"])
        fake.default = Behaviour(
            status=400, body=b'{"error":"bad request, engine says"}'
        )
        proxy = await self.proxy({"lmstudio": fake.url})
        code, headers, body = await self.post(
            facade_url(proxy, "lmstudio") + "/v1/chat/completions",
            {"model": "qwen", "messages": []},
        )
        self.assertEqual((code, body), (400, b'{"error":"bad request, engine says"}'))
        self.assertEqual(
            [r.path for r in fake.requests if r.path != "/v1/models"],
            ["/v1/chat/completions"],
        )

    async def test_multipart(self) -> None:
        """
        A multipart upload is routed by its C{model} field and forwarded
        byte for byte.
        """
        fake = await self.engine("openai", ["whisper"])
        proxy = await self.proxy({"vllm": fake.url})
        boundary = "XyZ"
        audio = bytes(range(256)) * 4000
        body = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                f'filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n'
            ).encode()
            + audio
            + (
                f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="model"'
                f"\r\n\r\nwhisper\r\n--{boundary}--\r\n"
            ).encode()
        )
        code, headers, answer = await self.client.request(
            "POST",
            facade_url(proxy, "vllm") + "/v1/audio/transcriptions",
            data=body,
            headers={"Content-Type": [f"multipart/form-data; boundary={boundary}"]},
        )
        self.assertEqual(code, 200, answer)
        self.assertEqual(fake.requests[-1].body, body)

    async def test_other_route_verbatim(self) -> None:
        fake = await self.engine("ollama", ["m:latest"])
        proxy = await self.proxy({"ollama": fake.url})
        code, headers, body = await self.client.request(
            "GET", facade_url(proxy, "ollama") + "/api/version?x=1"
        )
        self.assertEqual(code, 200)
        self.assertEqual(fake.requests[-1].uri, "/api/version?x=1")

    async def test_empty_body_commits(self) -> None:
        """
        An answer with no body bytes at all is a commit, not a stall (§5.2).
        """
        fake = await self.engine("llamacpp", ["tiny"])
        fake.default = Behaviour(body=b"")
        proxy = await self.proxy({"llamacpp": fake.url})
        code, headers, body = await self.post(
            facade_url(proxy, "llamacpp") + "/completion", {"model": "tiny"}
        )
        self.assertEqual((code, body), (200, b""))


class ErrorTests(ProxyTestCase):
    async def test_no_owner_502(self) -> None:
        """
        A model nobody advertises gets the local 502 in the engine dialect,
        and no engine is contacted (§5 step 1).
        """
        fake = await self.engine("ollama", ["other:latest"])
        proxy = await self.proxy({"ollama": fake.url})
        code, headers, body = await self.post(
            facade_url(proxy, "ollama") + "/api/generate", {"model": "llama3"}
        )
        self.assertEqual(code, 502)
        self.assertIn("llama3:latest", json.loads(body)["error"])
        self.assertEqual([r.path for r in fake.requests if r.path != "/api/tags"], [])

    async def test_no_engine_running(self) -> None:
        """
        With no engine at the backend address the facade stays up and answers
        inference with the local 502.
        """
        proxy = await self.proxy({"vllm": f"http://127.0.0.1:{free_port()}"})
        code, headers, body = await self.post(
            facade_url(proxy, "vllm") + "/v1/chat/completions", {"model": "m"}
        )
        self.assertEqual(code, 502)
        error = json.loads(body)["error"]
        self.assertEqual(error["code"], 502)
        self.assertIn("no node advertises", error["message"])

    async def test_malformed_json_400(self) -> None:
        fake = await self.engine("ollama", ["m:latest"])
        proxy = await self.proxy({"ollama": fake.url})
        code, headers, body = await self.client.request(
            "POST", facade_url(proxy, "ollama") + "/api/chat", data=b'{"model": "m",'
        )
        self.assertEqual(code, 400)
        self.assertIn("not valid JSON", json.loads(body)["error"])

    async def test_missing_model_400(self) -> None:
        fake = await self.engine("openai", ["m"])
        proxy = await self.proxy({"lmstudio": fake.url})
        code, headers, body = await self.post(
            facade_url(proxy, "lmstudio") + "/v1/chat/completions", {"messages": []}
        )
        self.assertEqual(code, 400)
        self.assertEqual(json.loads(body)["error"]["type"], "invalid_request_error")

    async def test_body_too_large_413(self) -> None:
        fake = await self.engine("openai", ["m"])
        config_proxy = await self.proxy({"lmstudio": fake.url})
        config_proxy.sites["lmstudio"].max_body = 1000
        code, headers, body = await self.client.request(
            "POST",
            facade_url(config_proxy, "lmstudio") + "/v1/chat/completions",
            data=b'{"model":"m","x":"' + b"a" * 5000 + b'"}',
        )
        self.assertEqual(code, 413)
        self.assertIn("exceeds", json.loads(body)["error"]["message"])
        self.assertEqual([r for r in fake.requests if r.path != "/v1/models"], [])


class InventoryTests(ProxyTestCase):
    async def test_ollama_tags_merged(self) -> None:
        """
        /api/tags asks every node and merges duplicates into Ollama's
        envelope.
        """
        a = await self.engine("ollama", ["llama3:latest", "qwen:7b"])
        b = await self.engine("ollama", ["llama3:latest", "phi:latest"])
        proxy = await self.proxy({"ollama": a.url}, nodes={"gpu-2": {"ollama": b.url}})
        code, headers, body = await self.client.request(
            "GET", facade_url(proxy, "ollama") + "/api/tags"
        )
        self.assertEqual(code, 200)
        names = sorted(m["name"] for m in json.loads(body)["models"])
        self.assertEqual(names, ["llama3:latest", "phi:latest", "qwen:7b"])

    async def test_llamacpp_aliases(self) -> None:
        a = await self.engine("llamacpp", ["tiny"])
        b = await self.engine("llamacpp", ["small"])
        proxy = await self.proxy(
            {"llamacpp": a.url}, nodes={"gpu-2": {"llamacpp": b.url}}
        )
        for path in ("/models", "/v1/models"):
            code, headers, body = await self.client.request(
                "GET", facade_url(proxy, "llamacpp") + path
            )
            listing = json.loads(body)
            self.assertEqual(listing["object"], "list")
            self.assertEqual(
                sorted(m["id"] for m in listing["data"]), ["small", "tiny"]
            )

    async def test_routes_to_the_owner(self) -> None:
        """
        A model only a direct node advertises is served by that node.
        """
        local = await self.engine("ollama", ["llama3:latest"])
        remote = await self.engine("ollama", ["phi:latest"])
        proxy = await self.proxy(
            {"ollama": local.url}, nodes={"gpu-2": {"ollama": remote.url}}
        )
        code, headers, body = await self.post(
            facade_url(proxy, "ollama") + "/api/generate",
            {"model": "phi", "stream": False},
        )
        self.assertEqual(code, 200)
        self.assertEqual([r.path for r in remote.requests][-1], "/api/generate")
        self.assertNotIn("/api/generate", [r.path for r in local.requests])

    async def test_node_stops_advertising(self) -> None:
        """
        A node that fails its poll stops advertising until it answers again.
        """
        fake = await self.engine("ollama", ["m:latest"])
        proxy = await self.proxy({"ollama": fake.url})
        snapshot = proxy.discovery.current
        self.assertEqual(
            [e.node_id for e in snapshot.owners("ollama", "m:latest")], ["local"]
        )
        await fake.stop()
        await proxy.polling.poll()
        self.assertEqual(proxy.discovery.current.owners("ollama", "m:latest"), ())
        await fake.listen(reactor)
        await proxy.polling.poll()
        self.assertEqual(
            [e.node_id for e in proxy.discovery.current.owners("ollama", "m:latest")],
            ["local"],
        )


class InventoryShapeTests(ProxyTestCase):
    async def test_wrong_shape_stops_advertising(self) -> None:
        """
        A node whose model list answers 200 with something that is not a
        model list stops advertising, like one that does not answer.
        """
        fake = await self.engine("ollama", ["m:latest"])
        proxy = await self.proxy({"ollama": fake.url}, poll_interval=600.0)
        self.assertTrue(proxy.discovery.current.owners("ollama", "m:latest"))
        fake.script(Behaviour(body=b'{"error": "busy"}'), path="/api/tags")
        await proxy.polling.poll()
        self.assertEqual(proxy.discovery.current.owners("ollama", "m:latest"), ())


class IsolationTests(ProxyTestCase):
    async def test_port_conflict_is_contained(self) -> None:
        """
        A facade whose port is taken fails alone; the others serve (§3.2).
        """
        fake = await self.engine("openai", ["m"])
        from twisted.internet.protocol import Factory

        config = proxy_config(self.mktemp(), {"lmstudio": fake.url, "vllm": fake.url})
        blocker = reactor.listenTCP(
            config.engines["lmstudio"].port, Factory(), interface="127.0.0.1"
        )
        self.addCleanup(blocker.stopListening)
        proxy = await start_proxy(reactor, config)
        self.addCleanup(proxy.stopService)
        self.assertIsNone(proxy.listeners["lmstudio"].listening)
        self.assertIn("Address already in use", proxy.listeners["lmstudio"].error or "")
        code, headers, body = await self.post(
            facade_url(proxy, "vllm") + "/v1/chat/completions", {"model": "m"}
        )
        self.assertEqual(code, 200)


class _SlowClient(Protocol):
    """
    Sends one raw request, then stops reading until told to resume.
    """

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.received = 0
        self.closed: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(self.request)
        self.transport.pauseProducing()  # type: ignore[attr-defined]

    def dataReceived(self, data: bytes) -> None:
        self.received += len(data)

    def connectionLost(self, reason: Any = None) -> None:
        self.closed.callback(None)


class BackpressureTests(ProxyTestCase):
    async def test_slow_client_pauses_upstream(self) -> None:
        """
        A client that stops reading makes nvproxy stop reading the upstream
        (its connection leaves the reactor's readers) instead of buffering
        the stream; reading resumes when the client does.
        """
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

        size = 48 * 1024 * 1024
        fake = await self.engine("openai", ["m"])
        fake.default = Behaviour(body=b"x" * size)
        proxy = await self.proxy({"lmstudio": fake.url}, poll_interval=600.0)
        # Only the request's own upstream connection may reach the engine.
        await proxy.upstream.close()
        port = proxy.listeners["lmstudio"].bound_port()
        body = b'{"model": "m"}'
        client = _SlowClient(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), client)

        def drop() -> Deferred[None]:
            if not client.closed.called:
                client.transport.abortConnection()  # type: ignore[union-attr]
            return client.closed

        self.addCleanup(drop)

        from twisted.internet.tcp import Server

        def pending(host_port: int | None = None, peer_port: int | None = None) -> int:
            # Bytes a transport holds in user space, waiting to be sent.
            for t in reactor.getWriters():
                if not isinstance(t, Server):
                    continue
                if host_port is not None and t.getHost().port != host_port:
                    continue
                if peer_port is not None and t.getPeer().port != peer_port:
                    continue
                return len(t.dataBuffer) + t._tempDataLen
            return 0

        assert client.transport is not None
        client_port = client.transport.getHost().port  # type: ignore[attr-defined]
        # Real sockets: the kernel's buffers decide when this holds.  The
        # engine cannot hand its body over (nvproxy stopped reading), while
        # nvproxy itself holds little for the stalled client.
        await eventually(
            reactor,
            lambda: pending(host_port=fake.port) > size // 2,
            attempts=100,
            interval=0.05,
            what="nvproxy holding back the engine while the client stalls",
        )
        self.assertLess(pending(peer_port=client_port), 4 * 1024 * 1024)
        self.assertLess(client.received, size)
        assert client.transport is not None
        client.transport.resumeProducing()  # type: ignore[attr-defined]
        await client.closed
        self.assertGreater(client.received, size)


class StreamTimingTests(MemoryProxyTestCase):
    def test_chunks_arrive_before_the_end(self) -> None:
        """
        Streaming is not buffered: the first chunk reaches the client while
        the engine is still generating.
        """
        fake = self.engine("ollama", ["m:latest"])
        fake.default = Behaviour(chunks=5, chunk_interval=0.3)
        proxy = self.proxy({"ollama": fake.url})
        response: IResponse = self.drive(
            self.client.http.post(
                facade_url(proxy, "ollama") + "/api/chat",
                data=b'{"model":"m","messages":[]}',
                headers={"content-type": ["application/json"]},
                unbuffered=True,
            )
        )
        chunks: list[bytes] = []
        done: Deferred[None] = Deferred()
        response.deliverBody(_Collect(chunks, done))
        self.net.advance(0.4)
        self.assertTrue(chunks, "no chunk relayed while the stream is running")
        self.assertNoResult(done)
        self.net.advance(0.3)
        self.assertGreater(len(b"".join(chunks).splitlines()), 1, "one more chunk")
        self.assertNoResult(done)
        self.drive(done)
        self.assertTrue(json.loads(b"".join(chunks).splitlines()[-1])["done"])


class DisconnectTests(MemoryProxyTestCase):
    def test_client_disconnect_cancels_upstream(self) -> None:
        """
        A client that goes away mid-stream ends the upstream request at
        once, and the workload is cancelled, not failed (§5.3, §5.4).
        """
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

        fake = self.engine("ollama", ["m:latest"])
        fake.default = Behaviour(chunks=100, chunk_interval=0.05)
        proxy = self.proxy({"ollama": fake.url})
        port = proxy.listeners["ollama"].bound_port()
        body = b'{"model": "m", "messages": []}'
        client = _SlowClient(
            b"POST /api/chat HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        endpoint = TCP4ClientEndpoint(self.net, "127.0.0.1", port)
        self.drive(connectProtocol(endpoint, client))
        assert client.transport is not None
        client.transport.resumeProducing()  # type: ignore[attr-defined]
        self.net.advance(0.1)
        self.assertGreater(client.received, 0)
        self.assertEqual(fake.pending, 1)
        client.transport.abortConnection()  # type: ignore[attr-defined]
        self.drive(client.closed)
        self.net.settle()
        self.assertEqual(fake.pending, 0)
        workload = proxy.workloads.recent(1)[0]["workloadInfo"]
        self.assertEqual(workload["state"], "cancelled")


class DialTests(TestCase):
    """
    L{nvproxy.proxy.upstream.EndpointFactory} dials an IP literal directly, so a
    refused or abandoned connection is reported as what it is, never as a
    failed DNS lookup.
    """

    def factory(self, on: Any = reactor) -> Any:
        from nvproxy.proxy.upstream import EndpointFactory

        return EndpointFactory(on, 7.0)

    def endpoint(self, url: bytes, on: Any = reactor) -> Any:
        from twisted.web.client import URI

        return self.factory(on).endpointForURI(URI.fromBytes(url))

    def connect(self, endpoint: Any) -> Deferred[Any]:
        from twisted.internet.protocol import Factory

        connected: Deferred[Any] = endpoint.connect(Factory.forProtocol(Protocol))
        return connected

    def test_ip_literal_dialled_directly(self) -> None:
        """
        An IPv4 or IPv6 literal is connected at once, with the dial timeout
        and without name resolution first.
        """
        from twisted.internet.testing import MemoryReactorClock

        for url, host in (
            (b"http://127.0.0.1:9/x", "127.0.0.1"),
            (b"http://[::1]:9/x", "::1"),
        ):
            memory = MemoryReactorClock()
            self.connect(self.endpoint(url, memory))
            self.assertEqual(
                [(h, port, timeout) for h, port, _, timeout, _ in memory.tcpClients],
                [(host, 9, 7.0)],
            )

    def test_endpoint_cached(self) -> None:
        """
        A plain endpoint is built once per host and port.
        """
        from twisted.web.client import URI

        factory = self.factory()
        first = factory.endpointForURI(URI.fromBytes(b"http://127.0.0.1:9/a"))
        again = factory.endpointForURI(URI.fromBytes(b"http://127.0.0.1:9/b"))
        other = factory.endpointForURI(URI.fromBytes(b"http://127.0.0.1:10/a"))
        self.assertIs(again, first)
        self.assertIsNot(other, first)

    def test_tls_endpoint_kept_while_creator_is(self) -> None:
        """
        An https endpoint is kept while the creator for its host and port is
        the same object (a peer's, kept per pin), and made again when the
        creator changes; a host without one gets web PKI verification, its
        options made once (else its endpoint would be made every time).
        """
        from twisted.internet.ssl import optionsForClientTLS
        from twisted.web.client import URI

        from nvproxy.proxy.upstream import EndpointFactory

        creators = {("10.0.0.3", 8443): optionsForClientTLS("node-c")}
        factory = EndpointFactory(
            reactor, 7.0, lambda host, port: creators.get((host, port))
        )

        def endpoint(url: bytes) -> Any:
            return factory.endpointForURI(URI.fromBytes(url))

        first = endpoint(b"https://10.0.0.3:8443/a")
        self.assertIs(endpoint(b"https://10.0.0.3:8443/b"), first)
        creators["10.0.0.3", 8443] = optionsForClientTLS("node-c")
        self.assertIsNot(endpoint(b"https://10.0.0.3:8443/a"), first)
        public = endpoint(b"https://example.com/a")
        self.assertIs(endpoint(b"https://example.com/b"), public)
        self.assertIsNot(endpoint(b"https://example.com:8443/a"), public)

    async def test_refused_is_refused(self) -> None:
        """
        A closed loopback port fails as a refused connection.
        """
        from twisted.internet.error import ConnectionRefusedError

        url = b"http://127.0.0.1:%d/" % free_port()
        with self.assertRaises(ConnectionRefusedError):
            await self.connect(self.endpoint(url))

    async def test_cancelled_dial_is_not_dns(self) -> None:
        """
        A dial to an IP literal cancelled at once (an attempt abandoned while
        connecting) fails as a cancelled connection attempt; resolving the
        literal first made it C{DNSLookupError}.
        """
        from twisted.internet.error import ConnectingCancelledError

        url = b"http://127.0.0.1:%d/" % free_port()
        d = self.connect(self.endpoint(url))
        d.cancel()
        with self.assertRaises(ConnectingCancelledError):
            await d


class AgentTests(SynchronousTestCase):
    """
    The data-path agent parses each URL once and sends what Twisted's would.
    """

    def test_request_line_and_host(self) -> None:
        """
        Two requests for the same URL share one parse; each goes to the URL's
        host and port with its path and query as the request target and the
        Host header Twisted computes, and a URL with another port gets its own.
        """
        from twisted.internet.testing import MemoryReactorClock, StringTransport

        from nvproxy.proxy import upstream

        memory = MemoryReactorClock()
        agent = upstream.Upstream(memory, 7.0).agent
        url = b"http://127.0.0.1:9/api/chat?x=1"
        sent = []
        for target in (url, url, b"http://127.0.0.1:10/api/tags"):
            agent.request(b"POST", target)
            factory = memory.tcpClients[-1][2]
            transport = StringTransport()
            factory.buildProtocol(None).makeConnection(transport)
            sent.append(transport.value())
        self.assertEqual(
            [(host, port) for host, port, *_ in memory.tcpClients],
            [("127.0.0.1", 9), ("127.0.0.1", 9), ("127.0.0.1", 10)],
        )
        for raw, line, host in (
            (sent[0], b"POST /api/chat?x=1 HTTP/1.1", b"127.0.0.1:9"),
            (sent[1], b"POST /api/chat?x=1 HTTP/1.1", b"127.0.0.1:9"),
            (sent[2], b"POST /api/tags HTTP/1.1", b"127.0.0.1:10"),
        ):
            head = raw.split(b"\r\n")
            self.assertEqual(head[0], line)
            self.assertIn(b"Host: " + host, head)
        self.assertIs(upstream._parsed(url), upstream._parsed(url))

    def test_host_values(self) -> None:
        """
        The Host value is Twisted's: the port unless it is the scheme's
        default, an IPv6 literal in brackets; the caller's headers are left
        as they were.
        """
        from twisted.internet.testing import MemoryReactorClock
        from twisted.web.client import Agent
        from twisted.web.http_headers import Headers

        from nvproxy.proxy import upstream

        twisted = Agent(None)  # type: ignore[no-untyped-call]
        for url in (
            b"http://127.0.0.1:9/x",
            b"http://127.0.0.1/x",
            b"https://node.example:443/x",
            b"https://node.example:8443/x",
            b"http://[::1]:9/x",
        ):
            parsed, _, host = upstream._parsed(url)
            expected = twisted._computeHostValue(  # type: ignore[no-untyped-call]
                parsed.scheme, parsed.host, parsed.port
            )
            self.assertEqual(host, expected)
        from twisted.internet.testing import StringTransport

        given = Headers({b"x-a": [b"1"]})
        memory = MemoryReactorClock()
        upstream.Upstream(memory, 7.0).agent.request(
            b"GET", b"http://127.0.0.1:9/x", given
        )
        self.assertEqual(list(given.getAllRawHeaders()), [(b"X-A", [b"1"])])
        transport = StringTransport()
        memory.tcpClients[-1][2].buildProtocol(None).makeConnection(transport)
        head = transport.value().split(b"\r\n")
        self.assertIn(b"X-A: 1", head)
        self.assertIn(b"Host: 127.0.0.1:9", head)

    def test_own_headers_completed_in_place(self) -> None:
        """
        Headers made for the one request (an attempt's) get their Host in
        place, not in a copy; a Host already in them is kept.
        """
        from twisted.internet.testing import MemoryReactorClock, StringTransport

        from nvproxy.proxy import upstream
        from nvproxy.proxy.headers import OwnHeaders

        memory = MemoryReactorClock()
        agent = upstream.Upstream(memory, 7.0).agent
        own = OwnHeaders({b"x-a": [b"1"]})
        agent.request(b"GET", b"http://127.0.0.1:9/x", own)
        self.assertEqual(own.getRawHeaders(b"host"), [b"127.0.0.1:9"])
        named = OwnHeaders({b"host": [b"engine.example"]})
        agent.request(b"GET", b"http://127.0.0.1:9/x", named)
        self.assertEqual(named.getRawHeaders(b"host"), [b"engine.example"])
        transport = StringTransport()
        memory.tcpClients[0][2].buildProtocol(None).makeConnection(transport)
        head = transport.value().split(b"\r\n")
        self.assertIn(b"X-A: 1", head)
        self.assertIn(b"Host: 127.0.0.1:9", head)


class _Recorder(Protocol):
    def __init__(self) -> None:
        self.data = b""
        self.lost: list[Any] = []

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason: Any = None) -> None:
        self.lost.append(reason)


class MemoryNetworkTests(SynchronousTestCase):
    """L{MemoryNetwork}: the in-memory TCP the memory tests run on."""

    def pair(self) -> tuple[MemoryNetwork, _Recorder, _Recorder]:
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
        from twisted.internet.protocol import Factory

        net = MemoryNetwork()
        server = _Recorder()
        net.listenTCP(8080, Factory.forProtocol(lambda: server), interface="127.0.0.1")
        client = _Recorder()
        d = connectProtocol(TCP4ClientEndpoint(net, "127.0.0.1", 8080), client)
        self.assertNoResult(d)  # connecting takes a turn of the clock
        net.settle()
        self.successResultOf(d)
        return net, server, client

    def test_bytes_arrive_on_the_next_turn(self) -> None:
        net, server, client = self.pair()
        assert client.transport is not None and server.transport is not None
        self.assertEqual(server.transport.getPeer().host, "127.0.0.1")
        self.assertEqual(client.transport.getPeer().port, 8080)
        client.transport.write(b"hello")
        self.assertEqual(server.data, b"")
        net.settle()
        self.assertEqual(server.data, b"hello")

    def test_lose_connection_delivers_then_closes_both(self) -> None:
        from twisted.internet.error import ConnectionDone

        net, server, client = self.pair()
        assert client.transport is not None
        client.transport.write(b"last")
        client.transport.loseConnection()
        net.settle()
        self.assertEqual(server.data, b"last")
        self.assertTrue(server.lost[0].check(ConnectionDone))
        self.assertTrue(client.lost[0].check(ConnectionDone))
        self.assertEqual(net.open_connections, 0)

    def test_abort(self) -> None:
        from twisted.internet.error import ConnectionAborted, ConnectionLost

        net, server, client = self.pair()
        assert client.transport is not None
        client.transport.write(b"lost")
        client.transport.abortConnection()  # type: ignore[attr-defined]
        net.settle()
        self.assertEqual(server.data, b"")
        self.assertTrue(client.lost[0].check(ConnectionAborted))
        self.assertTrue(server.lost[0].check(ConnectionLost))

    def test_paused_reader_throttles_a_push_producer(self) -> None:
        from twisted.internet.interfaces import IPushProducer
        from zope.interface import implementer

        @implementer(IPushProducer)
        class Producer:
            paused = False

            def pauseProducing(self) -> None:
                self.paused = True

            def resumeProducing(self) -> None:
                self.paused = False

            def stopProducing(self) -> None:
                pass

        net, server, client = self.pair()
        assert client.transport is not None and server.transport is not None
        producer = Producer()
        client.transport.registerProducer(producer, True)  # type: ignore[attr-defined]
        server.transport.pauseProducing()  # type: ignore[attr-defined]
        client.transport.write(b"x" * (128 * 1024))
        net.settle()
        self.assertEqual(server.data, b"")
        self.assertTrue(producer.paused)
        server.transport.resumeProducing()  # type: ignore[attr-defined]
        net.settle()
        self.assertEqual(len(server.data), 128 * 1024)
        self.assertFalse(producer.paused)

    def test_refused_and_in_use(self) -> None:
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
        from twisted.internet.error import CannotListenError, ConnectionRefusedError
        from twisted.internet.protocol import Factory

        net = MemoryNetwork()
        d = connectProtocol(TCP4ClientEndpoint(net, "127.0.0.1", 9), _Recorder())
        net.settle()
        self.failureResultOf(d, ConnectionRefusedError)
        factory = Factory.forProtocol(Protocol)
        port = net.listenTCP(0, factory)
        number = port.getHost().port  # type: ignore[attr-defined]
        with self.assertRaises(CannotListenError):
            net.listenTCP(number, factory)
        port.stopListening()
        net.listenTCP(number, factory)

    def test_run_moves_time_and_gives_up(self) -> None:
        from twisted.internet.task import deferLater

        net = MemoryNetwork()
        self.assertEqual(net.run(deferLater(net, 5, lambda: "done")), "done")
        self.assertEqual(net.seconds(), 5)
        with self.assertRaises(AssertionError):
            net.run(Deferred(), limit=10)


class InMemoryBodyRequestTests(SynchronousTestCase):
    """
    A request with its body in memory goes out as Twisted's own request
    writes it, without a producer registered with the transport.
    """

    @given(st.binary(max_size=300), st.sampled_from([b"POST", b"PUT"]))
    def test_same_bytes_as_twisted(self, body: bytes, method: bytes) -> None:
        from twisted.internet.testing import StringTransport
        from twisted.web._newclient import Request
        from twisted.web.client import URI
        from twisted.web.http_headers import Headers

        from nvproxy.proxy import upstream

        url = b"http://127.0.0.1:9/api/chat"
        headers = Headers({b"host": [b"127.0.0.1:9"], b"x-a": [b"1"]})
        sent = []
        for kind in (Request, upstream._Request):
            request = kind._construct(
                method,
                b"/api/chat",
                headers,
                upstream.BytesProducer(body),
                persistent=True,
                parsedURI=URI.fromBytes(url),
            )
            transport = StringTransport()
            self.successResultOf(request.writeTo(transport))
            self.assertIsNone(transport.producer)
            sent.append(transport.value())
        self.assertEqual(sent[0], sent[1])
        self.assertTrue(sent[1].endswith(b"\r\n\r\n" + body))

    def test_other_producers_as_twisted_does(self) -> None:
        import io

        from twisted.internet.task import Cooperator
        from twisted.internet.testing import StringTransport
        from twisted.web.client import URI
        from twisted.web.http_headers import Headers

        from nvproxy.proxy import upstream

        body = b"x" * (upstream.IN_MEMORY_LIMIT + 1)
        producer = upstream.RangeBodyProducer(
            io.BytesIO(body), len(body), Cooperator(scheduler=lambda f: f())
        )
        request = upstream._Request._construct(
            b"POST",
            b"/x",
            Headers({b"host": [b"h"]}),
            producer,
            persistent=True,
            parsedURI=URI.fromBytes(b"http://h/x"),
        )
        transport = StringTransport()
        self.successResultOf(request.writeTo(transport))
        self.assertTrue(transport.value().endswith(b"\r\n\r\n" + body))


class CanonicalNameTests(SynchronousTestCase):
    """
    The keys nvproxy reads and writes a L{Headers} table under are the ones
    Twisted's own methods use for the same names.
    """

    @given(
        st.sampled_from(
            [b"content-type", b"X-REQUEST-ID", b"www-authenticate", b"te", b"dnt"]
        )
        | st.binary(min_size=1, max_size=20).filter(
            lambda name: all(c in _TOKEN for c in name)
        )
    )
    def test_same_key_as_twisted(self, name: bytes) -> None:
        from twisted.web.http_headers import Headers

        from nvproxy.proxy.headers import canonical

        headers = Headers()
        headers.setRawHeaders(name, [b"v"])
        self.assertEqual(headers._rawHeaders, {canonical(name): [b"v"]})
        self.assertEqual(headers.getRawHeaders(name.upper()), [b"v"])


_TOKEN = frozenset(
    b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)
