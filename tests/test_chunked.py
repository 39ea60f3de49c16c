"""
L{nvproxy.proxy.chunked} decodes exactly what Twisted's chunked decoder
does, with fewer callbacks.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http import _ChunkedTransferDecoder, _DataLoss

from nvproxy.proxy.chunked import CoalescingChunkedDecoder


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


@st.composite
def _framed(draw: Any) -> bytes:
    chunks = draw(st.lists(st.binary(min_size=1, max_size=40), max_size=12))
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


class EquivalenceTests(SynchronousTestCase):
    @given(_framed(), st.lists(st.integers(0, 10_000), max_size=8))
    def test_well_formed(self, body: bytes, cuts: list[int]) -> None:
        pieces = _splits(body, cuts)
        theirs = _run(_ChunkedTransferDecoder, pieces)
        ours = _run(CoalescingChunkedDecoder, pieces)
        self.assertEqual(ours[:3], theirs[:3])
        self.assertLessEqual(ours[3], len(pieces), "at most one callback per read")

    @given(
        _framed(),
        st.integers(0, 10_000),
        st.binary(min_size=1, max_size=3),
        st.lists(st.integers(0, 10_000), max_size=6),
    )
    def test_mangled(self, body: bytes, at: int, junk: bytes, cuts: list[int]) -> None:
        at %= len(body)
        mangled = body[:at] + junk + body[at + 1 :]
        pieces = _splits(mangled, cuts)
        theirs = _run(_ChunkedTransferDecoder, pieces)
        ours = _run(CoalescingChunkedDecoder, pieces)
        self.assertEqual(ours[:3], theirs[:3])

    def test_one_read_many_chunks_one_callback(self) -> None:
        body = b"".join(b"5\r\ntoken\r\n" for _ in range(50)) + b"0\r\n\r\n"
        data, rest, error, calls = _run(CoalescingChunkedDecoder, [body])
        self.assertEqual((data, rest, error, calls), (b"token" * 50, b"", "", 1))

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
