# -*- test-case-name: tests.test_fakevllm -*-
"""
The vLLM API facts nvproxy's wake/sleep driver relies on (DESIGN §4,
ENGINES.md "vLLM on CPU"), as one mixin run against L{FakeVLLM}
(L{tests.test_fakevllm.FakeVllmContractTests}, in memory on a C{Clock}) and
against a real vLLM (L{tests.integration.test_vllm_real}, opt-in), so the
fake cannot drift from the real server.

Each fact is checked through nvproxy's own sleep-API client
(L{nvproxy.vllm._client.SleepApiClient}) and its gauge parser where the
driver uses them, and with raw calls where the answer's body is the fact.

A test case mixing in L{VllmContract} provides, before each test:

* C{base_url}: the server, awake, with its weights loaded;
* C{http}: a treq C{HTTPClient} (or C{StubTreq}) that reaches it;
* C{clock}: the clock of the client's timeouts;
* C{model}: the served model name;
* C{call_timeout}: the timeout of one call;
* C{drive(coroutine)}: run one test's coroutine to its end (in memory:
  flush and advance the clock until it is done; on a real reactor: return
  it as a Deferred).

Every test leaves the server awake with its weights loaded (it ends with
the full wake sequence when it slept it).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from twisted.internet.defer import Deferred

from nvproxy.vllm._client import BadAnswer, SleepApiClient
from nvproxy.vllm._poll import Observed, parse_sleep_state

_Test = Callable[[Any], Coroutine[Any, Any, None]]
_GAUGE_SAMPLE = re.compile(
    r'^vllm:engine_sleep_state\{[^}]*sleep_state="([^"]*)"[^}]*\}\s+(\S+)', re.M
)


def contract(test: _Test) -> Callable[[Any], Deferred[None] | None]:
    """An C{async} contract test, run by the test case's C{drive}."""

    @functools.wraps(test)
    def run(self: Any) -> Deferred[None] | None:
        result: Deferred[None] | None = self.drive(test(self))
        return result

    return run


