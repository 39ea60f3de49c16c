"""
Pooled upstream connections under discarded responses and engine-side
closes, on loopback against an engine double that is not built on Twisted's
HTTP stack: it parses requests by hand and writes each whole response (head
and body) in one call, so it reaches the client in one socket read, as a
fast engine's short error document does.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from attrs import define, field
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IListeningPort
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import readBody
from twisted.web.http_headers import Headers

from nvproxy.dispatch import AttemptFailed, Committed, FailureKind, StreamEnd
from nvproxy.proxy.attempt import (
    AttemptSettings,
    HttpAttempt,
    HttpTarget,
    UpstreamRequest,
)
from nvproxy.proxy.client import ClientSide
from nvproxy.proxy.upstream import Upstream
from nvproxy.testing.harness import eventually
from tests.test_attempt import FakeClientRequest

Answer = Callable[["_RawHTTP", int], None]
"""How the engine answers its Nth receipt (from 1) on a connection."""


def whole(status: int, body: bytes, close: bool = False) -> Answer:
    """Head and body in one write."""

    def answer(conn: _RawHTTP, n: int) -> None:
        head = (
            f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
        ).encode()
        if close:
            head += b"connection: close\r\n"
        conn.transport.write(head + b"\r\n" + body)
        if close:
            conn.transport.loseConnection()

    return answer


def hang_up(conn: _RawHTTP, n: int) -> None:
    """Close without answering, as an engine closing an idle keep-alive does."""
    conn.transport.loseConnection()


@define
class RawEngine:
    """
    Records every request it receives (C{receipts}: connection number and
    the request's C{x-id}); answers from C{script} in order, then C{ok}.
    """

    script: list[Answer] = field(factory=list)
    receipts: list[tuple[int, bytes]] = field(factory=list)
    connections: int = 0
    port: IListeningPort | None = None
    protocols: list[_RawHTTP] = field(factory=list)

    def answer(self, conn: _RawHTTP, request_id: bytes) -> None:
        self.receipts.append((conn.number, request_id))
        n = len(self.receipts)
        step = self.script.pop(0) if self.script else whole(200, b'{"ok": %d}' % n)
        step(conn, n)


class _RawHTTP(Protocol):
    def __init__(self, engine: RawEngine) -> None:
        self.engine = engine
        self.buffer = b""
        engine.connections += 1
        self.number = engine.connections

    def connectionMade(self) -> None:
        self.engine.protocols.append(self)

    def connectionLost(self, reason: Any = None) -> None:
        self.engine.protocols.remove(self)

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, rest = self.buffer.split(b"\r\n\r\n", 1)
            fields = dict(
                line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line
            )
            headers = {k.strip().lower(): v.strip() for k, v in fields.items()}
            size = int(headers.get(b"content-length", b"0"))
            if len(rest) < size:
                return
            self.buffer = rest[size:]
            self.engine.answer(self, headers.get(b"x-id", b""))


async def raw_engine(test: TestCase, script: list[Answer]) -> RawEngine:
    engine = RawEngine(script=script)
    factory = Factory.forProtocol(lambda: _RawHTTP(engine))
    engine.port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
        factory
    )

    async def stop() -> None:
        for protocol in list(engine.protocols):
            protocol.transport.abortConnection()
        assert engine.port is not None
        await engine.port.stopListening()

    test.addCleanup(lambda: Deferred.fromCoroutine(stop()))
    return engine


def _request(request_id: bytes) -> UpstreamRequest:
    headers = Headers({b"content-type": [b"application/json"], b"x-id": [request_id]})
    return UpstreamRequest(
        method=b"POST",
        path=b"/v1/chat/completions",
        headers=headers,
        content=io.BytesIO(b'{"model": "m"}'),
        inference=True,
    )


class ReuseTests(TestCase):
    timeout = 15

    def setUp(self) -> None:
        self.upstream = Upstream(reactor, dial_timeout=5.0)
        self.addCleanup(self.upstream.close)

    def attempt(
        self, engine: RawEngine, request_id: bytes, final: bool = False
    ) -> tuple[HttpAttempt, FakeClientRequest]:
        assert engine.port is not None
        url = b"http://127.0.0.1:%d/v1/chat/completions" % engine.port.getHost().port
        client = FakeClientRequest()
        settings = AttemptSettings(
            self.upstream.agent, reactor, self.upstream.cooperator, 5.0
        )
        target = HttpTarget(
            settings,
            "n",
            url,
            _request(request_id),
            ClientSide(client, lambda s, m, c: m.encode()),
        )
        attempt = target.start(final)
        return attempt, client

    def pooled(self) -> bool:
        return any(self.upstream.pool._connections.values())

    async def committed(self, attempt: HttpAttempt) -> StreamEnd:
        result = await attempt.result
        assert isinstance(result, Committed), result
        self.assertEqual(result.status, 200)
        return await result.done

    async def test_discarded_answer_never_carries_the_next_request(self) -> None:
        """
        A retryable status discarded while its body is still in the same
        read: the next request, taken from the pool at the moment the
        connection returns to it, is answered once, by its own response
        (before the fix it went down the closing connection: the engine
        received and answered it, and the attempt failed as a transport
        error).
        """
        engine = await raw_engine(self, [whole(500, b'{"error": "busy"}')])
        pool = self.upstream.pool
        put = pool._putConnection
        second: list[Any] = []

        def put_then_take(key: Any, connection: Any) -> None:
            put(key, connection)
            if not second:
                # The next request arrives in the next reactor turn: before
                # a close requested in this one takes effect.
                second.append(None)
                reactor.callLater(0, lambda: second.__setitem__(0, start()))

        def start() -> tuple[HttpAttempt, FakeClientRequest]:
            return self.attempt(engine, b"second")

        pool._putConnection = put_then_take  # type: ignore[method-assign]
        first, _ = self.attempt(engine, b"first")
        failed = await first.result
        self.assertEqual(
            failed, AttemptFailed("n", FailureKind.STATUS, 500), "the 500 is retryable"
        )
        await eventually(
            reactor, lambda: second and second[0], what="the second attempt"
        )
        self.assertEqual(len(second), 1, "the connection went back to the pool")
        attempt, client = second[0]
        self.assertEqual(await self.committed(attempt), StreamEnd.COMPLETE)
        self.assertEqual(b"".join(client.written), b'{"ok": 2}')
        self.assertEqual([r for _, r in engine.receipts], [b"first", b"second"])

    async def test_short_discarded_body_is_drained_and_reused(self) -> None:
        """
        A short error document is read to its end: the connection it came
        on serves the retry.
        """
        engine = await raw_engine(self, [whole(503, b'{"error": "later"}')])
        first, _ = self.attempt(engine, b"first")
        self.assertIsInstance(await first.result, AttemptFailed)
        await eventually(reactor, self.pooled, what="a pooled connection")
        retry, _ = self.attempt(engine, b"retry")
        self.assertEqual(await self.committed(retry), StreamEnd.COMPLETE)
        self.assertEqual(engine.receipts, [(1, b"first"), (1, b"retry")])

    async def test_long_discarded_body_closes_its_connection(self) -> None:
        """
        A long error body is not read to its end; its connection is closed
        and never reused.
        """
        engine = await raw_engine(self, [whole(500, b"x" * (256 * 1024))])
        first, _ = self.attempt(engine, b"first")
        self.assertIsInstance(await first.result, AttemptFailed)
        await eventually(reactor, lambda: not engine.protocols, what="the close")
        self.assertFalse(self.pooled())
        retry, client = self.attempt(engine, b"retry")
        self.assertEqual(await self.committed(retry), StreamEnd.COMPLETE)
        self.assertEqual(engine.receipts, [(1, b"first"), (2, b"retry")])

    async def test_post_on_a_connection_the_engine_closed_is_sent_again(
        self,
    ) -> None:
        """
        The engine closes a pooled keep-alive connection as the next POST
        arrives on it: the request is sent again on a new connection within
        the same attempt, which commits (no dispatch spent).
        """
        engine = await raw_engine(self, [whole(200, b'{"ok": 0}'), hang_up])
        self.upstream.pool.stale_idle = 0.0  # any idle time counts here
        first, _ = self.attempt(engine, b"first")
        self.assertEqual(await self.committed(first), StreamEnd.COMPLETE)
        await eventually(reactor, self.pooled, what="a pooled connection")
        second, client = self.attempt(engine, b"second")
        self.assertEqual(await self.committed(second), StreamEnd.COMPLETE)
        self.assertEqual(
            engine.receipts, [(1, b"first"), (1, b"second"), (2, b"second")]
        )
        self.assertEqual(b"".join(client.written), b'{"ok": 3}')

    async def test_close_right_after_reuse_is_a_transport_failure(self) -> None:
        """
        A connection reused within the stale window that the engine closes
        cleanly after reading the request is not sent again: an engine's
        keep-alive close comes after seconds idle, so this engine took the
        request and dropped it.
        """
        engine = await raw_engine(self, [whole(200, b'{"ok": 0}'), hang_up])
        first, _ = self.attempt(engine, b"first")
        self.assertEqual(await self.committed(first), StreamEnd.COMPLETE)
        second, _ = self.attempt(engine, b"second")
        self.assertEqual(
            await second.result, AttemptFailed("n", FailureKind.TRANSPORT, None)
        )
        self.assertEqual(engine.receipts, [(1, b"first"), (1, b"second")])

    async def test_fresh_connection_closed_is_a_transport_failure(self) -> None:
        """
        A new connection that closes without an answer is not retried inside
        the attempt: only a reused connection can be stale.
        """
        engine = await raw_engine(self, [hang_up])
        first, _ = self.attempt(engine, b"first")
        self.assertEqual(
            await first.result, AttemptFailed("n", FailureKind.TRANSPORT, None)
        )
        self.assertEqual(engine.receipts, [(1, b"first")])


class PoolExpiryTests(SynchronousTestCase):
    """
    A pooled connection closes after C{cachedConnectionTimeout} idle in the
    pool; its one timer is moved each time it comes back, and does nothing
    while the connection is out serving a request.
    """

    def setUp(self) -> None:
        self.memory = MemoryReactorClock()
        self.upstream = Upstream(self.memory, 7.0)
        self.pool = self.upstream.pool
        self.transports: list[StringTransport] = []
        self.protocols: list[Any] = []

    def send(self) -> Deferred[Any]:
        answer = self.upstream.agent.request(b"GET", b"http://127.0.0.1:9/x")
        if len(self.memory.tcpClients) > len(self.protocols):
            protocol = self.memory.tcpClients[-1][2].buildProtocol(None)
            transport = StringTransport()
            protocol.makeConnection(transport)
            self.protocols.append(protocol)
            self.transports.append(transport)
        return answer

    def answer(self, answer: Deferred[Any]) -> None:
        self.protocols[-1].dataReceived(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        )
        self.assertEqual(
            self.successResultOf(readBody(self.successResultOf(answer))), b"ok"
        )

    def expiries(self) -> list[Any]:
        return list(self.pool._timeouts.values())

    def test_one_timer_moved(self) -> None:
        self.answer(self.send())
        [expiry] = self.expiries()
        self.assertEqual(expiry.getTime(), 120)
        self.memory.advance(30)
        self.answer(self.send())
        self.assertEqual(len(self.memory.tcpClients), 1)
        self.assertEqual(self.expiries(), [expiry])
        self.assertEqual(expiry.getTime(), 150)
        self.memory.advance(119)
        self.assertFalse(self.transports[0].disconnecting)
        self.memory.advance(1)
        self.assertTrue(self.transports[0].disconnecting)
        self.assertEqual(self.pool._connections.get(("http", b"127.0.0.1", 9), []), [])

    def test_out_in_use_when_due(self) -> None:
        """
        Due while the connection serves a request: it stays open, and is
        idle C{cachedConnectionTimeout} from its return before it closes.
        """
        self.answer(self.send())
        pending = self.send()
        self.memory.advance(200)
        self.assertFalse(self.transports[0].disconnecting)
        self.answer(pending)
        [expiry] = self.expiries()
        self.assertEqual(expiry.getTime(), 320)
        self.memory.advance(120)
        self.assertTrue(self.transports[0].disconnecting)

    def test_lost_while_out_leaves_no_timer(self) -> None:
        self.answer(self.send())
        pending = self.send()
        self.assertEqual(self.expiries(), [])
        self.assertEqual(len(self.memory.getDelayedCalls()), 1)
        self.protocols[0].connectionLost(Failure(ConnectionDone()))
        self.failureResultOf(pending)
        self.assertEqual(self.memory.getDelayedCalls(), [])

    def test_close_cached_leaves_no_timer(self) -> None:
        self.answer(self.send())
        self.answer(self.send())
        self.upstream.close()
        self.protocols[0].connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.memory.getDelayedCalls(), [])
