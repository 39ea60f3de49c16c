# -*- test-case-name: tests.test_attempt -*-
"""
The client's half of a proxied exchange: the twisted.web request, guarded
against writes after the connection went away, and how an answer that
cannot be completed is ended (in the stream's own error framing).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web.http import NO_BODY_CODES
from twisted.web.http_headers import Headers

from nvproxy.jsonhttp import write_json
from nvproxy.proxy.headers import CONTENT_LENGTH, CONTENT_TYPE, DATE, SERVER
from nvproxy.proxy.requestid import HEADER_KEY, request_id
from nvproxy.proxy.site import when_lost
from nvproxy.proxy.upstream import end_to_end

# What the facade set and the upstream's answer replaces.
_REPLACED = (SERVER, DATE, CONTENT_TYPE, CONTENT_LENGTH)


class ClientSide:
    """
    The client's half of a proxied exchange: the twisted.web request, guarded
    against writes after the connection went away.
    """

    def __init__(
        self,
        request: Any,
        error_body: Callable[[int, str, str | None], bytes],
    ) -> None:
        self.request = request
        self.gone = False
        self.aborted = False
        self._closed: Deferred[None] | None = None
        self._error_body = error_body
        when_lost(request, self._lost)

    @property
    def closed(self) -> Deferred[None]:
        """Fires once the client's connection is gone (made when asked for:
        only a cut stream waits for it)."""
        if self._closed is None:
            self._closed = succeed(None) if self.gone else Deferred()
        return self._closed

    def _lost(self, reason: Failure) -> None:
        self.gone = True
        closed = self._closed
        if closed is not None and not closed.called:
            closed.callback(None)

    def start(
        self, status: int, phrase: bytes, headers: Headers, length: object = None
    ) -> None:
        """
        Start the answer: the upstream's status and end-to-end headers,
        and its C{Content-Length} when C{length} (the response's) is one.
        Twisted's client takes that header out of the response's headers;
        without it the answer went to the client chunked, and now it goes
        framed as the engine framed it.
        """
        request = self.request
        request.setResponseCode(status, phrase or None)
        out = request.responseHeaders
        table = out._rawHeaders  # constant names (nvproxy.proxy.headers)
        for key in _REPLACED:
            table.pop(key, None)
        end_to_end(headers, into=out)
        if (
            type(length) is int
            and status not in NO_BODY_CODES
            and request.method != b"HEAD"
        ):
            table[CONTENT_LENGTH] = [b"%d" % length]
        rid = request_id(request)
        if rid is not None:
            # Ours, whatever the upstream answered with.
            table[HEADER_KEY] = [rid.encode("ascii")]

    def finish(self) -> None:
        if self.gone or self.request.finished:
            return
        self.request.finish()

    def abort(self) -> None:
        """
        End a committed response that cannot be completed: closing the
        connection is the only signal left (DESIGN §7, "Streaming").
        """
        if self.gone or self.request.finished:
            return
        self.aborted = True
        # Not loseConnection: it waits for buffered data to drain, forever
        # for a stalled client.  A reset is also the clearer signal.
        transport = getattr(getattr(self.request, "channel", None), "transport", None)
        if transport is not None and hasattr(transport, "abortConnection"):
            transport.abortConnection()
        else:
            self.request.loseConnection()

    def cut(self, frame: bytes | None, clock: IReactorTime) -> None:
        """
        End a committed answer that cannot be completed, telling the client
        so: C{frame} (the stream dialect's error event, if there is one) is
        written, then the connection is closed without the rest of the body
        (no last chunk, or fewer bytes than the Content-Length), so the
        client's HTTP layer sees the body cut too.  An answer that declared
        its length gets no frame: its bytes would be read as the body's rest.
        What was already relayed is flushed first; a client that does not
        take it within L{CUT_GRACE} seconds is reset.
        """
        if self.gone or self.request.finished:
            return
        self.aborted = True
        if frame is not None and not self.request.responseHeaders.hasHeader(
            b"content-length"
        ):
            self.request.write(frame)
        channel = getattr(self.request, "channel", None)
        flush = getattr(channel, "flush", None)
        if flush is not None:
            # Held for the end of this read (nvproxy.proxy.cork): it must
            # reach the transport before the close below.
            flush()
        transport = getattr(channel, "transport", None)
        if transport is None:
            self.request.loseConnection()
            return
        transport.loseConnection()
        if hasattr(transport, "abortConnection"):
            reset = clock.callLater(CUT_GRACE, transport.abortConnection)
            self.closed.addBoth(lambda _: reset.cancel() if reset.active() else None)

    def reject(
        self,
        status: int,
        message: str,
        retry_after: int | None = None,
        code: str | None = None,
    ) -> None:
        """
        Answer with a proxy-generated error in the engine's dialect.
        """
        if self.gone or self.request.finished:
            return
        body = self._error_body(status, message, code)
        write_json(self.request, status, body, retry_after)


CUT_GRACE = 5.0
"""Seconds a cut stream's client may take to read the error frame."""

TRUNCATED_MESSAGE = "the upstream connection ended before the response was complete"
IDLE_MESSAGE = "the upstream sent nothing for longer than the stream idle timeout"

_NDJSON = frozenset(
    {b"application/x-ndjson", b"application/ndjson", b"application/jsonl"}
)


def error_frame(
    content_type: bytes | None, message: str, at_line_start: bool = True
) -> bytes | None:
    """
    The error event that ends a cut stream in its own framing, so SDKs
    raise instead of silently stopping: SSE (OpenAI and llama.cpp)
    C{data: {"error": {...}}}, NDJSON (Ollama) an C{{"error": "..."}} line;
    C{None} for a body that is not a stream of events.  An SSE frame starts
    with a blank line, which ends a partial event and is otherwise ignored.
    """
    kind = (content_type or b"").split(b";", 1)[0].strip().lower()
    if kind == b"text/event-stream":
        error = {"message": message, "type": "server_error", "code": "upstream_cut"}
        return b"\n\ndata: " + json.dumps({"error": error}).encode() + b"\n\n"
    if kind in _NDJSON:
        line = json.dumps({"error": message}).encode() + b"\n"
        return line if at_line_start else b"\n" + line
    return None
