"""
Fuzzing a live nvproxy on loopback: Hypothesis-generated HTTP requests
(methods, paths with percent-encodings and dot segments, headers, framing,
deep and broken JSON bodies) and random byte strings into the first-byte
demux and the TLS personality.  Whatever arrives: no 500 "internal proxy
error", no error or traceback in the log, and a normal request is served
afterwards.

Examples are drawn by Hypothesis in a synchronous step (derandomized, so a
run is reproducible), then sent over real sockets, a few connections at a
time.  The default run is bounded (well under a minute); set
C{NVPROXY_FUZZ_EXAMPLES=N} for N examples per test.

Random TOML into the config loader is L{tests.test_config.RandomDocumentTests};
random lines on the broker link are in L{tests.test_control}.
"""

from __future__ import annotations

import json
import os
from typing import Any

from attrs import evolve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import EventLoggingObserver
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.python.failure import Failure

from nvproxy.cluster import ClusterDir
from nvproxy.service import NvProxy
from nvproxy.testing.harness import proxy_config, start_proxy
from tests.test_forwarding import ProxyTestCase

EXAMPLES = int(os.environ.get("NVPROXY_FUZZ_EXAMPLES", "0")) or 150
"""Examples per fuzz test (C{NVPROXY_FUZZ_EXAMPLES} overrides)."""

AT_ONCE = 25
"""Connections open at the same time."""

WAIT = 0.5
"""Seconds a connection may take to be answered before it is dropped."""


def draw(strategy: st.SearchStrategy[bytes], n: int) -> list[bytes]:
    """C{n} examples of C{strategy}, the same ones every run."""
    out: list[bytes] = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: bytes) -> None:
        out.append(example)

    collect()
    return out[:n]


# -- strategies ----------------------------------------------------------------

_token = st.text(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~", max_size=12
)
_method = st.one_of(
    st.just(b"POST"),
    st.just(b"POST"),
    st.sampled_from(
        [b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"PATCH", b"TRACE"]
    ),
    st.binary(min_size=1, max_size=10).filter(lambda m: b" " not in m),
)
_segment = st.one_of(
    _token.map(str.encode),
    st.sampled_from(
        [
            b"v1",
            b"chat",
            b"completions",
            b"api",
            b"generate",
            b"models",
            b"..",
            b".",
            b"",
            b"%2e%2e",
            b"%2E",
            b"..%2f",
            b"%c0%af",
            b"%ff",
            b"%00",
            b"%2573leep",
            b"sleep",
            b";x",
            b"..;",
            b"\\",
            b"%5c",
            b"%e2%82",
            b"%f0%9f%98%80",
            b"%%",
            b"%zz",
        ]
    ),
)
_ROUTES = [
    b"/v1/chat/completions",
    b"/v1/completions",
    b"/v1/embeddings",
    b"/v1/responses",
    b"/v1/audio/transcriptions",
    b"/v1/models",
    b"/health",
]
_path = st.one_of(
    # Real routes (inference ones read the body), half the time.
    st.sampled_from(_ROUTES),
    st.sampled_from(_ROUTES),
    st.sampled_from(_ROUTES),
    st.lists(_segment, max_size=6).map(lambda s: b"/" + b"/".join(s)),
    st.binary(max_size=40).map(
        lambda b: b"/" + b.replace(b" ", b"").replace(b"\r", b"").replace(b"\n", b"")
    ),
    st.just(b"*"),
    st.just(b"http://x/v1/models"),
).flatmap(lambda p: st.one_of(st.just(p), _token.map(lambda q: p + b"?" + q.encode())))
_header = st.tuples(
    st.one_of(
        st.sampled_from(
            [
                b"Content-Type",
                b"Accept",
                b"X-Request-Id",
                b"Authorization",
                b"Expect",
                b"Connection",
                b"Origin",
                b"Host",
                b"Transfer-Encoding",
                b"Content-Length",
            ]
        ),
        st.binary(min_size=1, max_size=12).filter(
            lambda n: not any(c in n for c in b"\r\n:")
        ),
    ),
    st.one_of(
        st.sampled_from(
            [
                b"application/json",
                b"multipart/form-data; boundary=x",
                b"text/event-stream",
                b"100-continue",
                b"close",
                b"keep-alive",
                b"chunked",
                b"-1",
                b"99999999999999999999",
                b"\xff\xfe",
                b"",
            ]
        ),
        st.binary(max_size=30).filter(lambda v: b"\r" not in v and b"\n" not in v),
    ),
)


