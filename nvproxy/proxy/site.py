# -*- test-case-name: tests.test_facade -*-
"""
twisted.web plumbing for a facade port: a request that bounds its body and
leaves it unparsed, and a site that caps its connections.

What a client sees when a limit trips:

* body larger than C{max_body}: C{413} in the engine's error dialect, then the
  connection closes (the rest of the body is not read);
* more than C{max_connections} open connections: C{503} with C{Retry-After: 1}
  and an immediate close;
* no complete request within C{header_timeout} of silence: the connection is
  closed (twisted.web's idle timeout, suspended while a request is served).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IAddress
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

log = Logger()


class FacadeRequest(Request):
    """
    A request whose body is bounded and never parsed as a form: a proxy
    forwards bodies, and twisted.web's form parsing would read a whole
    multipart upload into memory.
    """

    # twisted.web adds text/html to a response without a content type; a
    # proxy relays the upstream's headers as they are.
    defaultContentType = None
    _received = 0
    _rejected = False

    def gotLength(self, length: int | None) -> None:
        limit = _site(self).max_body if self.channel else None
        if limit is not None and length is not None and length > limit:
            self._too_large()
            return
        Request.gotLength(self, length)

    def handleContentChunk(self, data: bytes) -> None:
        if self._rejected:
            return
        self._received += len(data)
        limit = _site(self).max_body
        if self._received > limit:
            self._too_large()
            return
        Request.handleContentChunk(self, data)

    def _too_large(self) -> None:
        self._rejected = True
        site = _site(self)
        body = site.error_body(413, f"request body exceeds {site.max_body} bytes")
        transport = self.channel.transport
        assert transport is not None
        transport.write(
            b"HTTP/1.1 413 Request Entity Too Large\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n"
            b"Connection: close\r\n\r\n" % len(body) + body
        )
        transport.loseConnection()

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if self._rejected:
            return
        # Hide the content type from twisted.web's form parser for the length
        # of the call; process() (called at its end) restores it.
        self._hidden_type = self.requestHeaders.getRawHeaders(b"content-type")
        self.requestHeaders.removeHeader(b"content-type")
        Request.requestReceived(self, command, path, version)

    def process(self) -> None:
        hidden = getattr(self, "_hidden_type", None)
        if hidden is not None:
            self.requestHeaders.setRawHeaders(b"content-type", hidden)
        Request.process(self)


def _site(request: Request) -> FacadeSite:
    site = request.channel.site  # type: ignore[attr-defined]
    assert isinstance(site, FacadeSite)
    return site


class _CountedChannel(HTTPChannel):
    def connectionMade(self) -> None:
        self.site.connections += 1
        HTTPChannel.connectionMade(self)

    site: FacadeSite

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.site.connections -= 1
        HTTPChannel.connectionLost(self, reason)


class _Overloaded(Protocol):
    def __init__(self, body: bytes) -> None:
        self._body = body

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\n"
            b"Content-Type: application/json\r\n"
            b"Retry-After: 1\r\n"
            b"Content-Length: %d\r\n"
            b"Connection: close\r\n\r\n" % len(self._body) + self._body
        )
        self.transport.loseConnection()


class FacadeSite(Site):
    """
    A site for one facade port.
    """

    protocol = _CountedChannel  # type: ignore[assignment]
    requestFactory = FacadeRequest
    noisy = False

    def __init__(
        self,
        resource: IResource,
        *,
        error_body: Callable[[int, str], bytes],
        max_body: int,
        max_connections: int,
        header_timeout: float,
        reactor: Any = None,
    ) -> None:
        Site.__init__(self, resource, timeout=header_timeout or None, reactor=reactor)
        self.error_body = error_body
        self.max_body = max_body
        self.max_connections = max_connections
        self.connections = 0
        self.displayTracebacks = False

    def buildProtocol(self, addr: IAddress | None) -> Any:
        if self.connections >= self.max_connections:
            log.warn(
                "connection limit {limit} reached, refusing a client",
                limit=self.max_connections,
            )
            return _Overloaded(self.error_body(503, "too many connections"))
        return Site.buildProtocol(self, addr)

    def log(self, request: Any) -> None:
        # Access logging goes through the facade's structured events.
        pass
