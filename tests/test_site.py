"""
Tests for L{nvproxy.proxy.site}: how a request head must arrive (an absolute
header deadline, an idle timeout, size limits) and the answers a client gets
when it does not, on a facade site and on the admin listener's site.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IListeningPort
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from nvproxy.engines import ENGINES
from nvproxy.proxy.accesslog import access_of
from nvproxy.proxy.client import ClientSide
from nvproxy.proxy.cork import (
    CORK,
    GATHER_AT,
    Turn,
    cover,
    hold,
    release,
    send_gathered,
    send_now,
    uncover,
)
from nvproxy.proxy.listener import DemuxFactory
from nvproxy.proxy.requestid import assign, request_id
from nvproxy.proxy.site import (
    _CHANNEL_ATTRIBUTES,
    _REQUEST_ATTRIBUTES,
    ClientLimits,
    FacadeRequest,
    FacadeSite,
    GuardedSite,
    _chunk_size_error,
    origin_form,
    when_lost,
)
from nvproxy.service import build
from tests.objects import keeps_own_dict
from tests.test_service import service_config

LIMITS = ClientLimits(
    header_timeout=2.0,
    idle_timeout=5.0,
    max_request_line=100,
    max_header_bytes=200,
    max_header_count=5,
)


class _Echo(Resource):
    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        return b"ok"

    def render_POST(self, request: Request) -> bytes:
        assert request.content is not None
        return b"got " + request.content.read()


def _facade_site(
    clock: Clock, engine: str = "ollama", resource: Resource | None = None
) -> FacadeSite:
    return FacadeSite(
        _Echo() if resource is None else resource,
        error_body=ENGINES[engine].error_body,
        max_body=1000,
        max_connections=10,
        limits=LIMITS,
        reactor=clock,
    )


class _Connection:
    """One channel of a site on a L{StringTransport}."""

    def __init__(self, test: SynchronousTestCase, site: GuardedSite) -> None:
        self.transport = StringTransport()
        self.channel: Any = site.buildProtocol(None)
        self.channel.makeConnection(self.transport)
        test.addCleanup(self.lost)

    def send(self, data: bytes) -> None:
        self.channel.dataReceived(data)

    def output(self) -> bytes:
        return self.transport.value()

    def closed(self) -> bool:
        return bool(self.transport.disconnecting)

    def lost(self) -> None:
        self.channel.connectionLost(Failure(ConnectionDone()))

    def refusal(self) -> tuple[int, dict[bytes, bytes], Any]:
        """The one answer written: status, headers, JSON body."""
        head, _, body = self.output().partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
        self.assertLength(headers, body)
        return status, headers, json.loads(body)

    @staticmethod
    def assertLength(headers: dict[bytes, bytes], body: bytes) -> None:
        assert int(headers[b"content-length"]) == len(body), (headers, body)


class _CountingTransport(StringTransport):
    asked = 0

    def getHost(self) -> Any:
        self.asked += 1
        return super().getHost()


class HostTests(SynchronousTestCase):
    def test_asked_once_per_connection(self) -> None:
        """
        Every request on a connection sees the connection's own address,
        asked of the transport once (each ask is a system call).
        """
        site = _facade_site(Clock())
        transport = _CountingTransport()
        channel: Any = site.buildProtocol(None)
        channel.makeConnection(transport)
        self.addCleanup(channel.connectionLost, Failure(ConnectionDone()))
        channel.dataReceived(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        self.assertEqual(transport.value().count(b"HTTP/1.1 200"), 3)
        self.assertEqual(transport.asked, 1)
        self.assertEqual(channel.getHost(), transport.getHost())


class HeaderDeadlineTests(SynchronousTestCase):
    """
    Request line and headers must be complete within C{header_timeout} of
    the request's first byte, however the bytes trickle in.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.site = _facade_site(self.clock)

    def test_trickle_does_not_extend_the_deadline(self) -> None:
        """
        One byte every 0.1 s keeps the idle timeout at bay but not the
        header deadline: at 2 s the client gets a 408 and the connection
        closes.
        """
        conn = _Connection(self, self.site)
        head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        for byte in head[:19]:
            conn.send(bytes([byte]))
            self.clock.advance(0.1)
        self.assertEqual(conn.output(), b"")
        self.assertFalse(conn.closed())
        self.clock.advance(0.05)  # 1.95 s after the first byte
        self.assertFalse(conn.closed())
        self.clock.advance(0.05)
        self.assertTrue(conn.closed())
        status, headers, body = conn.refusal()
        self.assertEqual(status, 408)
        self.assertEqual(headers[b"connection"], b"close")
        self.assertEqual(
            body, {"error": "request line and headers not complete within 2s"}
        )

    def test_bytes_after_the_refusal_are_ignored(self) -> None:
        conn = _Connection(self, self.site)
        conn.send(b"GET / HT")
        self.clock.advance(2)
        written = conn.output()
        conn.send(b"TP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(conn.output(), written)

    def test_complete_head_cancels_the_deadline(self) -> None:
        """
        A head that completes in time is served, and the deadline no longer
        applies once it has.
        """
        conn = _Connection(self, self.site)
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\n")
        self.clock.advance(1.9)
        conn.send(b"\r\n")
        self.assertTrue(conn.output().startswith(b"HTTP/1.1 200 OK\r\n"))
        self.assertTrue(conn.output().endswith(b"ok"))
        self.clock.advance(4.9)
        self.assertFalse(conn.closed())
        self.assertNotIn(b"408", conn.output())

    def test_keep_alive_deadline_starts_at_the_next_first_byte(self) -> None:
        """
        On a keep-alive connection the deadline of the next request starts
        with its first byte, not with the connection.
        """
        conn = _Connection(self, self.site)
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        self.clock.advance(4)  # idle, below idle_timeout
        conn.send(b"G")
        served = conn.output()
        self.clock.advance(1.9)
        self.assertFalse(conn.closed())
        self.clock.advance(0.1)
        self.assertTrue(conn.closed())
        self.assertTrue(conn.output()[len(served) :].startswith(b"HTTP/1.1 408 "))

    def test_next_request_before_the_last_deadline(self) -> None:
        """
        A request that starts before the previous one's deadline would have
        passed gets its own full deadline from its first byte; the
        connection's one deadline timer is moved for it, not replaced.
        """
        conn = _Connection(self, self.site)
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        deadlines = [
            call for call in self.clock.getDelayedCalls() if call.getTime() == 2
        ]
        self.assertEqual(len(deadlines), 1)
        self.clock.advance(1)
        conn.send(b"GET / HTTP/1.1\r\n")
        served = conn.output()
        self.assertIn(deadlines[0], self.clock.getDelayedCalls())
        self.assertEqual(deadlines[0].getTime(), 3)
        self.clock.advance(1.9)  # past the first deadline, within the second
        self.assertFalse(conn.closed())
        self.clock.advance(0.1)
        self.assertTrue(conn.closed())
        self.assertTrue(conn.output()[len(served) :].startswith(b"HTTP/1.1 408 "))

    def test_idle_keep_alive_connection_closed(self) -> None:
        """
        A connection silent for C{idle_timeout} after a response is closed
        without an answer.
        """
        conn = _Connection(self, self.site)
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        served = conn.output()
        self.clock.advance(4.9)
        self.assertFalse(conn.closed())
        self.clock.advance(0.1)
        self.assertTrue(conn.closed())
        self.assertEqual(conn.output(), served)

    def test_idle_timeout_off_while_a_request_is_handled(self) -> None:
        """
        A request handled for longer than C{idle_timeout} keeps its
        connection; the idle timeout starts again when it is answered, and
        the connection's one idle timer is moved for it, not replaced.
        """
        pending: list[Request] = []

        class Slow(Resource):
            isLeaf = True

            def render_GET(self, request: Request) -> object:
                pending.append(request)
                return NOT_DONE_YET

        conn = _Connection(self, _facade_site(self.clock, resource=Slow()))
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        self.clock.advance(12)  # twice the idle timeout, still handled
        self.assertFalse(conn.closed())
        pending[0].write(b"late")
        pending[0].finish()
        [idle] = [
            call
            for call in self.clock.getDelayedCalls()
            if call.getTime() == 12 + LIMITS.idle_timeout
        ]
        self.clock.advance(4.9)
        self.assertFalse(conn.closed())
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        pending[1].finish()
        self.assertIn(idle, self.clock.getDelayedCalls())
        self.assertEqual(idle.getTime(), 16.9 + LIMITS.idle_timeout)
        self.clock.advance(4.9)
        self.assertFalse(conn.closed())
        self.clock.advance(0.1)
        self.assertTrue(conn.closed())
        self.assertIn(b"late", conn.output())

    def test_admin_site_has_the_deadline(self) -> None:
        """
        The admin listener's site applies the same deadline, with a plain
        JSON error.
        """
        conn = _Connection(
            self, GuardedSite(_Echo(), limits=LIMITS, reactor=self.clock)
        )
        conn.send(b"GET /admin/status HTTP/1.1\r\nHost: x\r\nX: ")
        for _ in range(19):
            self.clock.advance(0.1)
            conn.send(b"a")
        self.clock.advance(0.1)
        self.assertTrue(conn.closed())
        status, headers, body = conn.refusal()
        self.assertEqual((status, headers[b"content-type"]), (408, b"application/json"))
        self.assertEqual(
            body, {"error": "request line and headers not complete within 2s"}
        )

    def test_client_that_does_not_read_is_aborted(self) -> None:
        """
        After the refusal the connection is aborted if it has not closed
        within C{abortTimeout}.
        """
        conn = _Connection(self, self.site)
        conn.send(b"G")
        self.clock.advance(2)
        self.assertTrue(conn.closed())
        self.assertFalse(conn.transport.disconnected)
        self.clock.advance(conn.channel.abortTimeout)
        self.assertTrue(conn.transport.disconnected)


class _CountingClock(Clock):
    """A C{Clock} that counts the timers made."""

    made = 0

    def callLater(self, delay: float, callable: Any, *args: Any, **kw: Any) -> Any:
        self.made += 1
        return super().callLater(delay, callable, *args, **kw)


class DemuxDeadlineTests(SynchronousTestCase):
    """
    Behind the facade port's demultiplexer, a channel's header deadline is
    the connection's first-byte timer, moved to the first byte: one timer
    fewer made (and cancelled) per connection.
    """

    def setUp(self) -> None:
        self.clock = _CountingClock()
        self.site = _facade_site(self.clock)
        demux = DemuxFactory(self.site, None, self.clock, first_byte_timeout=10.0)
        self.transport = StringTransport(
            peerAddress=IPv4Address("TCP", "127.0.0.1", 50000)
        )
        self.protocol = demux.buildProtocol(self.transport.getPeer())
        self.protocol.makeConnection(self.transport)
        self.addCleanup(self.protocol.connectionLost, Failure(ConnectionDone()))
        (self.first_byte,) = self.clock.getDelayedCalls()

    def test_first_byte_timer_becomes_the_deadline(self) -> None:
        """
        Three seconds of silence, then a head that never completes: the
        408 comes C{header_timeout} after the first byte, from the same
        timer, and only the idle timer is made besides it.
        """
        self.clock.advance(3)
        self.protocol.dataReceived(b"GET / HTTP/1.1\r\n")
        channel: Any = self.protocol._inner
        self.assertIs(channel._deadline, self.first_byte)
        self.assertEqual(self.first_byte.getTime(), 3 + LIMITS.header_timeout)
        self.assertEqual(self.clock.made, 2)  # the first-byte and idle timers
        self.clock.advance(LIMITS.header_timeout - 0.01)
        self.assertFalse(self.transport.disconnecting)
        self.clock.advance(0.01)
        self.assertTrue(self.transport.disconnecting)
        self.assertTrue(self.transport.value().startswith(b"HTTP/1.1 408 "))

    def test_served_and_closed_leaves_no_timer(self) -> None:
        """
        Two requests on the connection are served with the one deadline
        timer; once the connection is gone no timer is left.
        """
        self.protocol.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        self.clock.advance(1)
        self.protocol.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(self.transport.value().count(b"HTTP/1.1 200 OK"), 2)
        self.assertEqual(self.clock.made, 2)
        self.protocol.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.clock.getDelayedCalls(), [])


