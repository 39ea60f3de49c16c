# -*- test-case-name: tests.test_fakeengine -*-
"""
Tests for L{nvproxy.testing.fakeengine}: dialect shapes in memory (StubTreq +
Clock), scripted faults in memory and over real loopback TCP, the command line,
and the official C{openai} / C{ollama} clients parsing the fakes' answers.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import treq
from treq.client import HTTPClient
from treq.testing import StubTreq
from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.error import ConnectionRefusedError, ProcessDone
from twisted.internet.protocol import ProcessProtocol, Protocol, connectionDone
from twisted.internet.task import Clock
from twisted.internet.utils import getProcessOutputAndValue
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import (
    Agent,
    HTTPConnectionPool,
    ResponseDone,
    ResponseFailed,
    ResponseNeverReceived,
)
from twisted.web.iweb import IResponse

import nvproxy
from nvproxy.testing.fakeengine import Behaviour, FakeEngine
from nvproxy.testing.harness import eventually

reactor: Any = _reactor
ROOT = Path(nvproxy.__file__).resolve().parent.parent


class _Collect(Protocol):
    """Collects a response body chunk by chunk."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.done: Deferred[list[bytes]] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.chunks.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if reason.check(ResponseDone):
            self.done.callback(self.chunks)
        else:
            self.done.errback(reason)


def _collect(response: IResponse) -> _Collect:
    collector = _Collect()
    response.deliverBody(collector)
    return collector


def _lines(body: bytes) -> list[Any]:
    return [json.loads(line) for line in body.splitlines() if line]


def _sse(body: bytes) -> list[Any]:
    events = []
    for block in body.split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block[len(b"data: ") :]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def _named_sse(body: bytes) -> list[tuple[str, Any]]:
    events = []
    for block in body.split(b"\n\n"):
        if block:
            name, data = block.split(b"\n")
            events.append(
                (name.removeprefix(b"event: ").decode(), json.loads(data[6:]))
            )
    return events


class _Memory(SynchronousTestCase):
    """An engine behind StubTreq on a fake clock."""

    dialect = "ollama"
    models = ("llama3:latest", "qwen:7b")

    def setUp(self) -> None:
        self.clock = Clock()
        self.engine = FakeEngine(self.dialect, self.models, self.clock)  # type: ignore[arg-type]
        self.stub = StubTreq(self.engine.resource())

    def request(
        self, method: str, path: str, body: Mapping[str, Any] | None = None
    ) -> Deferred[IResponse]:
        kwargs: dict[str, Any] = {} if body is None else {"json": body}
        d: Deferred[IResponse] = self.stub.request(
            method, "http://engine.invalid" + path, **kwargs
        )
        self.stub.flush()
        return d

    def fetch(
        self, method: str, path: str, body: Mapping[str, Any] | None = None
    ) -> tuple[IResponse, bytes]:
        response = self.successResultOf(self.request(method, path, body))
        collector = _collect(response)
        self.stub.flush()
        return response, b"".join(self.successResultOf(collector.done))

    def fetch_json(
        self, method: str, path: str, body: Mapping[str, Any] | None = None
    ) -> tuple[int, Any]:
        response, raw = self.fetch(method, path, body)
        return response.code, json.loads(raw)

    def header(self, response: IResponse, name: str) -> str | None:
        values = response.headers.getRawHeaders(name)
        return None if values is None else values[0]


CHAT = {"model": "llama3", "messages": [{"role": "user", "content": "say hi now"}]}


