# -*- test-case-name: tests.test_fakevllm -*-
# trial's assertion methods are unannotated:
# mypy: disallow-untyped-calls=False
"""Tests for L{nvproxy.testing.fakevllm}."""

from __future__ import annotations

import json
from collections.abc import Coroutine
from typing import Any

import treq
from prometheus_client.parser import text_string_to_metric_families
from treq.testing import StubTreq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.interfaces import IReactorTCP, IReactorTime
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import HTTPConnectionPool, ResponseFailed
from twisted.web.iweb import IResponse

from nvproxy.testing.fakevllm import (
    REQUEST_WHILE_ASLEEP,
    REQUEST_WHILE_NOT_READY,
    REQUEST_WHILE_WAKING,
    SLEEP_ABORTED_REQUESTS,
    WEIGHTS_NOT_RELOADED,
    EngineState,
    FakeVLLM,
    Violation,
)
from tests.vllm_contract import VllmContract

BASE = "http://fake-vllm"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi there"}]}


class _Harness(SynchronousTestCase):
    """A fake on a Clock, reached through StubTreq."""

    def make(self, **kwargs: Any) -> FakeVLLM:
        self.clock = Clock()
        self.fake = FakeVLLM(clock=self.clock, **kwargs)
        self.stub = StubTreq(self.fake.resource())
        return self.fake

    def request(self, method: str, path: str, **kwargs: Any) -> Deferred[IResponse]:
        # StubTreq grows treq's functions at run time; mypy cannot see them.
        stub: Any = self.stub
        d: Deferred[IResponse] = stub.request(method, BASE + path, **kwargs)
        self.stub.flush()
        return d

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.stub.flush()

    def response(self, d: Deferred[IResponse]) -> IResponse:
        self.stub.flush()
        return self.successResultOf(d)

    def body(self, response: IResponse) -> bytes:
        d: Deferred[bytes] = treq.content(response)
        self.stub.flush()
        return self.successResultOf(d)

    def call(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        """Make a request that completes now; return (code, JSON or bytes)."""
        response = self.response(self.request(method, path, **kwargs))
        raw = self.body(response)
        try:
            return response.code, json.loads(raw)
        except ValueError:
            return response.code, raw

    def events(self, raw: bytes) -> list[Any]:
        """The SSE payloads of a stream; ``[DONE]`` as a string."""
        out: list[Any] = []
        for block in raw.decode().split("\n\n"):
            if not block:
                continue
            self.assertTrue(block.startswith("data: "), block)
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
        return out

    def is_sleeping(self) -> bool:
        code, body = self.call("GET", "/is_sleeping")
        self.assertEqual(code, 200)
        result = body["is_sleeping"]
        assert isinstance(result, bool)
        return result


class OpenAIRoutesTests(_Harness):
    def test_models(self) -> None:
        self.make(model="m1")
        code, body = self.call("GET", "/v1/models")
        self.assertEqual(code, 200)
        self.assertEqual(body["object"], "list")
        self.assertEqual([m["id"] for m in body["data"]], ["m1"])
        self.assertEqual(body["data"][0]["owned_by"], "vllm")

    def test_chat(self) -> None:
        self.make()
        code, body = self.call("POST", "/v1/chat/completions", json=CHAT)
        self.assertEqual(code, 200)
        self.assertEqual(body["object"], "chat.completion")
        choice = body["choices"][0]
        self.assertEqual(choice["message"]["content"], "Hello, I am a fake.")
        self.assertEqual(choice["finish_reason"], "stop")
        self.assertEqual(
            body["usage"],
            {
                "prompt_tokens": 2,
                "completion_tokens": 7,
                "total_tokens": 9,
                "prompt_tokens_details": None,
            },
        )

    def test_model_optional(self) -> None:
        """vLLM serves its only model when the request names none."""
        self.make()
        code, body = self.call("POST", "/v1/completions", json={"prompt": "x"})
        self.assertEqual(code, 200)
        self.assertEqual(body["model"], "fake-model")

    def test_chat_stream(self) -> None:
        self.make(chunks=("a", "b"))
        request = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        response = self.response(
            self.request("POST", "/v1/chat/completions", json=request)
        )
        self.assertEqual(
            response.headers.getRawHeaders(b"content-type"),
            [b"text/event-stream; charset=utf-8"],
        )
        events = self.events(self.body(response))
        self.assertEqual(events[-1], "[DONE]")
        deltas = [e["choices"][0]["delta"] for e in events[:-2]]
        self.assertEqual(
            deltas,
            [
                {"role": "assistant", "content": ""},
                {"content": "a"},
                {"content": "b"},
                {},
            ],
        )
        reasons = [e["choices"][0]["finish_reason"] for e in events[:-2]]
        self.assertEqual(reasons, [None, None, None, "stop"])
        self.assertEqual(events[-2]["choices"], [])
        self.assertEqual(events[-2]["usage"]["completion_tokens"], 2)

    def test_completion_stream_max_tokens(self) -> None:
        self.make(chunks=("a", "b", "c"))
        request = {"prompt": "p", "stream": True, "max_tokens": 2}
        response = self.response(self.request("POST", "/v1/completions", json=request))
        events = self.events(self.body(response))
        self.assertEqual(
            [
                (e["choices"][0]["text"], e["choices"][0]["finish_reason"])
                for e in events[:-1]
            ],
            [("a", None), ("b", None), ("", "length")],
        )
        self.assertEqual(events[0]["object"], "text_completion")

    def test_chunk_timing(self) -> None:
        """Headers arrive with the first chunk; then one chunk per interval."""
        self.make(chunks=("a", "b", "c"), first_chunk_latency=2, chunk_interval=1)
        d = self.request("POST", "/v1/chat/completions", json={**CHAT, "stream": True})
        self.advance(1.9)
        self.assertNoResult(d)
        self.assertEqual(self.fake.running, 1)
        self.advance(0.1)
        response = self.successResultOf(d)
        collected: list[bytes] = []
        done = treq.collect(response, collected.append)
        self.stub.flush()
        self.assertEqual(len(self.events(b"".join(collected))), 2)
        self.advance(1)
        self.assertEqual(len(self.events(b"".join(collected))), 3)
        self.assertNoResult(done)
        self.advance(1)
        self.successResultOf(done)
        self.assertEqual(self.events(b"".join(collected))[-1], "[DONE]")
        self.assertEqual(self.fake.running, 0)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_embeddings_and_pooling(self) -> None:
        self.make()
        code, body = self.call("POST", "/v1/embeddings", json={"input": ["a", "bb"]})
        self.assertEqual(code, 200)
        self.assertEqual([d["index"] for d in body["data"]], [0, 1])
        self.assertEqual(body["data"][0]["object"], "embedding")
        self.assertEqual(len(body["data"][0]["embedding"]), 8)
        self.assertEqual(body["usage"]["prompt_tokens"], 2)
        code, body = self.call("POST", "/pooling", json={"input": "a"})
        self.assertEqual((code, body["data"][0]["object"]), (200, "pooling"))

    def test_score_and_rerank(self) -> None:
        self.make()
        code, body = self.call(
            "POST", "/score", json={"text_1": "red fox", "text_2": ["fox", "owl"]}
        )
        self.assertEqual(code, 200)
        self.assertEqual([d["object"] for d in body["data"]], ["score", "score"])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            code, body = self.call(
                "POST",
                path,
                json={"query": "red fox", "documents": ["owl", "fox"], "top_n": 1},
            )
            self.assertEqual(code, 200)
            self.assertEqual(
                [(r["index"], r["document"]["text"]) for r in body["results"]],
                [(1, "fox")],
            )

    def test_transcription_reads_model_field(self) -> None:
        self.make()

        def upload(model: str) -> tuple[int, Any]:
            boundary = b"b0undary"
            body = b"".join(
                [
                    b"--b0undary\r\n",
                    b"Content-Disposition: form-data; "
                    b'name="file"; filename="model"\r\n',
                    b"Content-Type: audio/wav\r\n\r\n",
                    b"RIFF\0\0--not-a-boundary\r\n",
                    b"--b0undary\r\n",
                    b'Content-Disposition: form-data; name="model"\r\n\r\n',
                    model.encode() + b"\r\n",
                    b"--b0undary--\r\n",
                ]
            )
            content_type = b"multipart/form-data; boundary=" + boundary
            return self.call(
                "POST",
                "/v1/audio/transcriptions",
                data=body,
                headers={b"content-type": [content_type]},
            )

        code, body = upload("fake-model")
        self.assertEqual(code, 200)
        self.assertEqual(body, {"text": "Hello, I am a fake."})
        self.assertEqual(upload("other")[0], 404)

    def test_errors(self) -> None:
        self.make()
        code, body = self.call(
            "POST", "/v1/chat/completions", json={**CHAT, "model": "nope"}
        )
        self.assertEqual(code, 404)
        self.assertEqual(body["error"]["type"], "NotFoundError")
        code, body = self.call("POST", "/v1/chat/completions", data=b"{not json")
        self.assertEqual(code, 400)
        self.assertEqual(self.call("GET", "/nowhere"), (404, {"detail": "Not Found"}))
        self.assertEqual(
            self.call("GET", "/sleep"), (405, {"detail": "Method Not Allowed"})
        )
        self.assertEqual(self.call("GET", "/v1/chat/completions")[0], 405)
        self.assertEqual(self.call("GET", "/version"), (200, {"version": "0.32.0"}))


class SleepWakeTests(_Harness):
    def test_sleep_and_wake(self) -> None:
        fake = self.make()
        self.assertFalse(self.is_sleeping())
        code, body = self.call("POST", "/sleep", params={"level": "1"})
        self.assertEqual((code, body), (200, {"status": "sleeping", "level": 1}))
        self.assertEqual((fake.state, fake.sleep_level), (EngineState.ASLEEP, 1))
        self.assertTrue(self.is_sleeping())
        self.assertEqual(self.call("GET", "/health"), (200, b""))
        # vLLM 0.32 answers with the state after the wake.
        self.assertEqual(
            self.call("POST", "/wake_up"), (200, {"status": "awake", "tags": None})
        )
        self.assertFalse(self.is_sleeping())
        self.assertEqual((fake.state, fake.sleep_level), (EngineState.AWAKE, None))
        self.assertEqual(fake.wake_sequences, 1)
        self.assertEqual(self.call("POST", "/v1/chat/completions", json=CHAT)[0], 200)
        self.assertEqual(fake.violations, [])

    def test_default_level_is_one(self) -> None:
        self.make()
        self.assertEqual(
            self.call("POST", "/sleep"), (200, {"status": "sleeping", "level": 1})
        )
        self.assertEqual(self.call("POST", "/sleep", params={"level": "7"})[0], 400)

    def test_wake_on_awake_is_noop(self) -> None:
        fake = self.make()
        self.assertEqual(
            self.call("POST", "/wake_up"), (200, {"status": "awake", "tags": None})
        )
        self.assertEqual((fake.wake_sequences, fake.wake_calls), (0, 1))

    def test_full_wake_sequence(self) -> None:
        """FD §6.2 step 3 against a level-2 sleep leaves no violation."""
        fake = self.make()
        self.call("POST", "/sleep", params={"level": "2"})
        self.assertEqual(fake.sleep_level, 2)
        self.assertEqual(self.call("POST", "/wake_up")[0], 200)
        self.assertEqual(
            self.call("POST", "/collective_rpc", json={"method": "reload_weights"}),
            (200, {"results": [None]}),
        )
        self.assertEqual(
            self.call("POST", "/reset_prefix_cache"), (200, {"success": True})
        )
        self.assertEqual(self.call("GET", "/health")[0], 200)
        self.assertEqual(self.call("POST", "/v1/chat/completions", json=CHAT)[0], 200)
        self.assertEqual(fake.violations, [])

    def test_level2_without_reload(self) -> None:
        fake = self.make()
        self.call("POST", "/sleep", params={"level": "2"})
        self.call("POST", "/wake_up")
        self.assertEqual(self.call("POST", "/v1/chat/completions", json=CHAT)[0], 200)
        self.assertEqual(
            fake.violations,
            [Violation(0.0, WEIGHTS_NOT_RELOADED, "POST", "/v1/chat/completions")],
        )

    def test_level1_keeps_weights(self) -> None:
        fake = self.make()
        self.call("POST", "/sleep", params={"level": "1"})
        self.call("POST", "/wake_up")
        self.call("POST", "/v1/chat/completions", json=CHAT)
        self.assertEqual(fake.violations, [])

    def test_deepen_sleep(self) -> None:
        fake = self.make()
        self.call("POST", "/sleep", params={"level": "1"})
        self.call("POST", "/sleep", params={"level": "2"})
        self.assertEqual(fake.sleep_level, 2)
        self.call("POST", "/sleep", params={"level": "1"})
        self.assertEqual(fake.sleep_level, 2)

    def test_staged_wake(self) -> None:
        fake = self.make()
        self.call("POST", "/sleep", params={"level": "1"})
        self.call("POST", "/wake_up", params={"tags": "weights"})
        self.assertTrue(self.is_sleeping())
        self.call("POST", "/wake_up", params={"tags": "kv_cache"})
        self.assertFalse(self.is_sleeping())
        self.assertEqual((fake.wake_sequences, fake.wake_calls), (1, 2))

    def test_metrics(self) -> None:
        self.make(model="m")

        def states() -> dict[str, float]:
            code, raw = self.call("GET", "/metrics")
            self.assertEqual(code, 200)
            out: dict[str, float] = {}
            for family in text_string_to_metric_families(raw.decode()):
                if family.name == "vllm:engine_sleep_state":
                    for sample in family.samples:
                        self.assertEqual(sample.labels["model_name"], "m")
                        out[sample.labels["sleep_state"]] = sample.value
            return out

        awake = {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
        self.assertEqual(states(), awake)
        self.call("POST", "/sleep", params={"level": "1"})
        self.assertEqual(
            states(), {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
        )
        self.call("POST", "/sleep", params={"level": "2"})
        self.assertEqual(
            states(), {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
        )
        self.call("POST", "/wake_up")
        self.assertEqual(states(), awake)


class ScriptingTests(_Harness):
    def test_wake_latency(self) -> None:
        fake = self.make(wake_latency=5)
        fake.force_sleep(1)
        d = self.request("POST", "/wake_up")
        self.advance(4.9)
        self.assertNoResult(d)
        self.assertEqual(fake.state, EngineState.WAKING)
        self.assertTrue(self.is_sleeping())
        self.assertEqual(self.call("GET", "/health")[0], 200)
        self.advance(0.1)
        self.assertEqual(self.successResultOf(d).code, 200)
        self.assertEqual(fake.state, EngineState.AWAKE)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_wake_answers_early(self) -> None:
        fake = self.make(wake_latency=5, wake_answers_early=True)
        fake.force_sleep(1)
        self.assertEqual(
            self.call("POST", "/wake_up"),
            (200, {"status": "sleeping", "tags": ["kv_cache", "weights"]}),
        )
        self.assertTrue(self.is_sleeping())
        self.advance(5)
        self.assertFalse(self.is_sleeping())

    def test_concurrent_wakes_are_one_sequence(self) -> None:
        fake = self.make(wake_latency=3)
        fake.force_sleep(2)
        calls = [self.request("POST", "/wake_up") for _ in range(3)]
        self.advance(1)
        for d in calls:
            self.assertNoResult(d)
        self.advance(2)
        self.assertEqual([self.successResultOf(d).code for d in calls], [200] * 3)
        self.assertEqual((fake.wake_sequences, fake.wake_calls), (1, 3))

    def test_wake_failures(self) -> None:
        fake = self.make(wake_failures=1, wake_latency=1)
        fake.force_sleep(1)
        d = self.request("POST", "/wake_up")
        self.advance(1)
        response = self.successResultOf(d)
        self.assertEqual(response.code, 500)
        self.assertEqual(fake.state, EngineState.ASLEEP)
        self.assertEqual(fake.sleep_level, 1)
        d = self.request("POST", "/wake_up")
        self.advance(1)
        self.assertEqual(self.successResultOf(d).code, 200)
        self.assertEqual(fake.state, EngineState.AWAKE)
        self.assertEqual(fake.wake_sequences, 2)

    def test_health_delay(self) -> None:
        fake = self.make(health_delay=10)
        fake.force_sleep(1)
        self.call("POST", "/wake_up")
        self.assertEqual(self.call("GET", "/health")[0], 503)
        self.call("POST", "/v1/chat/completions", json=CHAT)
        self.advance(10)
        self.assertEqual(self.call("GET", "/health")[0], 200)
        self.call("POST", "/v1/chat/completions", json=CHAT)
        self.assertEqual(
            fake.violations,
            [Violation(0.0, REQUEST_WHILE_NOT_READY, "POST", "/v1/chat/completions")],
        )

    def test_sleep_waits_for_wake(self) -> None:
        fake = self.make(wake_latency=2)
        fake.force_sleep(1)
        wake = self.request("POST", "/wake_up")
        sleep = self.request("POST", "/sleep?level=2")
        self.assertNoResult(sleep)
        self.advance(2)
        self.assertEqual(self.successResultOf(wake).code, 200)
        self.assertEqual(self.successResultOf(sleep).code, 200)
        self.assertEqual((fake.state, fake.sleep_level), (EngineState.ASLEEP, 2))


class BehindTheProxyTests(_Harness):
    """Sleeping and waking the engine directly, as vllmctl or cron would."""

    def gauge(self) -> dict[str, float]:
        code, raw = self.call("GET", "/metrics")
        self.assertEqual(code, 200)
        return {
            sample.labels["sleep_state"]: sample.value
            for family in text_string_to_metric_families(raw.decode())
            if family.name == "vllm:engine_sleep_state"
            for sample in family.samples
        }

    def test_force_wake(self) -> None:
        """
        force_wake after a level-2 sleep: awake with its weights reloaded,
        the request held while it slept runs, the gauge says awake.
        """
        fake = self.make(crash_on_request_while_asleep=False, health_delay=2)
        fake.force_sleep(2)
        held = self.request("POST", "/v1/chat/completions", json=CHAT)
        self.assertEqual(fake.active, 1)
        fake.force_wake()
        self.assertEqual((fake.state, fake.sleep_level), (EngineState.AWAKE, None))
        self.assertFalse(self.is_sleeping())
        self.assertEqual(self.gauge()["awake"], 1.0)
        self.assertEqual(self.call("GET", "/health")[0], 503)
        self.assertEqual(self.response(held).code, 200)
        # only the request made while it slept is a violation: the weights
        # are loaded and /health readiness does not apply to it
        self.assertEqual([v.kind for v in fake.violations], [REQUEST_WHILE_ASLEEP])
        self.assertEqual(fake.wake_calls, 0)
        self.advance(2)
        self.assertEqual(self.call("POST", "/v1/chat/completions", json=CHAT)[0], 200)
        self.assertEqual(len(fake.violations), 1)

    def test_force_wake_only_when_asleep(self) -> None:
        fake = self.make(wake_latency=5)
        fake.force_wake()
        self.assertEqual(fake.state, EngineState.AWAKE)
        fake.force_sleep(1)
        self.request("POST", "/wake_up")
        self.assertRaises(ValueError, fake.force_wake)
        self.advance(5)
        self.assertEqual(fake.state, EngineState.AWAKE)

    def test_direct_sleep_route(self) -> None:
        """The engine's own /sleep and /wake_up move the gauge at once."""
        self.make()
        self.call("POST", "/sleep", params={"level": "2"})
        self.assertEqual(self.gauge()["discard_all"], 1.0)
        self.call("POST", "/wake_up")
        self.assertEqual(self.gauge()["awake"], 1.0)

    def test_without_gauge(self) -> None:
        """An older vLLM: /metrics has no engine_sleep_state gauge."""
        self.make(sleep_state_gauge=False)
        self.assertEqual(self.gauge(), {})
        code, raw = self.call("GET", "/metrics")
        self.assertIn(b"vllm:num_requests_running", raw)


class ViolationTests(_Harness):
    def test_crash_on_request_while_asleep(self) -> None:
        fake = self.make()
        fake.force_sleep(1)
        self.clock.advance(3)
        code, body = self.call("POST", "/v1/chat/completions", json=CHAT)
        self.assertEqual(code, 500)
        self.assertEqual(body["error"]["type"], "InternalServerError")
        self.assertEqual(
            fake.violations,
            [
                Violation(
                    3.0, REQUEST_WHILE_ASLEEP, "POST", "/v1/chat/completions", "asleep"
                )
            ],
        )
        self.assertEqual(fake.active, 0)

    def test_hold_while_asleep(self) -> None:
        """vLLM 0.32 on CPU: the request waits for the wake and completes."""
        fake = self.make(crash_on_request_while_asleep=False, wake_latency=1)
        fake.force_sleep(1)
        d = self.request("POST", "/v1/embeddings", json={"input": "x"})
        self.assertNoResult(d)
        self.assertEqual((fake.active, fake.running), (1, 0))
        self.request("POST", "/wake_up")
        self.advance(0.5)
        self.assertNoResult(d)
        self.advance(0.5)
        self.assertEqual(self.response(d).code, 200)
        self.assertEqual(fake.active, 0)
        self.assertEqual([v.kind for v in fake.violations], [REQUEST_WHILE_ASLEEP])

    def test_held_client_gone(self) -> None:
        fake = self.make(crash_on_request_while_asleep=False)
        fake.force_sleep(1)
        d = self.request("POST", "/v1/chat/completions", json=CHAT)
        self.assertEqual(fake.active, 1)
        d.cancel()
        self.stub.flush()
        self.failureResultOf(d)
        self.assertEqual(fake.active, 0)

    def test_503_while_asleep(self) -> None:
        fake = self.make(
            crash_on_request_while_asleep=False, hold_requests_while_asleep=False
        )
        fake.force_sleep(2)
        self.assertEqual(
            self.call("POST", "/v1/completions", json={"prompt": "x"})[0], 503
        )
        self.assertEqual([v.kind for v in fake.violations], [REQUEST_WHILE_ASLEEP])

    def test_request_while_waking(self) -> None:
        fake = self.make(wake_latency=5)
        fake.force_sleep(1)
        self.request("POST", "/wake_up")
        self.advance(1)
        self.call("POST", "/v1/chat/completions", json=CHAT)
        self.assertEqual(
            fake.violations,
            [
                Violation(
                    1.0, REQUEST_WHILE_WAKING, "POST", "/v1/chat/completions", "waking"
                )
            ],
        )

    def test_sleep_aborts_running_stream(self) -> None:
        fake = self.make(chunks=("a", "b", "c"), chunk_interval=1)
        response = self.response(
            self.request("POST", "/v1/chat/completions", json={**CHAT, "stream": True})
        )
        collected: list[bytes] = []
        done = treq.collect(response, collected.append)
        self.advance(1)
        self.assertEqual(self.call("POST", "/sleep?level=1")[0], 200)
        self.successResultOf(done)
        events = self.events(b"".join(collected))
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual(events[-2]["choices"][0]["finish_reason"], "abort")
        self.assertEqual(fake.state, EngineState.ASLEEP)
        self.assertEqual(
            fake.violations,
            [
                Violation(
                    1.0, SLEEP_ABORTED_REQUESTS, "POST", "/sleep?level=1", "1 running"
                )
            ],
        )
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_sleep_mode_wait_drains(self) -> None:
        fake = self.make(chunks=("a", "b"), chunk_interval=1)
        d = self.request("POST", "/v1/completions", json={"prompt": "x"})
        sleep = self.request("POST", "/sleep?level=1&mode=wait")
        self.assertNoResult(sleep)
        self.assertEqual(fake.state, EngineState.DRAINING)
        self.assertFalse(self.is_sleeping())
        self.advance(1)
        body = json.loads(self.body(self.response(d)))
        self.assertEqual(body["choices"][0]["finish_reason"], "stop")
        self.assertEqual(self.response(sleep).code, 200)
        self.assertEqual(fake.state, EngineState.ASLEEP)
        self.assertEqual(fake.violations, [])

    def test_request_while_draining(self) -> None:
        fake = self.make(chunks=("a", "b"), chunk_interval=1)
        self.request("POST", "/v1/completions", json={"prompt": "x"})
        self.request("POST", "/sleep?mode=wait")
        self.assertEqual(self.call("POST", "/v1/completions", json={})[0], 500)
        self.assertEqual(
            [(v.kind, v.detail) for v in fake.violations],
            [(REQUEST_WHILE_ASLEEP, "draining")],
        )

    def test_call_record(self) -> None:
        fake = self.make(wake_latency=2)
        self.call("GET", "/v1/models")
        self.clock.advance(1)
        self.call("POST", "/sleep?level=2&mode=wait")
        self.request("POST", "/wake_up?tags=weights")
        self.advance(2)
        self.call("GET", "/is_sleeping")
        self.assertEqual(
            fake.calls,
            [
                (0.0, "GET", "/v1/models"),
                (1.0, "POST", "/sleep?level=2&mode=wait"),
                (1.0, "POST", "/wake_up?tags=weights"),
                (3.0, "GET", "/is_sleeping"),
            ],
        )


class DownTests(_Harness):
    def test_down_503(self) -> None:
        fake = self.make(down_mode="503")
        fake.set_down()
        for method, path in [("GET", "/health"), ("GET", "/v1/models")]:
            self.assertEqual(self.call(method, path)[0], 503)
        self.assertEqual(fake.state, EngineState.DOWN)
        self.successResultOf(fake.set_up(ready_after=10))
        self.assertEqual(self.call("GET", "/health")[0], 503)
        self.advance(10)
        self.assertEqual(self.call("GET", "/health")[0], 200)
        self.assertFalse(self.is_sleeping())

    def test_down_drops_connections(self) -> None:
        fake = self.make(chunks=("a", "b"), chunk_interval=1)
        fake.force_sleep(1)
        self.call("POST", "/wake_up")
        stream = self.response(
            self.request("POST", "/v1/chat/completions", json={**CHAT, "stream": True})
        )
        done = treq.collect(stream, lambda _: None)
        fake.set_down()
        self.stub.flush()
        self.failureResultOf(done)
        self.assertEqual(fake.active, 0)
        self.failureResultOf(self.request("GET", "/health"), ResponseFailed)
        self.successResultOf(fake.set_up())
        self.assertEqual(fake.state, EngineState.AWAKE)
        self.assertEqual(self.call("GET", "/health")[0], 200)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_down_drops_pending_control_calls(self) -> None:
        """A wake in progress and a draining /sleep vanish with the engine."""
        fake = self.make(chunks=("a", "b"), chunk_interval=1, wake_latency=5)
        running = self.request("POST", "/v1/completions", json={"prompt": "x"})
        sleep = self.request("POST", "/sleep?mode=wait")
        fake.set_down()
        self.stub.flush()
        self.failureResultOf(running, ResponseFailed)
        self.failureResultOf(sleep, ResponseFailed)
        self.successResultOf(fake.set_up())
        fake.force_sleep(1)
        wake = self.request("POST", "/wake_up")
        fake.set_down()
        self.stub.flush()
        self.failureResultOf(wake, ResponseFailed)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertEqual(fake.active, 0)


class LoopbackTests(TestCase):
    """The fake on a real loopback port, with the real reactor."""

    def setUp(self) -> None:
        self.reactor: IReactorTCP = reactor
        clock: IReactorTime = reactor
        self.fake = FakeVLLM(clock=clock, chunks=("x", "y"), chunk_interval=0.01)
        self.fake.listen(self.reactor)
        self.addCleanup(self.fake.stop)
        self.pool = HTTPConnectionPool(reactor, persistent=False)

    async def get(self, path: str) -> tuple[int, bytes]:
        response = await treq.get(self.fake.url + path, pool=self.pool)
        return response.code, await response.content()

    async def test_round_trip(self) -> None:
        self.assertNotEqual(self.fake.port, 0)
        code, body = await self.get("/v1/models")
        self.assertEqual(code, 200)
        self.assertEqual(json.loads(body)["data"][0]["id"], "fake-model")
        response = await treq.post(
            self.fake.url + "/v1/chat/completions",
            json={**CHAT, "stream": True},
            pool=self.pool,
        )
        raw = await response.content()
        self.assertTrue(raw.endswith(b"data: [DONE]\n\n"))
        response = await treq.post(
            self.fake.url + "/sleep", params={"level": "1"}, pool=self.pool
        )
        self.assertEqual(await response.json(), {"status": "sleeping", "level": 1})
        self.assertEqual(await self.get("/is_sleeping"), (200, b'{"is_sleeping":true}'))

    async def test_down_refuses_then_comes_back(self) -> None:
        port = self.fake.port
        self.fake.set_down()
        with self.assertRaises(ConnectionRefusedError):
            await self.get("/health")
        await self.fake.set_up()
        self.assertEqual(self.fake.port, port)
        self.assertEqual(await self.get("/health"), (200, b""))
        self.assertEqual([c[2] for c in self.fake.calls], ["/health"])


class FakeVllmContractTests(VllmContract, SynchronousTestCase):
    """
    The vLLM contract (L{tests.vllm_contract}) against the fake, in memory
    on a Clock; the same tests run against a real vLLM in
    L{tests.integration.test_vllm_real}.
    """

    model = "fake-model"
    call_timeout = 10.0

    def setUp(self) -> None:
        self.clock = Clock()
        # a wake that takes a moment, as a real one does
        self.fake = FakeVLLM(clock=self.clock, model=self.model, wake_latency=0.05)
        self.stub = StubTreq(self.fake.resource())
        self.http = self.stub
        self.base_url = BASE

    def tearDown(self) -> None:
        self.assertEqual(self.fake.violations, [])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def drive(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Flush, and advance to the next timer, until the test is done."""
        done = Deferred.fromCoroutine(coroutine)
        for _ in range(1000):
            self.stub.flush()
            if done.called:
                break
            due = [call.getTime() for call in self.clock.getDelayedCalls()]
            if due:
                self.clock.advance(max(0.0, min(due) - self.clock.seconds()))
        self.successResultOf(done)
