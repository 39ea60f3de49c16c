# -*- test-case-name: tests.test_listener -*-
"""
Tests for L{nvproxy.proxy.listener}: the first-byte demultiplexer and the loopback gate.

Real TLS through the demux (handshakes, peer certificates, keep-alive) is exercised
in L{tests.test_cluster}; here everything runs on C{StringTransport} and C{Clock}.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from OpenSSL import SSL
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.error import CannotListenError, ConnectionDone
from twisted.internet.interfaces import (
    IAddress,
    IOpenSSLServerConnectionCreator,
    IPushProducer,
    ITCPTransport,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import (
    MemoryReactor,
    RaisingMemoryReactor,
    StringTransport,
)
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from nvproxy.proxy.listener import (
    DemuxFactory,
    is_loopback,
    listen_facade,
    tls_personality,
)

LOOPBACK_PEERS: list[IAddress] = [
    IPv4Address("TCP", "127.0.0.1", 40001),
    IPv4Address("TCP", "127.0.0.2", 40002),
    IPv4Address("TCP", "127.255.255.254", 40003),
    IPv6Address("TCP", "::1", 40004),
    IPv6Address("TCP", "::ffff:127.0.0.1", 40005),
    IPv6Address("TCP", "::ffff:127.1.2.3", 40006),
]

REMOTE_PEERS: list[IAddress] = [
    IPv4Address("TCP", "10.0.0.5", 40011),
    IPv4Address("TCP", "192.168.1.2", 40012),
    IPv4Address("TCP", "0.0.0.0", 40013),
    IPv6Address("TCP", "::ffff:10.0.0.5", 40014),
    IPv6Address("TCP", "::ffff:192.168.1.2", 40015),
    IPv6Address("TCP", "2001:db8::1", 40016),
    IPv6Address("TCP", "::", 40017),
    IPv6Address("TCP", "fe80::1", 40018),
    IPv4Address("TCP", "localhost", 40019),  # a name, not an address
    UNIXAddress(b"/run/nvproxy.sock"),
]

REQUEST = b"GET /api/tags HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
CLIENT_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32))


class Recorder(Protocol):
    """Records what the demux delivers, as a list of events."""

    def __init__(self, events: list[tuple[str, object]]) -> None:
        self.events = events

    def connectionMade(self) -> None:
        self.events.append(("made", self.transport))

    def dataReceived(self, data: bytes) -> None:
        self.events.append(("data", data))

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.events.append(("lost", reason.type))


class RecordingFactory(Factory):
    """Builds L{Recorder}s that share one event list; counts doStart/doStop."""

    recorder: type[Recorder] = Recorder

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []
        self.built: list[IAddress | None] = []

    def buildProtocol(self, addr: IAddress | None) -> Recorder:
        self.built.append(addr)
        return self.recorder(self.events)

    def received(self) -> bytes:
        return b"".join(
            data
            for kind, data in self.events
            if kind == "data" and isinstance(data, bytes)
        )


@implementer(ITCPTransport)
class TCPStringTransport(StringTransport):
    """A C{StringTransport} that says it is TCP, so C{abortConnection} is used."""

    aborted = False

    def abortConnection(self) -> None:
        self.aborted = True
        super().abortConnection()


class Harness:
    """One demux connection from C{peer} on a C{StringTransport}."""

    def __init__(
        self,
        peer: IAddress,
        *,
        tls: bool = True,
        timeout: float = 10.0,
        transport: StringTransport | None = None,
    ) -> None:
        self.clock = Clock()
        self.plain = RecordingFactory()
        self.tls = RecordingFactory()
        self.factory = DemuxFactory(
            self.plain,
            self.tls if tls else None,
            self.clock,
            first_byte_timeout=timeout,
        )
        self.transport = (
            transport
            if transport is not None
            else StringTransport(
                hostAddress=IPv4Address("TCP", "127.0.0.1", 11435), peerAddress=peer
            )
        )
        if transport is not None:
            self.transport.peerAddress = peer
        self.protocol = self.factory.buildProtocol(peer)
        self.protocol.makeConnection(self.transport)

    def feed(self, *chunks: bytes) -> None:
        for chunk in chunks:
            self.protocol.dataReceived(chunk)


class IsLoopbackTests(SynchronousTestCase):
    def test_loopback(self) -> None:
        for address in LOOPBACK_PEERS:
            self.assertTrue(is_loopback(address), address)

    def test_not_loopback(self) -> None:
        for address in REMOTE_PEERS:
            self.assertFalse(is_loopback(address), address)


class PlaintextTests(SynchronousTestCase):
    def test_whole_request_in_first_read(self) -> None:
        """
        A first read carrying a whole request reaches the plaintext personality
        intact, on the real transport, and the first-byte timer is gone.
        """
        h = Harness(IPv4Address("TCP", "127.0.0.1", 50000))
        h.feed(REQUEST)
        self.assertEqual(h.plain.events, [("made", h.transport), ("data", REQUEST)])
        self.assertEqual(h.tls.events, [])
        self.assertEqual(h.clock.getDelayedCalls(), [])
        self.assertFalse(h.transport.disconnecting)

    def test_first_byte_alone(self) -> None:
        """The first byte arriving alone is replayed before the rest."""
        h = Harness(IPv6Address("TCP", "::1", 50000))
        h.feed(REQUEST[:1], REQUEST[1:5], REQUEST[5:])
        self.assertEqual(
            h.plain.events,
            [
                ("made", h.transport),
                ("data", REQUEST[:1]),
                ("data", REQUEST[1:5]),
                ("data", REQUEST[5:]),
            ],
        )

    def test_garbage_from_loopback(self) -> None:
        """
        Whatever is not a TLS record goes to the plaintext personality, which
        decides what garbage means (HTTP answers 400).
        """
        h = Harness(IPv4Address("TCP", "127.0.0.2", 50000))
        h.feed(b"\x00\xff\x15garbage", b"\x16late")
        self.assertEqual(h.plain.received(), b"\x00\xff\x15garbage\x16late")
        self.assertEqual(h.tls.built, [])

    def test_ipv4_mapped_loopback(self) -> None:
        """A dual-stack listener's view of 127.0.0.1 is loopback."""
        h = Harness(IPv6Address("TCP", "::ffff:127.0.0.1", 50000))
        h.feed(REQUEST)
        self.assertEqual(h.plain.received(), REQUEST)

    def test_address_passed_to_personality(self) -> None:
        peer = IPv4Address("TCP", "127.0.0.1", 50001)
        h = Harness(peer)
        h.feed(REQUEST)
        self.assertEqual(h.plain.built, [peer])

    def test_connection_lost_forwarded(self) -> None:
        h = Harness(IPv4Address("TCP", "127.0.0.1", 50000))
        h.feed(REQUEST)
        h.protocol.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(h.plain.events[-1], ("lost", ConnectionDone))
        h.protocol.dataReceived(b"after")
        self.assertNotIn(("data", b"after"), h.plain.events)

    def test_producer_reaches_real_transport(self) -> None:
        """
        The personality's transport is the real one: a producer it registers is
        the one the transport pauses.
        """

        @implementer(IPushProducer)
        class Producer:
            def pauseProducing(self) -> None:
                pass

            def resumeProducing(self) -> None:
                pass

            def stopProducing(self) -> None:
                pass

        producer = Producer()

        class Registering(Protocol):
            def connectionMade(self) -> None:
                assert self.transport is not None
                self.transport.registerProducer(producer, True)  # type: ignore[attr-defined]

        clock = Clock()
        factory = DemuxFactory(Factory.forProtocol(Registering), None, clock)
        transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 1))
        protocol = factory.buildProtocol(transport.getPeer())
        protocol.makeConnection(transport)
        protocol.dataReceived(b"G")
        self.assertIs(transport.producer, producer)
        self.assertTrue(transport.streaming)