class OllamaTests(_Memory):
    def test_tags(self) -> None:
        code, body = self.fetch_json("GET", "/api/tags")
        self.assertEqual(code, 200)
        names = [m["name"] for m in body["models"]]
        self.assertEqual(names, ["llama3:latest", "qwen:7b"])
        entry = body["models"][0]
        self.assertEqual(entry["model"], "llama3:latest")
        self.assertEqual(
            set(entry), {"name", "model", "modified_at", "size", "digest", "details"}
        )
        self.assertEqual(entry["details"]["format"], "gguf")

    def test_inventory_follows_models(self) -> None:
        self.engine.models.remove("qwen:7b")
        _, body = self.fetch_json("GET", "/api/tags")
        self.assertEqual([m["name"] for m in body["models"]], ["llama3:latest"])

    def test_small_routes(self) -> None:
        self.assertEqual(self.fetch_json("GET", "/api/version")[0], 200)
        self.assertEqual(len(self.fetch_json("GET", "/api/ps")[1]["models"]), 2)
        code, show = self.fetch_json("POST", "/api/show", {"model": "llama3"})
        self.assertEqual((code, show["details"]["family"]), (200, "llama"))
        self.assertEqual(self.fetch("GET", "/")[1], b"Ollama is running")
        self.assertEqual(self.fetch("GET", "/nope")[0].code, 404)

    def test_chat_streams_by_default(self) -> None:
        response, raw = self.fetch("POST", "/api/chat", CHAT)
        self.assertEqual(self.header(response, "content-type"), "application/x-ndjson")
        self.assertEqual(self.header(response, "transfer-encoding"), None)  # decoded
        lines = _lines(raw)
        self.assertEqual(len(lines), 6)
        self.assertEqual(
            lines[0],
            {
                "model": "llama3",
                "created_at": "1970-01-01T00:00:00Z",
                "message": {"role": "assistant", "content": "Hello"},
                "done": False,
            },
        )
        text = "".join(line["message"]["content"] for line in lines)
        self.assertEqual(text, "Hello from the fake engine")
        last = lines[-1]
        self.assertEqual((last["done"], last["done_reason"]), (True, "stop"))
        self.assertEqual((last["prompt_eval_count"], last["eval_count"]), (3, 5))
        for key in ("eval_duration", "prompt_eval_duration", "total_duration"):
            self.assertIsInstance(last[key], int)

    def test_generate_not_streaming(self) -> None:
        body = {"model": "llama3:latest", "prompt": "hi", "stream": False}
        response, raw = self.fetch("POST", "/api/generate", body)
        self.assertEqual(response.length, len(raw))  # not chunked
        obj = json.loads(raw)
        self.assertEqual(obj["response"], "Hello from the fake engine")
        self.assertEqual((obj["done"], obj["eval_count"]), (True, 5))

    def test_no_usage(self) -> None:
        self.engine.script(Behaviour(report_usage=False, chunks=2))
        _, raw = self.fetch("POST", "/api/generate", {"model": "llama3", "prompt": "x"})
        last = _lines(raw)[-1]
        self.assertTrue(last["done"])
        for key in ("eval_count", "prompt_eval_count", "eval_duration"):
            self.assertNotIn(key, last)

    def test_unknown_model(self) -> None:
        code, body = self.fetch_json("POST", "/api/chat", {**CHAT, "model": "x"})
        self.assertEqual(
            (code, body), (404, {"error": 'model "x" not found, try pulling it first'})
        )
        code, body = self.fetch_json("POST", "/v1/chat/completions", {"model": "x"})
        self.assertEqual((code, body["error"]["code"]), (404, "model_not_found"))

    def test_embed(self) -> None:
        code, body = self.fetch_json(
            "POST", "/api/embed", {"model": "llama3", "input": ["a", "b"]}
        )
        self.assertEqual((code, len(body["embeddings"])), (200, 2))
        _, old = self.fetch_json("POST", "/api/embeddings", {"model": "llama3"})
        self.assertEqual(len(old["embedding"]), 8)

    def test_pull(self) -> None:
        _, raw = self.fetch("POST", "/api/pull", {"model": "mistral"})
        statuses = [line["status"] for line in _lines(raw)]
        self.assertEqual((statuses[0], statuses[-1]), ("pulling manifest", "success"))
        self.assertEqual(self.engine.pulls, ["mistral"])
        self.assertIn("mistral:latest", self.engine.models)

    def test_openai_compat(self) -> None:
        _, body = self.fetch_json("GET", "/v1/models")
        self.assertEqual([m["id"] for m in body["data"]], list(self.models))
        _, body = self.fetch_json("POST", "/v1/chat/completions", CHAT)
        self.assertEqual(body["object"], "chat.completion")
        self.assertEqual(body["usage"]["completion_tokens"], 5)