def _json_body() -> st.SearchStrategy[bytes]:
    leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8))
    doc = st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(
                st.sampled_from(["model", "messages", "x"]), inner, max_size=3
            ),
        ),
        max_leaves=8,
    )
    return st.one_of(
        doc.map(lambda d: json.dumps(d).encode()),
        st.dictionaries(st.just("model"), st.one_of(st.text(max_size=8), leaf)).map(
            lambda d: json.dumps(d).encode()
        ),
        st.integers(1, 20000).map(lambda n: b"[" * n + b"]" * n),
        st.integers(1, 20000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
        st.integers(1, 2000).map(lambda n: b'{"model":' + b"[" * n),
        st.binary(max_size=64),
        st.just(b'{"model": "m", "x": 1e999999}'),
        st.just(b'{"model": "\\ud800"}'),
    )


def _valid_body() -> st.SearchStrategy[bytes]:
    """A body naming the served model, sometimes with a deep or odd extra."""
    extra = st.one_of(
        st.none(),
        st.integers(1, 5000).map(lambda n: "[" * n + "]" * n),
        st.text(max_size=20).map(json.dumps),
    )
    return extra.map(
        lambda x: (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]'
            + (b', "extra": ' + x.encode() if x is not None else b"")
            + b"}"
        )
    )


def _framed(body: bytes, how: str) -> tuple[list[bytes], bytes]:
    if how == "length":
        return [b"Content-Length: %d" % len(body)], body
    if how == "chunked":
        return [b"Transfer-Encoding: chunked"], (
            (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
        )
    if how == "bad-chunk":
        return [b"Transfer-Encoding: chunked"], b"zz\r\n" + body + b"\r\n0\r\n\r\n"
    if how == "huge-chunk":
        return [b"Transfer-Encoding: chunked"], b"f" * 33 + b"\r\n" + body
    if how == "both":
        return [b"Content-Length: 3", b"Transfer-Encoding: chunked"], body
    if how == "short":
        return [b"Content-Length: %d" % (len(body) + 5)], body
    if how == "negative":
        return [b"Content-Length: -1"], body
    return [], body


_FRAMINGS = ["bad-chunk", "huge-chunk", "both", "short", "negative", "none"]
_SAFE_HEADER = st.tuples(
    st.sampled_from([b"Accept", b"X-Request-Id", b"Origin", b"User-Agent"]),
    st.sampled_from([b"*/*", b"text/event-stream", b"abc", b"http://x"]),
)


@st.composite
def http_requests(draw_: Any, odd: bool = True) -> bytes:
    """
    One request on the wire.  With C{odd}, anything goes (version, header
    bytes, framing, line endings); without, the framing is well-formed, so
    the facade's routes and body readers are reached with odd methods,
    paths and bodies.
    """
    method = draw_(_method)
    path = draw_(_path)
    version = b"HTTP/1.1"
    headers = [b"Content-Type: application/json"]
    how = draw_(st.sampled_from(["length", "chunked"]))
    eol = b"\r\n"
    extra = _SAFE_HEADER
    if odd:
        version = draw_(
            st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/x", b""])
        )
        how = draw_(st.sampled_from(["length", "chunked", *_FRAMINGS]))
        eol = draw_(st.sampled_from([b"\r\n", b"\n", b"\r"]))
        extra = _header
    headers += [b"%s: %s" % h for h in draw_(st.lists(extra, max_size=4))]
    body = draw_(st.one_of(_valid_body(), st.just(b""), _json_body()))
    framing, wire_body = _framed(body, how)
    line = b" ".join(p for p in (method, path, version) if p)
    head = eol.join(
        [line, b"Host: 127.0.0.1", *headers, *framing, b"Connection: close"]
    )
    return head + eol + eol + wire_body


KNOWN = [
    # The cases of the hostile-input issue, always sent.
    b"GET /v1/..%c0%afsleep HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: \xff\xfe\r\nConnection: close\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n"
    b"Content-Type: application/json\r\nConnection: close\r\n\r\n"
    + b"[" * 100000
    + b"]" * 100000,
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: close\r\n\r\n" + b"1" * 33 + b"\r\n",
    b"GET /v1/models HTTP/1.1\rHost: x\rConnection: close\r\r",
    b"HELLO\r\n\r\n",
]


random_bytes = st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=300).map(lambda b: b"\x16" + b),
    st.binary(max_size=300).map(lambda b: b"\x16\x03\x01" + b),
    st.binary(min_size=2, max_size=2).map(
        lambda n: b"\x16\x03\x01" + n + bytes(range(256))
    ),
)


