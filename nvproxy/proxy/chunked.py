# -*- test-case-name: tests.test_chunked -*-
"""
A chunked transfer decoder for upstream responses that hands on, per read,
everything the read completed as one piece.

An engine streaming tokens sends each as its own HTTP chunk, and one socket
read often carries dozens of them.  Twisted's C{_ChunkedTransferDecoder}
calls back once per chunk, so everything downstream (the response's
dispatch, the stream stats, the client write and its re-framing) ran once
per chunk; here it runs once per read.  Chunk boundaries carry no meaning
to SSE or NDJSON clients, and nothing waits: what a read brings is handed
on before the read returns (a chunk that arrives alone is passed alone).

It accepts and refuses exactly what Twisted's decoder does (same limits,
same errors; a property test checks both on random framings and splits).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from itertools import repeat
from typing import Any

from twisted.internet.defer import Deferred
from twisted.web import _newclient
from twisted.web._newclient import STATUS, HTTPClientParser
from twisted.web.http import (
    _ChunkedTransferDecoder,
    _chunkExtChars,
    _DataLoss,
    _MalformedChunkedDataError,
    maxChunkSizeLineLength,
)

from nvproxy.proxy.cork import cover, uncover

__all__ = ["CoalescingChunkedDecoder", "coalescing"]

_LENGTH, _BODY, _CRLF, _TRAILER, _FINISHED = range(5)
_MAX_TRAILER = 2**16
_is_hex = re.compile(rb"[0-9a-fA-F]+").fullmatch
"""Twisted's C{_ishexdigits} (1*HEXDIG), at C speed."""
_WHOLE_SIZE_LINE = re.compile(rb"([0-9a-fA-F]{1,16})\r\n").match
"""A size line without extensions, well within C{maxChunkSizeLineLength}."""


_FRAMING = re.compile(rb"\r\n([0-9a-fA-F]{1,16})\r\n")
"""A chunk's closing CRLF and the next size line, without extensions."""
_SIZES = {b"%x" % size: size for size in range(1, 1024)}
"""The sizes of token-sized chunks as engines write them (lower-case hex, no
leading zero): one lookup each, a third of C{int(size, 16)}; any other size
line makes the read's sizes go through C{int}."""
_HEX = [b"", *_SIZES]
"""The same sizes by length, to check a read's sizes against its chunks'
lengths without hashing a size line each (a size line is never empty, so
a chunk of length 0, the body's end, never matches)."""
_hex_of = _HEX.__getitem__
"""(A list's, a C method called directly; a tuple's is a slot wrapper,
slower per call.)"""


def _whole_chunks(buf: bytes, pieces: list[bytes]) -> int:
    """
    Take the whole chunks at the start of C{buf} (a size line there) with
    work done per chunk in C, not per chunk in Python; where the taking
    stopped: a chunk boundary, C{0} when it took none.

    C{buf} is split at everything that looks like the end of a chunk and
    the next size line, then every piece is checked to be exactly as long
    as the size before it says.  A body may hold such a look-alike; then a
    length is wrong and nothing is taken here (the exact loop does it all).
    When every length is right the split is the one parse there is: from a
    size line at 0, each checked length puts the next size line exactly
    where the split found it.  The last size line found is not taken (its
    chunk may be cut by the read, or be the last chunk), nor is a chunk of
    size 0 (the end of the body) anywhere.
    """
    parts = _FRAMING.split(buf)
    if len(parts) < 3:
        return 0
    head = parts[0]
    first = _WHOLE_SIZE_LINE(head)
    if first is None or first.end() == len(head):
        return 0  # no size line at 0, or the first chunk is the last one
    if len(head) - first.end() != int(first[1], 16):
        return 0
    bodies, sizes = parts[2:-1:2], parts[1:-2:2]
    try:
        same = sizes == list(map(_hex_of, map(len, bodies)))
    except IndexError:  # a chunk of 1,024 bytes or more
        same = False
    if not same:
        lengths = list(map(len, bodies))
        if lengths != list(map(int, sizes, repeat(16))) or 0 in lengths:
            return 0
    pieces.append(head[first.end() :])
    pieces.extend(bodies)
    return len(buf) - len(parts[-1]) - len(parts[-2]) - 2