class OpenAITests(_Memory):
    dialect = "openai"
    models = ("m", "other")

    def test_models(self) -> None:
        _, body = self.fetch_json("GET", "/v1/models")
        self.assertEqual(
            body,
            {
                "object": "list",
                "data": [
                    {"id": "m", "object": "model", "created": 0, "owned_by": "fake"},
                    {
                        "id": "other",
                        "object": "model",
                        "created": 0,
                        "owned_by": "fake",
                    },
                ],
            },
        )
        _, v0 = self.fetch_json("GET", "/api/v0/models")
        self.assertEqual(v0["data"][0]["state"], "loaded")

    def test_chat_not_streaming_by_default(self) -> None:
        code, body = self.fetch_json(
            "POST", "/v1/chat/completions", {**CHAT, "model": "m"}
        )
        self.assertEqual(code, 200)
        self.assertEqual(
            body["choices"][0]["message"]["content"], "Hello from the fake engine"
        )
        self.assertEqual(body["choices"][0]["finish_reason"], "stop")
        self.assertEqual(
            body["usage"],
            {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
        )

    def test_chat_stream(self) -> None:
        req = {**CHAT, "model": "m", "stream": True}
        response, raw = self.fetch("POST", "/v1/chat/completions", req)
        self.assertEqual(self.header(response, "content-type"), "text/event-stream")
        events = _sse(raw)
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual(events[0]["object"], "chat.completion.chunk")
        self.assertEqual(events[0]["choices"][0]["delta"]["role"], "assistant")
        self.assertEqual(events[-2]["choices"][0]["finish_reason"], "stop")
        self.assertNotIn("usage", events[-2])  # not asked for

    def test_stream_usage(self) -> None:
        req = {**CHAT, "model": "m", "stream": True}
        asked = {**req, "stream_options": {"include_usage": True}}
        events = _sse(self.fetch("POST", "/v1/chat/completions", asked)[1])
        self.assertEqual(events[-2]["usage"]["total_tokens"], 8)
        self.assertEqual(events[-2]["choices"], [])
        self.engine.script(Behaviour(always_stream_usage=True))
        events = _sse(self.fetch("POST", "/v1/chat/completions", req)[1])
        self.assertIn("usage", events[-2])
        self.engine.script(Behaviour(report_usage=False))
        events = _sse(self.fetch("POST", "/v1/chat/completions", asked)[1])
        self.assertFalse(any("usage" in e for e in events[:-1]))

    def test_completions_and_embeddings(self) -> None:
        _, body = self.fetch_json(
            "POST", "/v1/completions", {"model": "m", "prompt": "p"}
        )
        self.assertEqual(body["choices"][0]["text"], "Hello from the fake engine")
        _, body = self.fetch_json(
            "POST", "/v1/embeddings", {"model": "m", "input": "x"}
        )
        self.assertEqual(body["data"][0]["object"], "embedding")
        _, body = self.fetch_json("POST", "/api/v0/chat/completions", {"model": "m"})
        self.assertIn("stats", body)

    def test_unknown_model(self) -> None:
        code, body = self.fetch_json("POST", "/v1/chat/completions", {"model": "zz"})
        self.assertEqual(code, 404)
        self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertEqual(body["error"]["code"], "model_not_found")

    def test_multipart(self) -> None:
        body = (
            b"--XyZ\r\n"
            b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            b"Content-Type: audio/wav\r\n\r\nRIFF....\r\n"
            b"--XyZ\r\n"
            b'Content-Disposition: form-data; name="model"\r\n\r\nm\r\n'
            b"--XyZ--\r\n"
        )
        d = self.stub.post(
            "http://engine.invalid/v1/audio/transcriptions",
            data=body,
            headers={"Content-Type": ["multipart/form-data; boundary=XyZ"]},
        )
        self.stub.flush()
        response = self.successResultOf(d)
        body = self.successResultOf(treq.json_content(response))
        self.assertEqual(body, {"text": "Hello from the fake engine"})
        self.assertEqual(self.engine.requests[-1].model, "m")

    def test_bad_json(self) -> None:
        d = self.stub.post("http://engine.invalid/v1/completions", data=b"{nope")
        self.stub.flush()
        self.assertEqual(self.successResultOf(d).code, 400)


class LlamaCppTests(_Memory):
    dialect = "llamacpp"
    models = ("qwen2.5-0.5b.gguf",)

    def test_inventory(self) -> None:
        self.assertEqual(self.fetch_json("GET", "/health"), (200, {"status": "ok"}))
        for path in ("/models", "/v1/models"):
            _, body = self.fetch_json("GET", path)
            self.assertEqual(body["object"], "list")
            self.assertEqual([m["id"] for m in body["data"]], list(self.models))
            self.assertEqual([m["model"] for m in body["models"]], list(self.models))
        self.assertEqual(self.fetch_json("GET", "/props")[1]["total_slots"], 1)
        self.assertEqual(self.fetch_json("GET", "/slots")[1][0]["id"], 0)

    def test_native_completion(self) -> None:
        code, body = self.fetch_json("POST", "/completion", {"prompt": "a b"})
        self.assertEqual(
            (code, body["content"], body["stop"]),
            (200, "Hello from the fake engine", True),
        )
        self.assertEqual((body["tokens_predicted"], body["tokens_evaluated"]), (5, 2))
        self.assertEqual(body["timings"]["predicted_n"], 5)

    def test_native_stream(self) -> None:
        _, raw = self.fetch("POST", "/completion", {"prompt": "a", "stream": True})
        events = _sse(raw)
        self.assertEqual(len(events), 6)
        self.assertEqual((events[0]["content"], events[0]["stop"]), ("Hello", False))
        self.assertTrue(events[-1]["stop"])
        self.assertNotIn("[DONE]", events)

    def test_native_limit(self) -> None:
        """
        C{n_predict} (or C{max_tokens}) caps the tokens; an answer cut short
        says C{stop_type: "limit"}; a negative limit is no limit.
        """
        for body, n, stop_type in (
            ({"n_predict": 3}, 3, "limit"),
            ({"max_tokens": 2}, 2, "limit"),
            ({"n_predict": 5}, 5, "limit"),
            ({"n_predict": 9}, 5, "eos"),
            ({"n_predict": -1, "max_tokens": 2}, 5, "eos"),
        ):
            _, answer = self.fetch_json("POST", "/completion", {"prompt": "a", **body})
            self.assertEqual(
                (answer["tokens_predicted"], answer["stop_type"]), (n, stop_type), body
            )
            self.assertEqual(answer["timings"]["predicted_n"], n)
        _, raw = self.fetch(
            "POST", "/completion", {"prompt": "a", "n_predict": 2, "stream": True}
        )
        events = _sse(raw)
        self.assertEqual([e["content"] for e in events], ["Hello", " from", ""])
        self.assertEqual(events[-1]["stop_type"], "limit")

    def test_echoes_alias(self) -> None:
        """
        Like C{llama-server}, the answer names the served alias whatever
        model the request asked for.
        """
        for path in ("/v1/chat/completions", "/completion", "/v1/messages"):
            code, body = self.fetch_json(
                "POST", path, {**CHAT, "model": "whatever", "prompt": "x"}
            )
            self.assertEqual((code, body["model"]), (200, self.models[0]), path)

    def test_chat_limit_and_timings(self) -> None:
        """
        A plain chat answer: C{max_tokens} caps it (C{"length"}), and
        C{timings} sit next to C{usage}.
        """
        _, body = self.fetch_json("POST", "/v1/chat/completions", CHAT)
        self.assertEqual(body["choices"][0]["finish_reason"], "stop")
        self.assertEqual(body["usage"]["completion_tokens"], 5)
        _, body = self.fetch_json(
            "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 2}
        )
        (choice,) = body["choices"]
        self.assertEqual(
            (choice["message"]["content"], choice["finish_reason"]),
            ("Hello from", "length"),
        )
        self.assertEqual(body["usage"]["completion_tokens"], 2)
        self.assertEqual(body["timings"]["predicted_n"], 2)
        _, body = self.fetch_json(
            "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}
        )
        self.assertEqual(
            (body["choices"][0]["text"], body["choices"][0]["finish_reason"]),
            ("Hello", "length"),
        )
        self.assertEqual(body["timings"]["predicted_n"], 1)

    def test_chat_stream(self) -> None:
        """
        A role-only first chunk (C{content: null}), one chunk per token, and
        C{timings} on the finishing chunk when no usage chunk was asked for.
        """
        _, raw = self.fetch(
            "POST", "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 3}
        )
        events = _sse(raw)
        self.assertEqual(events[-1], "[DONE]")
        first, *middle, last = events[:-1]
        self.assertEqual(
            first["choices"][0]["delta"], {"role": "assistant", "content": None}
        )
        self.assertEqual(
            [e["choices"][0]["delta"] for e in middle],
            [{"content": "Hello"}, {"content": " from"}, {"content": " the"}],
        )
        self.assertEqual(
            last["choices"][0], {"finish_reason": "length", "index": 0, "delta": {}}
        )
        self.assertEqual(last["timings"]["predicted_n"], 3)
        self.assertNotIn("usage", last)

    def test_chat_stream_usage_chunk(self) -> None:
        """
        With C{include_usage}, the usage chunk carries C{timings} and the
        finishing chunk does not.
        """
        options = {"stream_options": {"include_usage": True}}
        _, raw = self.fetch(
            "POST", "/v1/chat/completions", {**CHAT, "stream": True, **options}
        )
        *_, finishing, report, done = _sse(raw)
        self.assertEqual(finishing["choices"][0]["finish_reason"], "stop")
        self.assertNotIn("timings", finishing)
        self.assertEqual(report["choices"], [])
        self.assertEqual(report["usage"]["completion_tokens"], 5)
        self.assertEqual(report["timings"]["predicted_n"], 5)
        self.engine.script(Behaviour(report_usage=False))
        _, raw = self.fetch(
            "POST", "/v1/chat/completions", {**CHAT, "stream": True, **options}
        )
        events = _sse(raw)
        self.assertEqual(len(events), 1 + 5 + 1 + 1)
        self.assertFalse(any("usage" in e or "timings" in e for e in events[:-1]))

    def test_completion_stream(self) -> None:
        """
        A C{/v1/completions} stream's finishing chunk always carries usage and
        timings; it has no role chunk.
        """
        _, raw = self.fetch(
            "POST", "/v1/completions", {"prompt": "x", "stream": True, "max_tokens": 2}
        )
        events = _sse(raw)
        self.assertEqual(
            [e["choices"][0]["text"] for e in events[:-1]], ["Hello", " from", ""]
        )
        last = events[-2]
        self.assertEqual(last["choices"][0]["finish_reason"], "length")
        self.assertEqual(last["usage"]["completion_tokens"], 2)
        self.assertEqual(last["timings"]["predicted_n"], 2)

    def test_responses(self) -> None:
        request = {"model": "m", "input": "say hi", "max_output_tokens": 2}
        code, body = self.fetch_json("POST", "/v1/responses", request)
        self.assertEqual(
            (code, body["object"], body["status"]), (200, "response", "completed")
        )
        (message,) = body["output"]
        self.assertEqual(
            (message["role"], message["content"][0]["text"]),
            ("assistant", "Hello from"),
        )
        self.assertEqual(body["usage"]["output_tokens"], 2)
        self.assertEqual(self.fetch_json("POST", "/responses", request)[0], 200)
        _, raw = self.fetch("POST", "/v1/responses", {**request, "stream": True})
        events = _named_sse(raw)
        names = [name for name, _ in events]
        self.assertEqual(names[:2], ["response.created", "response.in_progress"])
        self.assertEqual(names[-1], "response.completed")
        self.assertTrue(all(data["type"] == name for name, data in events))
        deltas = [d["delta"] for n, d in events if n == "response.output_text.delta"]
        self.assertEqual(deltas, ["Hello", " from"])
        completed = events[-1][1]
        self.assertEqual(completed["response"]["usage"]["output_tokens"], 2)
        self.assertEqual(completed["timings"]["predicted_n"], 2)

    def test_messages(self) -> None:
        request = {**CHAT, "max_tokens": 3}
        code, body = self.fetch_json("POST", "/v1/messages", request)
        self.assertEqual(
            (code, body["type"], body["role"]), (200, "message", "assistant")
        )
        self.assertEqual(body["content"], [{"type": "text", "text": "Hello from the"}])
        self.assertEqual(
            (body["stop_reason"], body["usage"]["output_tokens"]), ("max_tokens", 3)
        )
        _, body = self.fetch_json("POST", "/v1/messages", {**CHAT, "max_tokens": 99})
        self.assertEqual(body["stop_reason"], "end_turn")
        _, raw = self.fetch("POST", "/v1/messages", {**request, "stream": True})
        events = _named_sse(raw)
        self.assertEqual(
            [name for name, _ in events],
            [
                "message_start",
                "content_block_start",
                *["content_block_delta"] * 3,
                "content_block_stop",
                "message_delta",
                "message_stop",
            ],
        )
        self.assertEqual(events[-2][1]["delta"]["stop_reason"], "max_tokens")
        self.assertEqual(events[-2][1]["usage"]["output_tokens"], 3)
        code, body = self.fetch_json("POST", "/v1/messages/count_tokens", CHAT)
        self.assertEqual((code, body), (200, {"input_tokens": 3}))

    def test_bad_json(self) -> None:
        """An unparsable body is a 500 C{server_error}, as in C{llama-server}."""
        for path in ("/v1/chat/completions", "/completion", "/v1/messages"):
            d = self.stub.post("http://engine.invalid" + path, data=b'{"model":')
            self.stub.flush()
            response = self.successResultOf(d)
            collector = _collect(response)
            self.stub.flush()
            body = json.loads(b"".join(self.successResultOf(collector.done)))
            self.assertEqual(response.code, 500, path)
            self.assertEqual(body["error"]["type"], "server_error")
            self.assertEqual(body["error"]["code"], 500)
            self.assertIn("parse error", body["error"]["message"])

    def test_other_routes(self) -> None:
        for path in (
            "/embedding",
            "/v1/embeddings",
            "/infill",
            "/rerank",
            "/v1/rerank",
        ):
            code, _ = self.fetch_json(
                "POST",
                path,
                {"input": "x", "content": "x", "query": "q", "documents": ["a"]},
            )
            self.assertEqual(code, 200, path)
        code, body = self.fetch_json("GET", "/nothing")
        self.assertEqual((code, body["error"]["type"]), (404, "not_found_error"))


class BehaviourTests(_Memory):
    def test_validation(self) -> None:
        self.assertRaises(ValueError, Behaviour, latency=-1)
        self.assertRaises(ValueError, Behaviour, chunks=-1)
        self.assertEqual(Behaviour(headers={"a": "b"}).headers, (("a", "b"),))

    def test_status(self) -> None:
        self.engine.script(
            Behaviour(status=503, retry_after=7, headers={"X-Fake": "1"})
        )
        response, raw = self.fetch("POST", "/api/chat", CHAT)
        self.assertEqual(response.code, 503)
        self.assertEqual(json.loads(raw), {"error": "fake engine: scripted status 503"})
        self.assertEqual(self.header(response, "retry-after"), "7")
        self.assertEqual(self.header(response, "x-fake"), "1")
        self.assertEqual(self.fetch("POST", "/api/chat", CHAT)[0].code, 200)

    def test_body_override(self) -> None:
        self.engine.script(Behaviour(body=b"garbage", status=502))
        response, raw = self.fetch("POST", "/api/generate", {"model": "llama3"})
        self.assertEqual((response.code, raw), (502, b"garbage"))
        self.engine.script(
            Behaviour(body=b"<html/>", headers={"Content-Type": "text/html"})
        )
        response, raw = self.fetch("POST", "/api/generate", {"model": "llama3"})
        self.assertEqual((response.code, raw), (200, b"<html/>"))
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["text/html"])

    def test_queue_then_default(self) -> None:
        self.engine.default = Behaviour(status=500)
        self.engine.script(Behaviour(status=429), Behaviour(status=200))
        codes = [self.fetch("POST", "/api/chat", CHAT)[0].code for _ in range(3)]
        self.assertEqual(codes, [429, 200, 500])
        # Inventory routes take neither the queue nor the default...
        self.engine.script(Behaviour(status=418))
        self.assertEqual(self.fetch("GET", "/api/tags")[0].code, 200)
        self.assertEqual(self.engine.scripted, 1)
        # ...unless scripted by path.
        self.engine.script(Behaviour(status=500), path="/api/tags")
        self.assertEqual(self.fetch("GET", "/api/tags")[0].code, 500)
        self.assertEqual(self.engine.scripted, 1)

    def test_latency(self) -> None:
        self.engine.script(Behaviour(latency=2.0))
        d = self.request("POST", "/api/chat", CHAT)
        self.assertNoResult(d)
        self.clock.advance(1.9)
        self.stub.flush()
        self.assertNoResult(d)
        self.clock.advance(0.1)
        self.stub.flush()
        self.assertEqual(self.successResultOf(d).code, 200)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_chunk_interval(self) -> None:
        """Each body part is its own HTTP chunk, written when the clock says."""
        self.engine.script(Behaviour(chunks=3, chunk_interval=1.0, first_chunk_delay=5))
        response = self.successResultOf(self.request("POST", "/api/generate", CHAT))
        collector = _collect(response)
        self.stub.flush()
        self.assertEqual(collector.chunks, [])
        self.clock.advance(5)
        self.stub.flush()
        self.assertEqual(len(collector.chunks), 1)
        for expected in (2, 3, 4):
            self.clock.advance(1)
            self.stub.flush()
            self.assertEqual(len(collector.chunks), expected)
        chunks = self.successResultOf(collector.done)
        self.assertEqual(json.loads(chunks[0])["response"], "Hello")
        self.assertTrue(json.loads(chunks[-1])["done"])

    def test_stall_before_headers(self) -> None:
        self.engine.script(Behaviour(stall_before_headers=True))
        d = self.request("POST", "/api/chat", CHAT)
        self.clock.advance(3600)
        self.stub.flush()
        self.assertNoResult(d)
        self.assertEqual(self.engine.pending, 1)
        self.successResultOf(self.engine.stop())
        self.stub.flush()
        self.failureResultOf(d)
        self.assertEqual(self.engine.pending, 0)

    def test_headers_then_silence(self) -> None:
        self.engine.script(Behaviour(headers_then_silence=True))
        response = self.successResultOf(self.request("POST", "/api/chat", CHAT))
        self.assertEqual(response.code, 200)
        collector = _collect(response)
        self.clock.advance(3600)
        self.stub.flush()
        self.assertEqual(collector.chunks, [])
        self.assertNoResult(collector.done)
        self.successResultOf(self.engine.stop())
        self.stub.flush()
        self.failureResultOf(collector.done)

    def test_die_after_chunks(self) -> None:
        self.engine.script(Behaviour(die_after_chunks=2))
        response = self.successResultOf(self.request("POST", "/api/chat", CHAT))
        collector = _collect(response)
        self.stub.flush()
        self.failureResultOf(collector.done)
        self.assertEqual(len(collector.chunks), 2)

    def test_die_not_streaming(self) -> None:
        self.engine.script(Behaviour(die_after_chunks=1))
        body = {**CHAT, "stream": False}
        response = self.successResultOf(self.request("POST", "/api/chat", body))
        length = response.length
        collector = _collect(response)
        self.stub.flush()
        self.failureResultOf(collector.done)
        self.assertEqual(len(b"".join(collector.chunks)), length // 2)  # type: ignore[operator]

    def test_refuse(self) -> None:
        self.engine.script(Behaviour(refuse=True))
        d = self.request("POST", "/api/chat", CHAT)
        self.failureResultOf(d)
        self.assertEqual(len(self.engine.requests), 1)

    def test_recorded(self) -> None:
        self.clock.advance(42)
        d = self.stub.post(
            "http://engine.invalid/api/chat?x=1",
            json=CHAT,
            headers={"X-Forwarded-For": ["1.2.3.4"]},
        )
        self.stub.flush()
        self.successResultOf(d)
        self.fetch("GET", "/api/tags")
        first, second = self.engine.requests
        self.assertEqual(
            (first.method, first.path, first.uri, first.model, first.at),
            ("POST", "/api/chat", "/api/chat?x=1", "llama3", 42.0),
        )
        self.assertEqual(first.headers["x-forwarded-for"], "1.2.3.4")
        self.assertEqual(first.json(), CHAT)
        self.assertEqual((second.method, second.model, second.body), ("GET", None, b""))


# -- real loopback -------------------------------------------------------------


class LoopbackTests(TestCase):
    def setUp(self) -> None:
        self.engine = FakeEngine("openai", ["m"], reactor)
        pool = HTTPConnectionPool(reactor)
        self.addCleanup(pool.closeCachedConnections)
        self.http = HTTPClient(Agent(reactor, pool=pool))
        self.addCleanup(self.engine.stop)

    async def post(self, body: Mapping[str, Any]) -> IResponse:
        response: IResponse = await self.http.post(
            self.engine.url + "/v1/chat/completions", json=body
        )
        return response

    async def _listen(self) -> None:
        await self.engine.listen(reactor, port=0)

    async def _held(self, count: int) -> None:
        await eventually(
            reactor,
            lambda: self.engine.pending >= count,
            attempts=500,  # bounded: at most 5 s
            what=f"{count} requests held",
        )

    def test_stream_over_tcp(self) -> Deferred[None]:
        async def go() -> None:
            await self._listen()
            self.engine.script(Behaviour(chunks=4, chunk_interval=0.01))
            response = await self.post({"model": "m", "stream": True})
            chunks = await _collect(response).done
            self.assertEqual(len(chunks), 4 + 2)  # tokens, finish, [DONE]

        return ensureDeferred(go())

    def test_refuse_and_connection_refused(self) -> Deferred[None]:
        async def go() -> None:
            await self._listen()
            port = self.engine.port
            self.engine.script(Behaviour(refuse=True))
            with self.assertRaises(ResponseNeverReceived):
                await self.post({"model": "m"})
            await self.engine.stop_listening()
            with self.assertRaises(ConnectionRefusedError):
                await self.post({"model": "m"})
            await self.engine.listen(reactor)
            self.assertEqual(self.engine.port, port)
            response = await self.post({"model": "m"})
            self.assertEqual(response.code, 200)
            await response.text()

        return ensureDeferred(go())

    def test_stop_drops_held_requests(self) -> Deferred[None]:
        async def go() -> None:
            await self._listen()
            self.engine.script(
                Behaviour(stall_before_headers=True),
                Behaviour(headers_then_silence=True),
            )
            # The script is consumed in arrival order: the second request
            # is sent only once the first is held, or the two could swap.
            stalled = ensureDeferred(self.post({"model": "m"}))
            await self._held(1)
            silent = await self.post({"model": "m", "stream": True})
            body = _collect(silent).done
            await self._held(2)
            self.assertNoResult(stalled)
            self.assertNoResult(body)
            self.assertEqual(self.engine.pending, 2)
            await self.engine.stop()
            with self.assertRaises(ResponseNeverReceived):
                await stalled
            with self.assertRaises(ResponseFailed):
                await body
            self.assertEqual(self.engine.pending, 0)

        return ensureDeferred(go())

    def test_die_mid_stream(self) -> Deferred[None]:
        async def go() -> None:
            await self._listen()
            self.engine.script(
                Behaviour(chunks=10, die_after_chunks=3, chunk_interval=0.01)
            )
            response = await self.post({"model": "m", "stream": True})
            collector = _collect(response)
            with self.assertRaises(ResponseFailed):
                await collector.done
            self.assertEqual(len(collector.chunks), 3)

        return ensureDeferred(go())


# -- subprocesses ------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    env["NO_PROXY"] = "*"
    return env


class _Lines(ProcessProtocol):
    def __init__(self) -> None:
        self.first_line: Deferred[str] = Deferred()
        self.ended: Deferred[None] = Deferred()
        self.reason: Failure | None = None
        self._buffer = b""

    def outReceived(self, data: bytes) -> None:
        self._buffer += data
        if b"\n" in self._buffer and not self.first_line.called:
            self.first_line.callback(self._buffer.split(b"\n")[0].decode())

    def processEnded(self, reason: Failure) -> None:
        if not self.first_line.called:
            self.first_line.errback(reason)
        self.reason = reason
        self.ended.callback(None)


class CommandLineTests(TestCase):
    def test_cli(self) -> Deferred[None]:
        async def go() -> None:
            protocol = _Lines()
            args = [
                sys.executable,
                "-m",
                "nvproxy.testing.fakeengine",
                "--dialect",
                "llamacpp",
                "--port",
                "0",
                "--models",
                "a,b",
            ]
            process = reactor.spawnProcess(
                protocol, sys.executable, args, env=_env(), path=str(ROOT)
            )

            def kill() -> None:
                if process.pid is not None:
                    process.signalProcess("KILL")

            self.addCleanup(kill)
            line = await protocol.first_line.addTimeout(30, reactor)
            host, _, port = line.removeprefix("listening on ").rpartition(":")
            self.assertEqual(host, "127.0.0.1")
            pool = HTTPConnectionPool(reactor, persistent=False)
            response = await treq.get(f"http://127.0.0.1:{port}/v1/models", pool=pool)
            body = await response.json()
            self.assertEqual([m["id"] for m in body["data"]], ["a", "b"])
            process.signalProcess("TERM")
            await protocol.ended.addTimeout(10, reactor)
            assert protocol.reason is not None
            self.assertTrue(protocol.reason.check(ProcessDone), protocol.reason)

        return ensureDeferred(go())


OPENAI_SCRIPT = """
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="x", max_retries=0, timeout=10)
msgs = [{"role": "user", "content": "hi there"}]
r = c.chat.completions.create(model="m", messages=msgs)
s = c.chat.completions.create(model="m", messages=msgs, stream=True,
                              stream_options={"include_usage": True})
parts, usage = [], None
for chunk in s:
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
    if chunk.usage:
        usage = chunk.usage.total_tokens
e = c.embeddings.create(model="m", input="x")
print(json.dumps([r.choices[0].message.content, r.usage.total_tokens,
                  "".join(parts), usage, len(e.data[0].embedding),
                  [m.id for m in c.models.list()]]))
"""

OLLAMA_SCRIPT = """
import json, sys, ollama
c = ollama.Client(host=sys.argv[1], timeout=10)
msgs = [{"role": "user", "content": "hi there"}]
r = c.chat(model="llama3", messages=msgs)
s = list(c.chat(model="llama3", messages=msgs, stream=True))
g = c.generate(model="llama3", prompt="hi")
e = c.embed(model="llama3", input="x")
tags = c.list()
try:
    c.chat(model="nope", messages=msgs)
    missing = None
except ollama.ResponseError as err:
    missing = [err.status_code, err.error]
print(json.dumps([r.message.content, r.eval_count,
                  "".join(x.message.content for x in s), s[-1].done_reason,
                  g.response, len(e.embeddings[0]),
                  [m.model for m in tags.models], missing]))
"""


class ClientTests(TestCase):
    """The official SDKs (in a subprocess) parse what the fakes send."""

    async def run_client(self, script: str, url: str) -> Any:
        out, err, code = await getProcessOutputAndValue(
            sys.executable,
            ["-c", textwrap.dedent(script), url],
            env=_env(),
            path=str(ROOT),
        ).addTimeout(60, reactor)
        self.assertEqual(code, 0, err.decode(errors="replace"))
        return json.loads(out)

    def test_openai_client(self) -> Deferred[None]:
        async def go() -> None:
            engine = FakeEngine("openai", ["m"], reactor)
            await engine.listen(reactor, port=0)
            self.addCleanup(engine.stop)
            result = await self.run_client(OPENAI_SCRIPT, engine.url)
            text = "Hello from the fake engine"
            self.assertEqual(result, [text, 7, text, 7, 8, ["m"]])

        return ensureDeferred(go())

    def test_ollama_client(self) -> Deferred[None]:
        async def go() -> None:
            engine = FakeEngine("ollama", ["llama3:latest"], reactor)
            await engine.listen(reactor, port=0)
            self.addCleanup(engine.stop)
            result = await self.run_client(OLLAMA_SCRIPT, engine.url)
            text = "Hello from the fake engine"
            missing = [404, 'model "nope" not found, try pulling it first']
            self.assertEqual(
                result,
                [text, 5, text, "stop", text, 8, ["llama3:latest"], missing],
            )

        return ensureDeferred(go())
