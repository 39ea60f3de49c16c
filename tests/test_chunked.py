"""
L{nvproxy.proxy.chunked} decodes exactly what Twisted's chunked decoder
does, with fewer callbacks.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.protocol import Protocol
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http import _ChunkedTransferDecoder, _DataLoss

from nvproxy.proxy.chunked import CoalescingChunkedDecoder
from tests.objects import keeps_own_dict


def _run(decoder_type: Any, pieces: list[bytes]) -> tuple[bytes, Any, str, int]:
    """Feed C{pieces}: (data, rest or None, error class name, callbacks)."""
    data: list[bytes] = []
    rest: list[bytes] = []
    decoder = decoder_type(data.append, rest.append)
    error = ""
    for piece in pieces:
        try:
            decoder.dataReceived(piece)
        except Exception as e:
            error = type(e).__name__
            break
    if not error:
        try:
            decoder.noMoreData()
        except _DataLoss:
            error = "_DataLoss"
    return b"".join(data), (rest[0] if rest else None), error, len(data)


_LOOK_ALIKE = st.lists(
    st.sampled_from([b"\r", b"\n", b"\r\n", b"0", b"1", b"a", b"F", b";", b"x"]),
    min_size=1,
    max_size=20,
).map(b"".join)
"""Chunk bodies full of what looks like chunk framing."""


@st.composite
def _framed(draw: Any, body: Any = None) -> bytes:
    if body is None:
        body = st.one_of(st.binary(min_size=1, max_size=40), _LOOK_ALIKE)
    chunks = draw(st.lists(body, max_size=12))
    out = b""
    for chunk in chunks:
        size = b"%x" % len(chunk)
        if draw(st.booleans()):
            size = size.upper()
        if draw(st.integers(0, 5)) == 0:
            size += b";name=value"
        out += size + b"\r\n" + chunk + b"\r\n"
    out += b"0\r\n"
    for i in range(draw(st.integers(0, 2))):
        out += b"X-Trailer-%d: v\r\n" % i
    out += b"\r\n"
    return out + draw(st.binary(max_size=10))  # bytes after the body


def _splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for point in points:
        pieces.append(data[last:point])
        last = point
    pieces.append(data[last:])
    return [p for p in pieces if p]


def _mangled(data: bytes, at: int, junk: bytes) -> bytes:
    """C{data} with one byte (at C{at}, modulo its length) replaced by C{junk}."""
    at %= len(data)
    return data[:at] + junk + data[at + 1 :]


_MANGLES = (
    st.integers(0, 10_000),
    st.binary(min_size=1, max_size=3),
    st.lists(st.integers(0, 10_000), max_size=6),
)
"""Where to mangle, with what, and the cuts of the mangled bytes."""


class EquivalenceTests(SynchronousTestCase):
    @given(_framed(), st.lists(st.integers(0, 10_000), max_size=8))
    def test_well_formed(self, body: bytes, cuts: list[int]) -> None:
        pieces = _splits(body, cuts)
        theirs = _run(_ChunkedTransferDecoder, pieces)
        ours = _run(CoalescingChunkedDecoder, pieces)
        self.assertEqual(ours[:3], theirs[:3])
        self.assertLessEqual(ours[3], len(pieces), "at most one callback per read")

    @given(_framed(), *_MANGLES)
    def test_mangled(self, body: bytes, at: int, junk: bytes, cuts: list[int]) -> None:
        pieces = _splits(_mangled(body, at, junk), cuts)
        theirs = _run(_ChunkedTransferDecoder, pieces)
        ours = _run(CoalescingChunkedDecoder, pieces)
        self.assertEqual(ours[:3], theirs[:3])

    @given(_framed(_LOOK_ALIKE), st.lists(st.integers(0, 10_000), max_size=4))
    def test_look_alikes(self, body: bytes, cuts: list[int]) -> None:
        """Bodies that hold what looks like a chunk's end and size line."""
        pieces = _splits(body, cuts)
        self.assertEqual(
            _run(CoalescingChunkedDecoder, pieces)[:3],
            _run(_ChunkedTransferDecoder, pieces)[:3],
        )

    def test_many_chunks_taken_at_once(self) -> None:
        """
        Whole chunks are taken by the split, a look-alike in a body sends
        the read to the exact loop, and both give the same bytes.
        """
        from nvproxy.proxy.chunked import _whole_chunks

        plain = b"".join(b"%x\r\n%s\r\n" % (len(t), t) for t in [b"xy", b"zzz"] * 3)
        pieces: list[bytes] = []
        self.assertEqual(_whole_chunks(plain + b"2\r\nz", pieces), len(plain))
        self.assertEqual(pieces, [b"xy", b"zzz"] * 3)
        inner = b"xy\r\n1\r\nz"  # holds a chunk's end and a size line
        tricky = b"%x\r\n%s\r\n" % (len(inner), inner) + plain
        pieces = []
        self.assertEqual(_whole_chunks(tricky, pieces), 0)
        self.assertEqual(pieces, [])
        self.assertEqual(
            _run(CoalescingChunkedDecoder, [tricky + b"0\r\n\r\n"])[0],
            inner + b"xyzzz" * 3,
        )

    def test_chunks_after_the_last_one_are_not_the_body(self) -> None:
        """
        What follows the last chunk, however much it looks like chunks, is
        the rest (Twisted's too), not the body: a size of 0 found by the
        split sends the read to the exact loop.
        """
        from nvproxy.proxy.chunked import _whole_chunks

        plain = b"".join(b"%x\r\n%s\r\n" % (len(t), t) for t in [b"xy", b"zzz"] * 3)
        after = b"3\r\nabc\r\n2\r\nzz\r\n"
        framed = plain + b"0\r\n\r\n" + after
        pieces: list[bytes] = []
        self.assertEqual(_whole_chunks(framed, pieces), 0)
        self.assertEqual(pieces, [])
        ours = _run(CoalescingChunkedDecoder, [framed])
        self.assertEqual(ours[:3], (b"xyzzz" * 3, after, ""))
        self.assertEqual(ours[:3], _run(_ChunkedTransferDecoder, [framed])[:3])

    def test_sizes_outside_the_table(self) -> None:
        """Upper-case and large sizes are read with C{int}, still at once."""
        from nvproxy.proxy.chunked import _whole_chunks

        bodies = [b"x" * 2000, b"y" * 26, b"z" * 3]
        framed = b"".join(b"%X\r\n%s\r\n" % (len(b), b) for b in bodies)
        pieces: list[bytes] = []
        taken = _whole_chunks(framed + b"0\r\n\r\n", pieces)
        self.assertEqual((taken, pieces), (len(framed), bodies))

    @given(_framed(), st.data())
    def test_one_chunk_per_read(self, framed: bytes, data: Any) -> None:
        """
        Reads that are each exactly one chunk (paced tokens), some cut or
        joined: the same as Twisted's decoder, one callback per whole chunk.
        """
        cuts = []
        pos = 0
        while (
            found := re.match(rb"([0-9a-fA-F]+)(;[^\r]*)?\r\n", framed[pos:])
        ) and int(found[1], 16):
            pos += found.end() + int(found[1], 16) + 2
            cuts.append(pos)
        cuts += data.draw(st.lists(st.integers(0, len(framed)), max_size=2))
        pieces = _splits(framed, cuts)
        ours = _run(CoalescingChunkedDecoder, pieces)
        self.assertEqual(ours[:3], _run(_ChunkedTransferDecoder, pieces)[:3])

    def test_one_read_many_chunks_one_callback(self) -> None:
        body = b"".join(b"5\r\ntoken\r\n" for _ in range(50)) + b"0\r\n\r\n"
        data, rest, error, calls = _run(CoalescingChunkedDecoder, [body])
        self.assertEqual((data, rest, error, calls), (b"token" * 50, b"", "", 1))

    def test_read_after_a_cut_chunk_taken_at_once(self) -> None:
        """
        A read that starts inside a chunk the read before cut finishes that
        chunk, then takes the whole chunks after it at once (the split), as
        a read that starts at a chunk boundary does, not one by one.
        """
        from nvproxy.proxy import chunked

        tokens = [b"token %d\n" % i for i in range(40)]
        framed = b"".join(b"%x\r\n%s\r\n" % (len(t), t) for t in tokens)
        framed += b"0\r\n\r\n"
        taken: list[int] = []
        split = chunked._whole_chunks

        def recording(buf: bytes, pieces: list[bytes]) -> int:
            taken.append(split(buf, pieces))
            return taken[-1]

        self.patch(chunked, "_whole_chunks", recording)
        end = framed.index(b"token 3\n") + len(b"token 3\n")  # its CRLF next
        for cut in (end - 5, end, end + 1):
            del taken[:]
            pieces = [framed[:cut], framed[cut:]]
            self.assertEqual(
                _run(CoalescingChunkedDecoder, pieces),
                (*_run(_ChunkedTransferDecoder, pieces)[:3], 2),
            )
            self.assertGreater(taken[-1], len(framed) // 2)

    def test_limits(self) -> None:
        long_line = b"1" * 2000 + b"\r\n"
        self.assertEqual(
            _run(CoalescingChunkedDecoder, [long_line])[2],
            _run(_ChunkedTransferDecoder, [long_line])[2],
        )
        trailers = b"0\r\n" + b"X: " + b"y" * 70_000 + b"\r\n\r\n"
        self.assertEqual(
            _run(CoalescingChunkedDecoder, [trailers])[2],
            "_MalformedChunkedDataError",
        )


class ParserTests(SynchronousTestCase):
    def test_no_pause_for_a_body_taken_in_the_callback(self) -> None:
        """
        Twisted pauses the connection until the response's body has a
        protocol; one given in the response's callback, inside the read of
        the head, makes that pause (and its resume) unnecessary.
        """
        transport, _, body = _head_read(deliver=True)
        self.assertEqual(transport.pauses, 0)
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual(body, [b"hello"])
        self.assertNotIn("pauseProducing", vars(transport))
        self.assertNotIn("resumeProducing", vars(transport))

    def test_pause_kept_for_a_body_taken_later(self) -> None:
        """A body given no protocol in the callback still pauses the connection."""
        transport, got, body = _head_read(deliver=False)
        self.assertEqual(transport.pauses, 1)
        self.assertEqual(transport.producerState, "paused")
        response, collect = got
        response.deliverBody(collect())
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual(body, [b"hello"])

    def test_upstream_protocol_coalesces(self) -> None:
        """nvproxy's upstream connections parse chunked bodies with it."""
        from twisted.internet.testing import StringTransport
        from twisted.web._newclient import Request
        from twisted.web.http_headers import Headers

        from nvproxy.proxy.upstream import _ClientProtocol

        protocol = _ClientProtocol(lambda p: None)  # type: ignore[no-untyped-call]
        protocol.makeConnection(StringTransport())
        d = protocol.request(Request(b"GET", b"/", Headers({b"host": [b"x"]}), None))
        got: list[Any] = []
        d.addCallback(got.append)
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        response = got[0]
        body: list[bytes] = []

        from twisted.internet.protocol import Protocol

        class Collect(Protocol):
            def dataReceived(self, data: bytes) -> None:
                body.append(data)

        response.deliverBody(Collect())
        protocol.dataReceived(b"3\r\nabc\r\n3\r\ndef\r\n3\r\nghi\r\n")
        self.assertEqual(body, [b"abcdefghi"], "three chunks, one read, one write")

    def test_body_read_inside_a_body_callback(self) -> None:
        """
        A body read that comes in while the decoder's callback runs (a call
        from inside it) is buffered and handed on after it, in order, as
        Twisted's parser does; then the response ends as Twisted's does.
        """
        from twisted.web._newclient import HTTPClientParser, Request
        from twisted.web.http_headers import Headers

        from nvproxy.proxy.chunked import _CoalescingParser

        def run(parser_type: Any) -> tuple[list[bytes], list[bytes]]:
            rest: list[bytes] = []
            request = Request(b"GET", b"/", Headers({b"host": [b"x"]}), None)
            parser = parser_type(request, rest.append)
            parser.makeConnection(StringTransport())
            body: list[bytes] = []

            class Inner(Protocol):
                def dataReceived(self, data: bytes) -> None:
                    body.append(data)
                    if len(body) == 1:
                        parser.dataReceived(b"-inner-")

            parser._responseDeferred.addCallback(
                lambda response: response.deliverBody(Inner())
            )
            parser.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n")
            parser.dataReceived(b"first")
            parser.dataReceived(b"last....tail")
            return body, rest

        ours = run(_CoalescingParser)
        self.assertEqual(ours, run(HTTPClientParser))
        self.assertEqual(ours, ([b"first", b"-inner-", b"last...."], [b"tail"]))


class CoalescingTests(SynchronousTestCase):
    """
    L{coalescing}: Twisted's client protocol builds its response parser as
    a L{_CoalescingParser} for the call, and only for it.
    """

    def test_parser_built_as_coalescing(self) -> None:
        """
        nvproxy's upstream protocol gets the coalescing parser built as
        one (not a Twisted parser given another class afterwards, which
        would keep its attributes in a dict of its own).
        """
        from twisted.web import _newclient
        from twisted.web._newclient import HTTPClientParser, Request
        from twisted.web.http_headers import Headers

        from nvproxy.proxy.chunked import _CoalescingParser
        from nvproxy.proxy.upstream import _ClientProtocol

        protocol = _ClientProtocol(lambda p: None)  # type: ignore[no-untyped-call]
        protocol.makeConnection(StringTransport())
        protocol.request(Request(b"GET", b"/", Headers({b"host": [b"x"]}), None))
        parser: Any = protocol._parser  # type: ignore[attr-defined]
        self.assertIs(type(parser), _CoalescingParser)
        self.assertIs(_newclient.HTTPClientParser, HTTPClientParser)
        if sys.implementation.name == "cpython":
            self.assertFalse(keeps_own_dict(parser))

    def test_only_for_the_call(self) -> None:
        from twisted.web import _newclient
        from twisted.web._newclient import HTTPClientParser

        from nvproxy.proxy.chunked import _CoalescingParser, coalescing

        seen: list[object] = []

        def request(wire: object) -> Any:
            seen.append((wire, _newclient.HTTPClientParser))
            return "answer"

        def broken(wire: object) -> Any:
            raise ZeroDivisionError()

        self.assertEqual(coalescing(request, "wire"), "answer")
        self.assertEqual(seen, [("wire", _CoalescingParser)])
        self.assertIs(_newclient.HTTPClientParser, HTTPClientParser)
        self.assertRaises(ZeroDivisionError, coalescing, broken, "wire")
        self.assertIs(_newclient.HTTPClientParser, HTTPClientParser)


class _CountingTransport(StringTransport):
    """A StringTransport that counts the pauses asked of it."""

    pauses = 0

    def pauseProducing(self) -> None:
        self.pauses += 1
        super().pauseProducing()


def _head_read(deliver: bool) -> tuple[_CountingTransport, list[Any], list[bytes]]:
    """
    A response head and a body read in one piece by nvproxy's upstream
    protocol, its body delivered in the response's callback or not.
    """
    from twisted.web._newclient import Request
    from twisted.web.http_headers import Headers

    from nvproxy.proxy.upstream import _ClientProtocol

    protocol = _ClientProtocol(lambda p: None)  # type: ignore[no-untyped-call]
    transport = _CountingTransport()
    protocol.makeConnection(transport)
    d = protocol.request(Request(b"GET", b"/", Headers({b"host": [b"x"]}), None))
    got: list[Any] = []
    body: list[bytes] = []

    class Collect(Protocol):
        def dataReceived(self, data: bytes) -> None:
            body.append(data)

    def response(answer: Any) -> None:
        got.append(answer)
        if deliver:
            answer.deliverBody(Collect())

    d.addCallback(response)
    protocol.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")
    got.append(Collect)
    return transport, got, body


def _exchange(protocol_type: Any, pieces: list[bytes]) -> tuple[Any, ...]:
    """
    What a client protocol makes of a response fed in C{pieces}: the
    response (code, headers) or the request's failure, the body, how the
    body ended, and whether the connection was dropped.
    """
    from twisted.internet.protocol import Protocol
    from twisted.internet.testing import StringTransport
    from twisted.python.failure import Failure
    from twisted.web._newclient import Request, ResponseFailed
    from twisted.web.http_headers import Headers

    protocol = protocol_type(lambda p: None)
    transport = StringTransport()
    protocol.makeConnection(transport)
    request = Request(b"GET", b"/", Headers({b"host": [b"x"]}), None, persistent=True)
    d = protocol.request(request)
    outcome: list[Any] = []
    body: list[bytes] = []
    ended: list[str] = []

    class Collect(Protocol):
        def dataReceived(self, data: bytes) -> None:
            body.append(data)

        def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
            ended.append(reason.type.__name__)  # type: ignore[union-attr]

    def got(response: Any) -> None:
        headers = sorted(response.headers.getAllRawHeaders())
        outcome.append((response.code, response.phrase, headers, response.length))
        response.deliverBody(Collect())

    def failed(reason: Failure) -> None:
        if reason.check(ResponseFailed):
            why = [r.type.__name__ for r in reason.value.reasons]  # type: ignore[union-attr]
            outcome.append(("failed", why))
        else:
            outcome.append(("failed", reason.type.__name__))  # type: ignore[union-attr]

    d.addCallbacks(got, failed)
    for piece in pieces:
        protocol.dataReceived(piece)
    from twisted.internet.error import ConnectionDone

    protocol.connectionLost(Failure(ConnectionDone()))
    return (
        outcome,
        b"".join(body),
        ended,
        transport.disconnecting,
        transport.producerState,
    )


def _rest(parser_type: Any, pieces: list[bytes]) -> tuple[list[bytes], str]:
    """The bytes a bare parser passes on after a response, or its error."""
    from twisted.internet.testing import StringTransport
    from twisted.web._newclient import Request
    from twisted.web.http_headers import Headers

    rest: list[bytes] = []
    request = Request(b"GET", b"/", Headers({b"host": [b"x"]}), None)
    parser = parser_type(request, rest.append)
    parser.makeConnection(StringTransport())
    try:
        for piece in pieces:
            parser.dataReceived(piece)
    except Exception as e:
        return rest, type(e).__name__
    return rest, ""


@st.composite
def _response(draw: Any) -> bytes:
    """A response head (with its quirks) and a body to suit it."""
    eol = st.sampled_from([b"\r\n", b"\n"])
    out = b""
    if draw(st.integers(0, 6)) == 0:
        out += b"HTTP/1.1 100 Continue" + draw(eol) + draw(eol)
    code = draw(st.sampled_from([200, 200, 200, 204, 304, 404, 500]))
    out += b"HTTP/1.1 %d" % code
    if draw(st.booleans()):
        out += b" Some Phrase"
    out += draw(eol)
    kind = draw(st.sampled_from(["chunked", "length", "none"]))
    names = st.sampled_from([b"Content-Type", b"X-A", b"Server", b"Date"])
    for _ in range(draw(st.integers(0, 4))):
        out += (
            draw(names)
            + b": "
            + draw(
                st.binary(max_size=12).filter(
                    lambda v: b"\n" not in v and b"\r" not in v
                )
            )
            + draw(eol)
        )
        if draw(st.integers(0, 5)) == 0:
            out += b" continued" + draw(eol)
    body = draw(st.binary(max_size=60))
    if kind == "chunked":
        out += b"Transfer-Encoding: chunked" + draw(eol)
        body = draw(_framed())
    elif kind == "length":
        out += b"Content-Length: %d" % len(body) + draw(eol)
        body += draw(st.binary(max_size=6))  # bytes after the body
    return out + draw(eol) + body


class LineParsingTests(SynchronousTestCase):
    """
    The upstream parser takes header lines without copying the rest of the
    read per line, and makes of every response what Twisted's does.
    """

    def _both(self, data: bytes, cuts: list[int]) -> None:
        from twisted.web._newclient import HTTP11ClientProtocol, HTTPClientParser

        from nvproxy.proxy.chunked import _CoalescingParser
        from nvproxy.proxy.upstream import _ClientProtocol

        pieces = _splits(data, cuts)
        theirs = _exchange(HTTP11ClientProtocol, pieces)
        ours = _exchange(_ClientProtocol, pieces)
        self.assertEqual(ours, theirs)
        # what the parser hands its finisher after the response
        self.assertEqual(
            _rest(_CoalescingParser, pieces), _rest(HTTPClientParser, pieces)
        )

    @given(_response(), st.lists(st.integers(0, 10_000), max_size=8))
    def test_well_formed(self, data: bytes, cuts: list[int]) -> None:
        self._both(data, cuts)

    @given(_response(), *_MANGLES)
    def test_mangled(self, data: bytes, at: int, junk: bytes, cuts: list[int]) -> None:
        self._both(_mangled(data, at, junk), cuts)

    def test_overlong_lines(self) -> None:
        """A header line past Twisted's limit drops the connection in both."""
        head = b"HTTP/1.1 200 OK\r\nX-Long: " + b"v" * 20_000
        for data in (head, head + b"\r\n\r\n"):
            for cuts in ([], [100], [17, 19_000]):
                self._both(data, cuts)

    def test_whole_heads(self) -> None:
        """
        Heads whole in one read, with what a line at a time makes of them:
        a folded line with a colon of its own, a bare CR in a value and in
        the status line, a line without a colon, an informational answer
        before the answer, no headers at all.
        """
        for head in (
            b"HTTP/1.1 200 OK\r\nX-A: a\r\n b: c\r\nContent-Length: 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\r\nContent-Length: 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nno colon\r\nContent-Length: 2\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\n\r\n",
        ):
            self._both(head + b"hi", [])

    def test_head_in_one_piece(self) -> None:
        """No line of a head whole in one read goes through C{lineReceived}."""
        from twisted.internet.testing import StringTransport
        from twisted.web._newclient import Request
        from twisted.web.http_headers import Headers

        from nvproxy.proxy.upstream import _ClientProtocol

        protocol = _ClientProtocol(lambda p: None)  # type: ignore[no-untyped-call]
        protocol.makeConnection(StringTransport())
        d = protocol.request(Request(b"GET", b"/", Headers({b"host": [b"x"]}), None))
        parser = protocol._parser
        lines: list[bytes] = []
        original = parser.lineReceived
        parser.lineReceived = lambda line: (lines.append(line), original(line))[1]
        protocol.dataReceived(
            b"HTTP/1.1 200 OK\r\nContent-Type: a/b\r\nContent-Length: 2\r\n\r\nhi"
        )
        self.assertEqual(lines, [])
        response = self.successResultOf(d)
        self.assertEqual(
            (
                response.code,
                response.headers.getRawHeaders(b"content-type"),
                response.length,
            ),
            (200, [b"a/b"], 2),
        )

    def test_body_in_one_piece(self) -> None:
        """
        A whole answer in one read reaches the body decoder in one piece,
        after any number of header lines.
        """
        from twisted.internet.testing import StringTransport
        from twisted.web._newclient import Request
        from twisted.web.http_headers import Headers

        from nvproxy.proxy.upstream import _ClientProtocol

        protocol = _ClientProtocol(lambda p: None)  # type: ignore[no-untyped-call]
        protocol.makeConnection(StringTransport())
        protocol.request(Request(b"GET", b"/", Headers({b"host": [b"x"]}), None))
        parser = protocol._parser
        fed: list[bytes] = []
        original = parser.rawDataReceived
        parser.rawDataReceived = lambda data: (fed.append(data), original(data))[1]
        body = b"5\r\nhello\r\n0\r\n\r\n"
        head = b"HTTP/1.1 200 OK\r\n" + b"X-H: v\r\n" * 20
        protocol.dataReceived(head + b"Transfer-Encoding: chunked\r\n\r\n" + body)
        self.assertEqual(fed, [body])
