"""
The llama.cpp facade end to end, as one contract run against two backends:

* L{FakeLlamaCppTests}: C{nvproxy.testing.fakeengine.FakeEngine("llamacpp")}
  (always; part of the default suite, about a second);
* L{RealLlamaServerTests}: a real C{llama-server} serving a tiny GGUF model
  written per test (opt-in: C{NVPROXY_REAL_ENGINES=1} and a cached binary,
  see C{tox -e real} and L{tests.integration.llamacpp}).

Running the same assertions against both keeps the fake from drifting away
from the engine it stands for: every assertion holds for both.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from typing import TYPE_CHECKING, Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import TestCase

from nvproxy.service import NvProxy
from nvproxy.testing.fakeengine import Behaviour, FakeEngine
from nvproxy.testing.harness import Client, facade_url, proxy_config, start_proxy
from tests.integration import llamacpp

if TYPE_CHECKING:
    _Base = TestCase
else:
    _Base = object

MODEL = "tiny"
MAX_TOKENS = 12
PROMPT = "Say hello, nvproxy."


def sse_data(body: bytes) -> list[str]:
    """The C{data:} payloads of an SSE body, in order."""
    payloads = []
    for event in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                payloads.append(line[5:].strip().decode("utf-8"))
    return payloads


class LlamaCppContract(_Base):
    """
    What a client of the llama.cpp facade relies on, whatever the backend.

    A subclass provides L{start_backend} and L{generates}.  Every answer
    here runs to the request's token limit, so it reports being cut short
    (C{finish_reason: "length"}, C{stop_type: "limit"}).
    """

    timeout = 60

    client: Client
    backend: str
    proxy: NvProxy
    facade: str

    async def start_backend(self) -> str:
        """Start the engine, register its cleanup, return its base URL."""
        raise NotImplementedError

    def generates(self, tokens: int) -> None:
        """Arrange that the next inference requests produce C{tokens} tokens."""
        raise NotImplementedError

    def setUp(self) -> Deferred[None]:  # type: ignore[override]
        # trial waits for the Deferred a setUp returns.
        return Deferred.fromCoroutine(self._setUp())

    async def _setUp(self) -> None:
        self.client = Client(reactor)
        self.addCleanup(self.client.close)
        self.backend = await self.start_backend()
        # One node and no failover under test: an engine's error answer comes
        # back at once instead of after the retry backoff.
        config = proxy_config(
            self.mktemp(),
            {"llamacpp": self.backend},
            max_attempts=1,
            response_header_timeout=30.0,
        )
        self.proxy = await start_proxy(reactor, config)
        self.addCleanup(self.proxy.stopService)
        self.facade = facade_url(self.proxy, "llamacpp")

    async def post(self, path: str, body: object) -> tuple[int, Any, bytes]:
        return await self.client.request(
            "POST",
            self.facade + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": ["application/json"]},
        )

    def chat(self, **extra: object) -> dict[str, object]:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": MAX_TOKENS,
            **extra,
        }

    async def terminal_workload(self) -> dict[str, Any]:
        """
        The latest workload once it has its terminal event (the proxy records
        it as the response ends; allow it a moment, bounded).
        """
        for _ in range(100):
            recent = self.proxy.workloads.recent(1)
            if recent and recent[0]["workloadInfo"]["state"] != "running":
                entry: dict[str, Any] = recent[0]
                return entry
            await deferLater(reactor, 0.02, lambda: None)
        self.fail(f"no terminal workload event: {self.proxy.workloads.recent(1)}")

    # -- the contract ---------------------------------------------------------

    async def test_chat_completion(self) -> None:
        """
        A non-streaming chat completion: one C{chat.completion} object with
        the assistant's text and a usage report counting C{max_tokens}.
        """
        self.generates(MAX_TOKENS)
        code, headers, body = await self.post("/v1/chat/completions", self.chat())
        self.assertEqual(code, 200, body)
        self.assertEqual(
            headers.getRawHeaders("content-type")[0].split(";")[0],
            "application/json",
        )
        answer = json.loads(body)
        self.assertEqual(answer["object"], "chat.completion")
        self.assertEqual(answer["model"], MODEL)
        (choice,) = answer["choices"]
        self.assertEqual(choice["message"]["role"], "assistant")
        content = choice["message"]["content"]
        self.assertIsInstance(content, str)
        self.assertTrue(content.strip())
        self.assertTrue(content.isprintable(), repr(content))
        self.assertEqual(choice["finish_reason"], "length")
        usage = answer["usage"]
        self.assertEqual(usage["completion_tokens"], MAX_TOKENS)
        self.assertGreater(usage["prompt_tokens"], 0)
        self.assertEqual(usage["total_tokens"], usage["prompt_tokens"] + MAX_TOKENS)

    async def test_chat_completion_streaming(self) -> None:
        """
        A streaming chat completion: SSE chunks, one content delta per token,
        a usage chunk, and C{data: [DONE]} last.
        """
        self.generates(MAX_TOKENS)
        code, headers, body = await self.post(
            "/v1/chat/completions",
            self.chat(stream=True, stream_options={"include_usage": True}),
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(
            headers.getRawHeaders("content-type")[0].split(";")[0],
            "text/event-stream",
        )
        payloads = sse_data(body)
        self.assertEqual(payloads[-1], "[DONE]")
        chunks = [json.loads(p) for p in payloads[:-1]]
        self.assertTrue(all(c["object"] == "chat.completion.chunk" for c in chunks))
        deltas = [
            c["choices"][0]["delta"].get("content")
            for c in chunks
            if c["choices"] and c["choices"][0]["delta"].get("content")
        ]
        self.assertEqual(len(deltas), MAX_TOKENS)
        self.assertTrue("".join(deltas).isprintable())
        finishes = [
            c["choices"][0]["finish_reason"]
            for c in chunks
            if c["choices"] and c["choices"][0]["finish_reason"]
        ]
        self.assertEqual(finishes, ["length"])
        usages = [c["usage"] for c in chunks if c.get("usage")]
        self.assertEqual(usages[-1]["completion_tokens"], MAX_TOKENS)
        self.assertGreater(usages[-1]["prompt_tokens"], 0)

    async def test_native_completion_streaming(self) -> None:
        """
        llama.cpp's own C{/completion}, streaming: one event per token, then a
        C{stop} event with the counts and timings; no C{[DONE]}.
        """
        self.generates(MAX_TOKENS)
        code, headers, body = await self.post(
            "/completion",
            {"model": MODEL, "prompt": PROMPT, "n_predict": MAX_TOKENS, "stream": True},
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(
            headers.getRawHeaders("content-type")[0].split(";")[0],
            "text/event-stream",
        )
        events = [json.loads(p) for p in sse_data(body)]
        pieces = [e["content"] for e in events if not e["stop"]]
        self.assertEqual(len(pieces), MAX_TOKENS)
        self.assertTrue("".join(pieces).isprintable())
        last = events[-1]
        self.assertTrue(last["stop"])
        self.assertEqual([e for e in events if e["stop"]], [last])
        self.assertEqual(last["stop_type"], "limit")
        self.assertEqual(last["tokens_predicted"], MAX_TOKENS)
        self.assertGreater(last["tokens_evaluated"], 0)
        self.assertEqual(last["timings"]["predicted_n"], MAX_TOKENS)

    async def test_inventory(self) -> None:
        """
        C{GET /models} and C{GET /v1/models} answer the merged OpenAI list
        envelope naming the served model.
        """
        for path in ("/models", "/v1/models"):
            code, headers, body = await self.client.request("GET", self.facade + path)
            self.assertEqual(code, 200, (path, body))
            listing = json.loads(body)
            self.assertEqual(listing["object"], "list", path)
            self.assertEqual([m["id"] for m in listing["data"]], [MODEL], path)
            self.assertEqual(listing["data"][0]["object"], "model", path)

    async def test_engine_inventory(self) -> None:
        """
        The engine's own C{/models} carries both an OpenAI C{data} list and
        an Ollama-like C{models} list (discovery reads C{data}).
        """
        for path in ("/models", "/v1/models"):
            code, headers, body = await self.client.request("GET", self.backend + path)
            self.assertEqual(code, 200, (path, body))
            listing = json.loads(body)
            self.assertEqual([m["id"] for m in listing["data"]], [MODEL], path)
            self.assertEqual([m["name"] for m in listing["models"]], [MODEL], path)

    async def test_other_routes_verbatim(self) -> None:
        """
        Routes that are neither inference nor inventory (C{/health},
        C{/props}, an unknown one) are forwarded verbatim: the facade answers
        exactly what the engine answers.
        """
        for path in ("/health", "/props", "/no-such-route"):
            direct = await self.client.request("GET", self.backend + path)
            proxied = await self.client.request("GET", self.facade + path)
            self.assertEqual(proxied[0], direct[0], path)
            self.assertEqual(
                proxied[1].getRawHeaders("content-type"),
                direct[1].getRawHeaders("content-type"),
                path,
            )
            self.assertEqual(json.loads(proxied[2]), json.loads(direct[2]), path)
        health = await self.client.request("GET", self.facade + "/health")
        self.assertEqual((health[0], json.loads(health[2])), (200, {"status": "ok"}))
        missing = await self.client.request("GET", self.facade + "/no-such-route")
        self.assertEqual(missing[0], 404)
        self.assertEqual(json.loads(missing[2])["error"]["code"], 404)

    async def test_workload_stats(self) -> None:
        """
        The terminal workload event carries the engine's token counts, for a
        non-streaming and a streaming answer alike.
        """
        for stream in (False, True):
            self.generates(MAX_TOKENS)
            code, _, body = await self.post(
                "/v1/chat/completions",
                self.chat(stream=stream, stream_options={"include_usage": True})
                if stream
                else self.chat(),
            )
            self.assertEqual(code, 200, body)
            entry = await self.terminal_workload()
            info = entry["workloadInfo"]
            self.assertEqual(entry["events"][-1]["method"], "workload:completed")
            self.assertEqual(
                (info["state"], info["engine"], info["model"]),
                ("completed", "llamacpp", MODEL),
            )
            stats = info["stats"]
            self.assertEqual(stats["completionTokens"], MAX_TOKENS, stream)
            self.assertGreater(stats["promptTokens"], 0)
            self.assertNotIn("estimated", stats)

    async def test_workload_stats_stream_without_usage(self) -> None:
        """
        A stream that did not ask for usage still yields exact counts: the
        engine puts C{timings} on the finishing chunk.  The prompt counts in
        full although the same prompt, asked just before, came from the
        engine's prompt cache (C{prompt_n + cache_n}).
        """
        self.generates(MAX_TOKENS)
        code, _, body = await self.post("/v1/chat/completions", self.chat())
        self.assertEqual(code, 200, body)
        prompt_tokens = json.loads(body)["usage"]["prompt_tokens"]
        self.generates(MAX_TOKENS)
        code, _, body = await self.post("/v1/chat/completions", self.chat(stream=True))
        self.assertEqual(code, 200, body)
        self.assertEqual(sse_data(body)[-1], "[DONE]")
        stats = (await self.terminal_workload())["workloadInfo"]["stats"]
        self.assertEqual(stats["completionTokens"], MAX_TOKENS)
        self.assertEqual(stats["promptTokens"], prompt_tokens)
        self.assertNotIn("estimated", stats)

    async def test_responses_api(self) -> None:
        """
        OpenAI's Responses API (C{/v1/responses}) is routed by its model.
        """
        self.generates(MAX_TOKENS)
        code, _, body = await self.post(
            "/v1/responses",
            {"model": MODEL, "input": PROMPT, "max_output_tokens": MAX_TOKENS},
        )
        self.assertEqual(code, 200, body)
        answer = json.loads(body)
        self.assertEqual((answer["object"], answer["model"]), ("response", MODEL))
        (message,) = answer["output"]
        self.assertEqual(message["role"], "assistant")
        self.assertTrue(message["content"][0]["text"])
        self.assertEqual(answer["usage"]["output_tokens"], MAX_TOKENS)
        info = (await self.terminal_workload())["workloadInfo"]
        self.assertEqual((info["state"], info["model"]), ("completed", MODEL))

    async def test_anthropic_messages(self) -> None:
        """
        Anthropic's Messages API (C{/v1/messages}) is routed by its model.
        """
        self.generates(MAX_TOKENS)
        code, _, body = await self.post(
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": PROMPT}],
            },
        )
        self.assertEqual(code, 200, body)
        answer = json.loads(body)
        self.assertEqual((answer["type"], answer["role"]), ("message", "assistant"))
        self.assertEqual(answer["stop_reason"], "max_tokens")
        self.assertEqual(answer["usage"]["output_tokens"], MAX_TOKENS)
        info = (await self.terminal_workload())["workloadInfo"]
        self.assertEqual((info["state"], info["model"]), ("completed", MODEL))

    async def test_openai_sdk(self) -> None:
        """
        The official C{openai} client (in a subprocess: it blocks) lists the
        model and completes a chat, plain and streaming, through the facade.
        """
        self.generates(MAX_TOKENS)
        script = textwrap.dedent(
            """
            import json, sys
            import openai

            client = openai.OpenAI(
                base_url=sys.argv[1] + "/v1", api_key="unused",
                max_retries=0, timeout=30,
            )
            models = [m.id for m in client.models.list()]
            messages = [{"role": "user", "content": "hello"}]
            n = int(sys.argv[2])
            plain = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=n
            )
            pieces, usage = [], None
            stream = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=n, stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            print(json.dumps({
                "models": models,
                "content": plain.choices[0].message.content,
                "completion_tokens": plain.usage.completion_tokens,
                "pieces": len(pieces),
                "stream_usage": usage,
            }))
            """
        )
        d = getProcessOutputAndValue(
            sys.executable,
            ["-c", script, self.facade, str(MAX_TOKENS)],
            env=dict(os.environ),
        )
        d.addTimeout(45, reactor)
        out, err, code = await d
        self.assertEqual(code, 0, err.decode("utf-8", "replace"))
        result = json.loads(out)
        self.assertEqual(result["models"], [MODEL])
        self.assertTrue(result["content"])
        self.assertEqual(result["completion_tokens"], MAX_TOKENS)
        self.assertEqual(result["pieces"], MAX_TOKENS)
        self.assertEqual(result["stream_usage"], MAX_TOKENS)


class FakeLlamaCppTests(LlamaCppContract, TestCase):
    """The contract against L{FakeEngine}'s llama.cpp dialect."""

    fake: FakeEngine

    async def start_backend(self) -> str:
        self.fake = FakeEngine("llamacpp", [MODEL], reactor)
        await self.fake.listen(reactor)
        self.addCleanup(self.fake.stop)
        return self.fake.url

    def generates(self, tokens: int) -> None:
        # The fake's model stops by itself after Behaviour.chunks tokens; the
        # request's max_tokens / n_predict caps it, so at exactly the limit
        # the answer is cut short ("length"), as with the real tiny model.
        self.fake.default = Behaviour(chunks=tokens)


def _real_skip() -> str | None:
    if os.environ.get("NVPROXY_REAL_ENGINES") != "1":
        return "real engines are opt-in: set NVPROXY_REAL_ENGINES=1 (tox -e real)"
    if llamacpp.find_llama_server() is None:
        return (
            f"no llama-server at {llamacpp.llama_server_path()}: build it with "
            "`python -m tests.integration.llamacpp build` (or set "
            "NVPROXY_LLAMA_SERVER)"
        )
    try:
        import gguf  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        return f"writing the GGUF model needs gguf and numpy: {e}"
    return None


class RealLlamaServerTests(LlamaCppContract, TestCase):
    """The contract against a real C{llama-server} and a tiny GGUF model."""

    skip = _real_skip()

    server: llamacpp.LlamaServer

    async def start_backend(self) -> str:
        binary = llamacpp.find_llama_server()
        assert binary is not None  # else skipped
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        model = llamacpp.write_tiny_model(os.path.join(directory, "tiny.gguf"))
        self.server = await llamacpp.start_llama_server(reactor, binary, model)
        self.addCleanup(self.server.stop)
        return self.server.url

    def generates(self, tokens: int) -> None:
        # The tiny model never samples end-of-generation: it obeys max_tokens.
        pass