class TLSTests(SynchronousTestCase):
    def test_tls_from_any_peer(self) -> None:
        """0x16 goes to the TLS personality, from loopback and LAN peers alike."""
        for peer in [*LOOPBACK_PEERS, *REMOTE_PEERS]:
            h = Harness(peer)
            h.feed(CLIENT_HELLO[:1], CLIENT_HELLO[1:])
            self.assertEqual(h.tls.received(), CLIENT_HELLO, peer)
            self.assertEqual(h.tls.events[0], ("made", h.transport))
            self.assertEqual(h.plain.built, [])
            self.assertFalse(h.transport.disconnecting)
            self.assertEqual(h.clock.getDelayedCalls(), [])

    def test_no_tls_personality(self) -> None:
        """Without TLS configured, a TLS connection is closed, nothing built."""
        h = Harness(IPv4Address("TCP", "127.0.0.1", 50000), tls=False)
        with capturedLogs() as events:
            h.feed(CLIENT_HELLO)
        self.assertTrue(h.transport.disconnecting)
        self.assertEqual(h.plain.built, [])
        self.assertEqual(h.clock.getDelayedCalls(), [])
        self.assertEqual(
            [e["log_format"] for e in events],
            ["refused TLS connection from {peer}: no TLS personality"],
        )


class LoopbackGateTests(SynchronousTestCase):
    def test_remote_plaintext_refused(self) -> None:
        """
        A LAN peer's plaintext is refused before any byte reaches HTTP; later
        bytes are dropped too.
        """
        for peer in REMOTE_PEERS:
            h = Harness(peer)
            with capturedLogs() as events:
                h.feed(REQUEST, REQUEST)
            self.assertTrue(h.transport.disconnecting, peer)
            self.assertEqual((h.plain.built, h.tls.built), ([], []))
            self.assertEqual(h.clock.getDelayedCalls(), [])
            self.assertEqual(
                [(e["log_format"], e["peer"]) for e in events],
                [
                    (
                        "refused plaintext connection from {peer}:"
                        " not in access.plaintext_from",
                        str(peer),
                    )
                ],
            )

    def test_remote_without_tls_dropped_at_once(self) -> None:
        """
        When there is no TLS personality a LAN peer can never be served: it is
        closed in connectionMade, with no timer left behind.
        """
        h = Harness(IPv4Address("TCP", "10.0.0.5", 50000), tls=False)
        self.assertTrue(h.transport.disconnecting)
        self.assertEqual(h.clock.getDelayedCalls(), [])
        h.feed(REQUEST)
        self.assertEqual(h.plain.built, [])

    def test_loopback_without_tls_waits(self) -> None:
        h = Harness(IPv4Address("TCP", "127.0.0.1", 50000), tls=False)
        self.assertFalse(h.transport.disconnecting)
        h.feed(REQUEST)
        self.assertEqual(h.plain.received(), REQUEST)

    def test_custom_gate(self) -> None:
        """C{allow_plaintext_from} replaces the loopback rule."""
        plain = RecordingFactory()
        factory = DemuxFactory(
            plain, None, Clock(), allow_plaintext_from=lambda a: True
        )
        transport = StringTransport(peerAddress=IPv4Address("TCP", "10.0.0.5", 1))
        protocol = factory.buildProtocol(transport.getPeer())
        protocol.makeConnection(transport)
        protocol.dataReceived(REQUEST)
        self.assertEqual(plain.received(), REQUEST)


