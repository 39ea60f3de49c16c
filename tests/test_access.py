"""
Who may call a facade (DESIGN §3a): source networks, API keys, the per-key
limit, and keys nvproxy sends to engines that want one.

Non-loopback callers are simulated on loopback: the client binds to
127.0.0.2 and C{plaintext_from} allows only 127.0.0.1/32.  127.0.0.2 is
still loopback, so the key rule is exercised with
C{require_key_on_loopback}; L{NetnsKeyTests} covers a truly non-loopback
source where the machine allows a network namespace.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
import textwrap
from typing import Any

from attrs import evolve
from hypothesis import given
from hypothesis import strategies as st
from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.task import deferLater
from twisted.internet.utils import getProcessOutputAndValue
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import (
    Agent,
    HTTPConnectionPool,
    RequestTransmissionFailed,
    ResponseNeverReceived,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IAgentEndpointFactory
from zope.interface import implementer

from nvproxy.config import (
    AccessConfig,
    AccessOverride,
    ConfigError,
    ConfigErrors,
    VllmServiceConfig,
    load_config,
    parse_network,
)
from nvproxy.keyring import hash_key
from nvproxy.net import is_loopback
from nvproxy.ops import OperationError
from nvproxy.proxy.access import NetworkGate, access_warnings
from nvproxy.proxy.backendauth import BackendKeyError, KeyedAgent, read_backend_key
from nvproxy.service import NvProxy, build
from nvproxy.testing.fakecors import CorsPolicy
from nvproxy.testing.fakeengine import Behaviour, FakeEngine
from nvproxy.testing.fakevllm import FakeVLLM
from nvproxy.testing.harness import facade_url, free_port, proxy_config, start_proxy
from tests.test_forwarding import ProxyTestCase

_REFUSED = (ResponseNeverReceived, RequestTransmissionFailed)
"""What a client sees of a connection closed before any HTTP was read."""

KEY = "k" * 43
OTHER = "o" * 43
ONLY_ONE = (ipaddress.ip_network("127.0.0.1/32"),)
ALL_LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# -- the network gate ----------------------------------------------------------

_v4 = st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address)
_v6 = st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address)


def _v4_networks() -> st.SearchStrategy[ipaddress.IPv4Network]:
    return st.tuples(_v4, st.integers(0, 32)).map(
        lambda p: ipaddress.IPv4Network(f"{p[0]}/{p[1]}", strict=False)
    )


def _v6_networks() -> st.SearchStrategy[ipaddress.IPv6Network]:
    return st.tuples(_v6, st.integers(0, 128)).map(
        lambda p: ipaddress.IPv6Network(f"{p[0]}/{p[1]}", strict=False)
    )


class NetworkGateTests(SynchronousTestCase):
    @given(_v4, st.lists(_v4_networks(), max_size=4))
    def test_ipv4(self, address: ipaddress.IPv4Address, nets: list[Any]) -> None:
        gate = NetworkGate(nets)
        expected = any(address in net for net in nets)
        self.assertEqual(gate(IPv4Address("TCP", str(address), 1)), expected)
        # The same client seen by a dual-stack listener: matched as IPv4.
        mapped = IPv6Address("TCP", f"::ffff:{address}", 1)
        self.assertEqual(gate(mapped), expected)

    @given(_v6, st.lists(_v6_networks(), max_size=4), st.lists(_v4_networks()))
    def test_ipv6(
        self, address: ipaddress.IPv6Address, nets: list[Any], v4: list[Any]
    ) -> None:
        if address.ipv4_mapped is not None:
            return
        gate = NetworkGate([*nets, *v4])
        expected = any(address in net for net in nets)
        self.assertEqual(gate(IPv6Address("TCP", str(address), 1)), expected)

    @given(st.one_of(_v4, _v6))
    def test_default_is_loopback(self, address: Any) -> None:
        host = str(address)
        cls = IPv4Address if address.version == 4 else IPv6Address
        peer = cls("TCP", host, 1)
        gate = NetworkGate(AccessConfig().plaintext_from)
        self.assertEqual(gate(peer), is_loopback(peer))

    def test_not_ip(self) -> None:
        gate = NetworkGate([ipaddress.ip_network("0.0.0.0/0")])
        self.assertFalse(gate(UNIXAddress(b"/tmp/s")))
        self.assertFalse(gate(IPv4Address("TCP", "localhost", 1)))

    def test_warnings(self) -> None:
        wide = (*ALL_LOOPBACK, ipaddress.ip_network("10.0.0.0/8"))
        self.assertEqual(access_warnings(AccessConfig(), "0.0.0.0"), [])
        self.assertEqual(
            access_warnings(AccessConfig(plaintext_from=wide), "127.0.0.1"),
            [
                "plaintext_from allows 10.0.0.0/8 but the facade listens on"
                " 127.0.0.1: only loopback callers can reach it"
            ],
        )
        self.assertEqual(
            access_warnings(AccessConfig(plaintext_from=wide), "0.0.0.0"),
            ["plaintext HTTP from 10.0.0.0/8 without API keys"],
        )
        keyed = AccessConfig(plaintext_from=wide, api_keys_file="/k")
        self.assertEqual(access_warnings(keyed, "::"), [])

    def test_parse_network(self) -> None:
        self.assertEqual(str(parse_network(" 10.0.0.0/8 ")), "10.0.0.0/8")
        self.assertEqual(str(parse_network("10.1.2.3")), "10.1.2.3/32")
        self.assertEqual(str(parse_network("::ffff:10.0.0.0/104")), "10.0.0.0/8")
        self.assertRaises(ValueError, parse_network, "10.0.0.1/8")
        self.assertRaises(ValueError, parse_network, "nope")


# -- configuration ---------------------------------------------------------------


class AccessConfigTests(SynchronousTestCase):
    def load(self, text: str, **flags: str) -> Any:
        path = self.mktemp()
        with open(path, "w") as f:
            f.write(text)
        return load_config(path, flags, {"HOME": "/x"})

    def test_override_replaces_only_what_it_names(self) -> None:
        config = self.load(
            '[access]\nplaintext_from = ["10.0.0.0/8"]\napi_keys_file = "/k"\n'
            "max_concurrent_per_key = 4\n"
            "[engines.vllm.access]\nrequire_key_on_loopback = true\n"
            'plaintext_from = ["0.0.0.0/0", "::/0"]\n'
        )
        ollama = config.engines["ollama"].access_in(config)
        vllm = config.engines["vllm"].access_in(config)
        self.assertEqual(
            ollama,
            AccessConfig(
                (ipaddress.ip_network("10.0.0.0/8"),),
                "/k",
                False,
                max_concurrent_per_key=4,
            ),
        )
        self.assertEqual(
            vllm,
            AccessConfig(
                (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")),
                "/k",
                True,
                4,
            ),
        )

    def test_defaults(self) -> None:
        config = self.load("")
        access = config.engines["ollama"].access_in(config)
        self.assertEqual(access, AccessConfig())
        self.assertEqual(config.engines["ollama"].access, AccessOverride())
        self.assertIsNone(config.engines["ollama"].backend_api_key_file)

    def test_errors_one_line_each(self) -> None:
        with self.assertRaises(ConfigErrors) as caught:
            self.load(
                '[access]\nplaintext_from = "10.0.0.0/8"\n'
                "require_key_on_loopback = 1\nmax_concurrent_per_key = -1\n"
                '[engines.ollama.access]\nplaintext_from = ["10.0.0.1/8"]\n'
                "colour = 1\n"
                "[engines.ollama]\nbackend_api_key_file = 3\n"
            )
        self.assertEqual(
            [str(e) for e in caught.exception.errors],
            [
                'access.plaintext_from: must be an array, got "10.0.0.0/8"',
                "access.require_key_on_loopback: must be true or false, got 1",
                "access.max_concurrent_per_key: must be an integer >= 0, got -1",
                "engines.ollama.access.colour: unknown key",
                "engines.ollama.backend_api_key_file: must be a string, got 3",
                "engines.ollama.access.plaintext_from[0]: not a network"
                ' (10.0.0.1/8 has host bits set), got "10.0.0.1/8"',
            ],
        )

    def test_flag_and_environment(self) -> None:
        config = load_config(
            None,
            {"plaintext-from": "10.0.0.0/8,fd00::/8"},
            {"HOME": "/x", "NVPROXY_API_KEYS_FILE": "/keys"},
        )
        self.assertEqual(
            [str(n) for n in config.access.plaintext_from], ["10.0.0.0/8", "fd00::/8"]
        )
        self.assertEqual(config.access.api_keys_file, "/keys")
        with self.assertRaises(ConfigError) as caught:
            load_config(None, {"plaintext-from": "10.0.0.0/8,bad"}, {"HOME": "/x"})
        self.assertIn("--plaintext-from: not a network", str(caught.exception))

    def test_admin_stays_loopback(self) -> None:
        """No [access] setting opens the admin API to a network."""
        with self.assertRaises(ConfigError) as caught:
            self.load(
                '[access]\nplaintext_from = ["0.0.0.0/0"]\n'
                '[admin]\nlisten = "0.0.0.0:8010"\n'
            )
        self.assertEqual(
            str(caught.exception), "admin.listen: must be a loopback address"
        )

    def test_bad_keys_file_at_start(self) -> None:
        keys = self.mktemp()
        with open(keys, "w") as f:
            f.write("svc " + KEY + "\n")
        config = proxy_config(self.mktemp(), {"ollama": "http://127.0.0.1:1"})
        bad = evolve(config, access=AccessConfig(api_keys_file=keys))
        with self.assertRaises(ConfigError) as caught:
            build(bad, reactor)
        self.assertEqual(
            str(caught.exception),
            f"access.api_keys_file: {keys}: line 1: expected sha256: and 64 hex"
            " digits after the name (the key's hash, never the key)",
        )
        self.assertNotIn(KEY, str(caught.exception))
        engines = dict(config.engines)
        engines["ollama"] = evolve(
            engines["ollama"], backend_api_key_file=keys + ".missing"
        )
        with self.assertRaises(ConfigError) as caught:
            build(evolve(config, engines=engines), reactor)
        self.assertEqual(
            str(caught.exception),
            f"engines.ollama.backend_api_key_file: cannot read {keys}.missing:"
            " No such file or directory",
        )


# -- backend keys ---------------------------------------------------------------


@implementer(IAgent)
class _Recorder:
    def __init__(self) -> None:
        self.requests: list[tuple[bytes, Headers | None]] = []

    def request(
        self, method: bytes, uri: bytes, headers: Any = None, body: Any = None
    ) -> Deferred[Any]:
        self.requests.append((uri, headers))
        return succeed(None)


class KeyedAgentTests(SynchronousTestCase):
    def test_only_configured_bases(self) -> None:
        inner = _Recorder()
        agent = KeyedAgent(
            inner,
            {"http://127.0.0.1:8001": "vk", "http://10.0.0.2:80/v": "dk"},
        )
        caller = Headers({b"authorization": [b"Bearer client"], b"x": [b"1"]})
        for uri in (
            b"http://127.0.0.1:8001/v1/chat/completions",
            b"http://127.0.0.1:8001",
            b"http://127.0.0.1:8001?x",
            b"http://127.0.0.1:80011/x",
            b"http://10.0.0.2:80/v/models",
            b"http://10.0.0.2:80/vx",
        ):
            agent.request(b"GET", uri, caller)
        seen = [
            (uri, None if h is None else h.getRawHeaders(b"authorization"))
            for uri, h in inner.requests
        ]
        self.assertEqual(
            [auth for _, auth in seen],
            [
                [b"Bearer vk"],
                [b"Bearer vk"],
                [b"Bearer vk"],
                [b"Bearer client"],
                [b"Bearer dk"],
                [b"Bearer client"],
            ],
        )
        # The caller's headers are not changed in place.
        self.assertEqual(caller.getRawHeaders(b"authorization"), [b"Bearer client"])

    def test_own_headers_keyed_in_place(self) -> None:
        """Headers made for the one request get the key without a copy."""
        from nvproxy.proxy.headers import OwnHeaders

        inner = _Recorder()
        agent = KeyedAgent(inner, {"http://127.0.0.1:8001": "vk"})
        own = OwnHeaders({b"x": [b"1"]})
        agent.request(b"GET", b"http://127.0.0.1:8001/v1/models", own)
        [(_, sent)] = inner.requests
        self.assertIs(sent, own)
        self.assertEqual(own.getRawHeaders(b"authorization"), [b"Bearer vk"])

    def test_read_backend_key(self) -> None:
        path = self.mktemp()
        for text, ok in (
            ("secret\n", True),
            ("  secret  \n\n", True),
            ("", False),
            ("two words\n", False),
            ("a\nb\n", False),
        ):
            with open(path, "w") as f:
                f.write(text)
            if ok:
                self.assertEqual(read_backend_key(path), "secret")
            else:
                with self.assertRaises(BackendKeyError) as caught:
                    read_backend_key(path)
                self.assertNotIn("words", str(caught.exception))


# -- on loopback, end to end ------------------------------------------------------


@implementer(IAgentEndpointFactory)
class _FromSource:
    """Dials from C{source}: a caller on another (loopback) address."""

    def __init__(self, source: str) -> None:
        self._source = source

    def endpointForURI(self, uri: Any) -> TCP4ClientEndpoint:
        return TCP4ClientEndpoint(
            reactor, uri.host.decode(), uri.port, bindAddress=(self._source, 0)
        )


class AccessTestCase(ProxyTestCase):
    def keys_file(self, **keys: str) -> str:
        path = self.mktemp()
        with open(path, "w") as f:
            f.write("# test keys\n")
            for name, key in keys.items():
                f.write(f"{name} sha256:{hash_key(key).hex()}\n")
        return path

    async def keyed_proxy(
        self,
        backends: dict[str, str],
        access: AccessConfig,
        backend_key: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> NvProxy:
        config = proxy_config(self.mktemp(), backends, **kwargs)
        engines = dict(config.engines)
        for engine, key in (backend_key or {}).items():
            path = self.mktemp()
            with open(path, "w") as f:
                f.write(key + "\n")
            engines[engine] = evolve(engines[engine], backend_api_key_file=path)
        config = evolve(config, access=access, engines=engines)
        proxy = await start_proxy(reactor, config)
        self.addCleanup(proxy.stopService)
        return proxy

    def from_source(self, source: str = "127.0.0.2") -> HTTPClient:
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        return HTTPClient(
            Agent.usingEndpointFactory(reactor, _FromSource(source), pool)
        )

    async def call(
        self,
        http: HTTPClient,
        method: str,
        url: str,
        body: object = None,
        headers: dict[str, list[str]] | None = None,
    ) -> tuple[int, Headers, bytes]:
        import treq

        data = None if body is None else json.dumps(body).encode()
        response = await http.request(method, url, data=data, headers=headers)
        return response.code, response.headers, await treq.content(response)


class NetworkIngressTests(AccessTestCase):
    async def test_refused_before_any_http(self) -> None:
        fake = await self.engine("openai", ["m"])
        proxy = await self.keyed_proxy(
            {"vllm": fake.url}, AccessConfig(plaintext_from=ONLY_ONE)
        )
        url = facade_url(proxy, "vllm")
        with self.assertRaises(_REFUSED):
            await self.call(
                self.from_source(), "POST", url + "/v1/chat/completions", CHAT
            )
        self.assertEqual([r.path for r in fake.requests if r.method == "POST"], [])
        # 127.0.0.1 itself is served.
        code, _, _ = await self.call(
            self.from_source("127.0.0.1"), "GET", url + "/v1/models"
        )
        self.assertEqual(code, 200)

    async def test_allowed_network(self) -> None:
        fake = await self.engine("openai", ["m"])
        proxy = await self.keyed_proxy(
            {"vllm": fake.url}, AccessConfig(plaintext_from=ALL_LOOPBACK)
        )
        code, _, body = await self.call(
            self.from_source(),
            "POST",
            facade_url(proxy, "vllm") + "/v1/chat/completions",
            CHAT,
        )
        self.assertEqual(code, 200, body)

    async def test_per_facade_override(self) -> None:
        openai = await self.engine("openai", ["m"])
        ollama = await self.engine("ollama", ["m:latest"])
        config = proxy_config(self.mktemp(), {"vllm": openai.url, "ollama": ollama.url})
        engines = dict(config.engines)
        engines["vllm"] = evolve(
            engines["vllm"], access=AccessOverride(plaintext_from=ALL_LOOPBACK)
        )
        proxy = await start_proxy(
            reactor,
            evolve(
                config, engines=engines, access=AccessConfig(plaintext_from=ONLY_ONE)
            ),
        )
        self.addCleanup(proxy.stopService)
        http = self.from_source()
        code, _, _ = await self.call(
            http, "GET", facade_url(proxy, "vllm") + "/v1/models"
        )
        self.assertEqual(code, 200)
        with self.assertRaises(_REFUSED):
            await self.call(http, "GET", facade_url(proxy, "ollama") + "/api/tags")


class KeyTests(AccessTestCase):
    async def start(self, **access: Any) -> tuple[FakeEngine, NvProxy, str]:
        fake = await self.engine("openai", ["m"])
        keys = self.keys_file(**{"svc-a": KEY, "svc-b": OTHER})
        proxy = await self.keyed_proxy(
            {"vllm": fake.url},
            AccessConfig(plaintext_from=ALL_LOOPBACK, api_keys_file=keys, **access),
            admin=True,
        )
        return fake, proxy, facade_url(proxy, "vllm")

    async def test_missing_or_wrong_key_401(self) -> None:
        fake, proxy, url = await self.start(require_key_on_loopback=True)

        def sent() -> int:
            # Discovery's polls (GET /v1/models) go on meanwhile.
            return len([r for r in fake.requests if r.path != "/v1/models"])

        before = sent()
        http = self.from_source()
        for headers in (
            None,
            {"Authorization": ["Bearer " + "x" * 43]},
            {"Authorization": ["Basic " + KEY]},
            {"x-api-key": ["nope"]},
        ):
            code, out, body = await self.call(
                http, "POST", url + "/v1/chat/completions", CHAT, headers
            )
            self.assertEqual(code, 401, body)
            self.assertEqual(out.getRawHeaders("www-authenticate"), ["Bearer"])
            error = json.loads(body)["error"]
            self.assertEqual(error["code"], "invalid_api_key")
            self.assertNotIn(KEY, body.decode())
            self.assertFalse(
                [
                    n
                    for n, _ in out.getAllRawHeaders()
                    if n.lower().startswith(b"access-control")
                ]
            )
        self.assertEqual(sent(), before, "nothing sent upstream")

    async def test_key_accepted_consumed_and_named(self) -> None:
        fake, proxy, url = await self.start(require_key_on_loopback=True)
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        http = self.from_source()
        code, _, _ = await self.call(
            http, "POST", url + "/v1/chat/completions", CHAT, {"x-api-key": [KEY[:-1]]}
        )
        self.assertEqual(code, 401)
        for headers in (
            {"Authorization": ["Bearer " + KEY]},
            {"x-api-key": [OTHER]},
        ):
            code, _, body = await self.call(
                http, "POST", url + "/v1/chat/completions", CHAT, headers
            )
            self.assertEqual(code, 200, body)
        seen = [r for r in fake.requests if r.path == "/v1/chat/completions"]
        self.assertEqual(len(seen), 2)
        for request in seen:
            self.assertNotIn("authorization", request.headers)
            self.assertNotIn("x-api-key", request.headers)
        recent = proxy.workloads.recent()
        self.assertEqual(_requesters(recent), {"svc-a", "svc-b"})
        admin = f"http://127.0.0.1:{proxy.admin.bound_port()}"
        code, _, metrics = await self.client.request("GET", admin + "/metrics")
        text = metrics.decode()
        self.assertIn(
            'nvproxy_requests_total{engine="vllm",key="svc-a",model="m",node="local",'
            'outcome="completed",route="inference"} 1.0',
            text,
        )
        self.assertNotIn(KEY, text)
        self.assertNotIn(hash_key(KEY).hex(), text)
        self.assertNotIn(KEY, json.dumps(recent))
        logged = " ".join(formatEvent(e) + repr(e) for e in events)
        self.assertIn("no valid API key", logged)
        self.assertNotIn(KEY[:-1], logged)
        self.assertNotIn(OTHER, logged)

    async def test_ollama_dialect(self) -> None:
        fake = await self.engine("ollama", ["m:latest"])
        keys = self.keys_file(**{"svc-a": KEY})
        proxy = await self.keyed_proxy(
            {"ollama": fake.url},
            AccessConfig(api_keys_file=keys, require_key_on_loopback=True),
        )
        code, headers, body = await self.client.request(
            "GET", facade_url(proxy, "ollama") + "/api/tags"
        )
        self.assertEqual(code, 401)
        self.assertEqual(headers.getRawHeaders("www-authenticate"), ["Bearer"])
        self.assertEqual(
            json.loads(body),
            {"error": "a valid API key is required (Authorization: Bearer KEY)"},
        )

    async def test_loopback_without_key_when_not_required(self) -> None:
        fake, proxy, url = await self.start()
        http = self.from_source()
        code, _, _ = await self.call(http, "POST", url + "/v1/chat/completions", CHAT)
        self.assertEqual(code, 200)
        # A key that is not one of ours passes through untouched.
        code, _, _ = await self.call(
            http,
            "POST",
            url + "/v1/chat/completions",
            CHAT,
            {"Authorization": ["Bearer engine-own"]},
        )
        self.assertEqual(code, 200)
        seen = [r for r in fake.requests if r.path == "/v1/chat/completions"]
        self.assertEqual(seen[-1].headers.get("authorization"), "Bearer engine-own")
        self.assertEqual(_requesters(proxy.workloads.recent()), {None})

    async def test_preflight_needs_no_key(self) -> None:
        fake, proxy, url = await self.start(require_key_on_loopback=True)
        fake.cors = CorsPolicy(origins=("http://app.example",))
        code, headers, _ = await self.call(
            self.from_source(),
            "OPTIONS",
            url + "/v1/chat/completions",
            headers={
                "Origin": ["http://app.example"],
                "Access-Control-Request-Method": ["POST"],
                "Access-Control-Request-Headers": ["authorization, content-type"],
            },
        )
        self.assertEqual(code, 200)
        self.assertEqual(
            headers.getRawHeaders("access-control-allow-origin"), ["http://app.example"]
        )
        # A plain OPTIONS is no preflight: it needs a key.
        code, _, _ = await self.call(self.from_source(), "OPTIONS", url + "/v1/models")
        self.assertEqual(code, 401)

    async def test_concurrency_limit_429(self) -> None:
        fake, proxy, url = await self.start(
            require_key_on_loopback=True, max_concurrent_per_key=1
        )
        fake.script(Behaviour(latency=0.5))
        http = self.from_source()
        auth = {
            "Authorization": ["Bearer " + KEY],
            "Content-Type": ["application/json"],
        }
        first = Deferred.fromCoroutine(
            self.call(http, "POST", url + "/v1/chat/completions", CHAT, auth)
        )
        for _ in range(200):
            if fake.pending:
                break
            await deferLater(reactor, 0.01, lambda: None)
        code, headers, body = await self.call(
            http, "POST", url + "/v1/chat/completions", CHAT, auth
        )
        self.assertEqual(code, 429, body)
        self.assertEqual(headers.getRawHeaders("retry-after"), ["1"])
        self.assertEqual(json.loads(body)["error"]["code"], "rate_limit_exceeded")
        # Another key is not held back by this one.
        code, _, _ = await self.call(
            http,
            "POST",
            url + "/v1/chat/completions",
            CHAT,
            {"x-api-key": [OTHER]},
        )
        self.assertEqual(code, 200)
        self.assertEqual((await first)[0], 200)
        code, _, _ = await self.call(
            http, "POST", url + "/v1/chat/completions", CHAT, auth
        )
        self.assertEqual(code, 200)
        self.assertEqual(
            len([r for r in fake.requests if r.path == "/v1/chat/completions"]), 3
        )

    async def test_keys_file_reread(self) -> None:
        fake, proxy, url = await self.start(require_key_on_loopback=True)
        path = proxy.config.access.api_keys_file
        assert path is not None
        with open(path, "a") as f:
            f.write(f"svc-c sha256:{hash_key('c' * 43).hex()}\n")
        later = os.stat(path).st_mtime_ns + 5 * 10**9
        os.utime(path, ns=(later, later))
        await deferLater(reactor, 1.05, lambda: None)
        code, _, _ = await self.call(
            self.from_source(),
            "POST",
            url + "/v1/chat/completions",
            CHAT,
            {"x-api-key": ["c" * 43]},
        )
        self.assertEqual(code, 200)

    async def test_openai_client(self) -> None:
        """The official openai client's api_key= is the facade's key."""
        fake, proxy, url = await self.start(require_key_on_loopback=True)
        script = textwrap.dedent(
            f"""
            import json, openai
            def client(key):
                return openai.OpenAI(base_url="{url}/v1", api_key=key,
                                     max_retries=0, timeout=30)
            answer = client("{KEY}").chat.completions.create(
                model="m", messages=[{{"role": "user", "content": "hi"}}])
            models = [m.id for m in client("{KEY}").models.list()]
            try:
                client("wrong").chat.completions.create(model="m", messages=[])
                refused = None
            except openai.AuthenticationError as e:
                refused = e.status_code
            print(json.dumps({{"content": answer.choices[0].message.content,
                              "models": models, "refused": refused}}))
            """
        )
        d = getProcessOutputAndValue(
            sys.executable, ["-c", script], env=dict(os.environ)
        )
        d.addTimeout(60, reactor)
        out, err, code = await d
        self.assertEqual(code, 0, err.decode())
        result = json.loads(out)
        self.assertTrue(result["content"])
        self.assertEqual(result["models"], ["m"])
        self.assertEqual(result["refused"], 401)
        seen = [r for r in fake.requests if r.path == "/v1/chat/completions"]
        self.assertNotIn("authorization", seen[-1].headers)


def _requesters(recent: list[dict[str, Any]]) -> set[str | None]:
    found: set[str | None] = set()
    for workload in recent:
        stack: list[Any] = [workload]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                if "requesterId" in item:
                    found.add(item["requesterId"])
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
    return found


class BackendKeyTests(AccessTestCase):
    async def test_sent_on_requests_and_polls(self) -> None:
        fake = await self.engine("ollama", ["m:latest"])
        keys = self.keys_file(**{"svc-a": KEY})
        proxy = await self.keyed_proxy(
            {"ollama": fake.url},
            AccessConfig(api_keys_file=keys, require_key_on_loopback=True),
            backend_key={"ollama": "engine-secret"},
        )
        code, _, body = await self.call(
            self.from_source("127.0.0.1"),
            "POST",
            facade_url(proxy, "ollama") + "/api/generate",
            {"model": "m", "prompt": "hi"},
            {"Authorization": ["Bearer " + KEY]},
        )
        self.assertEqual(code, 200, body)
        generate = [r for r in fake.requests if r.path == "/api/generate"]
        polls = [r for r in fake.requests if r.path == "/api/tags"]
        self.assertTrue(polls)
        for request in generate + polls:
            self.assertEqual(
                request.headers.get("authorization"), "Bearer engine-secret"
            )

    async def test_vllm_control_calls(self) -> None:
        text = FakeVLLM(reactor, model="Qwen3-Text", api_key="vllm-secret")
        text.listen(reactor)
        self.addCleanup(text.stop)
        config = proxy_config(self.mktemp(), {"vllm": text.url}, admin=True)
        path = self.mktemp()
        with open(path, "w") as f:
            f.write("vllm-secret\n")
        engines = dict(config.engines)
        engines["vllm"] = evolve(
            engines["vllm"],
            services=(VllmServiceConfig("text", text.url, "Qwen3-Text"),),
            backend_api_key_file=path,
        )
        proxy = await start_proxy(reactor, evolve(config, engines=engines))
        self.addCleanup(proxy.stopService)
        admin = f"http://127.0.0.1:{proxy.admin.bound_port()}"
        code, _, body = await self.client.request(
            "POST", admin + "/admin/sleep/text?level=1"
        )
        self.assertEqual(code, 200, body)
        self.assertTrue(text.is_sleeping)
        code, _, body = await self.post(
            facade_url(proxy, "vllm") + "/v1/chat/completions",
            {"model": "Qwen3-Text", "messages": [{"role": "user", "content": "hi"}]},
        )
        self.assertEqual(code, 200, body)
        self.assertFalse(text.is_sleeping)
        paths = {p.split("?")[0] for _, _, p in text.calls}
        self.assertTrue({"/sleep", "/wake_up", "/collective_rpc", "/health"} <= paths)


class NetnsKeyTests(AccessTestCase):
    """
    A truly non-loopback caller (a network namespace, as in
    L{tests.test_netns}): allowed in by C{plaintext_from}, it needs a key.
    """

    async def test_network_caller_needs_a_key(self) -> None:
        from tests.test_netns import HOST_ADDRESS, NetnsTests

        namespace = await NetnsTests.namespace(self)
        fake = await self.engine("ollama", ["m:latest"])
        keys = self.keys_file(**{"lan-svc": KEY})
        config = proxy_config(self.mktemp(), {"ollama": fake.url})
        engines = dict(config.engines)
        port = free_port()
        engines["ollama"] = evolve(engines["ollama"], port=port)
        access = AccessConfig(
            plaintext_from=(*ALL_LOOPBACK, ipaddress.ip_network("10.213.7.0/24")),
            api_keys_file=keys,
        )
        proxy = await start_proxy(
            reactor,
            evolve(config, engines=engines, listen_interface="0.0.0.0", access=access),
        )
        self.addCleanup(proxy.stopService)
        probe = textwrap.dedent(
            f"""
            import socket, sys
            def ask(extra):
                s = socket.create_connection(("{HOST_ADDRESS}", {port}), timeout=10)
                s.sendall(b"GET /api/tags HTTP/1.1\\r\\nHost: x\\r\\n" + extra
                          + b"Connection: close\\r\\n\\r\\n")
                data = b""
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                return data.split(b" ", 2)[1].decode()
            print(ask(b""), ask(b"Authorization: Bearer {KEY}\\r\\n"))
            """
        )
        d = getProcessOutputAndValue(
            "/usr/sbin/ip",
            ["netns", "exec", namespace, sys.executable, "-c", probe],
            env=dict(os.environ),
        )
        d.addTimeout(30, reactor)
        out, err, code = await d
        self.assertEqual(code, 0, err.decode())
        self.assertEqual(out.split(), [b"401", b"200"])
        # Loopback callers need none (require_key_on_loopback is false).
        code, _, _ = await self.client.request(
            "GET", f"http://127.0.0.1:{port}/api/tags"
        )
        self.assertEqual(code, 200)


class ReloadAccessTests(AccessTestCase):
    """A reload (SIGHUP, POST /admin/reload) changes who may call, at once."""

    async def test_networks_and_keys_reloaded(self) -> None:
        fake = await self.engine("openai", ["m"])
        proxy = await self.keyed_proxy(
            {"vllm": fake.url}, AccessConfig(plaintext_from=ONLY_ONE)
        )
        url = facade_url(proxy, "vllm") + "/v1/models"
        with self.assertRaises(_REFUSED):
            await self.call(self.from_source(), "GET", url)
        keys = self.keys_file(svc=KEY)
        wider = AccessConfig(
            plaintext_from=(*ONLY_ONE, ipaddress.ip_network("127.0.0.2/32")),
            api_keys_file=keys,
            require_key_on_loopback=True,
        )
        loads = [evolve(proxy.config, access=wider)]
        proxy.enable_reload(lambda: loads[0])
        result = await proxy.ops.reload()
        self.assertIn("engines.vllm.access", result["changed"])
        # 127.0.0.2 is let in now, and needs the new key (it is loopback:
        # require_key_on_loopback)
        code, _, _ = await self.call(self.from_source(), "GET", url)
        self.assertEqual(code, 401)
        auth = {"Authorization": [f"Bearer {KEY}"]}
        code, _, _ = await self.call(self.from_source(), "GET", url, headers=auth)
        self.assertEqual(code, 200)
        # a keys file that cannot be read refuses the reload, keeping the rules
        loads[0] = evolve(
            proxy.config,
            access=evolve(wider, api_keys_file=os.path.join(self.mktemp(), "none")),
        )
        with self.assertRaises(OperationError) as caught:
            await proxy.ops.reload()
        self.assertEqual(caught.exception.status, 400)
        code, _, _ = await self.call(self.from_source(), "GET", url, headers=auth)
        self.assertEqual(code, 200)
