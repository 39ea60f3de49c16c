"""
The browser policy (spec §5.8): engines' CORS headers pass through,
nvproxy's own answers grant nothing, preflights are intersected across
every candidate, and a browser's inventory needs every engine's agreement.
"""

from __future__ import annotations

import json

from attrs import evolve
from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers

from nvproxy.config import AccessConfig
from nvproxy.proxy.cors import Grant, cors_headers, grant_of, intersect
from nvproxy.service import NvProxy
from nvproxy.testing.fakecors import CorsPolicy
from nvproxy.testing.fakeengine import Behaviour, FakeEngine
from nvproxy.testing.harness import facade_url
from tests.test_access import _REFUSED, ONLY_ONE, AccessTestCase

ORIGIN = "http://app.example"
OTHER_ORIGIN = "http://evil.example"

# -- the intersection, as a browser would read it ------------------------------

SAFE_METHODS = frozenset({"GET", "HEAD", "POST"})
SAFE_HEADERS = frozenset(
    {"accept", "accept-language", "content-language", "content-type"}
)


def permits(
    grant: Grant, method: str, headers: frozenset[str], credentialed: bool
) -> bool:
    """Whether a browser lets this request through after C{grant} (Fetch)."""
    if credentialed:
        if grant.origin != ORIGIN or not grant.credentials:
            return False
    elif grant.origin not in ("*", ORIGIN):
        return False
    if (
        method not in SAFE_METHODS
        and method not in grant.methods
        and (credentialed or "*" not in grant.methods)
    ):
        return False
    for name in headers:
        if name in SAFE_HEADERS or name in grant.headers:
            continue
        if "*" in grant.headers and not credentialed and name != "authorization":
            continue
        return False
    return True


def exposes(grant: Grant, name: str, credentialed: bool) -> bool:
    return name in grant.expose or ("*" in grant.expose and not credentialed)


_names = st.frozensets
grants = st.builds(
    Grant,
    origin=st.sampled_from([None, "*", ORIGIN, OTHER_ORIGIN]),
    credentials=st.booleans(),
    methods=_names(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "*"])),
    headers=_names(st.sampled_from(["authorization", "x-custom", "content-type", "*"])),
    expose=_names(st.sampled_from(["x-request-id", "x-other", "*"])),
    max_age=st.one_of(st.none(), st.integers(0, 86400)),
    private_network=st.booleans(),
)
requests = st.tuples(
    st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    _names(st.sampled_from(["authorization", "x-custom", "content-type", "x-else"])),
    st.booleans(),
)


def emitted(grant: Grant, preflight: bool) -> Grant:
    """What a browser reads back from the headers nvproxy writes."""
    headers = Headers()
    for name, value in cors_headers(grant, preflight=preflight):
        headers.addRawHeader(name, value)
    return grant_of(headers)


class IntersectionTests(SynchronousTestCase):
    @given(st.lists(grants, min_size=1, max_size=4), st.lists(requests, max_size=12))
    def test_never_grants_more_than_any_responder(
        self, responders: list[Grant], asked: list[tuple[str, frozenset[str], bool]]
    ) -> None:
        result = intersect(responders, ORIGIN)
        if result is None:
            self.assertTrue(any(not g.allows_origin(ORIGIN) for g in responders))
            return
        read = emitted(result, preflight=True)
        for method, headers, credentialed in asked:
            if permits(read, method, headers, credentialed):
                for grant in responders:
                    self.assertTrue(
                        permits(grant, method, headers, credentialed),
                        (grant, read, method, headers, credentialed),
                    )
        ages = [5 if g.max_age is None else g.max_age for g in responders]
        if read.max_age is not None:
            self.assertLessEqual(read.max_age, min(ages))
        if read.private_network:
            self.assertTrue(all(g.private_network for g in responders))
        simple = emitted(result, preflight=False)
        for credentialed in (False, True):
            for name in ("x-request-id", "x-other", "x-unlisted"):
                if exposes(simple, name, credentialed) and permits(
                    simple, "GET", frozenset(), credentialed
                ):
                    for grant in responders:
                        self.assertTrue(exposes(grant, name, credentialed))

    @given(grants)
    def test_one_responder_keeps_what_a_browser_sees(self, grant: Grant) -> None:
        result = intersect([grant], ORIGIN)
        if not grant.allows_origin(ORIGIN):
            self.assertIsNone(result)
            return
        assert result is not None
        read = emitted(result, preflight=True)
        for method in ("GET", "PUT", "DELETE"):
            for credentialed in (False, True):
                self.assertEqual(
                    permits(read, method, frozenset({"x-custom"}), credentialed),
                    permits(grant, method, frozenset({"x-custom"}), credentialed),
                )

    def test_examples(self) -> None:
        a = Grant(
            origin="*",
            methods=frozenset({"GET", "POST", "PUT"}),
            headers=frozenset({"*"}),
            max_age=600,
        )
        b = Grant(
            origin=ORIGIN,
            credentials=True,
            methods=frozenset({"POST", "PUT", "DELETE"}),
            headers=frozenset({"authorization", "content-type"}),
            max_age=60,
            vary=("Origin",),
        )
        result = intersect([a, b], ORIGIN)
        assert result is not None
        self.assertEqual(
            cors_headers(result, preflight=True),
            [
                (b"access-control-allow-origin", ORIGIN.encode()),
                (b"access-control-allow-methods", b"POST, PUT"),
                (b"access-control-allow-headers", b"content-type"),
                (b"access-control-max-age", b"60"),
                (b"vary", b"Origin"),
            ],
        )
        self.assertIsNone(intersect([a, Grant(origin=OTHER_ORIGIN)], ORIGIN))
        both = intersect([a, evolve(a, max_age=None)], ORIGIN)
        assert both is not None
        self.assertEqual(both.origin, "*")
        self.assertEqual(both.max_age, 5)


