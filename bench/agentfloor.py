"""
A diagnostic reference: the proxy nvproxy's data path is built from, with
none of nvproxy's work.  A bare C{twisted.web} leaf resource forwards each
request through C{twisted.web.client.Agent} on one persistent
C{HTTPConnectionPool} (HTTP/1.1 to the upstream, connections reused) and
relays the answer as it arrives (hop-by-hop headers dropped with nvproxy's
own C{end_to_end}); no routing, retries, events, metrics,
access log or limits.

    python -m bench.agentfloor --port 0 --upstream 127.0.0.1:11434

It prints C{listening on HOST:PORT} once ready and runs until SIGTERM/SIGINT.
Twisted's C{ReverseProxyResource} (L{bench.rpr}) opens a new upstream
connection per request; this one does not, so the two differ in their
client, and the gap between this floor and nvproxy is nvproxy's own work.
"""

from __future__ import annotations

from collections.abc import Sequence
from io import BytesIO
from typing import Any

from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool
from twisted.web.iweb import IResponse
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from bench.refserver import QuietSite, run
from nvproxy.proxy.upstream import end_to_end

# Besides the hop-by-hop headers: what each side sets itself.
_DROP = frozenset({b"content-length", b"host", b"date", b"server"})


class _Request(Request):
    defaultContentType = None  # relay the upstream's


class _Site(QuietSite):
    requestFactory = _Request


class _Relay(Protocol):
    def __init__(self, request: Any) -> None:
        self._request = request

    def dataReceived(self, data: bytes) -> None:
        if not self._request._disconnected:
            self._request.write(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if not self._request.finished and not self._request._disconnected:
            self._request.finish()


class _Front(Resource):
    isLeaf = True

    def __init__(self, agent: Agent, upstream: bytes) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._agent = agent
        self._upstream = upstream

    def render(self, request: Any) -> object:
        body = request.content.read()
        d = self._agent.request(
            request.method,
            self._upstream + request.uri,
            end_to_end(request.requestHeaders, _DROP),
            FileBodyProducer(BytesIO(body)) if body else None,
        )

        def answered(response: IResponse) -> None:
            request.setResponseCode(response.code)
            for name, values in end_to_end(response.headers, _DROP).getAllRawHeaders():
                request.responseHeaders.setRawHeaders(name, values)
            response.deliverBody(_Relay(request))

        def failed(reason: Failure) -> None:
            if not request.finished and not request._disconnected:
                request.setResponseCode(502)
                request.finish()

        d.addCallbacks(answered, failed)
        return NOT_DONE_YET


def floor_agent(reactor: Any) -> Agent:
    """The floors' client: C{Agent} on one persistent pool (the lean and
    facade floors use this same one, so only their server sides differ)."""
    pool = HTTPConnectionPool(reactor, persistent=True)
    pool.maxPersistentPerHost = 4096
    return Agent(reactor, pool=pool)


def _site(reactor: Any, upstream: str) -> Site:
    front = _Front(floor_agent(reactor), f"http://{upstream}".encode())
    return _Site(front, reactor=reactor)  # type: ignore[no-untyped-call]


def main(argv: Sequence[str] | None = None) -> None:
    """Run the reference proxy until SIGTERM/SIGINT."""
    run(
        "python -m bench.agentfloor",
        "A bare Agent proxy on a persistent pool, as a reference.",
        _site,
        backlog=4096,
        argv=argv,
    )


if __name__ == "__main__":
    main()