class FirstByteTimeoutTests(SynchronousTestCase):
    def test_stall(self) -> None:
        """A silent connection is aborted at the timeout, not before."""
        h = Harness(
            IPv4Address("TCP", "10.0.0.5", 50000),
            timeout=5.0,
            transport=TCPStringTransport(),
        )
        h.clock.advance(4.999)
        self.assertFalse(h.transport.disconnecting)
        h.clock.advance(0.001)
        assert isinstance(h.transport, TCPStringTransport)
        self.assertTrue(h.transport.aborted)
        self.assertEqual(h.clock.getDelayedCalls(), [])
        h.feed(REQUEST)
        h.protocol.connectionLost(Failure(ConnectionDone()))
        self.assertEqual((h.plain.built, h.tls.built), ([], []))

    def test_stall_without_abort(self) -> None:
        """A transport without abortConnection is closed the ordinary way."""
        h = Harness(IPv4Address("TCP", "127.0.0.1", 50000), timeout=1.0)
        h.clock.advance(1.0)
        self.assertTrue(h.transport.disconnecting)

    def test_close_before_first_byte(self) -> None:
        """A connection closed before its first byte holds nothing."""
        h = Harness(IPv4Address("TCP", "127.0.0.1", 50000))
        h.protocol.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(h.clock.getDelayedCalls(), [])
        self.assertEqual((h.plain.built, h.tls.built), ([], []))

    def test_empty_read_is_not_a_first_byte(self) -> None:
        h = Harness(IPv4Address("TCP", "127.0.0.1", 50000))
        h.feed(b"")
        self.assertEqual(len(h.clock.getDelayedCalls()), 1)
        h.feed(REQUEST)
        self.assertEqual(h.plain.received(), REQUEST)
        self.assertEqual(h.clock.getDelayedCalls(), [])


