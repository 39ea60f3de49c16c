# -*- test-case-name: tests.test_listener -*-
"""
One facade port, two personalities, told apart by the connection's first byte (§7).

A TLS ClientHello always starts with the handshake record type ``0x16``; an HTTP
request line never does. So::

    accept ─► connectionMade: note whether the peer is loopback
                 │   (not loopback and no TLS personality ─► close now)
                 │   start the first-byte timer
                 ▼
              first byte ── 0x16 ──► TLS personality  (mTLS, any peer address)
                 │                      no TLS configured ─► close
                 └─ else ───────────► plaintext personality (loopback peers only)
                                        other peers ─► close, nothing parsed
              timer fires first ───► abort the connection

A plaintext personality whose protocol has C{adopt_deadline} (the facade's
channel) takes the first-byte timer over as its header deadline, moved to
start at the first byte, instead of the timer being cancelled and a new
one made (Twisted keeps a cancelled call in its heap until it would have
been due, so every connection left one behind).  The timer is then the
protocol's to move and cancel; when it fires it calls what
C{adopt_deadline} returned.

The chosen personality's protocol is connected to the *real* transport and handed
every byte received so far, then every later byte, so producer/consumer flow control,
``getPeer``/``getHost`` and (for TLS) ``getPeerCertificate`` behave exactly as on a
dedicated port.

Loopback means 127.0.0.0/8, ``::1`` and IPv4-mapped ``::ffff:127.0.0.0/104`` (a
dual-stack listener sees IPv4 clients that way; ``ipaddress`` does not call those
loopback on Python 3.11, so the mapping is unwrapped first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from OpenSSL import SSL
from twisted.application.service import Service
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.internet.interfaces import (
    IAddress,
    IDelayedCall,
    IListeningPort,
    IOpenSSLServerConnectionCreator,
    IProtocol,
    IProtocolFactory,
    IReactorTCP,
    IReactorTime,
    ITCPTransport,
)
from twisted.internet.protocol import Protocol, ServerFactory, connectionDone
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory, TLSMemoryBIOProtocol
from twisted.python.failure import Failure

from nvproxy.logs import clip
from nvproxy.net import is_loopback

__all__ = [
    "TLS_HANDSHAKE_RECORD",
    "CannotListen",
    "DemuxFactory",
    "PortListener",
    "is_loopback",
    "listen_facade",
    "tls_personality",
]

log = Logger()

#: The first byte of every TLS connection: a handshake record (the ClientHello).
TLS_HANDSHAKE_RECORD = 0x16


class _DemuxProtocol(Protocol):
    """
    Waits for the first byte, then becomes a pipe to the chosen personality.

    States: I{waiting} (C{_timer} set, C{_inner} None), I{handed off} (C{_inner}
    set), I{closed} (C{_closed} true; every later byte is dropped).
    C{_adopted} is what the timer calls once the inner protocol took it over.
    """

    def __init__(self, factory: DemuxFactory, addr: IAddress) -> None:
        self._factory = factory
        self._addr = addr
        self._inner: IProtocol | None = None
        self._timer: IDelayedCall | None = None
        self._closed = False
        self._plaintext_allowed = False
        self._adopted: Callable[[], None] | None = None

    def connectionMade(self) -> None:
        assert self.transport is not None
        peer = self.transport.getPeer()
        self._plaintext_allowed = self._factory.allow_plaintext_from(peer)
        if not self._plaintext_allowed and self._factory.tls is None:
            # This peer can only ever be refused: do not wait for its first byte.
            log.info(
                "refused connection from {peer}: not in access.plaintext_from"
                " and no TLS personality",
                peer=str(peer),
            )
            self._close()
            return
        self._timer = self._factory.clock.callLater(
            self._factory.first_byte_timeout, self._first_byte_timed_out
        )

    def dataReceived(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.dataReceived(data)
            return
        if self._closed or not data:
            return
        assert self.transport is not None
        peer = self.transport.getPeer()
        factory: IProtocolFactory
        if data[0] == TLS_HANDSHAKE_RECORD:
            if self._factory.tls is None:
                log.info(
                    "refused TLS connection from {peer}: no TLS personality",
                    peer=str(peer),
                )
                self._close()
                return
            factory = self._factory.tls
        else:
            if not self._plaintext_allowed:
                log.info(
                    "refused plaintext connection from {peer}:"
                    " not in access.plaintext_from",
                    peer=str(peer),
                )
                self._close()
                return
            factory = self._factory.plaintext
        inner = factory.buildProtocol(self._addr)
        if inner is None:
            self._close()
            return
        # Looked up on the class: a protocol wrapper (the TLS side) forwards
        # unknown instance attributes to its transport.
        adopt = getattr(type(inner), "adopt_deadline", None)
        timer = self._timer
        if adopt is not None and timer is not None and timer.active():
            self._timer = None
            self._adopted = adopt(inner, timer)
        else:
            self._cancel_timer()
        self._inner = inner
        inner.makeConnection(self.transport)
        inner.dataReceived(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._cancel_timer()
        self._closed = True
        self._adopted = None
        inner, self._inner = self._inner, None
        if inner is not None:
            inner.connectionLost(reason)

    def _first_byte_timed_out(self) -> None:
        adopted = self._adopted
        if adopted is not None:
            adopted()  # the inner protocol's deadline now
            return
        self._timer = None
        assert self.transport is not None
        log.debug(
            "dropped {peer}: no first byte within {timeout}s",
            peer=str(self.transport.getPeer()),
            timeout=self._factory.first_byte_timeout,
        )
        self._closed = True
        transport = self.transport
        if ITCPTransport.providedBy(transport):
            ITCPTransport(transport).abortConnection()
        else:
            transport.loseConnection()

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _close(self) -> None:
        self._cancel_timer()
        self._closed = True
        assert self.transport is not None
        self.transport.loseConnection()


class DemuxFactory(ServerFactory):
    """
    A listening port's factory that hands each connection to C{tls} (first byte
    0x16) or to C{plaintext} (anything else, peers accepted by
    C{allow_plaintext_from} only).

    @param plaintext: builds the plaintext personality (e.g. a twisted.web C{Site}).
    @param tls: builds the TLS personality, normally L{tls_personality}; L{None}
        closes every TLS connection.
    @param clock: schedules the first-byte timeout.
    @param first_byte_timeout: seconds a connection may stay silent before its
        first byte; it is then aborted.
    @param allow_plaintext_from: the loopback gate.
    """

    def __init__(
        self,
        plaintext: IProtocolFactory,
        tls: IProtocolFactory | None,
        clock: IReactorTime,
        first_byte_timeout: float = 10.0,
        allow_plaintext_from: Callable[[IAddress], bool] = is_loopback,
    ) -> None:
        self.plaintext = plaintext
        self.tls = tls
        self.clock = clock
        self.first_byte_timeout = first_byte_timeout
        self.allow_plaintext_from = allow_plaintext_from

    # The listener logs its own start and stop, without object reprs.
    noisy = False

    def _personalities(self) -> list[IProtocolFactory]:
        return [self.plaintext] if self.tls is None else [self.plaintext, self.tls]

    def startFactory(self) -> None:
        for factory in self._personalities():
            factory.doStart()

    def stopFactory(self) -> None:
        for factory in self._personalities():
            factory.doStop()

    def buildProtocol(self, addr: IAddress | None) -> _DemuxProtocol:
        assert addr is not None
        protocol = _DemuxProtocol(self, addr)
        protocol.factory = self
        return protocol


class _TLSProtocol(TLSMemoryBIOProtocol):
    """
    Server-side TLS whose failures (garbage after a 0x16, a failed
    handshake, a broken record) are an expected client error: one debug
    line with OpenSSL's reason, never a traceback.
    """

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        # The TLS layer keeps the error that ended it in _reason and hands
        # it to the wrapped protocol in place of the transport's reason.
        why = getattr(self, "_reason", None) or reason
        if why.check(SSL.Error) is not None:
            transport = self.transport
            log.debug(
                "TLS with {peer} failed: {reason}",
                peer=str(transport.getPeer()) if transport is not None else "?",
                reason=clip(why.getErrorMessage()),
            )
        super().connectionLost(reason)  # type: ignore[no-untyped-call]


class _TLSPersonality(TLSMemoryBIOFactory):
    protocol = _TLSProtocol
    noisy = False


def tls_personality(
    creator: IOpenSSLServerConnectionCreator,
    wrapped: IProtocolFactory,
    clock: IReactorTime,
) -> TLSMemoryBIOFactory:
    """
    The TLS personality: C{wrapped} (e.g. a C{Site}) behind a server-side TLS
    layer whose connections come from C{creator} (see L{nvproxy.cluster.ServerTLS}).
    """
    return _TLSPersonality(creator, False, wrapped, clock)


def listen_facade(
    reactor: IReactorTCP,
    clock: IReactorTime,
    port: int,
    interface: str,
    plaintext: IProtocolFactory,
    tls: IProtocolFactory | None,
    *,
    first_byte_timeout: float = 10.0,
) -> Deferred[IListeningPort]:
    """
    Listen on C{interface}:C{port} with a L{DemuxFactory} (what C{TCP4ServerEndpoint}
    and C{TCP6ServerEndpoint} do, typed). An IPv6 interface such as ``"::"`` is
    dual-stack on most systems, which is where the IPv4-mapped loopback form comes
    from. A port that cannot be bound fails the Deferred with C{CannotListenError}.
    """
    factory = DemuxFactory(plaintext, tls, clock, first_byte_timeout)
    try:
        listening = reactor.listenTCP(port, factory, interface=interface)
    except Exception:
        return fail()
    return succeed(listening)


# Twisted's default is 50: a burst of connections beyond that (500 clients
# opening streams at once) is dropped by the kernel and retried by the
# clients a second or more later.  The kernel caps it at net.core.somaxconn
# (4096 on current Linux).
BACKLOG = 4096


def _server_endpoint(reactor: Any, interface: str, port: int) -> Any:
    if ":" in interface:
        return TCP6ServerEndpoint(reactor, port, backlog=BACKLOG, interface=interface)
    return TCP4ServerEndpoint(reactor, port, backlog=BACKLOG, interface=interface)


def _port_of(port: IListeningPort) -> int:
    address = port.getHost()
    assert isinstance(address, (IPv4Address, IPv6Address))
    return address.port


class CannotListen(Exception):
    """A facade could not bind its port (the reason is the message)."""


class PortListener(Service):
    """
    One listening port whose failure to bind is logged and contained: the
    other facades keep running (spec §3.2).

    @ivar ready: fires once the first bind was tried: C{True} if it listens.
    @ivar error: why the last bind failed, else L{None}.
    """

    def __init__(
        self,
        reactor: Any,
        label: str,
        interface: str,
        port: int,
        factory: IProtocolFactory,
        optional: bool = False,
    ) -> None:
        self._reactor = reactor
        self._optional = optional
        self.label = label
        self.interface = interface
        self.port = port
        self._factory = factory
        self.listening: IListeningPort | None = None
        self.error: str | None = None
        self.ready: Deferred[bool] = Deferred()

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._listen()

    def _listen(self) -> None:
        endpoint = _server_endpoint(self._reactor, self.interface, self.port)
        d = endpoint.listen(self._factory)
        d.addCallbacks(self._listening, self._failed)

    def _listening(self, port: IListeningPort) -> None:
        self.listening = port
        self.error = None
        log.info(
            "{label} listening on {interface}:{port}",
            label=self.label,
            interface=self.interface,
            port=_port_of(port),
        )
        if not self.ready.called:
            self.ready.callback(True)

    def _failed(self, reason: Failure) -> None:
        self.error = str(reason.value)
        emit = log.warn if self._optional else log.error
        emit(
            "{label} cannot listen on {interface}:{port}: {error}",
            label=self.label,
            interface=self.interface,
            port=self.port,
            error=self.error,
        )
        if not self.ready.called:
            self.ready.callback(False)

    def stopService(self) -> Deferred[None] | None:
        super().stopService()  # type: ignore[no-untyped-call]
        port, self.listening = self.listening, None
        if port is not None:
            log.info(
                "{label} stopped listening on {interface}:{port}",
                label=self.label,
                interface=self.interface,
                port=_port_of(port),
            )
            stopped: Deferred[None] | None = port.stopListening()
            return stopped
        return None

    def move(self, port: int) -> Deferred[None]:
        """
        Listen on C{port} instead; the old port is released only once the
        new one is bound, so a failed move leaves the facade where it was.
        """
        endpoint = _server_endpoint(self._reactor, self.interface, port)

        async def move() -> None:
            new = await endpoint.listen(self._factory)
            old, self.listening = self.listening, new
            self.port = port
            self.error = None
            log.info("{label} moved to port {port}", label=self.label, port=port)
            if old is not None:
                stopped = old.stopListening()
                if stopped is not None:
                    await stopped

        return Deferred.fromCoroutine(move())

    def bound_port(self) -> int | None:
        if self.listening is None:
            return None
        return _port_of(self.listening)