def _fast(buf: bytes, pos: int, pieces: list[bytes]) -> int:
    """
    Take the whole chunks of C{buf} from C{pos} (a size line there) without
    extensions; where the taking stopped.  Anything else (a chunk cut by
    the read, an extension, the last chunk, an error) is left to the exact
    loop, from that position.
    """
    pos += _whole_chunks(buf[pos:] if pos else buf, pieces)
    # The hot loop: each one C-level match and one slice.
    match = _WHOLE_SIZE_LINE
    ends = buf.startswith
    append = pieces.append
    while found := match(buf, pos):
        start = found.end()
        stop = start + int(found[1], 16)
        if stop == start or not ends(b"\r\n", stop):
            break
        append(buf[start:stop])
        pos = stop + 2
    return pos


class CoalescingChunkedDecoder:
    """
    Same interface as Twisted's C{_ChunkedTransferDecoder}: C{dataReceived},
    C{noMoreData}, and the two callbacks.
    """

    def __init__(
        self,
        dataCallback: Callable[[bytes], None],
        finishCallback: Callable[[bytes], None],
    ) -> None:
        self.dataCallback = dataCallback
        self.finishCallback = finishCallback
        self._buffer = b""
        self._state = _LENGTH
        self._length = 0
        self._trailer = 0

    @property
    def state(self) -> str:
        return ("CHUNK_LENGTH", "BODY", "CRLF", "TRAILER", "FINISHED")[self._state]

    def dataReceived(self, data: bytes) -> None:
        if self._state == _LENGTH and not self._buffer:
            # A read that is exactly one whole chunk (a token that arrives
            # alone, paced generation's every read): its body at once.
            found = _WHOLE_SIZE_LINE(data)
            if found is not None:
                start = found.end()
                size = found[1]
                stop = start + (_SIZES.get(size) or int(size, 16))
                if stop > start and len(data) == stop + 2 and data.endswith(b"\r\n"):
                    self.dataCallback(data[start:stop])
                    return
        elif self._state == _FINISHED:
            raise RuntimeError(
                "chunked decoder called after the last chunk was processed"
            )
        buf = self._buffer + data if self._buffer else data
        pieces: list[bytes] = []
        try:
            pos = self._parse(buf, pieces)
        except BaseException:
            self._flush(pieces)
            raise
        if self._state == _FINISHED:
            self._buffer = b""
            self._flush(pieces)
            self.finishCallback(buf[pos:])
            return
        self._buffer = buf[pos:]
        self._flush(pieces)

    def _flush(self, pieces: list[bytes]) -> None:
        if pieces:
            self.dataCallback(pieces[0] if len(pieces) == 1 else b"".join(pieces))

    def _parse(self, buf: bytes, pieces: list[bytes]) -> int:
        """Consume what C{buf} completes; the position reached."""
        pos, end, state = 0, len(buf), self._state
        # The rest of a chunk the read before cut, and its CRLF: then this
        # read goes on at a chunk boundary, and is taken as fast as a read
        # that starts at one (reads cut mid-chunk: a saturated proxy's 64 KB
        # reads, TLS records, a network's segments).  A CRLF that is not
        # there (yet) is left to the exact loop.
        if state == _BODY and self._length < end:
            pos = self._length
            pieces.append(buf[:pos])
            self._length = 0
            state = _CRLF
        if state == _CRLF and buf.startswith(b"\r\n", pos):
            pos += 2
            state = _LENGTH
        if state == _LENGTH:
            pos = _fast(buf, pos, pieces)
        try:
            while pos < end:
                if state == _BODY:
                    take = min(self._length, end - pos)
                    pieces.append(buf[pos : pos + take])
                    pos += take
                    self._length -= take
                    if self._length == 0:
                        state = _CRLF
                elif state == _CRLF:
                    if end - pos < 2:
                        break
                    if buf[pos : pos + 2] != b"\r\n":
                        raise _MalformedChunkedDataError("Chunk did not end with CRLF")
                    pos += 2
                    state = _LENGTH
                elif state == _LENGTH:
                    eol = buf.find(b"\r\n", pos)
                    if eol - pos >= maxChunkSizeLineLength or (
                        eol == -1 and end - pos > maxChunkSizeLineLength
                    ):
                        raise _MalformedChunkedDataError(
                            f"Chunk size line exceeds maximum of"
                            f" {maxChunkSizeLineLength} bytes."
                        )
                    if eol == -1:
                        break
                    semi = buf.find(b";", pos, eol)
                    stop = eol if semi == -1 else semi
                    digits = buf[pos:stop]
                    if _is_hex(digits) is None:
                        raise _MalformedChunkedDataError(
                            "Chunk-size must be an integer."
                        )
                    length = int(digits, 16)
                    if semi != -1:
                        ext = buf[stop + 1 : eol]
                        if ext and ext.translate(None, _chunkExtChars) != b"":
                            raise _MalformedChunkedDataError(
                                f"Invalid characters in chunk extensions: {ext!r}."
                            )
                    pos = eol + 2
                    if length == 0:
                        state = _TRAILER
                    elif buf[pos + length : pos + length + 2] == b"\r\n":
                        # The common case, a whole chunk in this read: body
                        # and its CRLF taken at once, next size line.
                        pieces.append(buf[pos : pos + length])
                        pos += length + 2
                    else:
                        state, self._length = _BODY, length
                elif state == _TRAILER:
                    eol = buf.find(b"\r\n", pos)
                    if eol == -1:
                        pending = end - pos
                        least = (
                            self._trailer + pending + (1 if buf.endswith(b"\r") else 2)
                        )
                        if least > _MAX_TRAILER:
                            raise _MalformedChunkedDataError(
                                "Trailer headers data is too long."
                            )
                        break
                    if eol > pos:
                        self._trailer += eol - pos + 2
                        pos = eol + 2
                        if self._trailer > _MAX_TRAILER:
                            raise _MalformedChunkedDataError(
                                "Trailer headers data is too long."
                            )
                        continue
                    state = _FINISHED
                    return eol + 2
        finally:
            self._state = state
        return pos

    def noMoreData(self) -> None:
        if self._state != _FINISHED:
            raise _DataLoss(
                f"Chunked decoder in {self.state!r} state, still expecting more"
                " data to get to 'FINISHED' state."
            )


