# -*- test-case-name: tests.test_forwarding -*-
"""
The one shared upstream HTTP stack: a persistent connection pool sized for a
proxy, an L{Agent} for the data path, treq on the same pool for control calls
(DESIGN §1), header hygiene and request-body producers.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import IO, Any

import treq
from treq.client import HTTPClient
from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.endpoints import (
    HostnameEndpoint,
    TCP4ClientEndpoint,
    TCP6ClientEndpoint,
    wrapClientTLS,
)
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import (
    IConsumer,
    IDelayedCall,
    IOpenSSLClientConnectionCreator,
    IStreamClientEndpoint,
)
from twisted.internet.ssl import optionsForClientTLS
from twisted.internet.task import Cooperator, TaskDone, TaskStopped
from twisted.python.failure import Failure
from twisted.web._newclient import (
    HTTP11ClientProtocol,
    Request,
    RequestNotSent,
    RequestTransmissionFailed,
    ResponseNeverReceived,
    _ensureValidMethod,
    _ensureValidURI,
)
from twisted.web.client import (
    URI,
    Agent,
    HTTPConnectionPool,
    _HTTP11ClientFactory,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IAgentEndpointFactory, IBodyProducer, IResponse
from zope.interface import implementer

from nvproxy.discovery import InventoryClient
from nvproxy.memo import keep_short
from nvproxy.proxy.backendauth import KeyedAgent
from nvproxy.proxy.chunked import coalescing
from nvproxy.proxy.cork import CORK, Turn, hold, release
from nvproxy.proxy.headers import CONNECTION, HOST, OwnHeaders, copy_headers

# RFC 9110 §7.6.1 plus the legacy names proxies traditionally drop.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)


_LISTED: dict[frozenset[bytes], frozenset[bytes]] = {}
"""C{HOP_BY_HOP | drop} for each C{drop} in use (a handful, all constants)."""


def end_to_end(
    headers: Headers,
    drop: frozenset[bytes] = frozenset(),
    into: Headers | None = None,
) -> Headers:
    """
    A copy of C{headers} without hop-by-hop headers (including those the
    C{Connection} header names) and without C{drop}; written into C{into}
    (over its headers of the same names) when given, else into new headers.
    """
    listed: frozenset[bytes] | set[bytes] | None = _LISTED.get(drop)
    if listed is None:
        listed = _LISTED[drop] = HOP_BY_HOP | drop
    connection = headers._rawHeaders.get(CONNECTION)
    if connection:
        listed = set(listed)
        for value in connection:
            for token in value.split(b","):
                token = token.strip().lower()
                if token:
                    listed.add(token)
    out = Headers() if into is None else into
    # Straight into the other Headers' table: its names are already in
    # canonical form and its values sanitized, which is all setRawHeaders
    # would do to them again (a name encoding and a scan of every value).
    table = out._rawHeaders
    for name, values in headers._rawHeaders.items():
        if name.lower() not in listed:
            table[name] = list(values)
    return out


# Headers the Agent computes for the upstream request itself.
REQUEST_DROP = frozenset({b"host", b"content-length"})


@implementer(IBodyProducer)
class BytesProducer:
    """
    A request body that is already in memory: written in one call.
    """

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.length = len(body)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        consumer.write(self.body)
        return succeed(None)

    def release(self) -> None:
        """Let the body go: nothing will send it again (L{release_body})."""
        self.body = b""

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


IN_MEMORY_LIMIT = 1 << 20
READ_SIZE = 1 << 16


def _reader(content: IO[bytes]) -> Callable[[int, int], bytes]:
    """
    Read C{n} bytes at C{offset} without moving anyone's file position:
    every attempt of a job streams the same buffered body.
    """
    if isinstance(content, io.BytesIO):
        view = content.getbuffer()
        return lambda offset, n: bytes(view[offset : offset + n])
    fd = content.fileno()
    return lambda offset, n: os.pread(fd, n, offset)


@implementer(IBodyProducer)
class RangeBodyProducer:
    """
    Streams a buffered request body with backpressure from its own offset.

    Unlike C{FileBodyProducer} it neither moves the shared file position nor
    closes the file, so a retry (another attempt, another producer) can send
    the same body again.
    """

    def __init__(self, content: IO[bytes], size: int, cooperator: Cooperator) -> None:
        self.length = size
        self._read = _reader(content)
        self._cooperator = cooperator
        self._task: Any = None

    def _chunks(self, consumer: IConsumer) -> Iterator[None]:
        offset = 0
        while offset < self.length:
            data = self._read(offset, min(READ_SIZE, self.length - offset))
            if not data:
                break
            consumer.write(data)
            offset += len(data)
            yield None

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        self._task = self._cooperator.cooperate(self._chunks(consumer))
        done: Deferred[None] = self._task.whenDone()

        def stopped(reason: Failure) -> Deferred[None] | Failure:
            if reason.check(CancelledError):
                self.stopProducing()
            elif not reason.check(TaskStopped):
                return reason
            # IBodyProducer: this Deferred never fires once stopped.
            return Deferred()

        done.addCallbacks(lambda _: None, stopped)
        return done

    def pauseProducing(self) -> None:
        self._task.pause()

    def resumeProducing(self) -> None:
        self._task.resume()

    def stopProducing(self) -> None:
        with contextlib.suppress(TaskDone):
            self._task.stop()


def body_producer(content: IO[bytes], cooperator: Cooperator) -> IBodyProducer | None:
    """
    A fresh producer for a buffered request body, or C{None} when it is empty.

    Small bodies are sent in one write; larger ones (twisted.web spools them to
    a temporary file) are streamed with backpressure, each attempt reading at
    its own offset, so a retry re-reads the file rather than holding a second
    copy and no two attempts disturb each other.
    """
    content.seek(0, os.SEEK_END)
    size = content.tell()
    content.seek(0)
    if size == 0:
        return None
    if size <= IN_MEMORY_LIMIT:
        data = content.read()
        content.seek(0)
        return BytesProducer(data)
    return RangeBodyProducer(content, size, cooperator)


def release_body(content: IO[bytes], producer: IBodyProducer | None) -> None:
    """
    Let an in-memory request body go once its attempt has committed: the
    engine has answered, so neither another attempt nor a resend on a fresh
    connection (L{_Reused}) can follow, and a long stream holds no copy of
    its prompt.  A body that went out in one write (L{BytesProducer}) is
    dropped by the producer and the request's buffer; one still streaming
    (L{RangeBodyProducer}: the engine may answer before it has read all of
    it) is left to the request's own cleanup.
    """
    if isinstance(producer, BytesProducer):
        producer.release()
    elif producer is not None:
        return
    if isinstance(content, io.BytesIO):
        content.close()


_KEPT = 4096
"""How many https endpoints and web PKI creators L{EndpointFactory} keeps
before it starts again (a fleet's worth; an address that changes often
must not grow them without bound)."""


@implementer(IAgentEndpointFactory)
class EndpointFactory:
    """
    Dials upstreams with the dial timeout and no happy-eyeballs delay, so a
    refused connection fails over at once (DESIGN §7, "Pool").

    @ivar tls_for: maps C{(host, port)} of an https URL to the connection
        creator to use (pinned peer mTLS); C{None} means ordinary
        certificate verification against the system roots.
    """

    def __init__(
        self,
        reactor: Any,
        dial_timeout: float,
        tls_for: Callable[[str, int], IOpenSSLClientConnectionCreator | None]
        | None = None,
    ) -> None:
        self._reactor = reactor
        self._timeout = dial_timeout if dial_timeout > 0 else 30.0
        self._tls_for = tls_for
        self._plain: dict[tuple[str, int], IStreamClientEndpoint] = {}
        self._tls: dict[
            tuple[str, int],
            tuple[IOpenSSLClientConnectionCreator, IStreamClientEndpoint],
        ] = {}
        self._web_pki: dict[str, IOpenSSLClientConnectionCreator] = {}

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        host = uri.host.decode("ascii")
        port = int(uri.port)
        if uri.scheme != b"https":
            # The Agent asks for an endpoint on every request, pooled or
            # not; plain ones are reusable, so build each once.
            cached = self._plain.get((host, port))
            if cached is None:
                cached = self._plain[host, port] = self._tcp(host, port)
            return cached
        # https: the creator may change with the cluster's pins, so it is
        # asked for each time; the endpoint is kept while it is the same
        # (a peer's creator, and so its SSL context, is kept per pin).
        creator = self._tls_for(host, port) if self._tls_for else None
        if creator is None:
            creator = self._web_pki.get(host)
            if creator is None:
                if len(self._web_pki) >= _KEPT:
                    self._web_pki.clear()
                creator = self._web_pki[host] = optionsForClientTLS(host)
        kept = self._tls.get((host, port))
        if kept is not None and kept[0] is creator:
            return kept[1]
        if len(self._tls) >= _KEPT:
            self._tls.clear()
        endpoint = wrapClientTLS(creator, self._tcp(host, port))
        self._tls[host, port] = (creator, endpoint)
        return endpoint

    def _tcp(self, host: str, port: int) -> IStreamClientEndpoint:
        """
        An IP literal is dialled directly.  L{HostnameEndpoint} would resolve
        it in a thread first, and a dial cancelled during that resolution
        (or a resolution that fails) surfaces as C{DNSLookupError}, so a
        refused or abandoned connection to C{127.0.0.1} could be logged as a
        failed DNS lookup.
        """
        if isIPAddress(host):
            return TCP4ClientEndpoint(self._reactor, host, port, timeout=self._timeout)
        if isIPv6Address(host):
            return TCP6ClientEndpoint(self._reactor, host, port, timeout=self._timeout)
        return HostnameEndpoint(
            self._reactor, host, port, timeout=self._timeout, attemptDelay=0
        )


class _ClientProtocol(HTTP11ClientProtocol):
    """
    Twisted's client protocol, decoding chunked bodies with
    L{nvproxy.proxy.chunked} and leaving no reference cycle behind a
    response: its parser and the parser's body decoder point at each other
    (C{HTTPClientParser._finished} is the decoder's callback), so every
    response would wait for the cyclic collector, with everything it holds.
    """

    expiry: IDelayedCall | None = None
    """The pool's timer for closing this connection once idle too long,
    kept while the connection is out of the pool (L{ProxyPool})."""

    def __init__(self, quiescentCallback: Any, turn: Turn | None = None) -> None:
        super().__init__(quiescentCallback)  # type: ignore[no-untyped-call]
        self._turn = turn

    def request(self, request: Any) -> Deferred[Any]:
        # The request's head and (in-memory) body leave in one send, in this
        # call, rather than at the next poll, when it is its turn's first
        # (nvproxy.proxy.cork.Turn).
        transport = self.transport
        turn = self._turn
        held = hold(transport) if turn is None or turn.available else None
        try:
            # chunked bodies handed on once per read, not once per chunk
            answer = coalescing(super().request, request)
        finally:
            if held is not None:
                release(transport, held, turn)
        return answer

    def dataReceived(self, data: bytes) -> None:
        # What this read makes the facades write leaves at its end
        # (nvproxy.proxy.cork).  CORK.during and Twisted's dataReceived,
        # inlined: each token of a stream is a read, and each call is a
        # share of what relaying it costs.
        cork = CORK
        outer = not cork.active
        cork.active = True
        try:
            parser: Any = self._parser  # None: caught, as Twisted catches it
            parser.dataReceived(data)
        except BaseException:
            self._giveUp(Failure())  # type: ignore[no-untyped-call]
        finally:
            if outer:
                cork.end()

    def _disconnectParser(self, reason: Failure) -> None:
        parser = self._parser
        super()._disconnectParser(reason)  # type: ignore[no-untyped-call]
        if parser is not None:
            parser.bodyDecoder = None

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        expiry, self.expiry = self.expiry, None
        if expiry is not None and expiry.active():
            expiry.cancel()  # (which also lets go of this protocol)
        super().connectionLost(reason)  # type: ignore[no-untyped-call]


class _QuietClientFactory(_HTTP11ClientFactory):
    # One factory per upstream connection: logging each start/stop at info
    # would flood the log with every poll.
    noisy = False

    def __init__(self, quiescentCallback: Any, metadata: Any, turn: Turn) -> None:
        super().__init__(quiescentCallback, metadata)  # type: ignore[no-untyped-call]
        self._turn = turn

    def buildProtocol(self, addr: Any) -> HTTP11ClientProtocol:
        return _ClientProtocol(self._quiescentCallback, self._turn)


def _stale(failure: Failure) -> bool:
    """
    Whether a request on a reused connection failed only because the engine
    had closed that connection: nothing was sent, or the engine's clean
    close (FIN) came before a single byte of response — the race between
    an engine's keep-alive close and our next request.  A reset (an engine
    that took the request and dropped it) and our own timeouts and
    cancellations (C{CancelledError}) never count.
    """
    exception = failure.value
    if isinstance(exception, RequestNotSent):
        return True
    if not isinstance(exception, (RequestTransmissionFailed, ResponseNeverReceived)):
        return False
    reasons = exception.reasons
    return bool(reasons) and all(
        reason.check(ConnectionDone) is not None for reason in reasons
    )


class _Reused:
    """
    A pooled connection handed out again.  Twisted retries a request that
    failed on a stale pooled connection only for idempotent methods without
    a body; inference is a POST with one.  Our body producers restart from
    the beginning, and an HTTP/1.1 engine closes a keep-alive connection only
    between requests, so a request that found the connection closed under it
    is sent once more on a new connection, inside the same attempt (it costs
    no dispatch: the engine never saw it).

    From outside, an engine that closes cleanly right after reading a
    request looks the same, so only a connection that sat idle for at least
    L{ProxyPool.stale_idle} seconds qualifies: engines close idle keep-alive
    connections after seconds (uvicorn and llama-server: 5 s), never within
    milliseconds of the last answer.
    """

    def __init__(
        self,
        connection: HTTP11ClientProtocol,
        new: Callable[[], Deferred[HTTP11ClientProtocol]],
    ) -> None:
        self._connection = connection
        self._new = new

    def request(self, request: Any) -> Deferred[Any]:
        d: Deferred[Any] = self._connection.request(request)

        def failed(reason: Failure) -> Deferred[Any] | Failure:
            if not _stale(reason):
                return reason
            again: Deferred[Any] = self._new().addCallback(
                lambda connection: connection.request(request)
            )
            return again

        return d.addErrback(failed)


class ProxyPool(HTTPConnectionPool):
    """
    The shared persistent pool, with one rule Twisted's lacks: a connection
    whose transport is already being closed is never handed out again.

    An attempt that abandons a response stops its transport; when the rest
    of that response was in the same socket read, the response still
    completes, and Twisted puts the connection back in the pool before the
    close takes effect.  Handing it to the next request would send that
    request down a connection that is about to close: the engine receives
    it and answers, and the attempt fails as a transport error anyway.
    """

    retryAutomatically = False  # L{_Reused} retries, with our rule
    stale_idle = 1.0
    """Seconds idle in the pool before a closed connection counts as stale."""

    def __init__(self, reactor: Any, persistent: bool = True) -> None:
        super().__init__(reactor, persistent)  # type: ignore[no-untyped-call]

    def closeCachedConnections(self) -> Deferred[None]:
        closed: Deferred[None] = super().closeCachedConnections()  # type: ignore[no-untyped-call]
        return closed

    def getConnection(self, key: Any, endpoint: IStreamClientEndpoint) -> Deferred[Any]:
        # HTTPConnectionPool.getConnection, plus the closing check.
        cached = self.cached(key, endpoint)
        if cached is not None:
            return succeed(cached)
        fresh: Deferred[Any] = self._newConnection(key, endpoint)
        return fresh

    def cached(self, key: Any, endpoint: IStreamClientEndpoint) -> Any | None:
        """
        A pooled connection for C{key} ready for a request, now (L{_Agent}
        sends on it without a Deferred in between), or C{None}.  It keeps
        the pool's own bookkeeping (C{_connections}, C{_timeouts}).  The
        expiry timer of a connection handed out is not cancelled: it is
        moved when the connection comes back (L{_putConnection}), and does
        nothing if it fires meanwhile.
        """
        connections = self._connections.get(key)
        while connections:
            connection = connections.pop(0)
            expiry = self._timeouts.pop(connection)
            transport = connection.transport
            if (
                connection.state != "QUIESCENT"
                or transport is None
                or getattr(transport, "disconnecting", False)
            ):
                if expiry.active():
                    expiry.cancel()
                continue
            idle = self._reactor.seconds() - (
                expiry.getTime() - self.cachedConnectionTimeout
            )
            if idle < self.stale_idle:
                return connection
            return _Reused(connection, lambda: self._newConnection(key, endpoint))
        return None

    def _putConnection(self, key: Any, connection: Any) -> None:
        # HTTPConnectionPool._putConnection, with the connection's own
        # expiry timer moved rather than a new one made each time: a new
        # timer and a cancelled one cost the reactor ten times a reset, on
        # every request.
        if connection.state != "QUIESCENT" or not isinstance(
            connection, _ClientProtocol
        ):
            super()._putConnection(key, connection)  # type: ignore[no-untyped-call]
            return
        connections = self._connections.setdefault(key, [])
        if len(connections) == self.maxPersistentPerHost:
            dropped = connections.pop(0)
            dropped.transport.loseConnection()
            self._timeouts.pop(dropped).cancel()
        connections.append(connection)
        expiry = connection.expiry
        if expiry is not None and expiry.active():
            expiry.reset(self.cachedConnectionTimeout)
        else:
            expiry = connection.expiry = self._reactor.callLater(
                self.cachedConnectionTimeout, self._expire, key, connection
            )
        self._timeouts[connection] = expiry

    def _expire(self, key: Any, connection: _ClientProtocol) -> None:
        connection.expiry = None
        if connection in self._timeouts:  # idle in the pool, not out in use
            self._removeConnection(key, connection)  # type: ignore[no-untyped-call]


@keep_short(512, longest=512)
def _parsed(uri: bytes) -> tuple[URI, bytes, bytes]:
    """
    A request URL parsed as C{Agent.request} parses it, with its origin
    form and the C{Host} value C{Agent} would compute: an upstream is asked
    for the same few URLs over and over.  The URI is shared, and nothing in
    Twisted's request path changes it.
    """
    parsed = URI.fromBytes(_ensureValidURI(uri.strip()))
    host = parsed.host
    if isIPv6Address(host.decode("ascii")):
        host = b"[" + host + b"]"
    if (parsed.scheme, parsed.port) not in ((b"http", 80), (b"https", 443)):
        host = b"%b:%d" % (host, parsed.port)
    return parsed, parsed.originForm, host


class _Agent(Agent):
    """
    Twisted's L{Agent}, with each URL parsed once (L{_parsed}): parsing it,
    rebuilding its path and its C{Host} value was 5 % of a request's
    instructions.  Its requests write an in-memory body themselves
    (L{_Request}) and go out at once on a pooled connection
    (L{ProxyPool.cached}).
    """

    def request(
        self,
        method: bytes,
        uri: bytes,
        headers: Headers | None = None,
        bodyProducer: IBodyProducer | None = None,
    ) -> Deferred[IResponse]:
        parsed, origin, host = _parsed(uri)
        # L{EndpointFactory} dials any scheme: no SchemeNotSupported to catch.
        endpoint = self._getEndpoint(parsed)  # type: ignore[no-untyped-call]
        # As Agent does: the caller's headers are never changed (one set may
        # go to several URLs), a copy gets the Host.
        # Headers made for this request alone (an attempt's) get it in place.
        if headers is None:
            headers = Headers({b"host": [host]})
        elif type(headers) is OwnHeaders:
            headers._rawHeaders.setdefault(HOST, [host])  # a valid URI's
        elif not headers.hasHeader(b"host"):
            headers = copy_headers(headers)
            headers.setRawHeaders(b"host", [host])
        # Agent._requestWithEndpoint, without its second Host check and its
        # closure, with a request that writes an in-memory body itself, and
        # sent at once on a pooled connection (no Deferred in between).
        if not isinstance(method, bytes):
            raise TypeError(f"method={method!r} is {type(method)}, but must be bytes")
        request = _Request._construct(  # type: ignore[no-untyped-call]
            _ensureValidMethod(method),
            origin,
            headers,
            bodyProducer,
            persistent=self._pool.persistent,
            parsedURI=parsed,
        )
        key = (parsed.scheme, parsed.host, parsed.port)
        pool = self._pool
        if isinstance(pool, ProxyPool):
            cached = pool.cached(key, endpoint)
            if cached is not None:
                return _send(cached, request)
        connected = pool.getConnection(key, endpoint)
        answer: Deferred[IResponse] = connected.addCallback(_send, request)
        return answer


def _send(connection: Any, request: Any) -> Deferred[IResponse]:
    sent: Deferred[IResponse] = connection.request(request)
    return sent


class _Request(Request):
    """
    Twisted's client request, writing a body already in memory
    (L{BytesProducer}) with its head, as it writes an empty one.  Through
    C{IBodyProducer} the same bytes took two Deferreds of Twisted's and the
    producer's own, a length-checking consumer, six closures and a producer
    registered with the transport and unregistered again: about a tenth of
    the calls a proxied request makes.
    """

    def writeTo(self, transport: Any) -> Deferred[None]:
        producer = self.bodyProducer
        if type(producer) is not BytesProducer:
            written: Deferred[None] = super().writeTo(transport)  # type: ignore[no-untyped-call]
            return written
        self._writeHeaders(transport, b"Content-Length: %d\r\n" % producer.length)  # type: ignore[no-untyped-call]
        transport.write(producer.body)
        return succeed(None)


class Upstream:
    """
    The shared pool, the data-path agent and the control-path treq client.

    @param backend_keys: engine base URL -> the key it wants (see
        L{nvproxy.proxy.backendauth}).
    """

    def __init__(
        self,
        reactor: Any,
        dial_timeout: float,
        tls_for: Callable[[str, int], IOpenSSLClientConnectionCreator | None]
        | None = None,
        max_per_host: int = 256,
        backend_keys: Mapping[str, str] | None = None,
    ) -> None:
        self.pool = ProxyPool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = max_per_host
        self.pool.cachedConnectionTimeout = 120
        self.pool._factory = partial(  # type: ignore[assignment]
            _QuietClientFactory, turn=Turn(reactor)
        )
        self.agent: IAgent = _Agent.usingEndpointFactory(  # type: ignore[no-untyped-call]
            reactor, EndpointFactory(reactor, dial_timeout, tls_for), self.pool
        )
        if backend_keys:
            # Engines that want a key get it on every request to them.
            self.agent = KeyedAgent(self.agent, backend_keys)
        self.treq = HTTPClient(self.agent)
        self.cooperator = Cooperator(scheduler=lambda f: reactor.callLater(0, f))

    def close(self) -> Deferred[None]:
        closed: Deferred[None] = self.pool.closeCachedConnections()
        return closed


_ACCEPT_JSON: dict[bytes | str, list[bytes | str]] = {b"accept": [b"application/json"]}


class TreqInventoryClient(InventoryClient):
    """
    L{nvproxy.discovery.InventoryClient} over treq on the shared pool.
    """

    def __init__(self, client: HTTPClient, clock: Any) -> None:
        self._client = client
        self._clock = clock

    def get_json(self, url: str, timeout: float) -> Deferred[Any]:
        async def get() -> Any:
            response = await self._client.get(url, headers=_ACCEPT_JSON)
            if response.code != 200:
                await treq.content(response)
                raise ValueError(f"HTTP {response.code}")
            return await treq.json_content(response)

        d = Deferred.fromCoroutine(get())
        d.addTimeout(timeout, self._clock)
        return d
