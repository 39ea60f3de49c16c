"""
A diagnostic reference: the Agent floor (L{bench.agentfloor}) with its
C{twisted.web} server side replaced by the least an HTTP/1.1 server can do.

Each request's head is parsed in one piece once it is whole, its body
(C{Content-Length} only) forwarded through C{twisted.web.client.Agent} on
one persistent C{HTTPConnectionPool}, exactly as the Agent floor does (the
same body producer, the same hop-by-hop headers dropped), and the answer
relayed with chunked framing as C{Agent} hands it on.  Requests on one
connection are answered one at a time.  No limits, timeouts, URL parsing,
resource tree or C{Request} object: it is not a server anyone should run,
only a measure of what twisted.web's server layer costs a proxy
(Agent floor minus this) and of what nvproxy costs beyond the least a
proxy on C{Agent} must do.

    python -m bench.leanfloor --port 0 --upstream 127.0.0.1:11434

It prints C{listening on HOST:PORT} once ready and runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

from collections.abc import Sequence
from io import BytesIO
from typing import Any

from twisted.internet.protocol import Protocol, ServerFactory, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import (
    Agent,
    FileBodyProducer,
    ResponseDone,
)
from twisted.web.http import RESPONSES, PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from bench.agentfloor import floor_agent
from bench.refserver import run
from nvproxy.proxy.upstream import HOP_BY_HOP

# Hop-by-hop headers, and what each side sets itself (as the Agent floor).
_DROP = HOP_BY_HOP | {b"content-length", b"host", b"date", b"server"}


class _Relay(Protocol):
    """The upstream answer's body, each piece as one chunk to the client."""

    def __init__(self, front: LeanChannel) -> None:
        self._front = front

    def dataReceived(self, data: bytes) -> None:
        transport = self._front.transport
        if transport is not None:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        # (not Failure.check, which names each class it is given, per call)
        if isinstance(reason.value, ResponseDone | PotentialDataLoss):
            self._front.answered(b"0\r\n\r\n")
        else:
            # Cut short: no last chunk, so the client sees it was.
            self._front.abandon()


class LeanChannel(Protocol):
    """One client connection: a request at a time, its head in one piece."""

    factory: LeanFactory
    _buffer = b""
    _busy = False

    def dataReceived(self, data: bytes) -> None:
        self._buffer += data
        if not self._busy:
            self._next()

    def _next(self) -> None:
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = buffer[:end].split(b"\r\n")
        try:
            method, target, _version = lines[0].split(b" ")
        except ValueError:
            self._close(400)
            return
        headers: dict[bytes, list[bytes]] = {}
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.lower()
            value = value.strip(b" \t")
            if name == b"content-length" and value.isdigit():
                length = int(value)
            elif name == b"transfer-encoding":
                self._close(501)  # a reference needs no chunked bodies
                return
            elif name not in _DROP:
                headers.setdefault(name, []).append(value)
        whole = end + 4 + length
        if len(buffer) < whole:
            return
        body = buffer[end + 4 : whole]
        self._buffer = buffer[whole:]
        self._busy = True
        forwarded = Headers()
        forwarded._rawHeaders = headers
        d = self.factory.agent.request(
            method,
            self.factory.upstream + target,
            forwarded,
            FileBodyProducer(BytesIO(body)) if body else None,
        )
        d.addCallbacks(self._relay, self._failed)

    def _relay(self, response: IResponse) -> None:
        head = [
            b"HTTP/1.1 %d %b\r\n" % (response.code, RESPONSES.get(response.code, b""))
        ]
        for name, values in response.headers.getAllRawHeaders():
            if name.lower() not in _DROP:
                head.extend(b"%b: %b\r\n" % (name, value) for value in values)
        head.append(b"Transfer-Encoding: chunked\r\n\r\n")
        if self.transport is not None:
            self.transport.write(b"".join(head))
        response.deliverBody(_Relay(self))

    def _failed(self, reason: Failure) -> None:
        self.answered(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")

    def answered(self, last: bytes) -> None:
        """The answer's last bytes: write them, then the next request."""
        if self.transport is None:
            return
        self.transport.write(last)
        self._busy = False
        if self._buffer:
            self._next()

    def abandon(self) -> None:
        """The answer was cut short after its head: close the connection."""
        if self.transport is not None:
            self.transport.loseConnection()

    def _close(self, status: int) -> None:
        if self.transport is not None:
            self.transport.write(
                b"HTTP/1.1 %d %b\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                % (status, RESPONSES.get(status, b""))
            )
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.transport = None


class LeanFactory(ServerFactory[LeanChannel]):
    protocol = LeanChannel
    noisy = False

    def __init__(self, agent: Agent, upstream: bytes) -> None:
        self.agent = agent
        self.upstream = upstream


def _factory(reactor: Any, upstream: str) -> LeanFactory:
    return LeanFactory(floor_agent(reactor), f"http://{upstream}".encode())


def main(argv: Sequence[str] | None = None) -> None:
    """Run the reference proxy until SIGTERM/SIGINT."""
    run(
        "python -m bench.leanfloor",
        "The Agent floor behind a minimal HTTP/1.1 server, as a reference.",
        _factory,
        backlog=4096,
        argv=argv,
    )


if __name__ == "__main__":
    main()