# -- against fake engines ------------------------------------------------------


def cors_of(headers: Headers) -> dict[str, list[str]]:
    return {
        name.decode().lower(): [v.decode() for v in values]
        for name, values in headers.getAllRawHeaders()
        if name.lower().startswith(b"access-control-") or name.lower() == b"vary"
    }


PREFLIGHT = {
    "Origin": [ORIGIN],
    "Access-Control-Request-Method": ["POST"],
    "Access-Control-Request-Headers": ["content-type, x-custom"],
    "Cookie": ["session=s3cret"],
    "Authorization": ["Bearer caller"],
}


class BrowserPolicyTests(AccessTestCase):
    async def fleet(
        self, *policies: CorsPolicy | None, poll_interval: float = 60.0
    ) -> tuple[list[FakeEngine], NvProxy, str]:
        fakes = []
        for policy in policies:
            fake = await self.engine("openai", ["m"])
            fake.cors = policy
            fakes.append(fake)
        nodes = {f"node-{i}": {"vllm": f.url} for i, f in enumerate(fakes[1:], 1)}
        proxy = await self.proxy(
            {"vllm": fakes[0].url}, nodes=nodes, poll_interval=poll_interval
        )
        return fakes, proxy, facade_url(proxy, "vllm")

    async def test_proxied_answers_keep_the_engines_headers(self) -> None:
        policy = CorsPolicy(origins=(ORIGIN,), credentials=True, expose=("x-id",))
        (fake,), proxy, url = await self.fleet(policy)
        code, headers, _ = await self.post(
            url + "/v1/chat/completions",
            {"model": "m", "messages": []},
            {"Origin": [ORIGIN], "Content-Type": ["application/json"]},
        )
        self.assertEqual(code, 200)
        self.assertEqual(
            cors_of(headers),
            {
                "access-control-allow-origin": [ORIGIN],
                "access-control-allow-credentials": ["true"],
                "access-control-expose-headers": ["x-id"],
                "vary": ["Origin"],
            },
        )
        # A denial (no header at all) passes through as a denial.
        code, headers, _ = await self.post(
            url + "/v1/chat/completions",
            {"model": "m", "messages": []},
            {"Origin": [OTHER_ORIGIN], "Content-Type": ["application/json"]},
        )
        self.assertEqual((code, cors_of(headers)), (200, {}))

    async def test_own_errors_grant_nothing(self) -> None:
        (fake,), proxy, url = await self.fleet(CorsPolicy())
        origin = {"Origin": [ORIGIN], "Content-Type": ["application/json"]}
        for path, body, status in (
            ("/v1/chat/completions", {"model": "nope", "messages": []}, 502),
            ("/v1/chat/completions", {"messages": []}, 400),
            ("/sleep", {}, 404),
        ):
            code, headers, _ = await self.post(url + path, body, origin)
            self.assertEqual(code, status)
            self.assertEqual(cors_of(headers), {})

    async def test_preflight_intersection(self) -> None:
        fakes, proxy, url = await self.fleet(
            CorsPolicy(methods=("GET", "POST", "PUT"), max_age=600),
            CorsPolicy(
                origins=(ORIGIN,),
                methods=("POST", "PUT", "DELETE"),
                headers=("content-type",),
                max_age=60,
            ),
        )
        code, headers, body = await self.client.request(
            "OPTIONS", url + "/v1/chat/completions", headers=PREFLIGHT
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(
            cors_of(headers),
            {
                "access-control-allow-origin": [ORIGIN],
                "access-control-allow-methods": ["POST, PUT"],
                "access-control-allow-headers": ["content-type"],
                "access-control-max-age": ["60"],
                "vary": ["Origin"],
            },
        )
        for fake in fakes:
            (asked,) = [r for r in fake.requests if r.method == "OPTIONS"]
            self.assertEqual(asked.headers["origin"], ORIGIN)
            self.assertNotIn("cookie", asked.headers)
            self.assertNotIn("authorization", asked.headers)
        # No reservation, no workload.
        self.assertEqual(proxy.workloads.recent(), [])
        self.assertEqual(set(proxy.ops.reservation_counts().values()), {0})

    async def test_preflight_denial_and_single_engine(self) -> None:
        _, proxy, url = await self.fleet(
            CorsPolicy(), CorsPolicy(origins=("http://only.example",))
        )
        code, headers, body = await self.client.request(
            "OPTIONS", url + "/v1/chat/completions", headers=PREFLIGHT
        )
        self.assertEqual((code, body), (400, b"Disallowed CORS origin"))
        self.assertEqual(cors_of(headers), {})

    async def test_preflight_skips_unavailable_and_502_without_responders(
        self,
    ) -> None:
        fakes, proxy, url = await self.fleet(CorsPolicy(), CorsPolicy(max_age=30))
        await fakes[1].stop()
        code, headers, _ = await self.client.request(
            "OPTIONS", url + "/v1/chat/completions", headers=PREFLIGHT
        )
        # One responder left: its answer as it is.
        self.assertEqual(code, 200)
        self.assertEqual(headers.getRawHeaders("access-control-max-age"), ["600"])
        await fakes[0].stop()
        code, headers, body = await self.client.request(
            "OPTIONS", url + "/v1/chat/completions", headers=PREFLIGHT
        )
        self.assertEqual(code, 502, body)
        self.assertEqual(cors_of(headers), {})
        self.assertIn("preflight", json.loads(body)["error"]["message"])

    async def test_inventory_needs_every_engine(self) -> None:
        fakes, proxy, url = await self.fleet(
            CorsPolicy(), CorsPolicy(origins=(ORIGIN,), expose=("x-id",))
        )
        fakes[1].models = ["n"]
        asked = {"Origin": [ORIGIN], "Cookie": ["session=s3cret"]}
        code, headers, body = await self.client.request(
            "GET", url + "/v1/models", headers=asked
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(sorted(m["id"] for m in json.loads(body)["data"]), ["m", "n"])
        self.assertEqual(
            cors_of(headers),
            {"access-control-allow-origin": [ORIGIN], "vary": ["Origin"]},
        )
        for fake in fakes:
            asked_here = [r for r in fake.requests if "origin" in r.headers]
            self.assertEqual(asked_here[-1].headers["origin"], ORIGIN)
            self.assertNotIn("cookie", asked_here[-1].headers)
        # One engine denies this origin: 403, no CORS header.
        code, headers, body = await self.client.request(
            "GET", url + "/v1/models", headers={"Origin": ["http://x.example"]}
        )
        self.assertEqual(code, 403, body)
        self.assertEqual(cors_of(headers), {})
        # An invalid list: 502 without a partial list, CORS kept (all agreed).
        fakes[1].script(Behaviour(body=b"not json"), path="/v1/models")
        code, headers, body = await self.client.request(
            "GET", url + "/v1/models", headers=asked
        )
        self.assertEqual(code, 502, body)
        self.assertNotIn(b'"m"', body)
        self.assertEqual(headers.getRawHeaders("access-control-allow-origin"), [ORIGIN])
        # ... and none when not every engine agreed.
        fakes[1].script(Behaviour(body=b"not json"), path="/v1/models")
        code, headers, body = await self.client.request(
            "GET", url + "/v1/models", headers={"Origin": ["http://x.example"]}
        )
        self.assertEqual(code, 502, body)
        self.assertEqual(cors_of(headers), {})
        # Without Origin, nothing changes: every list merged.
        code, _, body = await self.client.request("GET", url + "/v1/models")
        self.assertEqual(code, 200)

    async def test_preflight_network_gate_applies(self) -> None:
        fake = await self.engine("openai", ["m"])
        fake.cors = CorsPolicy()
        proxy = await self.keyed_proxy(
            {"vllm": fake.url},
            AccessConfig(plaintext_from=ONLY_ONE),
        )
        with self.assertRaises(_REFUSED):
            await self.call(
                self.from_source(),
                "OPTIONS",
                facade_url(proxy, "vllm") + "/v1/chat/completions",
                headers=PREFLIGHT,
            )
        self.assertEqual([r for r in fake.requests if r.method == "OPTIONS"], [])