class _CoalescingParser(HTTPClientParser):
    """
    Twisted's response parser, with L{CoalescingChunkedDecoder}, and header
    lines taken without copying the rest of the read once per line.

    Twisted's C{LineReceiver} takes each line with C{buffer.split(b"\n", 1)},
    which copies everything after it: an engine's status line, headers and
    whole streamed answer often come in one read, so the answer was copied
    once per header line (30 KB six times for a 200-token stream).  Here the
    lines are found by index and the rest is copied once.  The parser reads
    its buffer only when the headers end (C{clearLineBuffer} for a body-less
    answer, raw mode for a body), so the buffer is brought up to date before
    an empty line and on every way out.
    """

    def dataReceived(self, data: bytes) -> None:
        if not self.line_mode:
            decoder = self.bodyDecoder
            if decoder is None or self._busyReceiving or self.paused or self._buffer:
                super().dataReceived(data)  # type: ignore[no-untyped-call]
                return
            # The body (a stream's every token): straight to its decoder, as
            # Twisted's parser and LineReceiver hand it on in raw mode, less
            # their three calls a read.  What comes in meanwhile (a call
            # from inside the decoder's callbacks) is buffered, as
            # LineReceiver buffers it, and handed on as its loop would.
            self._everReceivedData = True
            self._busyReceiving = True
            try:
                decoder.dataReceived(data)
            finally:
                self._busyReceiving = False
            if self._buffer and not self.paused:
                # (mypy keeps the narrowing above across the call: unchecked)
                super().dataReceived(b"")
            return
        if self._busyReceiving or self.paused:
            super().dataReceived(data)  # type: ignore[no-untyped-call]
            return
        self._everReceivedData = True
        buf = self._buffer + data if self._buffer else data
        pos = 0
        self._buffer = b""
        self._busyReceiving = True
        transport: Any = self.transport
        try:
            head = self._whole_head(buf) if self.state == STATUS else None
            if head is not None:
                status, headers, pos = head
                self.statusReceived(status)  # type: ignore[no-untyped-call]
                for name, value in headers:
                    self.headerReceived(name, value)  # type: ignore[no-untyped-call]
                # the empty line, and the way out after it, as below
                self._buffer, buf, pos = buf[pos:] + self._buffer, b"", 0
                self.allHeadersReceived()
                buf, self._buffer = self._buffer, b""
                if transport and transport.disconnecting:
                    return
            while self.line_mode and not self.paused:
                end = buf.find(b"\n", pos)
                if end < 0:
                    if len(buf) - pos >= self.MAX_LENGTH + 1:
                        line, buf, pos = buf[pos:], b"", 0
                        self.lineLengthExceeded(line)  # type: ignore[no-untyped-call]
                        return
                    break
                if end - pos > self.MAX_LENGTH:
                    line, buf, pos = buf[pos:], b"", 0
                    self.lineLengthExceeded(line)  # type: ignore[no-untyped-call]
                    return
                line = buf[pos:end]
                pos = end + 1
                if line and line != b"\r":
                    why = self.lineReceived(line)  # type: ignore[no-untyped-call]
                    if self._buffer:  # data came in again meanwhile
                        buf, pos = buf[pos:] + self._buffer, 0
                        self._buffer = b""
                else:
                    # the end of the headers: the parser reads its buffer
                    self._buffer, buf, pos = buf[pos:], b"", 0
                    why = self.lineReceived(line)  # type: ignore[no-untyped-call]
                    buf, self._buffer = self._buffer, b""
                if why or (transport and transport.disconnecting):
                    return
        finally:
            self._buffer = buf[pos:] + self._buffer if pos else buf + self._buffer
            self._busyReceiving = False
        if self._buffer and not (self.line_mode or self.paused):
            # the body, in raw mode: Twisted's loop hands it on uncopied
            super().dataReceived(b"")  # type: ignore[no-untyped-call]

    def _whole_head(
        self, buf: bytes
    ) -> tuple[bytes, list[tuple[bytes, bytes]], int] | None:
        """
        A response head whole in C{buf}, each of its lines ended by a CRLF,
        none folded and each header with its colon: its status line, its
        headers as Twisted's C{lineReceived} hands them on (name, stripped
        value), and where its empty line ends.  C{None} for any other,
        which goes a line at a time.
        """
        end = buf.find(b"\r\n\r\n")
        if end <= 0 or end > self.MAX_LENGTH:
            return None
        head = buf[:end]
        lines = head.split(b"\r\n")
        # (a bare CR stays in its line, as in Twisted's, which splits at LF
        # and takes one CR off a line's end)
        if head.count(b"\n") != len(lines) - 1:
            return None
        headers = []
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or line[0] in b" \t":
                return None
            headers.append((name, value.strip()))
        return lines[0], headers, end + 4

    def allHeadersReceived(self) -> None:
        # Twisted pauses the transport here until the response's body has a
        # protocol, and resumes it when it gets one; nvproxy's attempt gives
        # it one in the response's callback, inside this call, so the pause
        # and the resume were two epoll_ctl calls for nothing.  Here a pause
        # asked for during the call is made after it, if no resume came.
        transport: Any = self.transport
        if transport is None:
            super().allHeadersReceived()  # type: ignore[no-untyped-call]
            return
        due: list[bool] = []
        resumed = transport.resumeProducing  # (not vars(): see cork.cover)

        def resume() -> None:
            due.clear()
            resumed()

        # For this call only (put back after it: no cycle is left behind).
        pause = cover(transport, "pauseProducing", partial(due.append, True))
        resume_ = cover(transport, "resumeProducing", resume)
        try:
            super().allHeadersReceived()  # type: ignore[no-untyped-call]
        finally:
            uncover(transport, "pauseProducing", pause)
            uncover(transport, "resumeProducing", resume_)
        if due:
            transport.pauseProducing()

    def switchToBodyMode(self, decoder: Any) -> None:
        response = self.response
        if response is not None and decoder.dataCallback == response._bodyDataReceived:
            decoder.dataCallback = partial(_deliver, response)
        if type(decoder) is _ChunkedTransferDecoder:
            decoder = CoalescingChunkedDecoder(
                decoder.dataCallback, decoder.finishCallback
            )
        super().switchToBodyMode(decoder)  # type: ignore[no-untyped-call]