class Adopter(Recorder):
    """A personality's protocol that takes the first-byte timer over."""

    def __init__(self, events: list[tuple[str, object]]) -> None:
        super().__init__(events)
        self.timer: object = None

    def adopt_deadline(self, timer: object) -> object:
        self.timer = timer
        return lambda: self.events.append(("deadline", None))


class AdoptingFactory(RecordingFactory):
    recorder = Adopter


@implementer(IOpenSSLServerConnectionCreator)
class _Creator:
    """Server TLS connections without a certificate: enough to be built."""

    def serverConnectionForTLS(self, tlsProtocol: object) -> SSL.Connection:
        return SSL.Connection(SSL.Context(SSL.TLS_METHOD), None)


class TimerHandOverTests(SynchronousTestCase):
    """
    A personality whose protocol has C{adopt_deadline} takes the first-byte
    timer over rather than having it cancelled and making its own.
    """

    def harness(self) -> Harness:
        h = Harness(IPv4Address("TCP", "127.0.0.1", 50000), timeout=5.0)
        h.factory.plaintext = h.plain = AdoptingFactory()
        return h

    def test_timer_adopted(self) -> None:
        """
        The running timer is handed over before the protocol is connected,
        not cancelled, and when it fires it calls what the protocol gave
        back instead of aborting the connection.
        """
        h = self.harness()
        (timer,) = h.clock.getDelayedCalls()
        h.clock.advance(1)
        h.feed(REQUEST)
        protocol = h.protocol._inner
        assert isinstance(protocol, Adopter)
        self.assertIs(protocol.timer, timer)
        self.assertTrue(timer.active())
        self.assertEqual(h.clock.getDelayedCalls(), [timer])
        self.assertEqual([kind for kind, _ in h.plain.events], ["made", "data"])
        h.clock.advance(4)
        self.assertEqual(h.plain.events[-1], ("deadline", None))
        self.assertFalse(h.transport.disconnecting)
        h.feed(b"more")
        self.assertEqual(h.plain.received(), REQUEST + b"more")

    def test_timer_not_adopted_after_it_fired(self) -> None:
        """A connection whose timer fired is closed: nothing is built."""
        h = self.harness()
        h.clock.advance(5)
        h.feed(REQUEST)
        self.assertEqual(h.plain.built, [])

    def test_tls_personality_does_not_adopt(self) -> None:
        """
        The TLS side's protocol does not take the timer over, even when the
        protocol it wraps would (a protocol wrapper forwards unknown
        attributes): the timer is cancelled.
        """
        h = self.harness()
        wrapped = AdoptingFactory()
        h.factory.tls = tls_personality(_Creator(), wrapped, h.clock)
        h.feed(CLIENT_HELLO)
        self.assertEqual(h.clock.getDelayedCalls(), [])
        self.assertIsNone(h.protocol._adopted)
        self.assertEqual(len(wrapped.built), 1)

    def test_lost_connection_forgets_the_adopter(self) -> None:
        h = self.harness()
        h.feed(REQUEST)
        h.protocol.connectionLost(Failure(ConnectionDone()))
        self.assertIsNone(h.protocol._adopted)
        self.assertEqual(h.plain.events[-1], ("lost", ConnectionDone))


