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
from typing import Any

from twisted.web._newclient import HTTPClientParser
from twisted.web.http import (
    _ChunkedTransferDecoder,
    _chunkExtChars,
    _DataLoss,
    _MalformedChunkedDataError,
    maxChunkSizeLineLength,
)

__all__ = ["CoalescingChunkedDecoder", "coalesce_chunks"]

_LENGTH, _BODY, _CRLF, _TRAILER, _FINISHED = range(5)
_MAX_TRAILER = 2**16
_is_hex = re.compile(rb"[0-9a-fA-F]+").fullmatch
"""Twisted's C{_ishexdigits} (1*HEXDIG), at C speed."""
_WHOLE_SIZE_LINE = re.compile(rb"([0-9a-fA-F]{1,16})\r\n").match
"""A size line without extensions, well within C{maxChunkSizeLineLength}."""


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
        if self._state == _FINISHED:
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
        if state == _LENGTH:
            # The hot loop: whole chunks without extensions, each one C-level
            # match and one slice.  Anything else (a chunk cut by the read,
            # an extension, the last chunk, an error) is left to the loop
            # below, from the same position.
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
    """Twisted's response parser, with L{CoalescingChunkedDecoder}."""

    def switchToBodyMode(self, decoder: Any) -> None:
        if type(decoder) is _ChunkedTransferDecoder:
            decoder = CoalescingChunkedDecoder(
                decoder.dataCallback, decoder.finishCallback
            )
        super().switchToBodyMode(decoder)  # type: ignore[no-untyped-call]


def coalesce_chunks(parser: Any) -> None:
    """
    Make C{parser} (a Twisted C{HTTPClientParser}, before its headers are
    in) decode a chunked body with L{CoalescingChunkedDecoder}.  Twisted
    builds the parser inside C{HTTP11ClientProtocol.request}; its class is
    swapped for a subclass that differs only there (no instance attribute,
    so no reference cycle through the parser).
    """
    if type(parser) is HTTPClientParser:
        parser.__class__ = _CoalescingParser