class SizeLimitTests(SynchronousTestCase):
    """
    Request line, header bytes and header count beyond the limits get 414
    and 431 in the engine's dialect, then a close.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.site = _facade_site(self.clock, "lmstudio")

    def refused(self, data: bytes) -> tuple[int, str]:
        conn = _Connection(self, self.site)
        conn.send(data)
        self.assertTrue(conn.closed(), conn.output())
        status, headers, body = conn.refusal()
        self.assertEqual(headers[b"connection"], b"close")
        self.assertEqual(body["error"]["code"], status)
        message: str = body["error"]["message"]
        return status, message

    def served(self, data: bytes) -> bytes:
        conn = _Connection(self, self.site)
        conn.send(data)
        self.assertFalse(conn.closed(), conn.output())
        return conn.output()

    def test_request_line_414(self) -> None:
        path = b"/" + b"a" * 100
        self.assertEqual(
            self.refused(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
            (414, "request line exceeds 100 bytes"),
        )

    def test_partial_request_line_414_at_once(self) -> None:
        """No need to wait for the CRLF of a line already too long."""
        self.assertEqual(self.refused(b"GET /" + b"a" * 200)[0], 414)

    def test_request_line_at_the_limit_served(self) -> None:
        line = b"GET /" + b"a" * 86 + b" HTTP/1.1"
        self.assertEqual(len(line), 100)
        self.assertIn(b" 200 ", self.served(line + b"\r\nHost: x\r\n\r\n"))

    def test_huge_request_line_414(self) -> None:
        """A request line beyond twisted.web's own limits too."""
        self.assertEqual(self.refused(b"GET /" + b"a" * 200_000)[0], 414)

    def test_header_bytes_431(self) -> None:
        self.assertEqual(
            self.refused(b"GET / HTTP/1.1\r\nX: " + b"a" * 200 + b"\r\n\r\n"),
            (431, "request headers exceed 200 bytes"),
        )

    def test_partial_header_431_at_once(self) -> None:
        self.assertEqual(
            self.refused(b"GET / HTTP/1.1\r\nX: " + b"a" * 100_000)[0], 431
        )

    def test_header_bytes_at_the_limit_served(self) -> None:
        header = b"X: " + b"a" * 195 + b"\r\n"
        self.assertEqual(len(header), 200)
        self.assertIn(b" 200 ", self.served(b"GET / HTTP/1.1\r\n" + header + b"\r\n"))

    def test_header_count_431(self) -> None:
        headers = b"".join(b"X-%d: 1\r\n" % i for i in range(6))
        self.assertEqual(
            self.refused(b"GET / HTTP/1.1\r\n" + headers + b"\r\n"),
            (431, "more than 5 header fields"),
        )

    def test_header_count_at_the_limit_served(self) -> None:
        headers = b"".join(b"X-%d: 1\r\n" % i for i in range(5))
        self.assertIn(b" 200 ", self.served(b"GET / HTTP/1.1\r\n" + headers + b"\r\n"))

    def test_limits_apply_to_each_request(self) -> None:
        """Header bytes are counted per request, not per connection."""
        header = b"X: " + b"a" * 150 + b"\r\n"
        request = b"GET / HTTP/1.1\r\n" + header + b"\r\n"
        self.assertEqual(self.served(request * 3).count(b" 200 OK"), 3)


class FramingTests(SynchronousTestCase):
    """
    Malformed framing gets a 400 in the dialect at once instead of a wait.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.site = _facade_site(self.clock)

    def refused(self, data: bytes) -> str:
        conn = _Connection(self, self.site)
        conn.send(data)
        self.assertTrue(conn.closed(), conn.output())
        status, _, body = conn.refusal()
        self.assertEqual(status, 400)
        message: str = body["error"]
        return message

    def test_bare_cr_line_endings(self) -> None:
        self.assertEqual(
            self.refused(b"GET / HTTP/1.1\rHost: x\r\r"),
            "bare CR or LF in the request head",
        )

    def test_bare_lf_line_endings(self) -> None:
        self.assertEqual(
            self.refused(b"GET / HTTP/1.1\nHost: x\n\n"),
            "bare CR or LF in the request head",
        )

    def test_bare_cr_inside_a_complete_line(self) -> None:
        self.assertEqual(
            self.refused(b"GET / HTTP/1.1\r\nX: a\rb\r\n\r\n"),
            "bare CR or LF in the request head",
        )

    def test_cr_awaiting_its_lf_is_not_refused(self) -> None:
        conn = _Connection(self, self.site)
        conn.send(b"GET / HTTP/1.1\r")
        self.assertFalse(conn.closed())
        conn.send(b"\nHost: x\r\n\r\n")
        self.assertIn(b" 200 ", conn.output())

    def chunked(self, body: bytes) -> bytes:
        return (
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + body
        )

    def test_chunk_size_of_33_digits(self) -> None:
        self.assertEqual(
            self.refused(self.chunked(b"1" * 33 + b"\r\n")),
            "chunk size has more than 16 hex digits",
        )

    def test_chunk_size_not_hex(self) -> None:
        self.assertEqual(
            self.refused(self.chunked(b"5x\r\nhello\r\n0\r\n\r\n")),
            "chunk size is not hexadecimal",
        )

    def test_chunk_size_line_with_bare_cr(self) -> None:
        self.assertEqual(
            self.refused(self.chunked(b"5\rhello")),
            "bare CR or LF in a chunk-size line",
        )

    def test_chunk_not_ended_by_crlf(self) -> None:
        self.assertEqual(
            self.refused(self.chunked(b"5\r\nhelloXX")),
            "chunk data not followed by CRLF",
        )

    def test_chunked_body_served(self) -> None:
        conn = _Connection(self, self.site)
        conn.send(self.chunked(b"5;a=b\r\nhello\r\n"))
        conn.send(b"1\r\n!\r\n0\r\n\r\n")
        self.assertTrue(conn.output().endswith(b"got hello!"), conn.output())

    def test_malformed_header_400_in_dialect(self) -> None:
        """twisted.web's own refusals get a body in the dialect too."""
        self.assertEqual(
            self.refused(b"GET / HTTP/1.1\r\nno colon here\r\n\r\n"),
            "malformed request head",
        )

    def test_malformed_request_line(self) -> None:
        self.assertEqual(self.refused(b"GARBAGE\r\n\r\n"), "malformed request head")


class _Recorder(Resource):
    """Answers every request with what it received, and keeps it."""

    isLeaf = True

    def __init__(self) -> None:
        Resource.__init__(self)
        self.seen: list[tuple[object, ...]] = []

    def render(self, request: Any) -> bytes:
        assert request.content is not None
        body = request.content.read()
        self.seen.append(
            (
                request.method,
                request.uri,
                request.clientproto,
                list(request.requestHeaders.getAllRawHeaders()),
                body,
            )
        )
        return b"got " + body


_DEFECTS = (
    "lead",
    "method",
    "target",
    "long target",
    "version",
    "separator",
    "line end",
    "value",
    "long value",
    "name",
    "folded",
    "many",
    "length",
    "two lengths",
    "transfer",
    "expect",
    "close",
    "cookie",
    "next",
)
"""What L{_requests} may do to a well-formed request, at most twice."""