class FactoryLifecycleTests(SynchronousTestCase):
    def test_start_stop_forwarded(self) -> None:
        """Listening starts and stops both personalities' factories."""
        plain, tls = RecordingFactory(), RecordingFactory()
        factory = DemuxFactory(plain, tls, Clock())
        factory.doStart()
        self.assertEqual((plain.numPorts, tls.numPorts), (1, 1))
        factory.doStop()
        self.assertEqual((plain.numPorts, tls.numPorts), (0, 0))

    def test_listen_facade(self) -> None:
        reactor = MemoryReactor()
        plain = RecordingFactory()
        port = self.successResultOf(
            listen_facade(reactor, Clock(), 11435, "127.0.0.1", plain, None)
        )
        self.assertIsNotNone(port)
        [(number, factory, _backlog, interface)] = reactor.tcpServers
        self.assertEqual((number, interface), (11435, "127.0.0.1"))
        assert isinstance(factory, DemuxFactory)
        self.assertIs(factory.plaintext, plain)
        self.assertIsNone(factory.tls)

    def test_listen_facade_failure(self) -> None:
        reactor = RaisingMemoryReactor(listenException=CannotListenError("", 1, None))
        d = listen_facade(reactor, Clock(), 1, "", RecordingFactory(), None)
        self.failureResultOf(d, CannotListenError)


ADDRESSES = st.sampled_from([*LOOPBACK_PEERS, *REMOTE_PEERS])


@st.composite
def split_stream(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """A byte stream and a random partition of it into non-empty reads."""
    first = draw(
        st.sampled_from([b"\x16", b"G", b"\x00", b"P"])
        | st.binary(min_size=1, max_size=1)
    )
    data = first + draw(st.binary(max_size=300))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)))))
    cuts = [cut for cut in cuts if cut < len(data)]
    bounds = [0, *cuts, len(data)]
    return data, [data[a:b] for a, b in itertools.pairwise(bounds)]


class DemuxPropertyTests(SynchronousTestCase):
    @settings(deadline=None, max_examples=300)
    @given(split_stream(), ADDRESSES, st.booleans())
    def test_stream_arrives_intact(
        self, stream: tuple[bytes, list[bytes]], peer: IAddress, tls: bool
    ) -> None:
        """
        However a stream is split into reads, the chosen personality sees exactly
        that stream, or nobody sees any of it; no timer outlives the decision.
        """
        data, chunks = stream
        h = Harness(peer, tls=tls)
        h.feed(*chunks)
        h.protocol.connectionLost(Failure(ConnectionDone()))
        if data[0] == 0x16 and tls:
            expected = (b"", data)
        elif data[0] != 0x16 and is_loopback(peer):
            expected = (data, b"")
        else:
            expected = (b"", b"")
            self.assertTrue(h.transport.disconnecting)
        self.assertEqual((h.plain.received(), h.tls.received()), expected)
        self.assertEqual(h.clock.getDelayedCalls(), [])
        for recorder in (h.plain, h.tls):
            if recorder.events:
                self.assertEqual(recorder.events[0], ("made", h.transport))
                self.assertEqual(recorder.events[-1], ("lost", ConnectionDone))