class VllmContract:
    """The contract; see the module docstring for what a test case provides."""

    base_url: str
    http: Any
    clock: Any
    model: str
    call_timeout: float

    # trial's assertions, provided by the TestCase this is mixed into
    assertEqual: Any
    assertTrue: Any
    assertFalse: Any
    assertIn: Any

    def drive(self, coroutine: Coroutine[Any, Any, None]) -> Deferred[None] | None:
        raise NotImplementedError("the test case drives the contract")

    # -- plumbing -----------------------------------------------------------

    def api(self) -> SleepApiClient:
        return SleepApiClient(
            self.http, self.clock, self.base_url, "contract", self.call_timeout
        )

    async def raw(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        """One call: its status and its body (JSON if it parses)."""
        code, data = await self.api().call(method, path, body=body)
        try:
            return code, json.loads(data)
        except ValueError:
            return code, data

    async def gauge(self) -> dict[str, float]:
        """The C{vllm:engine_sleep_state} samples by C{sleep_state}."""
        text = (await self.api().metrics()).decode("utf-8", "replace")
        return {name: float(value) for name, value in _GAUGE_SAMPLE.findall(text)}

    async def wake_fully(self) -> None:
        """nvproxy's wake sequence (FD §6.2 step 3), each step answering 200."""
        api = self.api()
        await api.wake_up()
        self.assertFalse(await api.is_sleeping())
        await api.reload_weights()
        await api.reset_prefix_cache()
        self.assertEqual(await api.health(), 200)

    async def chat(self) -> dict[str, Any]:
        code, body = await self.raw(
            "POST",
            "/v1/chat/completions",
            {
                "model": self.model,
                "messages": [{"role": "user", "content": "hello world"}],
                "max_tokens": 4,
                "temperature": 0,
            },
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(len(body["choices"]), 1)
        answer: dict[str, Any] = body
        return answer

    # -- the facts ----------------------------------------------------------

    @contract
    async def test_awake(self) -> None:
        """Awake: C{/is_sleeping} false, the gauge says awake, C{/health} 200."""
        self.assertEqual(
            await self.raw("GET", "/is_sleeping"), (200, {"is_sleeping": False})
        )
        api = self.api()
        self.assertFalse(await api.is_sleeping())
        self.assertEqual(await api.health(), 200)
        self.assertEqual(parse_sleep_state(await api.metrics()), Observed(False))
        gauge = await self.gauge()
        self.assertEqual(
            {k: gauge.get(k) for k in ("awake", "weights_offloaded", "discard_all")},
            {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0},
        )
        await self.chat()

    async def _sleep_and_wake(self, level: int) -> None:
        code, body = await self.raw("POST", f"/sleep?level={level}")
        self.assertEqual((code, body), (200, {"status": "sleeping", "level": level}))
        api = self.api()
        self.assertEqual(
            await self.raw("GET", "/is_sleeping"), (200, {"is_sleeping": True})
        )
        self.assertTrue(await api.is_sleeping())
        # what the state poll reads: the gauge tells the level
        self.assertEqual(parse_sleep_state(await api.metrics()), Observed(True, level))
        state = "weights_offloaded" if level == 1 else "discard_all"
        gauge = await self.gauge()
        self.assertEqual(
            {k: gauge.get(k) for k in ("awake", "weights_offloaded", "discard_all")},
            {
                "awake": 0.0,
                "weights_offloaded": 1.0 if state == "weights_offloaded" else 0.0,
                "discard_all": 1.0 if state == "discard_all" else 0.0,
            },
        )
        await self.wake_fully()
        self.assertEqual(parse_sleep_state(await api.metrics()), Observed(False))
        await self.chat()

    @contract
    async def test_sleep_level_1(self) -> None:
        """C{/sleep?level=1}: asleep, gauge C{weights_offloaded}; woken, it serves."""
        await self._sleep_and_wake(1)

    @contract
    async def test_sleep_level_2(self) -> None:
        """C{/sleep?level=2}: asleep, gauge C{discard_all}; woken and reloaded,
        it serves."""
        await self._sleep_and_wake(2)

    @contract
    async def test_sleep_mode_wait(self) -> None:
        """C{mode=wait} (what nvproxy always sends) is accepted."""
        api = self.api()
        await api.sleep(1, "wait")
        self.assertTrue(await api.is_sleeping())
        await self.wake_fully()

    @contract
    async def test_level_2_over_level_1(self) -> None:
        """A level-1 sleeper takes C{/sleep?level=2} directly (the escalation)."""
        api = self.api()
        await api.sleep(1, "wait")
        code, body = await self.raw("POST", "/sleep?level=2&mode=wait")
        self.assertEqual((code, body["level"]), (200, 2))
        self.assertTrue(await api.is_sleeping())
        await self.wake_fully()
        await self.chat()

    @contract
    async def test_bad_level_refused(self) -> None:
        """A level other than 0, 1, 2 is a 400 (and nothing sleeps)."""
        try:
            await self.api().sleep(3, None)
        except BadAnswer as e:
            self.assertEqual(e.code, 400)
        else:
            raise AssertionError("/sleep?level=3 was accepted")
        self.assertFalse(await self.api().is_sleeping())

    @contract
    async def test_answers_while_asleep(self) -> None:
        """C{/health} and C{/v1/models} answer 200 while asleep, any level."""
        api = self.api()
        for level in (1, 2):
            await api.sleep(level)
            self.assertEqual(await api.health(), 200)
            code, body = await self.raw("GET", "/v1/models")
            self.assertEqual(code, 200)
            self.assertEqual([m["id"] for m in body["data"]], [self.model])
            await self.wake_fully()

    @contract
    async def test_wake_answers(self) -> None:
        """The wake sequence's answers: C{/wake_up} tells the state after it,
        C{reload_weights} and C{reset_prefix_cache} answer as documented."""
        await self.api().sleep(2)
        code, body = await self.raw("POST", "/wake_up")
        self.assertEqual((code, body), (200, {"status": "awake", "tags": None}))
        self.assertFalse(await self.api().is_sleeping())
        rpc = await self.raw("POST", "/collective_rpc", {"method": "reload_weights"})
        self.assertEqual(rpc, (200, {"results": [None]}))
        reset = await self.raw("POST", "/reset_prefix_cache")
        self.assertEqual(reset, (200, {"success": True}))
        self.assertEqual(await self.api().health(), 200)
        await self.chat()

    @contract
    async def test_staged_wake(self) -> None:
        """C{/wake_up?tags=weights} leaves it sleeping; C{?tags=kv_cache}
        then wakes it."""
        api = self.api()
        await api.sleep(1)
        await api.wake_up(["weights"])
        self.assertTrue(await api.is_sleeping())
        await api.wake_up(["kv_cache"])
        self.assertFalse(await api.is_sleeping())
        await api.reload_weights()
        await api.reset_prefix_cache()
        self.assertEqual(await api.health(), 200)
        await self.chat()