@st.composite
def _requests(draw: st.DrawFn) -> bytes:
    """
    Bytes a client may send: a well-formed request with a body, or one with
    one or two L{_DEFECTS}, each drawn where it lands (the limits' edges
    among them: L{LIMITS} allows a 100-byte request line, 200 bytes and
    5 fields of headers).
    """
    body = draw(st.sampled_from([b"", b"hello"]))
    method, target, version = b"POST", b"/api/chat", b"HTTP/1.1"
    lead, blank, tail = b"", b"\r\n", b""
    headers = [[b"Host", b": ", b"x", b"\r\n"]]
    headers.append([b"Content-Type", b": ", b"application/json", b"\r\n"])
    headers.append([b"Content-Length", b": ", b"%d" % len(body), b"\r\n"])
    some = st.integers(0, 10)

    def pick() -> list[bytes]:
        field: list[bytes] = headers[draw(some) % len(headers)]
        return field

    for defect in draw(st.lists(st.sampled_from(_DEFECTS), max_size=2)):
        if defect == "lead":
            lead = b"\r\n"
        elif defect == "method":
            method = draw(st.sampled_from([b"GET", b"get", b"P@ST", b""]))
        elif defect == "target":
            target = draw(
                st.sampled_from(
                    [b"/a?x=1&y", b"*", b"http://h/p", b"/a b", b"/\x00", b""]
                )
            )
        elif defect == "long target":
            target = b"/" + b"a" * draw(st.integers(80, 90))  # the line: 13 more
        elif defect == "version":
            version = draw(st.sampled_from([b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 "]))
        elif defect == "separator":
            pick()[1] = draw(st.sampled_from([b":", b":\t", b" :", b"", b":  "]))
        elif defect == "line end":
            end = draw(st.sampled_from([b"\n", b"\r", b"\r\r\n"]))
            if draw(st.booleans()):
                blank = end
            else:
                pick()[3] = end
        elif defect == "value":
            pick()[2] = draw(
                st.sampled_from([b"a\rb", b"a\nb", b"a\x00b", b" s \t", b"", b"\t"])
            )
        elif defect == "long value":
            # the fields before: 52 bytes and up
            pick()[2] = b"v" * draw(st.integers(130, 160))
        elif defect == "name":
            pick()[0] = draw(
                st.sampled_from(
                    [
                        b"Bad Name",
                        b"",
                        b" Folded",
                        b"\tTab",
                        b"X\x00",
                        b"x-a",
                        b"content-length",
                        b"HOST",
                        b"Te",
                    ]
                )
            )
        elif defect == "folded":
            headers.insert(
                draw(some) % len(headers) + 1, [b"", b"", b" folded", b"\r\n"]
            )
        elif defect == "many":
            while len(headers) < draw(st.integers(4, 7)):
                headers.append([b"X-A", b": ", b"a", b"\r\n"])
        elif defect == "length":
            headers[2][2] = draw(st.sampled_from([b"0", b"3", b"-1", b"1x", b"", b"9"]))
        elif defect == "two lengths":
            headers.append(list(headers[2]))
        elif defect == "transfer":
            coding = draw(st.sampled_from([b"chunked", b"identity", b"gzip"]))
            headers.append([b"Transfer-Encoding", b": ", coding, b"\r\n"])
            if coding == b"chunked" and draw(st.booleans()):
                del headers[2]
                body = b"5\r\nhello\r\n0\r\n\r\n"
        elif defect == "expect":
            headers.append([b"Expect", b": ", b"100-continue", b"\r\n"])
        elif defect == "close":
            headers.append([b"Connection", b": ", b"close", b"\r\n"])
        elif defect == "cookie":
            headers.append([b"Cookie", b": ", b"a=b", b"\r\n"])
        else:  # "next"
            tail = draw(st.sampled_from([b"GET /next HTTP/1.1\r\n\r\n", b"GET"]))
    line = b" ".join([method, target, version])
    return b"".join([lead, line, b"\r\n", *map(b"".join, headers), blank, body, tail])


class WholeHeadTests(SynchronousTestCase):
    """
    A head that arrives whole in one read is taken in one piece
    (C{_whole_head}), with what twisted.web's line-at-a-time parsing and
    the channel's per-line checks make of it.
    """

    def served(self, pieces: list[bytes]) -> tuple[bytes, bool, list[object]]:
        recorder = _Recorder()
        conn = _Connection(self, _facade_site(Clock(), resource=recorder))
        for piece in pieces:
            conn.send(piece)
        return conn.output(), conn.closed(), list(recorder.seen)

    @settings(max_examples=600)
    @given(_requests())
    def test_same_as_line_at_a_time(self, data: bytes) -> None:
        """
        The same answers, the same requests seen by the resource (method,
        target, version, headers in order, body) and the same connection
        state as when the head comes a byte and then the rest, which
        twisted.web parses a line at a time; and the same for a request
        that follows in a read of its own (whole, or a byte and the rest).
        """
        again = b"GET /again HTTP/1.1\r\nHost: y\r\n\r\n"
        whole = self.served([data, again])
        split = self.served([data[:1], data[1:], again[:1], again[1:]])
        self.assertEqual(whole, split)
        # the rest of a head after a read that ended with a line
        line = data.find(b"\r\n") + 2
        if line > 1:
            self.assertEqual(self.served([data[:line], data[line:], again]), split)

    def test_taken_in_one_piece(self) -> None:
        """
        No line of a whole head goes through C{lineReceived}; one split
        over reads does, and both are served alike.
        """
        lines: list[bytes] = []
        recorder = _Recorder()
        conn = _Connection(self, _facade_site(Clock(), resource=recorder))
        original = conn.channel.lineReceived

        def line_received(line: bytes) -> None:
            lines.append(line)
            original(line)

        conn.channel.lineReceived = line_received
        head = b"POST /p?q=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nX-A: a \r\n"
        conn.send(head + b"\r\nhi")
        self.assertEqual(lines, [])
        conn.send(head)
        conn.send(b"\r\nhi")
        self.assertEqual(len(lines), 5)
        expected = (
            b"POST",
            b"/p?q=1",
            b"HTTP/1.1",
            [(b"Host", [b"x"]), (b"Content-Length", [b"2"]), (b"X-A", [b"a"])],
            b"hi",
        )
        self.assertEqual(recorder.seen, [expected, expected])
        self.assertEqual(conn.output().count(b"got hi"), 2)

    def test_rest_of_a_head_is_not_a_request(self) -> None:
        """
        A read that completes a head begun in the read before is the rest
        of that head, even when it looks like a whole request: here a line
        without a colon, refused.
        """
        recorder = _Recorder()
        conn = _Connection(self, _facade_site(Clock(), resource=recorder))
        conn.send(b"POST / HTTP/1.1\r\n")
        conn.send(b"GET /x HTTP/1.1\r\n\r\n")
        self.assertEqual(recorder.seen, [])
        self.assertEqual(conn.refusal()[0], 400)

    def test_no_form_parsed(self) -> None:
        """
        A form body reaches the resource as it came, and only the query
        becomes arguments; the headers keep the client's order.
        """
        seen: list[tuple[object, ...]] = []

        class Args(_Recorder):
            def render(self, request: Any) -> bytes:
                seen.append((request.args, request.path))
                return _Recorder.render(self, request)

        recorder = Args()
        conn = _Connection(self, _facade_site(Clock(), resource=recorder))
        conn.send(
            b"POST /f?x=1&x=2&y= HTTP/1.1\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\n"
            b"Content-Length: 7\r\nHost: h\r\n\r\na=b&c=d"
        )
        self.assertEqual(seen, [({b"x": [b"1", b"2"], b"y": [b""]}, b"/f")])
        self.assertEqual(
            recorder.seen[0][3],
            [
                (b"Content-Type", [b"application/x-www-form-urlencoded"]),
                (b"Content-Length", [b"7"]),
                (b"Host", [b"h"]),
            ],
        )
        self.assertEqual(recorder.seen[0][4], b"a=b&c=d")

    def test_restarts_the_idle_timeout(self) -> None:
        """
        A whole head is a read like any other: the idle timeout runs from
        it while the body is awaited.
        """
        clock = Clock()
        conn = _Connection(self, _facade_site(clock))
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        clock.advance(4)  # idle_timeout is 5
        conn.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n")
        clock.advance(4)
        self.assertFalse(conn.closed())
        conn.send(b"hi")
        self.assertTrue(conn.output().endswith(b"got hi"))
        clock.advance(4.9)
        self.assertFalse(conn.closed())
        clock.advance(0.1)
        self.assertTrue(conn.closed())

    def test_first_request_of_a_connection(self) -> None:
        """A connection's first head is taken whole too (its deadline is
        armed from the connection, before any byte)."""
        lines: list[bytes] = []
        conn = _Connection(self, _facade_site(Clock()))
        original = conn.channel.lineReceived
        conn.channel.lineReceived = lambda line: (lines.append(line), original(line))
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(lines, [])
        self.assertTrue(conn.output().endswith(b"ok"))


class ChunkSizeErrorTests(SynchronousTestCase):
    """
    L{_chunk_size_error} on partial and complete chunk-size lines.
    """

    def test_accepted(self) -> None:
        for line, complete in [
            (b"", False),
            (b"5", False),
            (b"5\r", False),
            (b"5", True),
            (b"f" * 16, True),
            (b"5;name=value", True),
            (b"5;na", False),
        ]:
            self.assertIsNone(_chunk_size_error(line, complete), (line, complete))

    def test_refused(self) -> None:
        for line, complete in [
            (b"", True),
            (b"\r", False),
            (b"f" * 17, False),
            (b"5 ", False),
            (b"-5", True),
            (b"0x5", True),
            (b"5\rx", False),
            (b"5;a\nb", False),
        ]:
            self.assertIsNotNone(_chunk_size_error(line, complete), (line, complete))


class ServiceLimitsTests(SynchronousTestCase):
    """
    The limits from the config reach every facade site and the admin site.
    """

    def test_config_limits_reach_the_sites(self) -> None:
        config = service_config(
            self,
            '[admin]\nlisten = "127.0.0.1:28010"\n'
            "[engines.ollama]\nport = 21435\n"
            '[limits]\nheader_timeout = "3s"\nidle_timeout = "7s"\n'
            'max_request_line = "1KiB"\nmax_header_bytes = "2KiB"\n'
            "max_header_count = 9\n",
        )
        expected = ClientLimits(
            header_timeout=3.0,
            idle_timeout=7.0,
            max_request_line=1024,
            max_header_bytes=2048,
            max_header_count=9,
        )
        proxy = build(config, MemoryReactorClock(), hostname="ignored")
        self.assertTrue(proxy.sites)
        for site in proxy.sites.values():
            self.assertEqual(site.limits, expected)
        admin = proxy.admin._factory
        self.assertIsInstance(admin, GuardedSite)
        self.assertNotIsInstance(admin, FacadeSite)
        self.assertEqual(admin.limits, expected)
        self.assertEqual(admin.timeOut, 7.0)

    def test_defaults(self) -> None:
        self.assertEqual(
            ClientLimits(),
            ClientLimits(
                header_timeout=30.0,
                idle_timeout=60.0,
                max_request_line=8192,
                max_header_bytes=65536,
                max_header_count=100,
            ),
        )


class _Server(Protocol):
    """The server's half of a loopback connection, handed to the test."""

    def __init__(self, made: Deferred[Protocol]) -> None:
        self._made = made

    def connectionMade(self) -> None:
        self._made.callback(self)


class _Reader(Protocol):
    def __init__(self) -> None:
        self.data = b""
        self.closed: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.closed.callback(None)


async def _received(reader: _Reader, size: int) -> bytes:
    """What C{reader} got once it has C{size} bytes (a bounded wait)."""
    for _ in range(200):
        if len(reader.data) >= size:
            break
        await deferLater(reactor, 0.005, lambda: None)
    return reader.data


def _sent_at_once(test: TestCase, transport: Any) -> None:
    """Nothing of C{transport}'s is queued, and it is not watched for writability."""
    test.assertEqual((transport.dataBuffer, transport._tempDataLen), (b"", 0))
    # Not registered for writability: no poll round, no epoll_ctl.
    test.assertNotIn(transport, reactor.getWriters())  # type: ignore[attr-defined]


class SendNowTests(TestCase):
    """
    L{send_now}: on a plain TCP connection with nothing queued, bytes go to
    the socket in the call; otherwise they take Twisted's queue.
    """

    async def connection(self) -> tuple[Any, _Reader]:
        made: Deferred[Protocol] = Deferred()
        factory = ServerFactory.forProtocol(lambda: _Server(made))
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")  # type: ignore[attr-defined]
        self.addCleanup(port.stopListening)
        reader = _Reader()
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        await connectProtocol(endpoint, reader)
        server = await made
        transport = server.transport

        async def close() -> None:
            transport.loseConnection()
            await reader.closed

        self.addCleanup(lambda: Deferred.fromCoroutine(close()))
        return transport, reader

    async def test_sent_in_the_call(self) -> None:
        transport, reader = await self.connection()
        self.assertTrue(send_now(transport, b"hello"))
        _sent_at_once(self, transport)
        self.assertEqual(await _received(reader, 5), b"hello")

    async def test_queued_bytes_go_first(self) -> None:
        transport, reader = await self.connection()
        transport.write(b"first ")
        self.assertFalse(send_now(transport, b"second"))
        transport.write(b"second")
        self.assertEqual(await _received(reader, 12), b"first second")

    async def test_what_the_socket_does_not_take_is_queued(self) -> None:
        transport, reader = await self.connection()
        transport.writeSomeData = lambda data: 3
        self.assertTrue(send_now(transport, b"abcdefgh"))
        self.assertEqual(transport._tempDataBuffer, [b"defgh"])
        del transport.writeSomeData
        self.assertEqual(await _received(reader, 5), b"defgh")

    async def test_lost_connection_takes_the_queue(self) -> None:
        transport, reader = await self.connection()
        transport.writeSomeData = lambda data: ConnectionLost()
        self.assertFalse(send_now(transport, b"abc"))

    async def test_closing_connection_takes_the_queue(self) -> None:
        """
        Bytes held through a read that also closed the connection (an
        HTTP/1.0 answer) are queued, and still leave before the close.
        """
        transport, reader = await self.connection()
        transport.loseConnection()
        self.assertFalse(send_now(transport, b"late"))
        transport.write(b"late")
        await reader.closed
        self.assertEqual(reader.data, b"late")

    async def test_aborted_connection_takes_the_queue(self) -> None:
        transport, reader = await self.connection()
        transport.abortConnection()
        self.assertFalse(send_now(transport, b"late"))

    def test_other_transports(self) -> None:
        """A transport that is neither TCP nor TLS over TCP is never written here."""
        self.assertFalse(send_now(StringTransport(), b"x"))


class _Socket:
    """A connection's socket whose C{sendmsg} takes what C{take} says (a
    count, or an error to raise), recording the pieces it was handed."""

    def __init__(self, real: Any, take: int | OSError | None) -> None:
        self._real = real
        self._take = take
        self.handed: list[list[bytes]] = []

    def sendmsg(self, pieces: list[bytes]) -> int:
        self.handed.append(list(pieces))
        if isinstance(self._take, OSError):
            raise self._take
        if self._take is None:
            sent: int = self._real.sendmsg(pieces)
            return sent
        return self._take

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class SendGatheredTests(TestCase):
    """
    L{send_gathered}: pieces that come to L{GATHER_AT} bytes or more go to
    a plain TCP connection's socket as they are, in one call, when nothing
    is queued; what the socket does not take is queued in order.
    """

    connection = SendNowTests.connection
    pieces = [b"5000\r\n", b"x" * 0x5000, b"\r\n", b"0\r\n\r\n"]
    whole = b"".join(pieces)

    def socket(self, transport: Any, take: int | OSError | None) -> _Socket:
        fake = _Socket(transport.socket, take)
        real = transport.socket
        transport.socket = fake

        def put_back() -> None:
            transport.socket = real

        self.addCleanup(put_back)
        return fake

    async def test_sent_in_the_call_unjoined(self) -> None:
        transport, reader = await self.connection()
        socket = self.socket(transport, None)
        self.assertTrue(send_gathered(transport, self.pieces))
        self.assertEqual(socket.handed, [self.pieces])
        _sent_at_once(self, transport)
        self.assertEqual(await _received(reader, len(self.whole)), self.whole)

    async def test_small_pieces_are_joined(self) -> None:
        transport, reader = await self.connection()
        socket = self.socket(transport, None)
        small = [b"a" * (GATHER_AT // 2), b"b" * (GATHER_AT // 2 - 1)]
        self.assertFalse(send_gathered(transport, small))
        self.assertEqual(socket.handed, [])

    async def test_queued_bytes_go_first(self) -> None:
        transport, reader = await self.connection()
        transport.write(b"first ")
        socket = self.socket(transport, None)
        self.assertFalse(send_gathered(transport, self.pieces))
        self.assertEqual(socket.handed, [])

    async def test_what_the_socket_does_not_take_is_queued(self) -> None:
        """Cut inside a piece, at a piece's end, or before the first byte."""
        for sent in (3, 7, 7 + 0x5000 + 1, 7 + 0x5000 + 2, 0):
            transport, reader = await self.connection()
            socket = self.socket(transport, sent)
            self.assertTrue(send_gathered(transport, self.pieces))
            queued = b"".join(transport._tempDataBuffer)
            self.assertEqual(queued, self.whole[sent:], sent)
            self.assertEqual(len(socket.handed), 1)

    async def test_a_full_socket_queues_it_all(self) -> None:
        transport, reader = await self.connection()
        self.socket(transport, BlockingIOError(errno.EAGAIN, "full"))
        self.assertTrue(send_gathered(transport, self.pieces))
        self.assertEqual(b"".join(transport._tempDataBuffer), self.whole)
        transport.socket = transport.socket._real
        self.assertEqual(await _received(reader, len(self.whole)), self.whole)

    async def test_lost_connection_takes_the_queue(self) -> None:
        transport, reader = await self.connection()
        self.socket(transport, BrokenPipeError(errno.EPIPE, "gone"))
        self.assertFalse(send_gathered(transport, self.pieces))
        self.assertEqual(transport._tempDataBuffer, [])

    def test_other_transports(self) -> None:
        self.assertFalse(send_gathered(StringTransport(), self.pieces))


class HoldTests(TestCase):
    """
    L{hold} and L{release}: what is written to an idle connection during a
    call leaves in one send at its end, with no poll round; a connection with
    something queued keeps Twisted's path.
    """

    connection = SendNowTests.connection

    async def test_held_then_sent_in_one_piece(self) -> None:
        transport, reader = await self.connection()
        held = hold(transport)
        assert held is not None
        transport.write(b"head ")
        transport.writeSequence([b"and ", b"body"])
        self.assertEqual(held.data, [b"head ", b"and ", b"body"])
        self.assertEqual(transport._tempDataLen, 0)
        release(transport, held)
        # The class's write is back, nothing queued, no writability watch.
        self.assertNotIn("write", vars(transport))
        self.assertNotIn("writeSequence", vars(transport))
        _sent_at_once(self, transport)
        self.assertEqual(await _received(reader, 13), b"head and body")

    async def test_nothing_held_nothing_sent(self) -> None:
        transport, reader = await self.connection()
        held = hold(transport)
        assert held is not None
        release(transport, held)
        transport.write(b"later")
        self.assertEqual(await _received(reader, 5), b"later")

    async def test_queued_connection_not_held(self) -> None:
        transport, reader = await self.connection()
        transport.write(b"first ")
        self.assertIsNone(hold(transport))
        transport.write(b"second")
        self.assertEqual(await _received(reader, 12), b"first second")

    def test_other_transports_not_held(self) -> None:
        transport = StringTransport()
        self.assertIsNone(hold(transport))
        self.assertNotIn("write", vars(transport))

    async def test_upstream_request_sent_in_the_call(self) -> None:
        """
        nvproxy's client protocol sends a request's head and body in one
        send inside C{request}, not at the next poll.
        """
        from twisted.web._newclient import Request as ClientRequest

        from nvproxy.proxy.upstream import BytesProducer, _ClientProtocol

        transport, reader = await self.connection()
        protocol = _ClientProtocol(lambda p: None)  # type: ignore[no-untyped-call]
        protocol.makeConnection(transport)
        sends: list[bytes] = []
        original = transport.writeSomeData

        def spy(data: bytes) -> object:
            sends.append(data)
            return original(data)

        transport.writeSomeData = spy
        request = ClientRequest(
            b"POST", b"/api/chat", Headers({b"host": [b"x"]}), BytesProducer(b"{}")
        )
        protocol.request(request)
        self.assertEqual(len(sends), 1)
        self.assertTrue(sends[0].startswith(b"POST /api/chat HTTP/1.1\r\n"))
        self.assertTrue(sends[0].endswith(b"\r\n\r\n{}"))
        self.assertNotIn(transport, reactor.getWriters())  # type: ignore[attr-defined]
        self.assertEqual(await _received(reader, len(sends[0])), sends[0])
        protocol.abort()


class TurnTests(TestCase):
    """
    L{Turn}: the first request of a reactor turn leaves at once, the others
    of the same turn take Twisted's queue (sent together at the next poll).
    """

    connection = SendNowTests.connection

    def test_one_per_turn(self) -> None:
        clock = Clock()
        turn = Turn(clock)
        self.assertTrue(turn.available)
        turn.use()
        turn.use()
        self.assertFalse(turn.available)
        self.assertEqual(len(clock.getDelayedCalls()), 1)
        clock.advance(0)
        self.assertTrue(turn.available)

    async def test_second_of_a_turn_queued(self) -> None:
        from twisted.web._newclient import Request as ClientRequest

        from nvproxy.proxy.upstream import BytesProducer, _ClientProtocol

        clock = Clock()
        turn = Turn(clock)
        connections = [await self.connection() for _ in range(3)]
        protocols = []
        for transport, _ in connections:
            protocol = _ClientProtocol(lambda p: None, turn)
            protocol.makeConnection(transport)
            protocols.append(protocol)

        def request() -> ClientRequest:
            headers = Headers({b"host": [b"x"]})
            return ClientRequest(b"POST", b"/", headers, BytesProducer(b"{}"))

        first, second, third = (transport for transport, _ in connections)
        protocols[0].request(request())
        protocols[1].request(request())
        self.assertEqual(first._tempDataLen, 0)  # sent in the call
        self.assertGreater(second._tempDataLen, 0)  # queued for the poll
        self.assertIn(second, reactor.getWriters())  # type: ignore[attr-defined]
        clock.advance(0)  # the next turn
        protocols[2].request(request())
        self.assertEqual(third._tempDataLen, 0)
        for (_, reader), protocol in zip(connections, protocols, strict=True):
            data = await _received(reader, 10)
            self.assertTrue(data.startswith(b"POST / HTTP/1.1\r\n"))
            self.assertTrue(data.endswith(b"{}"))
            protocol.abort()


class _TLSEcho(Protocol):
    """The server's half of a TLS connection, handed to the test."""

    def __init__(self, made: Deferred[Protocol]) -> None:
        self._made = made
        self.data = b""

    def connectionMade(self) -> None:
        self._made.callback(self)

    def dataReceived(self, data: bytes) -> None:
        self.data += data


class TLSSendNowTests(TestCase):
    """
    L{send_now} and L{hold} over TLS (a peer's connection): the records go to
    the socket in the call, with no poll round, and arrive intact.
    """

    async def connection(self) -> tuple[Any, _Reader]:
        from twisted.internet.endpoints import wrapClientTLS
        from twisted.internet.protocol import Factory

        from nvproxy.cluster import ClientTLS, ClusterState, Peer, ServerTLS
        from nvproxy.proxy.listener import tls_personality
        from tests.test_cluster import make_dir

        server_dir, client_dir = make_dir(self, "node-a"), make_dir(self, "node-b")
        server_id, client_id = server_dir.identity(), client_dir.identity()
        assert server_id is not None and client_id is not None
        pin = Peer("node-b", "127.0.0.1", client_id.fingerprint)
        state = ClusterState(server_id, (pin,))
        made: Deferred[Protocol] = Deferred()
        factory = tls_personality(
            ServerTLS(lambda: state),
            Factory.forProtocol(lambda: _TLSEcho(made)),
            reactor,
        )
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")  # type: ignore[attr-defined]
        self.addCleanup(port.stopListening)
        endpoint = wrapClientTLS(
            ClientTLS(client_id, "node-a", server_dir.fingerprint()),
            TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port),
        )
        reader = _Reader()
        await connectProtocol(endpoint, reader)
        # The server's side exists once the handshake has been made.
        reader.transport.write(b"x")  # type: ignore[union-attr]
        server = await made
        tls = server.transport
        # The handshake done, and what it wrote (TLS 1.3 session tickets
        # follow it) gone to the socket: an idle connection.
        tcp = tls.transport  # type: ignore[union-attr]
        for _ in range(400):
            if tls._handshakeDone and not (tcp._tempDataLen or tcp.dataBuffer):  # type: ignore[union-attr]
                break
            await deferLater(reactor, 0.005, lambda: None)

        async def close() -> None:
            tls.loseConnection()  # type: ignore[union-attr]
            await reader.closed

        self.addCleanup(lambda: Deferred.fromCoroutine(close()))
        self.server = server
        return tls, reader

    async def test_sent_in_the_call(self) -> None:
        tls, reader = await self.connection()
        tcp = tls.transport
        self.assertTrue(send_now(tls, b"hello over tls"))
        self.assertNotIn("write", vars(tcp))
        _sent_at_once(self, tcp)
        self.assertEqual(await _received(reader, 14), b"hello over tls")

    async def test_large_write_in_order(self) -> None:
        """More than one TLS record, the socket taking part of it."""
        tls, reader = await self.connection()
        tcp = tls.transport
        original = tcp.writeSomeData
        tcp.writeSomeData = lambda data: original(data[:1000])
        data = bytes(range(256)) * 300  # 76,800 bytes: five records
        self.assertTrue(send_now(tls, data))
        del tcp.writeSomeData
        self.assertEqual(await _received(reader, len(data)), data)

    async def test_held_then_sent(self) -> None:
        tls, reader = await self.connection()
        held = hold(tls)
        assert held is not None
        tls.write(b"head ")
        tls.writeSequence([b"body"])
        release(tls, held)
        self.assertNotIn(tls.transport, reactor.getWriters())  # type: ignore[attr-defined]
        self.assertEqual(await _received(reader, 9), b"head body")

    async def test_client_tls_keeps_its_own_write(self) -> None:
        """
        Twisted's client TLS keeps its C{write} on the instance (it gathers
        small writes until the next turn): holding puts it back, and what it
        gathered goes ahead of what is sent at once.  Deleting it sent a
        request's body ahead of its gathered head.
        """
        tls, reader = await self.connection()
        client: Any = reader.transport
        own = vars(client)["write"]
        held = hold(client)
        assert held is not None
        client.write(b"first ")
        release(client, held)
        self.assertIs(vars(client)["write"], own)
        self.assertNotIn("writeSequence", vars(client))
        client.writeSequence([b"head "])  # gathered for the next turn
        client.write(b"body ")
        self.assertTrue(send_now(client, b"now"))
        expected = b"xfirst head body now"
        for _ in range(200):
            if len(self.server.data) >= len(expected):
                break
            await deferLater(reactor, 0.005, lambda: None)
        self.assertEqual(self.server.data, expected)

    async def test_queued_tcp_keeps_the_ordinary_path(self) -> None:
        tls, reader = await self.connection()
        tls.write(b"first ")  # queued on the TCP connection
        self.assertFalse(send_now(tls, b"second"))
        self.assertIsNone(hold(tls))
        tls.write(b"second")
        self.assertEqual(await _received(reader, 12), b"first second")


class _LoadEcho(Resource):
    isLeaf = True

    def render_POST(self, request: Any) -> bytes:
        return b"ok:" + request.content.read()

    def render_GET(self, request: Any) -> bytes:
        return b"got"


class TLSUpstreamLoadTests(TestCase):
    """
    nvproxy's upstream agent over TLS (the hop to a peer) with many requests
    in flight on kept-alive connections and polls among them: every request
    arrives whole and in order, whichever way each one was written (at
    once, gathered by Twisted's TLS, or queued).
    """

    timeout = 60

    async def test_every_request_arrives_whole(self) -> None:
        from nvproxy.cluster import ClientTLS, ClusterState, Peer, ServerTLS
        from nvproxy.proxy.listener import tls_personality
        from nvproxy.proxy.upstream import BytesProducer, Upstream
        from tests.test_cluster import make_dir

        server_dir, client_dir = make_dir(self, "node-a"), make_dir(self, "node-b")
        server_id, client_id = server_dir.identity(), client_dir.identity()
        assert server_id is not None and client_id is not None
        state = ClusterState(
            server_id, (Peer("node-b", "127.0.0.1", client_id.fingerprint),)
        )
        factory = tls_personality(ServerTLS(lambda: state), Site(_LoadEcho()), reactor)
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")  # type: ignore[attr-defined]
        self.addCleanup(port.stopListening)
        creator = ClientTLS(client_id, "node-a", server_dir.fingerprint())
        upstream = Upstream(reactor, 5.0, tls_for=lambda host, port: creator)
        self.addCleanup(upstream.close)
        base = f"https://127.0.0.1:{port.getHost().port}"
        wrong: list[object] = []

        async def worker(n: int) -> None:
            for i in range(15):
                body = b'{"worker": %d, "request": %d}' % (n, i)
                response = await upstream.agent.request(
                    b"POST",
                    f"{base}/api/chat".encode(),
                    Headers({b"content-type": [b"application/json"]}),
                    BytesProducer(body),
                )
                got = await readBody(response)
                if (response.code, got) != (200, b"ok:" + body):
                    wrong.append((response.code, got))

        async def poller() -> None:
            for _ in range(30):
                response = await upstream.treq.get(f"{base}/api/tags")
                if await response.content() != b"got":
                    wrong.append("poll")

        work = [Deferred.fromCoroutine(worker(n)) for n in range(32)]
        work.append(Deferred.fromCoroutine(poller()))
        await gatherResults(work)
        self.assertEqual(wrong, [])


class CorkTests(TestCase):
    """
    L{nvproxy.proxy.cork}: while an upstream read is handled, a facade
    channel holds what it writes, head included, and writes it in one piece
    at the end of the read (or before a close), in order.
    """

    async def connection(self) -> tuple[Any, _Reader]:
        """A facade channel on a loopback connection, and its client."""
        site = _facade_site(Clock())
        port = reactor.listenTCP(0, site, interface="127.0.0.1")  # type: ignore[attr-defined]
        self.addCleanup(port.stopListening)
        reader = _Reader()
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        await connectProtocol(endpoint, reader)
        for _ in range(200):
            if site.channels:
                break
            await deferLater(reactor, 0.005, lambda: None)
        (channel,) = site.channels

        async def close() -> None:
            if channel.transport is not None:
                channel.transport.loseConnection()
            await reader.closed

        self.addCleanup(lambda: Deferred.fromCoroutine(close()))
        return channel, reader

    def sends(self, transport: Any) -> list[bytes]:
        """What C{transport} hands its socket, one entry per send."""
        sent: list[bytes] = []
        send = transport.writeSomeData

        def record(data: bytes) -> Any:
            sent.append(bytes(data))
            return send(data)

        self.patch(transport, "writeSomeData", record)
        return sent

    async def test_finished_answer_leaves_before_the_read_ends(self) -> None:
        """
        An answer finished inside an upstream read is sent when it is
        finished, in one piece, before what its end sets off (here a
        C{notifyFinish} callback) runs and before the read is over; what is
        written later in the read goes at its end.
        """
        channel, reader = await self.connection()
        sent = self.sends(channel.transport)
        seen: list[list[bytes]] = []
        request = FacadeRequest(channel)
        request.method, request.clientproto, request.uri = b"GET", b"HTTP/1.1", b"/"
        channel.requests.append(request)
        request.notifyFinish().addCallback(lambda _: seen.append(list(sent)))

        def read(data: bytes) -> None:
            request.write(data)  # chunked: whole at its end
            self.assertEqual(sent, [])
            request.finish()
            self.assertEqual(len(sent), 1)
            channel.write(b"later")
            self.assertEqual(len(sent), 1)

        CORK.during(read, b"answer")
        self.assertEqual(len(seen), 1)
        ((answer,),) = seen
        self.assertTrue(answer.startswith(b"HTTP/1.1 200 OK\r\n"))
        self.assertTrue(answer.endswith(b"\r\n\r\n6\r\nanswer\r\n0\r\n\r\n"))
        self.assertEqual(sent[1:], [b"later"])

    async def answering(self) -> tuple[FacadeRequest, list[bytes]]:
        """A request on a facade channel, and what its socket is handed."""
        channel, reader = await self.connection()
        sent = self.sends(channel.transport)
        request = FacadeRequest(channel)
        request.method, request.clientproto, request.uri = b"GET", b"HTTP/1.1", b"/"
        channel.requests.append(request)
        return request, sent

    async def test_whole_answer_leaves_at_its_last_byte(self) -> None:
        """
        An answer with a C{Content-Length} is sent, head and body in one
        piece, when its last byte is written: before it is finished (what
        the end of the upstream's body sets off), not at the end of the read.
        """
        request, sent = await self.answering()

        def read(data: bytes) -> None:
            request.setHeader(b"content-length", b"%d" % (2 * len(data)))
            request.write(data)
            self.assertEqual(sent, [])  # half of it: held
            request.write(data)
            self.assertEqual(len(sent), 1)
            request.finish()
            self.assertEqual(len(sent), 1)

        CORK.during(read, b"half")
        self.assertTrue(sent[0].startswith(b"HTTP/1.1 200 OK\r\n"))
        self.assertTrue(sent[0].endswith(b"\r\n\r\nhalfhalf"))
        self.assertEqual(len(sent), 1)

    async def test_large_relayed_read_leaves_in_pieces(self) -> None:
        """
        A chunked answer's piece of L{GATHER_AT} bytes or more is held with
        its framing beside it, not copied into it; what is held goes to the
        socket in one call, unjoined, when it comes to L{GATHER_AT} bytes or
        more (a smaller piece framed, and joined when the whole is small).
        """
        for size in (GATHER_AT, GATHER_AT - 1, 100):
            request, sent = await self.answering()
            transport: Any = request.channel.transport
            socket = transport.socket = _Socket(transport.socket, None)
            piece = b"p" * size

            def read(data: bytes, request: FacadeRequest = request) -> None:
                request.write(data)  # the head and the first piece
                request.write(data)  # framed directly
                request.finish()

            CORK.during(read, piece)
            transport.socket = socket._real
            framed = b"%x\r\n%b\r\n" % (size, piece)
            if size == 100:
                self.assertEqual(socket.handed, [])
                (answer,) = sent
            else:
                (handed,) = socket.handed
                self.assertEqual(sent, [])
                answer = b"".join(handed)
                if size == GATHER_AT:
                    self.assertEqual(handed[-3:], [piece, b"\r\n", b"0\r\n\r\n"])
                    self.assertIs(handed[-3], piece)
                else:
                    self.assertEqual(handed[-2:], [framed, b"0\r\n\r\n"])
            head, _, body = answer.partition(b"\r\n\r\n")
            self.assertTrue(head.startswith(b"HTTP/1.1 200 OK\r\n"))
            self.assertEqual(body, framed + framed + b"0\r\n\r\n")

    async def test_other_answers_wait_for_their_end(self) -> None:
        """
        A chunked answer, or one whose C{Content-Length} is not one number,
        is not sent at a write: it is whole only once it is finished.
        """
        for length in (None, [b"4", b"4"], [b"+4"], [b"4 "]):
            request, sent = await self.answering()
            if length is not None:
                request.responseHeaders.setRawHeaders(b"content-length", length)

            def read(
                data: bytes, request: FacadeRequest = request, sent: list[bytes] = sent
            ) -> None:
                request.write(data)
                self.assertEqual(sent, [])

            CORK.during(read, b"four")
            self.assertEqual(len(sent), 1, length)
            self.assertIn(b"four", sent[0])

    async def test_refusal_and_continue_behind_what_is_held(self) -> None:
        """
        A pipelined request parsed inside the read that ended the answer
        before it: its 100 Continue, or its refusal, goes after that answer.
        """
        channel, reader = await self.connection()
        sent = self.sends(channel.transport)

        def read(data: bytes) -> None:
            channel.write(data)
            channel._send100Continue()
            channel._refuse(400, "malformed request head")

        CORK.during(read, b"answer one")
        await reader.closed
        self.assertEqual(sent[0], b"answer one")
        self.assertTrue(sent[1].startswith(b"HTTP/1.1 100 Continue\r\n\r\n"))
        self.assertTrue(reader.data.startswith(b"answer oneHTTP/1.1 100 Continue"))
        self.assertIn(b"HTTP/1.1 400 ", reader.data)

    async def test_held_until_the_read_is_handled(self) -> None:
        channel, reader = await self.connection()
        sent = self.sends(channel.transport)
        headers = Headers({b"content-type": [b"text/plain"]})

        def read(data: bytes) -> None:
            channel.writeHeaders(b"HTTP/1.1", b"200", b"OK", headers)
            channel.writeSequence([b"5\r\n", data, b"\r\n"])
            channel.write(b"0\r\n\r\n")
            self.assertEqual(sent, [])
            self.assertEqual(channel.transport._tempDataBuffer, [])

        CORK.during(read, b"hello")
        answer = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n"
            b"5\r\nhello\r\n0\r\n\r\n"
        )
        # One send, in the call: nothing queued, no poll round.
        self.assertEqual(sent, [answer])
        self.assertNotIn(channel.transport, reactor.getWriters())  # type: ignore[attr-defined]
        self.assertFalse(CORK.active)
        self.assertEqual(await _received(reader, len(answer)), answer)

    async def test_not_held_outside_a_read(self) -> None:
        channel, reader = await self.connection()
        channel.write(b"a")
        channel.writeSequence([b"b", b"c"])
        self.assertEqual(b"".join(channel.transport._tempDataBuffer), b"abc")
        self.assertEqual(await _received(reader, 3), b"abc")

    async def test_behind_what_is_queued(self) -> None:
        channel, reader = await self.connection()
        channel.transport.write(b"queued ")
        CORK.during(channel.write, b"held")
        self.assertEqual(await _received(reader, 11), b"queued held")

    async def test_every_channel_flushed_even_when_the_read_fails(self) -> None:
        one, one_reader = await self.connection()
        two, two_reader = await self.connection()

        def read(data: bytes) -> None:
            one.write(data)
            two.write(data)
            raise ZeroDivisionError

        self.assertRaises(ZeroDivisionError, CORK.during, read, b"x")
        self.assertFalse(CORK.active)
        self.assertEqual(await _received(one_reader, 1), b"x")
        self.assertEqual(await _received(two_reader, 1), b"x")

    async def test_nested_read_leaves_the_flush_to_the_outer(self) -> None:
        channel, reader = await self.connection()
        sent = self.sends(channel.transport)

        def outer(data: bytes) -> None:
            CORK.during(channel.write, b"inner ")
            self.assertEqual(sent, [])
            channel.write(data)

        CORK.during(outer, b"outer")
        self.assertEqual(sent, [b"inner outer"])

    async def test_answer_that_closes_its_connection(self) -> None:
        """
        An answer that closes its connection inside the read (HTTP/1.0,
        C{Connection: close}) is held past that close and still sent whole
        before it.
        """
        channel, reader = await self.connection()
        CORK.during(channel.dataReceived, b"GET / HTTP/1.0\r\n\r\n")
        await reader.closed
        self.assertTrue(reader.data.startswith(b"HTTP/1.0 200 OK\r\n"), reader.data)
        self.assertTrue(reader.data.endswith(b"\r\n\r\nok"), reader.data)

    def tls(self) -> _Connection:
        """A channel on a transport that, like TLS, drops writes once closing."""
        conn = _Connection(self, _facade_site(Clock()))
        conn.transport = _ClosingDrops()
        conn.channel.makeConnection(conn.transport)
        return conn

    def test_held_bytes_go_before_a_close(self) -> None:
        """
        A TLS connection (a peer) drops what is written after its
        C{loseConnection}; an answer that closes its connection inside the
        read has its held bytes written first.
        """
        conn = self.tls()

        def read(data: bytes) -> None:
            conn.channel.writeHeaders(b"HTTP/1.1", b"200", b"OK", Headers())
            conn.channel.write(data)
            self.assertEqual(conn.output(), b"")
            conn.channel.loseConnection()

        CORK.during(read, b"x")
        self.assertEqual(conn.output(), b"HTTP/1.1 200 OK\r\n\r\nx")
        self.assertTrue(conn.transport.disconnecting)

    def test_cut_stream_frame_goes_before_the_close(self) -> None:
        """L{ClientSide.cut} closes the transport itself: held bytes first."""
        conn = self.tls()
        client = ClientSide(_FakeRequest(conn.channel), lambda *args: b"")

        def read(data: bytes) -> None:
            conn.channel.write(data)
            client.cut(b"frame", Clock())

        CORK.during(read, b"part ")
        self.assertEqual(conn.output(), b"part frame")
        self.assertTrue(conn.transport.disconnecting)


class _ClosingDrops(StringTransport):
    def write(self, data: bytes) -> None:
        if not self.disconnecting:
            super().write(data)

    def writeSequence(self, seq: Any) -> None:
        self.write(b"".join(seq))


class _FakeRequest:
    """What L{ClientSide.cut} uses of a request."""

    finished = False

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.responseHeaders = Headers()

    def notifyFinish(self) -> Deferred[None]:
        return Deferred()

    def write(self, data: bytes) -> None:
        self.channel.write(data)


class _Trickler(Protocol):
    """
    Sends a request head one byte per C{interval}, never finishing it; notes
    when its first byte left and when the connection closed.
    """

    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.sent = 0
        self.data = b""
        self.first_byte: float | None = None
        self.closed: Deferred[float] = Deferred()
        self._call: Any = None

    def connectionMade(self) -> None:
        self.first_byte = reactor.seconds()  # type: ignore[attr-defined]
        self._tick()

    def _tick(self) -> None:
        assert self.transport is not None
        self.transport.write(self.head[self.sent : self.sent + 1])
        self.sent += 1
        self._call = reactor.callLater(self.interval, self._tick)  # type: ignore[attr-defined]

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason: Failure | None = None) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self.closed.callback(reactor.seconds())  # type: ignore[attr-defined]


class SlowlorisTests(TestCase):
    """
    Many connections trickling their headers over loopback are all dropped
    at the header deadline while a normal client is still served.

    The default suite holds 200 connections; set C{NVPROXY_SLOWLORIS=1000}
    (or any count) for a bigger run.
    """

    header_timeout = 0.5
    timeout = 60

    def listen(self) -> tuple[IListeningPort, FacadeSite]:
        site = FacadeSite(
            _Echo(),
            error_body=ENGINES["ollama"].error_body,
            max_body=1000,
            max_connections=4096,
            limits=ClientLimits(header_timeout=self.header_timeout),
            reactor=reactor,
        )
        factory = DemuxFactory(site, None, reactor)  # type: ignore[arg-type]
        port = reactor.listenTCP(  # type: ignore[attr-defined]
            0, factory, backlog=4096, interface="127.0.0.1"
        )
        self.addCleanup(port.stopListening)
        return port, site

    async def _normal_client(
        self, url: bytes, stop: Deferred[None], latencies: list[float]
    ) -> None:
        agent = Agent(reactor)
        while not stop.called:
            start = reactor.seconds()  # type: ignore[attr-defined]
            response = await agent.request(b"GET", url)
            body = await readBody(response)
            latencies.append(reactor.seconds() - start)  # type: ignore[attr-defined]
            self.assertEqual((response.code, body), (200, b"ok"))
            await deferLater(reactor, 0.01)

    async def _slowloris(self, count: int) -> None:
        port, site = self.listen()
        address = port.getHost()
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", address.port)
        url = b"http://127.0.0.1:%d/" % address.port

        baseline: list[float] = []
        for _ in range(20):
            await self._normal_client_once(url, baseline)

        tricklers = [_Trickler(0.05) for _ in range(count)]
        await gatherResults(
            [connectProtocol(endpoint, trickler) for trickler in tricklers]
        )
        # Every trickler's first byte has reached the site: measure the
        # normal client while all of them are held.
        for _ in range(500):
            if site.connections >= count:
                break
            await deferLater(reactor, 0.01)
        self.assertEqual(site.connections, count)
        stop: Deferred[None] = Deferred()
        during: list[float] = []
        normal = Deferred.fromCoroutine(self._normal_client(url, stop, during))
        closes = await gatherResults([t.closed for t in tricklers])
        stop.callback(None)
        await normal

        for trickler, closed in zip(tricklers, closes, strict=True):
            assert trickler.first_byte is not None
            held = closed - trickler.first_byte
            # The server's deadline starts when the first byte reaches it,
            # a moment after the client sent it.
            self.assertGreaterEqual(held, self.header_timeout - 0.02)
            self.assertLess(held, self.header_timeout + 10)
            self.assertTrue(trickler.data.startswith(b"HTTP/1.1 408 "), trickler.data)
        self.assertTrue(during)
        for _ in range(20):
            await self._normal_client_once(url, during)
        self.report(count, baseline, during)

    async def _normal_client_once(self, url: bytes, latencies: list[float]) -> None:
        agent = Agent(reactor)
        start = reactor.seconds()  # type: ignore[attr-defined]
        response = await agent.request(b"GET", url)
        body = await readBody(response)
        latencies.append(reactor.seconds() - start)  # type: ignore[attr-defined]
        self.assertEqual((response.code, body), (200, b"ok"))

    def report(self, count: int, baseline: list[float], during: list[float]) -> None:
        def p(values: list[float], q: float) -> float:
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

        line = (
            f"slowloris x{count}: normal client p50/p99 {p(baseline, 0.5):.1f}/"
            f"{p(baseline, 0.99):.1f} ms alone, {p(during, 0.5):.1f}/"
            f"{p(during, 0.99):.1f} ms during ({len(during)} requests)"
        )
        if os.environ.get("NVPROXY_SLOWLORIS_REPORT"):
            with open(os.environ["NVPROXY_SLOWLORIS_REPORT"], "a") as f:
                f.write(line + "\n")

    def test_trickling_connections_dropped_at_the_deadline(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._slowloris(200))

    def test_many_trickling_connections(self) -> Deferred[None]:
        count = int(os.environ.get("NVPROXY_SLOWLORIS", "0"))
        if not count:
            self.skipTest("set NVPROXY_SLOWLORIS=1000 to run")
        return Deferred.fromCoroutine(self._slowloris(count))


class OriginFormTests(SynchronousTestCase):
    """Absolute-form request targets are routed and forwarded as origin-form."""

    def test_forms(self) -> None:
        cases = {
            b"/v1/models": b"/v1/models",
            b"http://x/v1/models": b"/v1/models",
            b"https://x:8000/v1/chat/completions?a=1": b"/v1/chat/completions?a=1",
            b"http://x?a=1": b"/?a=1",
            b"http://x": b"/",
            b"*": b"*",
            b"x:y/z": b"x:y/z",
        }
        for target, expected in cases.items():
            self.assertEqual(origin_form(target), expected, target)


class _Pieces(Resource):
    """Writes its body in pieces, an empty one among them."""

    isLeaf = True

    def render(self, request: Any) -> int:
        for piece in (b"one", b"", b"two" * 100, b"\r\n0\r\n"):
            request.write(piece)
        request.finish()
        return NOT_DONE_YET


class ChunkedWriteTests(SynchronousTestCase):
    """
    L{FacadeRequest.write} frames a chunked body's pieces itself after the
    head: the same bytes as Twisted's C{Request.write}, the same count of
    bytes sent, and no body at all for a HEAD request.
    """

    def answer(self, request_class: Any, head: bytes) -> tuple[bytes, int]:
        site = _facade_site(Clock(), resource=_Pieces())
        site.requestFactory = request_class
        sent: list[int] = []
        original = request_class.finish

        def finish(request: Any) -> None:
            sent.append(request.sentLength)
            original(request)

        self.patch(request_class, "finish", finish)
        conn = _Connection(self, site)
        conn.send(head)
        return conn.output(), sent[0]

    def test_same_as_twisted(self) -> None:
        class Plain(FacadeRequest):
            # never framed directly: its write is not FacadeRequest.write
            def write(self, data: bytes) -> None:
                FacadeRequest.write(self, data)

        for head in (
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET / HTTP/1.0\r\nHost: x\r\n\r\n",
        ):
            ours, theirs = self.answer(FacadeRequest, head), self.answer(Plain, head)
            self.assertEqual(ours, theirs)
        output, sent = self.answer(FacadeRequest, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertTrue(
            output.endswith(
                b"3\r\none\r\n12c\r\n"
                + b"two" * 100
                + b"\r\n5\r\n\r\n0\r\n\r\n0\r\n\r\n"
            )
        )
        self.assertEqual(sent, 3 + 300 + 5)

    def test_direct_decided_without_own_dict(self) -> None:
        """
        A GET's pieces are framed directly after the head, a HEAD's are not
        (its C{write} is Twisted's no-op then, an attribute of its own),
        and deciding so leaves a GET's attributes in its class's shared
        table.
        """
        seen: list[tuple[bytes, bool, bool]] = []

        class Fresh(FacadeRequest):
            """(A class of its own: a table no other test has added to.)"""

            def finish(self) -> None:
                own = sys.implementation.name == "cpython" and keeps_own_dict(self)
                seen.append((self.method, self._notes.chunks_direct, own))
                FacadeRequest.finish(self)

        for head in (
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n",
        ):
            site = _facade_site(Clock(), resource=_Pieces())
            site.requestFactory = Fresh
            conn = _Connection(self, site)
            conn.send(head)
        self.assertEqual(seen[0], (b"GET", True, False))
        self.assertEqual(seen[1][:2], (b"HEAD", False))


class WhenLostTests(SynchronousTestCase):
    """
    L{when_lost}: told when the client goes away before the answer is
    finished, in order, and never once it is finished.
    """

    def request(self) -> Any:
        conn = _Connection(self, _facade_site(Clock()))
        conn.channel.requests.append(FacadeRequest(conn.channel))
        return conn.channel.requests[-1]

    def test_lost_before_the_end(self) -> None:
        request = self.request()
        told: list[object] = []

        def broken(reason: Failure) -> None:
            raise ZeroDivisionError()

        when_lost(request, lambda reason: told.append(("first", reason.type)))
        when_lost(request, broken)
        when_lost(request, lambda reason: told.append(("second", reason.type)))
        request.connectionLost(Failure(ConnectionLost()))
        self.assertEqual(told, [("first", ConnectionLost), ("second", ConnectionLost)])
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.assertIsNone(request._notes.on_lost)

    def test_not_after_the_end(self) -> None:
        request = self.request()
        told: list[object] = []
        when_lost(request, told.append)
        request.finish()
        self.assertIsNone(request._notes.on_lost)
        self.assertEqual(told, [])

    def test_client_side_closed(self) -> None:
        """C{ClientSide.closed} fires when the client is gone, asked before or after."""
        for asked_before in (True, False):
            request = self.request()
            client = ClientSide(request, ENGINES["ollama"].error_body)
            if asked_before:
                closed = client.closed
                self.assertFalse(closed.called)
            request.connectionLost(Failure(ConnectionLost()))
            if not asked_before:
                closed = client.closed
            self.assertTrue(client.gone)
            self.assertTrue(closed.called)
            self.assertIs(client.closed, closed)

    def test_other_requests_use_notify_finish(self) -> None:
        from twisted.web.test.requesthelper import DummyRequest

        request = DummyRequest([b""])
        told: list[object] = []
        when_lost(request, told.append)
        request.processingFailed(Failure(ConnectionLost()))
        self.assertEqual(len(told), 1)


class DefaultHeadersTests(SynchronousTestCase):
    """
    A facade's own answers carry Twisted's Server header and a Date from the
    site's clock (not the wall clock), formatted once a second.
    """

    def _headers(self, site: FacadeSite, path: bytes = b"/") -> dict[bytes, bytes]:
        conn = _Connection(self, site)
        conn.send(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = conn.output().partition(b"\r\n\r\n")
        self.assertEqual(body, b"ok")
        pairs = (line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        return {name.lower(): value for name, value in pairs}

    def test_date_from_the_clock(self) -> None:
        from twisted.web.server import version

        clock = Clock()
        clock.advance(784111777)
        site = _facade_site(clock)
        headers = self._headers(site)
        self.assertEqual(headers[b"date"], b"Sun, 06 Nov 1994 08:49:37 GMT")
        self.assertEqual(headers[b"server"], version)
        clock.advance(0.5)
        self.assertEqual(self._headers(site)[b"date"], b"Sun, 06 Nov 1994 08:49:37 GMT")
        clock.advance(0.5)
        self.assertEqual(self._headers(site)[b"date"], b"Sun, 06 Nov 1994 08:49:38 GMT")

    def test_resource_found_as_twisted_does(self) -> None:
        """The path is split and unquoted for the resource tree as before."""
        seen: list[list[bytes]] = []

        class Record(Resource):
            isLeaf = True

            def render_GET(self, request: Request) -> bytes:
                seen.append(request.postpath)
                return b"ok"

        site = _facade_site(Clock(), resource=Record())
        self._headers(site, b"/a%20b/c")
        self.assertEqual(seen, [[b"a b", b"c"]])


class _Produced(Resource):
    """Answers through a streaming producer, as the relay of a stream does."""

    isLeaf = True

    def render(self, request: Request) -> Any:
        producer = _NoProducer()
        request.registerProducer(producer, True)
        request.write(b"first ")
        request.channel.pauseProducing()  # type: ignore[union-attr]
        request.channel.resumeProducing()  # type: ignore[union-attr]
        request.write(b"second")
        request.unregisterProducer()
        request.finish()
        return NOT_DONE_YET


class _NoProducer:
    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


class ChannelAttributesTests(SynchronousTestCase):
    """
    A facade channel sets no attribute outside L{_CHANNEL_ATTRIBUTES} on
    its common paths, and gets from the class what C{Site.buildProtocol}
    would set on it.
    """

    def test_names_within_the_shared_table(self) -> None:
        clock = Clock()
        root = Resource()
        root.putChild(b"echo", _Echo())
        root.putChild(b"stream", _Produced())
        site = _facade_site(clock, resource=root)
        # More channels than names: every new instance takes one name's room
        # in the class's table, so a name first set now would not fit.
        for _ in range(len(_CHANNEL_ATTRIBUTES) + 10):
            site.buildProtocol(None)
        conn = _Connection(self, site)
        conn.send(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        conn.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        conn.send(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
        conn.send(b"Transfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n")
        conn.send(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        CORK.during(conn.send, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        clock.advance(LIMITS.idle_timeout / 2)
        conn.send(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = conn.output().count(b"HTTP/1.1 200 ")
        self.assertEqual(answers, 6)
        self.assertIn(b"first second", conn.output().replace(b"\r\n6\r\n", b""))
        names = set(vars(conn.channel))
        self.assertEqual(names - set(_CHANNEL_ATTRIBUTES), set())
        self.assertLessEqual(len(_CHANNEL_ATTRIBUTES), 29)
        self.assertEqual(len(set(_CHANNEL_ATTRIBUTES)), len(_CHANNEL_ATTRIBUTES))
        if sys.implementation.name == "cpython":
            # A dict of its own is over 1.2 KB; the shared table's values,
            # seen through vars(), a quarter of that.
            self.assertLess(sys.getsizeof(vars(conn.channel)), 800)

    def test_what_site_build_protocol_sets(self) -> None:
        clock = Clock()
        site = _facade_site(clock)
        channel: Any = site.buildProtocol(None)
        twisted_channel: Any = Site.buildProtocol(site, None)
        for name in ("factory", "site", "requestFactory", "timeOut"):
            self.assertIs(getattr(channel, name), getattr(twisted_channel, name))
        self.assertEqual(channel.callLater, twisted_channel.callLater)
        self.assertEqual(channel.MAX_LENGTH, 201)
        self.assertEqual(channel.totalHeadersSize, 301)
        self.assertEqual(channel.maxHeaders, 6)
        self.assertIsInstance(channel, site.protocol)
        site.requestFactory = Request
        self.assertIs(channel.requestFactory, Request)

    def test_new_limits_for_new_connections(self) -> None:
        site = _facade_site(Clock())
        before: Any = site.buildProtocol(None)
        site.limits = ClientLimits(max_request_line=1000, max_header_bytes=50)
        after: Any = site.buildProtocol(None)
        self.assertEqual(after.MAX_LENGTH, 1001)
        self.assertEqual(after.totalHeadersSize, 1051)
        self.assertEqual(before.MAX_LENGTH, 201)
        self.assertIs(after.site, site)


class _Held(Resource):
    """Writes a first piece and holds the answer open (a stream the client
    leaves)."""

    isLeaf = True

    def render(self, request: Request) -> Any:
        request.write(b"first")
        return NOT_DONE_YET


class RequestAttributesTests(SynchronousTestCase):
    """
    A facade request sets no attribute outside L{_REQUEST_ATTRIBUTES} on
    its common paths, keeps its attributes in its class's shared table,
    and starts as twisted.web's request starts.
    """

    def serve(self, heads: list[bytes]) -> list[FacadeRequest]:
        """Each head on a connection of its own; the requests served."""
        served: list[FacadeRequest] = []
        finish, lost = FacadeRequest.finish, FacadeRequest.connectionLost

        def finishing(request: FacadeRequest) -> None:
            served.append(request)
            finish(request)

        def losing(request: FacadeRequest, reason: Failure) -> None:
            served.append(request)
            lost(request, reason)

        self.patch(FacadeRequest, "finish", finishing)
        self.patch(FacadeRequest, "connectionLost", losing)
        root = Resource()
        root.putChild(b"echo", _Echo())
        root.putChild(b"stream", _Produced())
        root.putChild(b"held", _Held())
        root.putChild(b"pieces", _Pieces())
        site = _facade_site(Clock(), resource=root)
        site.access_log = True
        for head in heads:
            conn = _Connection(self, site)
            conn.send(head)
            conn.lost()
        return served

    def test_names_within_the_shared_table(self) -> None:
        served = self.serve(
            [
                b"GET /echo HTTP/1.1\r\nHost: x\r\nCookie: a=b\r\n\r\n",
                b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                b"Content-Type: application/json\r\n\r\nhi",
                b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                b"\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
                b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET /pieces HTTP/1.1\r\nHost: x\r\n\r\n",
                b"HEAD /pieces HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n",
            ]
        )
        self.assertEqual(len(served), 7)
        self.assertLessEqual(len(_REQUEST_ATTRIBUTES), 29)
        self.assertEqual(len(set(_REQUEST_ATTRIBUTES)), len(_REQUEST_ATTRIBUTES))
        for request in served:
            # A HEAD's answer gets twisted.web's no-op write, which the
            # table has no room for, by design (see _REQUEST_ATTRIBUTES).
            head = request.method == b"HEAD"
            if sys.implementation.name == "cpython":
                # (the class's table is seeded at import: whatever other
                # tests set on other requests, these names are in it)
                self.assertEqual(keeps_own_dict(request), head, request)
            extra = set(vars(request)) - set(_REQUEST_ATTRIBUTES)
            self.assertEqual(extra, {"write"} if head else set(), request)
        self.assertEqual(served[0].getCookie(b"a"), b"b")
        self.assertTrue(served[-1]._disconnected)

    def test_starts_as_twisted_does(self) -> None:
        """
        What twisted.web's C{Request.__init__} sets, a facade request has,
        equal (its own or its class's), but for the form parsing it turns
        off; and what it sets on itself is among those or its notes.
        """
        channel: Any = _facade_site(Clock()).buildProtocol(None)
        channel.makeConnection(StringTransport())
        self.addCleanup(channel.connectionLost, Failure(ConnectionDone()))
        theirs: Any = Request(channel)
        ours: Any = FacadeRequest(channel)
        for name, value in vars(theirs).items():
            mine = getattr(ours, name)
            if name == "_parsePOSTFormSubmission":
                self.assertIs(mine, False)
            elif isinstance(value, Headers):
                self.assertEqual(list(mine.getAllRawHeaders()), [])
            elif isinstance(value, dict | list):
                self.assertEqual(type(value)(mine), value, name)
            else:
                self.assertEqual(mine, value, name)
        self.assertEqual(set(vars(ours)) - set(vars(theirs)), {"_notes"})

    def test_nothing_shared_between_requests(self) -> None:
        """
        Cookies and components on one request are its own: the class's
        empty defaults stay empty.
        """
        channel: Any = _facade_site(Clock()).buildProtocol(None)
        channel.makeConnection(StringTransport())
        self.addCleanup(channel.connectionLost, Failure(ConnectionDone()))
        one, other = FacadeRequest(channel), FacadeRequest(channel)
        one.addCookie(b"k", b"v")
        one.requestHeaders.setRawHeaders(b"Cookie", [b"a=b"])
        one.parseCookies()
        one.setComponent(IResource, _Echo())
        self.assertEqual(one.cookies, [b"k=v"])
        self.assertEqual(one.getCookie(b"a"), b"b")
        self.assertIsInstance(one.getComponent(IResource), _Echo)
        self.assertEqual(list(other.cookies), [])
        self.assertIsNone(other.getCookie(b"a"))
        self.assertIsNone(other.getComponent(IResource))
        self.assertEqual(FacadeRequest.cookies, ())
        self.assertEqual(dict(FacadeRequest.received_cookies), {})

    def test_request_id_and_access_record_kept_in_notes(self) -> None:
        channel: Any = _facade_site(Clock()).buildProtocol(None)
        channel.makeConnection(StringTransport())
        self.addCleanup(channel.connectionLost, Failure(ConnectionDone()))
        request = FacadeRequest(channel)
        rid = assign(request)
        access_of(request).model = "m"
        self.assertEqual(request_id(request), rid)
        self.assertEqual(request._notes.request_id, rid)
        self.assertEqual(access_of(request).model, "m")
        self.assertEqual(set(vars(request)) & {"access", "_nvproxy_request_id"}, set())


class CoverTests(SynchronousTestCase):
    """
    L{cover} and L{uncover}: an instance attribute for the length of a
    call, whatever the instance had under that name put back after it.
    """

    class _Target:
        def __init__(self) -> None:
            self.n = 0

        def write(self, data: bytes) -> None:
            self.n += 1

    def test_class_method_covered_and_restored(self) -> None:
        target: Any = self._Target()
        written: list[bytes] = []
        before = cover(target, "write", written.append)
        self.assertIsNone(before)
        target.write(b"x")
        uncover(target, "write", before)
        target.write(b"y")
        self.assertEqual((written, target.n), ([b"x"], 1))
        self.assertEqual(target.write.__func__, self._Target.write)
        if sys.implementation.name == "cpython":
            self.assertFalse(keeps_own_dict(target))

    def test_instance_attribute_put_back(self) -> None:
        target: Any = self._Target()
        own: list[bytes] = []
        target.write = own.append
        covered: list[bytes] = []
        before = cover(target, "write", covered.append)
        self.assertEqual(before, own.append)
        target.write(b"x")
        uncover(target, "write", before)
        target.write(b"y")
        self.assertEqual((covered, own, target.n), ([b"x"], [b"y"], 0))

    def test_another_instances_method_is_its_own(self) -> None:
        """A bound method of another object under the name is kept."""
        target: Any = self._Target()
        other = self._Target()
        target.write = other.write
        before = cover(target, "write", [].append)
        uncover(target, "write", before)
        target.write(b"x")
        self.assertEqual((target.n, other.n), (0, 1))