# -- sending -----------------------------------------------------------------------


class _Raw(Protocol):
    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.received = b""
        self.done: Deferred[bytes] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(self.payload)
        self._timer = reactor.callLater(WAIT, self._drop)  # type: ignore[attr-defined]

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def _drop(self) -> None:
        assert self.transport is not None
        self.transport.abortConnection()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure | None = None) -> None:
        if self._timer.active():
            self._timer.cancel()
        self.done.callback(self.received)


async def send_raw(port: int, payload: bytes) -> bytes:
    endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port)
    protocol = _Raw(payload)
    await endpoint.connect(Factory.forProtocol(lambda: protocol))
    return await protocol.done


async def tls_proxy(case: ProxyTestCase) -> Any:
    """
    A running nvproxy with a cluster identity (so its TLS personality is
    on), its vLLM facade in front of a fake engine.
    """
    fake = await case.engine("openai", ["m"])
    root = os.path.abspath(case.mktemp())
    ClusterDir(os.path.join(root, "cluster")).init("local", reactor)  # type: ignore[arg-type]
    config = evolve(
        proxy_config(os.path.join(root, "state"), {"vllm": fake.url}),
        cluster_dir=os.path.join(root, "cluster"),
    )
    proxy = await start_proxy(reactor, config)
    case.addCleanup(proxy.stopService)
    return proxy


class FuzzCase(ProxyTestCase):
    timeout = 300

    def setUp(self) -> None:
        super().setUp()
        self.logged = EventLoggingObserver()
        globalLogPublisher.addObserver(self.logged)
        self.addCleanup(globalLogPublisher.removeObserver, self.logged)

    async def fuzz(self, port: int, payloads: list[bytes]) -> list[bytes]:
        answers: list[bytes] = []
        for start in range(0, len(payloads), AT_ONCE):
            batch = payloads[start : start + AT_ONCE]
            answers += await gatherResults(
                [Deferred.fromCoroutine(send_raw(port, p)) for p in batch]
            )
        return answers

    def assertNoCrash(self, payloads: list[bytes], answers: list[bytes]) -> None:
        for payload, answer in zip(payloads, answers, strict=True):
            status = answer.split(b"\r\n", 1)[0]
            self.assertFalse(
                status.startswith(b"HTTP/1.1 500") or b"internal proxy error" in answer,
                f"{payload[:200]!r} -> {answer[:300]!r}",
            )
        bad = [
            formatEvent(e)[:500]
            for e in self.logged
            if "log_failure" in e
            or e.get("log_level") in (LogLevel.error, LogLevel.critical)
        ]
        self.assertEqual(bad, [])

    async def assertServes(self, proxy: NvProxy, engine: str) -> None:
        port = proxy.listeners[engine].bound_port()
        code, _, body = await self.client.request(
            "GET", f"http://127.0.0.1:{port}/v1/models"
        )
        self.assertEqual(code, 200)
        self.assertEqual(json.loads(body)["data"][0]["id"], "m")


class HTTPFuzzTests(FuzzCase):
    async def test_generated_requests(self) -> None:
        """
        Generated requests into a live facade with a fake engine behind it:
        none crashes the facade, and it serves normally afterwards.
        """
        payloads = [
            *KNOWN,
            *draw(http_requests(odd=False), EXAMPLES // 2),
            *draw(http_requests(), EXAMPLES - EXAMPLES // 2),
        ]
        fake = await self.engine("openai", ["m"])
        proxy = await self.proxy({"vllm": fake.url})
        port = proxy.listeners["vllm"].bound_port()
        assert port is not None
        answers = await self.fuzz(port, payloads)
        self.assertNoCrash(payloads, answers)
        self.assertTrue(
            any(a.startswith(b"HTTP/1.1 400") for a in answers), "some were refused"
        )
        await self.assertServes(proxy, "vllm")


class ByteFuzzTests(FuzzCase):
    async def test_random_bytes_into_demux_and_tls(self) -> None:
        """
        Random bytes, many starting with the TLS record byte, into a facade
        with a cluster identity (so the TLS personality is on).
        """
        payloads = draw(random_bytes, EXAMPLES)
        proxy = await tls_proxy(self)
        self.assertIsNotNone(proxy.server_tls)
        port = proxy.listeners["vllm"].bound_port()
        assert port is not None
        answers = await self.fuzz(port, payloads)
        self.assertNoCrash(payloads, answers)
        await self.assertServes(proxy, "vllm")
