"""
Expected client errors are one log line with the reason, never a
traceback; a bug is still logged with its stack (spec §3.2).
"""

from __future__ import annotations

import json
from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from treq.testing import StubTreq
from twisted.internet.testing import EventLoggingObserver
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.admin import admin_app, admin_resource
from nvproxy.proxy.pathnorm import url_text_problem
from tests.test_facade import FacadeCase
from tests.test_forwarding import ProxyTestCase
from tests.test_fuzz import send_raw, tls_proxy


class URLTextProblemTests(SynchronousTestCase):
    def test_text(self) -> None:
        self.assertIsNone(url_text_problem([b"v1", b"caf\xc3\xa9"], b"h\xc3\xb4te"))

    def test_path(self) -> None:
        self.assertEqual(
            url_text_problem([b"v1", b"..\xc0\xafsleep"], b"x"),
            "the request path is not valid UTF-8",
        )

    def test_host(self) -> None:
        self.assertEqual(
            url_text_problem([b""], b"\xff\xfe"), "the Host header is not valid UTF-8"
        )

    @given(
        st.binary(max_size=12).filter(lambda v: b"\n" not in v and b"\r" not in v),
        st.none() | st.integers(min_value=0, max_value=65535),
    )
    def test_whole_host_value_judged_as_its_name(
        self, name: bytes, port: int | None
    ) -> None:
        """
        Judging the whole C{Host} value decides as judging the host name
        twisted.web's C{getRequestHostname} takes out of it would.
        """
        from twisted.web.http import _hostHeaderExpression

        value = name if port is None else b"%s:%d" % (name, port)
        match = _hostHeaderExpression.match(value)
        assert match is not None
        self.assertEqual(
            url_text_problem([b""], value),
            url_text_problem([b""], match.group("host")),
        )


class LiveClientErrorTests(ProxyTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.logged = EventLoggingObserver()
        globalLogPublisher.addObserver(self.logged)
        self.addCleanup(globalLogPublisher.removeObserver, self.logged)
        self.since = 0

    def recent(self) -> list[dict[str, object]]:
        return [dict(e) for e in list(self.logged)[self.since :]]

    def events(self, namespace: str) -> list[dict[str, object]]:
        return [e for e in self.recent() if e.get("log_namespace") == namespace]

    def assertNoTraceback(self) -> None:
        self.assertEqual([e for e in self.logged if "log_failure" in e], [])
        levels = [e["log_level"] for e in self.logged]
        self.assertNotIn(LogLevel.error, levels)
        self.assertNotIn(LogLevel.critical, levels)

    async def raw(self, request: bytes) -> bytes:
        fake = await self.engine("openai", ["m"])
        proxy = await self.proxy({"vllm": fake.url})
        port = proxy.listeners["vllm"].bound_port()
        assert port is not None
        self.since = len(self.logged)
        return await send_raw(port, request)

    async def test_overlong_utf8_path(self) -> None:
        answer = await self.raw(
            b"GET /v1/..%c0%afsleep HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        head, _, body = answer.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 400"), answer)
        self.assertEqual(
            json.loads(body)["error"]["message"], "the request path is not valid UTF-8"
        )
        [event] = self.events("nvproxy.proxy.facade")
        self.assertEqual(event["log_level"], LogLevel.info)
        self.assertEqual(event["reason"], "the request path is not valid UTF-8")
        self.assertEqual(event["path"], "/v1/..%c0%afsleep")
        self.assertNoTraceback()

    async def test_non_utf8_host(self) -> None:
        answer = await self.raw(
            b"GET /v1/models HTTP/1.1\r\nHost: \xff\xfe\r\nConnection: close\r\n\r\n"
        )
        self.assertTrue(answer.startswith(b"HTTP/1.1 400"), answer)
        [event] = self.events("nvproxy.proxy.facade")
        self.assertEqual(event["reason"], "the Host header is not valid UTF-8")
        self.assertNoTraceback()

    async def test_absolute_form_target_is_served(self) -> None:
        """An absolute-form request target (RFC 9112 §3.2.2) is routed."""
        body = b'{"model": "m"}'
        answer = await self.raw(
            b"POST http://x/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%s" % (len(body), body)
        )
        self.assertTrue(answer.startswith(b"HTTP/1.1 200"), answer)
        self.assertNoTraceback()

    async def test_non_http_first_line(self) -> None:
        answer = await self.raw(b"HELLO THERE\r\n\r\n")
        self.assertTrue(answer.startswith(b"HTTP/1.1 400"), answer)
        self.assertNoTraceback()

    async def test_tls_garbage(self) -> None:
        proxy = await tls_proxy(self)
        port = proxy.listeners["vllm"].bound_port()
        assert port is not None
        self.since = len(self.logged)
        await send_raw(port, b"\x16\x03\x01" + bytes(range(256)))
        [event] = self.events("nvproxy.proxy.listener")
        self.assertEqual(event["log_level"], LogLevel.debug)
        self.assertIn("SSL routines", str(event["reason"]))
        self.assertNoTraceback()
        code, _, _ = await self.client.request(
            "GET", f"http://127.0.0.1:{port}/v1/models"
        )
        self.assertEqual(code, 200)


class BugsKeepTheirStackTests(FacadeCase):
    def test_a_bug_is_logged_with_its_stack(self) -> None:
        logged = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)

        def broken(*args: object) -> Any:
            raise RuntimeError("a bug")

        self.backend.resolve = broken  # type: ignore[method-assign]
        code, _, _ = self.call("POST", "/v1/chat/completions", {"model": "m"})
        self.assertEqual(code, 500)
        [event] = [e for e in logged if "log_failure" in e]
        self.assertEqual(event["log_level"], LogLevel.critical)
        self.assertIn("in broken", event["log_failure"].getTraceback())
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_bad_encoding_in_memory(self) -> None:
        logged = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        code, _, body = self.call("GET", "/v1/..%c0%afsleep")
        self.assertEqual(code, 400)
        self.assertEqual(
            json.loads(body)["error"]["message"], "the request path is not valid UTF-8"
        )
        self.assertEqual([e for e in logged if "log_failure" in e], [])
        self.assertEqual(self.fakes["n1"].requests, [])


class AdminURLTests(SynchronousTestCase):
    """The admin API refuses a non-UTF-8 URL the same way: JSON, one line."""

    def test_bad_encoding(self) -> None:
        logged = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        app = admin_app(cast(Any, None), CollectorRegistry())
        stub = StubTreq(admin_resource(app))
        response = self.successResultOf(stub.get("http://admin/admin/%c0%afstatus"))
        self.assertEqual(response.code, 400)
        body = json.loads(self.successResultOf(stub.content(response)))
        self.assertEqual(body, {"error": "the request path is not valid UTF-8"})
        self.assertEqual([e for e in logged if "log_failure" in e], [])
        [event] = [e for e in logged if e.get("reason")]
        self.assertEqual(event["log_level"], LogLevel.info)