def _deliver(response: Any, data: bytes) -> None:
    """
    C{response._bodyDataReceived(data)}: straight to the body's protocol
    once it has one, which is what Twisted's state dispatcher does then,
    without its name lookup and second call (once per read: a stream's
    every token).
    """
    if response._state == "CONNECTED":
        response._bodyProtocol.dataReceived(data)
    else:
        response._bodyDataReceived(data)


def coalescing(
    request: Callable[[Any], Deferred[Any]], wire_request: Any
) -> Deferred[Any]:
    """
    C{request(wire_request)}: a Twisted C{HTTP11ClientProtocol.request},
    which builds the response's parser as a L{_CoalescingParser}, so that
    a chunked body is decoded with L{CoalescingChunkedDecoder}.

    Twisted builds the parser inside that call, from its module's
    C{HTTPClientParser}, which names the subclass for the call only.
    (Swapping the built parser's C{__class__} instead made CPython keep its
    attributes in a dict of their own, as it must when an object changes
    class: every attribute the parser reads per read, and per head line,
    got slower; see L{nvproxy.proxy.cork.cover}.)
    """
    module: Any = _newclient
    before = module.HTTPClientParser
    module.HTTPClientParser = _CoalescingParser
    try:
        return request(wire_request)
    finally:
        module.HTTPClientParser = before
