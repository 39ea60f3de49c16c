"""
Request ids: kept or generated, returned, sent upstream, in workload events;
W3C trace context passes through unchanged.
"""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.proxy import requestid
from nvproxy.proxy.requestid import new_id, valid
from nvproxy.testing.fakeengine import Behaviour
from nvproxy.testing.harness import facade_url, nvproxyctl
from tests.test_forwarding import MemoryProxyTestCase, ProxyTestCase

_GENERATED = re.compile(r"[0-9a-f]{32}")


class ValidTests(SynchronousTestCase):
    def test_bounds(self) -> None:
        self.assertTrue(valid(b"a"))
        self.assertTrue(valid(b"x" * 128))
        self.assertTrue(valid(b"req 1/2:3"))
        self.assertFalse(valid(b""))
        self.assertFalse(valid(b"x" * 129))
        self.assertFalse(valid(b"caf\xc3\xa9"))
        self.assertFalse(valid(b"a\tb"))
        self.assertFalse(valid(b"a\x7fb"))

    @given(st.binary(max_size=200))
    def test_matches_the_rule(self, value: bytes) -> None:
        expected = 1 <= len(value) <= 128 and all(0x20 <= b <= 0x7E for b in value)
        self.assertEqual(valid(value), expected)


class NewIdTests(SynchronousTestCase):
    def test_fresh_past_the_pool(self) -> None:
        """
        Ids are 32 lower-case hex digits and never repeat, also across
        refills of the pool of randomness they are cut from.
        """
        count = 3 * requestid._POOL_IDS + 7
        ids = [new_id() for _ in range(count)]
        self.assertEqual(len(set(ids)), count)
        for rid in ids:
            self.assertIsNotNone(re.fullmatch("[0-9a-f]{32}", rid), rid)


class RequestIdTests(MemoryProxyTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.fake = self.engine("openai", ["m"])
        self.proxy_ = self.proxy({"lmstudio": self.fake.url})
        self.url = facade_url(self.proxy_, "lmstudio") + "/v1/chat/completions"

    def call(self, headers: dict[str, list[str]], model: str = "m") -> str:
        """One request; the id it was answered with (checked upstream too)."""
        before = len(self.fake.requests)
        code, response, _body = self.post(
            self.url,
            {"model": model, "messages": []},
            {"Content-Type": ["application/json"], **headers},
        )
        ids = response.getRawHeaders(b"x-request-id")
        self.assertEqual(len(ids), 1)
        rid: str = ids[0].decode()
        if code == 200:
            seen = self.fake.requests[before:]
            self.assertEqual([r.headers.get("x-request-id") for r in seen], [rid])
        return rid

    def test_kept(self) -> None:
        """
        A valid incoming id is returned and forwarded as is, and carried by
        every workload event of the request.
        """
        rid = self.call({"X-Request-Id": ["client-42/abc"]})
        self.assertEqual(rid, "client-42/abc")
        entry = self.proxy_.ops.recent_workloads(1)[0]
        self.assertEqual(entry["workloadInfo"]["requestId"], "client-42/abc")
        self.assertEqual(
            {e["workloadInfo"]["requestId"] for e in entry["events"]},
            {"client-42/abc"},
        )

    def test_generated(self) -> None:
        """
        Without one, or with one that is too long, empty or not ASCII, a
        fresh random id is used, a different one each time.
        """
        ids = [
            self.call({}),
            self.call({}),
            self.call({"X-Request-Id": ["x" * 129]}),
            self.call({"X-Request-Id": ["caf\u00e9"]}),
            self.call({"X-Request-Id": ["a", "b"]}),
        ]
        for rid in ids:
            self.assertRegex(rid, _GENERATED)
        self.assertEqual(len(set(ids)), len(ids))

    def test_on_proxy_errors(self) -> None:
        """
        An answer the proxy makes itself (no node has the model) carries the
        id too.
        """
        self.assertEqual(self.call({"X-Request-Id": ["e-1"]}, model="nope"), "e-1")

    def test_upstream_id_replaced(self) -> None:
        """
        An engine answering with an id of its own does not change the id the
        client sees.
        """
        self.fake.default = Behaviour(headers={"X-Request-Id": "engine-made"})
        self.assertEqual(self.call({"X-Request-Id": ["mine"]}), "mine")

    def test_trace_context_passes_through(self) -> None:
        """
        W3C C{traceparent} and C{tracestate} reach the engine unchanged.
        """
        parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        state = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
        self.call({"traceparent": [parent], "tracestate": [state]})
        seen = self.fake.requests[-1].headers
        self.assertEqual(
            (seen.get("traceparent"), seen.get("tracestate")), (parent, state)
        )


class CtlTests(ProxyTestCase):
    async def test_workloads_show_the_id(self) -> None:
        """
        C{nvproxyctl workloads} shows each workload's request id.
        """
        fake = await self.engine("openai", ["m"])
        proxy = await self.proxy({"lmstudio": fake.url}, admin=True)
        code, _h, _b = await self.post(
            facade_url(proxy, "lmstudio") + "/v1/chat/completions",
            {"model": "m", "messages": []},
            {"Content-Type": ["application/json"], "X-Request-Id": ["ctl-id-1"]},
        )
        self.assertEqual(code, 200)
        code, out = await nvproxyctl(
            f"127.0.0.1:{proxy.admin.bound_port()}", "workloads", "--limit", "1"
        )
        self.assertEqual(code, 0, out)
        self.assertIn("ctl-id-1", out)
