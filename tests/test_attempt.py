"""
Unit tests for L{nvproxy.proxy.attempt.HttpAttempt}: the header and first-body
timeouts, the commit gate and the commit-versus-cancel claim (spec §5.2,
§5.3), with a fake agent, real C{Response} objects and a C{Clock}.
"""

from __future__ import annotations

import io
import json
from typing import Any

import attrs
from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock, Cooperator
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web._newclient import Response, TransportProxyProducer
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http_headers import Headers

from nvproxy.dispatch import AttemptFailed, Committed, FailureKind, StreamEnd
from nvproxy.proxy.attempt import (
    DRAIN_LIMIT,
    DRAIN_TIMEOUT,
    AttemptSettings,
    HttpAttempt,
    HttpTarget,
    UpstreamRequest,
)
from nvproxy.proxy.client import (
    CUT_GRACE,
    IDLE_MESSAGE,
    TRUNCATED_MESSAGE,
    ClientSide,
    error_frame,
)
from nvproxy.proxy.upstream import IN_MEMORY_LIMIT

TIMEOUT = 30.0


@define
class FakeAgent:
    """
    Records requests; each answers through the Deferred it returned.
    """

    requests: list[tuple[bytes, bytes, Headers]] = field(factory=list)
    pending: list[Deferred[Any]] = field(factory=list)
    bodies: list[Any] = field(factory=list)
    cancelled: int = 0

    def request(
        self, method: bytes, uri: bytes, headers: Headers, body: Any = None
    ) -> Deferred[Any]:
        self.requests.append((method, uri, headers))
        self.bodies.append(body)

        def cancel(d: Deferred[Any]) -> None:
            self.cancelled += 1

        d: Deferred[Any] = Deferred(cancel)
        self.pending.append(d)
        return d


class _Channel:
    def __init__(self, request: FakeClientRequest) -> None:
        self.transport = self
        self._request = request

    def abortConnection(self) -> None:
        self._request.aborted = True

    def loseConnection(self) -> None:
        self._request.closed_cleanly = True


class FakeClientRequest:
    """
    The parts of a twisted.web request the client side uses.
    """

    method = b"POST"

    def __init__(self) -> None:
        self.channel = _Channel(self)
        self.aborted = False
        self.closed_cleanly = False
        self.code: int | None = None
        self.responseHeaders = Headers()
        self.written: list[bytes] = []
        self.finished = False
        self.lost = False
        self.producer: Any = None
        self._finish_waiters: list[Deferred[None]] = []

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        self.code = code

    def write(self, data: bytes) -> None:
        assert not self.finished
        self.written.append(data)

    def finish(self) -> None:
        self.finished = True

    def loseConnection(self) -> None:
        self.lost = True

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        assert self.producer is None
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None

    def notifyFinish(self) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        self._finish_waiters.append(d)
        return d

    def disconnect(self) -> None:
        for d in self._finish_waiters:
            d.errback(Failure(ConnectionError("client gone")))


class UpstreamTransport(StringTransport):
    """
    Like a TCP transport, resuming a stopped (closing) connection is a
    no-op rather than an error.
    """

    def resumeProducing(self) -> None:
        if self.producerState != "stopped":
            super().resumeProducing()


def response(code: int, headers: dict[bytes, list[bytes]] | None = None) -> Response:
    transport = UpstreamTransport()
    return Response(
        (b"HTTP", 1, 1),
        code,
        b"Phrase",
        Headers(headers or {}),
        TransportProxyProducer(transport),
    )


class _AttemptCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.agent = FakeAgent()
        self.client_request = FakeClientRequest()
        self.client = ClientSide(self.client_request, lambda s, m, c: b"error")
        self.upstream = UpstreamRequest(
            method=b"POST",
            path=b"/v1/chat/completions?x=1",
            headers=Headers(
                {
                    b"host": [b"facade"],
                    b"connection": [b"keep-alive, x-drop"],
                    b"x-drop": [b"1"],
                    b"authorization": [b"Bearer t"],
                }
            ),
            content=io.BytesIO(b'{"model": "m"}'),
            inference=True,
        )

    def start(
        self, final: bool = False, timeout: float = TIMEOUT, idle: float = 0.0
    ) -> HttpAttempt:
        settings = AttemptSettings(
            agent=self.agent,
            clock=self.clock,
            cooperator=Cooperator(scheduler=lambda f: self.clock.callLater(0, f)),
            response_timeout=timeout,
            stream_idle_timeout=idle,
        )
        target = HttpTarget(
            settings,
            "n1",
            b"http://engine/v1/chat/completions?x=1",
            self.upstream,
            self.client,
        )
        return target.start(final)


class AttemptTests(_AttemptCase):
    def test_request_headers(self) -> None:
        self.start()
        method, uri, headers = self.agent.requests[0]
        self.assertEqual(
            (method, uri), (b"POST", b"http://engine/v1/chat/completions?x=1")
        )
        names = {name.lower() for name, _ in headers.getAllRawHeaders()}
        self.assertEqual(names, {b"authorization"})

    def test_commit_at_first_body_byte(self) -> None:
        """
        Headers alone do not commit; the first body byte does, and it is
        relayed intact, then every later chunk.
        """
        attempt = self.start()
        r = response(200, {b"content-type": [b"text/event-stream"]})
        self.agent.pending[0].callback(r)
        self.assertNoResult(attempt.result)
        self.assertEqual(self.client_request.code, None)
        r._bodyDataReceived(b"d")
        committed = self.successResultOf(attempt.result)
        self.assertIsInstance(committed, Committed)
        assert isinstance(committed, Committed)
        self.assertEqual((committed.node_id, committed.status), ("n1", 200))
        self.assertEqual(self.client_request.code, 200)
        self.assertEqual(
            self.client_request.responseHeaders.getRawHeaders(b"content-type"),
            [b"text/event-stream"],
        )
        r._bodyDataReceived(b"ata: x\n\n")
        self.assertEqual(b"".join(self.client_request.written), b"data: x\n\n")
        self.assertIsNotNone(self.client_request.producer)
        r._bodyDataFinished(Failure(ResponseDone()))
        self.assertEqual(self.successResultOf(committed.done), StreamEnd.COMPLETE)
        self.assertTrue(self.client_request.finished)
        self.assertIsNone(self.client_request.producer)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def committed_with(
        self, length: int | None, code: int = 200, method: bytes = b"POST"
    ) -> FakeClientRequest:
        """The client's request after an answer of C{length} committed."""
        self.client_request.method = method
        self.client_request.responseHeaders.setRawHeaders(b"content-length", [b"9"])
        self.start()
        r = response(code)
        if length is not None:
            r.length = length
        self.agent.pending[0].callback(r)
        r._bodyDataReceived(b"body")
        return self.client_request

    def test_answer_keeps_its_length(self) -> None:
        """
        The upstream's C{Content-Length} (Twisted's client keeps it out of
        the response's headers) is the client's answer's, over any the
        facade set; without one, or for a HEAD request or a status without
        a body, the answer has none.
        """
        lengths = [
            self.committed_with(4).responseHeaders.getRawHeaders(b"content-length")
        ]
        for length, code, method in [
            (None, 200, b"POST"),
            (0, 200, b"HEAD"),
            (0, 304, b"GET"),
            (0, 204, b"POST"),
        ]:
            self.setUp()
            request = self.committed_with(length, code, method)
            lengths.append(request.responseHeaders.getRawHeaders(b"content-length"))
        self.assertEqual(lengths, [[b"4"], None, None, None, None])

    def sent(self, index: int = 0) -> bytes:
        """What the body producer of attempt C{index} writes."""
        transport = StringTransport()
        self.agent.bodies[index].startProducing(transport)
        return transport.value()

    def test_commit_lets_the_body_go(self) -> None:
        """
        Once an attempt commits nothing sends the request body again, so a
        long stream holds no copy of its prompt: the producer forgets it and
        the buffered body is closed.
        """
        attempt = self.start()
        self.assertEqual(self.sent(), b'{"model": "m"}')
        r = response(200)
        self.agent.pending[0].callback(r)
        self.assertFalse(self.upstream.content.closed)
        r._bodyDataReceived(b"x")
        self.assertIsInstance(self.successResultOf(attempt.result), Committed)
        self.assertTrue(self.upstream.content.closed)
        self.assertEqual(self.sent(), b"")

    def test_failed_attempt_keeps_the_body(self) -> None:
        """
        An attempt that fails before commit leaves the body for the next
        one, which sends it whole.
        """
        attempt = self.start()
        self.agent.pending[0].callback(response(503))
        self.assertIsInstance(self.successResultOf(attempt.result), AttemptFailed)
        self.assertFalse(self.upstream.content.closed)
        self.start()
        self.assertEqual(self.sent(1), b'{"model": "m"}')

    def test_streamed_body_is_left_to_the_request(self) -> None:
        """
        A body too large for one write may still be going out when the
        engine answers: commit leaves it alone.
        """
        self.upstream = attrs.evolve(
            self.upstream, content=io.BytesIO(b"x" * (IN_MEMORY_LIMIT + 1))
        )
        attempt = self.start()
        r = response(200)
        self.agent.pending[0].callback(r)
        r._bodyDataReceived(b"x")
        self.assertIsInstance(self.successResultOf(attempt.result), Committed)
        self.assertFalse(self.upstream.content.closed)

    def test_eof_commits(self) -> None:
        attempt = self.start()
        r = response(200)
        self.agent.pending[0].callback(r)
        r._bodyDataFinished(Failure(ResponseDone()))
        committed = self.successResultOf(attempt.result)
        assert isinstance(committed, Committed)
        self.assertEqual(self.successResultOf(committed.done), StreamEnd.COMPLETE)
        self.assertTrue(self.client_request.finished)

    def test_header_timeout(self) -> None:
        attempt = self.start()
        self.clock.advance(TIMEOUT - 0.001)
        self.assertNoResult(attempt.result)
        self.clock.advance(0.001)
        self.assertEqual(
            self.successResultOf(attempt.result),
            AttemptFailed("n1", FailureKind.TRANSPORT),
        )
        self.assertEqual(self.agent.cancelled, 1)

    def test_first_body_timeout_starts_at_headers(self) -> None:
        """
        The first-body timeout counts from the arrival of headers, and it
        never commits (§5.2).
        """
        attempt = self.start()
        self.clock.advance(TIMEOUT - 1)
        r = response(200)
        self.agent.pending[0].callback(r)
        self.clock.advance(TIMEOUT - 1)
        self.assertNoResult(attempt.result)
        self.clock.advance(1)
        self.assertEqual(
            self.successResultOf(attempt.result),
            AttemptFailed("n1", FailureKind.NO_CONTENT, 200),
        )
        self.assertIsNone(self.client_request.code)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_zero_disables_timeouts(self) -> None:
        attempt = self.start(timeout=0)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.agent.pending[0].callback(response(200))
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertNoResult(attempt.result)

    def test_retryable_status_not_relayed(self) -> None:
        """
        A retryable status before the final attempt is reported, not
        relayed.  Its connection is not stopped from the response callback
        (the rest of the body may be in the same read): a short body is
        read to its end, so the connection can be reused.
        """
        attempt = self.start()
        r = response(503)
        self.agent.pending[0].callback(r)
        self.assertEqual(r._transport._producer.producerState, "producing")
        self.assertEqual(
            self.successResultOf(attempt.result),
            AttemptFailed("n1", FailureKind.STATUS, 503),
        )
        self.assertIsNone(self.client_request.code)
        r._bodyDataReceived(b'{"error": "busy"}')
        r._bodyDataFinished(Failure(ResponseDone()))
        self.assertEqual(r._transport._producer.producerState, "producing")
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertEqual(self.client_request.written, [])

    def test_long_discarded_body_is_stopped(self) -> None:
        """
        A discarded body longer than the drain limit stops its connection.
        """
        self.start()
        r = response(500)
        self.agent.pending[0].callback(r)
        r._bodyDataReceived(b"x" * (DRAIN_LIMIT + 1))
        self.assertEqual(r._transport._producer.producerState, "stopped")
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_slow_discarded_body_is_stopped(self) -> None:
        """
        A discarded body that does not end within the drain timeout stops
        its connection, from the timer.
        """
        self.start()
        r = response(500)
        self.agent.pending[0].callback(r)
        r._bodyDataReceived(b"x")
        self.clock.advance(DRAIN_TIMEOUT)
        self.assertEqual(r._transport._producer.producerState, "stopped")
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_final_attempt_commits_any_status(self) -> None:
        attempt = self.start(final=True)
        r = response(503, {b"retry-after": [b"7"]})
        self.agent.pending[0].callback(r)
        r._bodyDataReceived(b'{"error": "busy"}')
        committed = self.successResultOf(attempt.result)
        assert isinstance(committed, Committed)
        self.assertEqual(committed.status, 503)
        self.assertEqual(self.client_request.code, 503)
        self.assertEqual(
            self.client_request.responseHeaders.getRawHeaders(b"retry-after"), [b"7"]
        )

    def test_cancel_before_commit(self) -> None:
        """
        The target left discovery before any body byte: the attempt is
        abandoned as TARGET_LOST and a late byte changes nothing.
        """
        attempt = self.start()
        r = response(200)
        self.agent.pending[0].callback(r)
        attempt.cancel()
        self.assertEqual(
            self.successResultOf(attempt.result),
            AttemptFailed("n1", FailureKind.TARGET_LOST),
        )
        r._bodyDataReceived(b"late")
        self.assertEqual(self.client_request.written, [])

    def test_commit_wins_over_cancel(self) -> None:
        """
        A delivered first byte wins the claim: a cancel after it is a no-op
        and the stream goes on (§5.3).
        """
        attempt = self.start()
        r = response(200)
        self.agent.pending[0].callback(r)
        r._bodyDataReceived(b"first")
        attempt.cancel()
        r._bodyDataReceived(b" second")
        committed = self.successResultOf(attempt.result)
        assert isinstance(committed, Committed)
        self.assertEqual(b"".join(self.client_request.written), b"first second")

    def test_truncated_stream_cuts_client(self) -> None:
        attempt = self.start()
        r = response(200)
        self.agent.pending[0].callback(r)
        r._bodyDataReceived(b"part")
        r._bodyDataFinished(Failure(ResponseFailed([Failure(ConnectionError())])))
        committed = self.successResultOf(attempt.result)
        assert isinstance(committed, Committed)
        self.assertEqual(self.successResultOf(committed.done), StreamEnd.TRUNCATED)
        # Closed short, after what was relayed; reset only if the client
        # stalls (a graceful close alone could wait on it forever).
        self.assertTrue(self.client_request.closed_cleanly)
        self.assertFalse(self.client_request.finished)
        self.clock.advance(CUT_GRACE)
        self.assertTrue(self.client_request.aborted)

    def test_client_gone_during_stream(self) -> None:
        attempt = self.start()
        r = response(200)
        self.agent.pending[0].callback(r)
        r._bodyDataReceived(b"part")
        committed = self.successResultOf(attempt.result)
        assert isinstance(committed, Committed)
        self.client_request.disconnect()
        attempt.abort()
        self.assertEqual(self.successResultOf(committed.done), StreamEnd.CLIENT_GONE)
        self.assertFalse(self.client_request.aborted)

    def test_shutdown_after_commit_cuts_the_stream(self) -> None:
        """
        Aborting a committed attempt while the client is still there (our
        own shutdown) resets the client's connection: its stream must not
        look complete.
        """
        attempt = self.start()
        r = response(200)
        self.agent.pending[0].callback(r)
        r._bodyDataReceived(b"part")
        committed = self.successResultOf(attempt.result)
        assert isinstance(committed, Committed)
        attempt.abort()
        self.assertEqual(self.successResultOf(committed.done), StreamEnd.CLIENT_GONE)
        self.assertTrue(self.client_request.aborted)
        self.assertFalse(self.client_request.finished)

    def test_first_bytes_before_the_commit_is_told(self) -> None:
        """
        The first body bytes are written to the client before C{result}
        fires: the dispatcher's commit bookkeeping runs after them.
        """
        attempt = self.start()
        r = response(200)
        self.agent.pending[0].callback(r)
        seen: list[list[bytes]] = []
        attempt.result.addCallback(
            lambda _: seen.append(list(self.client_request.written))
        )
        r._bodyDataReceived(b"body")
        self.assertEqual(seen, [[b"body"]])

    def test_abort_in_the_first_write(self) -> None:
        """
        An abort while the first bytes are written (the attempt has
        claimed the commit, the dispatcher has not heard of it) still ends
        with both Deferreds fired: the commit, and its stream cut.
        """
        attempt = self.start()
        r = response(200)
        self.agent.pending[0].callback(r)
        write = self.client_request.write

        def aborting(data: bytes) -> None:
            write(data)
            attempt.abort()

        self.client_request.write = aborting  # type: ignore[method-assign]
        r._bodyDataReceived(b"body")
        committed = self.successResultOf(attempt.result)
        assert isinstance(committed, Committed)
        self.assertEqual(self.successResultOf(committed.done), StreamEnd.CLIENT_GONE)
        self.assertTrue(self.client_request.aborted)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_abort_before_headers(self) -> None:
        attempt = self.start()
        attempt.abort()
        self.assertEqual(self.agent.cancelled, 1)
        self.assertEqual(
            self.successResultOf(attempt.result),
            AttemptFailed("n1", FailureKind.TRANSPORT),
        )
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_failures_reported(self) -> None:
        kinds: list[str] = []
        settings = AttemptSettings(self.agent, self.clock, None, TIMEOUT)
        target = HttpTarget(
            settings,
            "n1",
            b"http://engine/",
            self.upstream,
            self.client,
            on_failure=kinds.append,
        )
        attempt = target.start(False)
        self.agent.pending[0].callback(response(429))
        self.successResultOf(attempt.result)
        self.assertEqual(kinds, ["status"])


_CUT = Failure(ResponseFailed([Failure(ConnectionError())]))


class HonestEndingTests(_AttemptCase):
    """
    A committed stream cut short ends with its dialect's error frame and a
    close without the last chunk (issue: honest endings), and the optional
    stream idle timeout does the same for a silent upstream.
    """

    def stream(self, content_type: bytes, idle: float = 0.0) -> tuple[Any, Any]:
        attempt = self.start(idle=idle)
        r = response(200, {b"content-type": [content_type]})
        self.agent.pending[0].callback(r)
        r._bodyDataReceived(b"data: {}\n\n")
        committed = self.successResultOf(attempt.result)
        assert isinstance(committed, Committed)
        return r, committed

    def test_sse_cut_ends_with_error_event(self) -> None:
        r, committed = self.stream(b"text/event-stream; charset=utf-8")
        r._bodyDataFinished(_CUT)
        self.assertEqual(self.successResultOf(committed.done), StreamEnd.TRUNCATED)
        frame = self.client_request.written[-1]
        self.assertTrue(frame.startswith(b"\n\ndata: "), frame)
        self.assertTrue(frame.endswith(b"\n\n"))
        error = json.loads(frame.strip()[len(b"data: ") :])["error"]
        self.assertEqual(error["message"], TRUNCATED_MESSAGE)
        self.assertTrue(self.client_request.closed_cleanly)
        self.assertFalse(self.client_request.finished, "no last chunk")
        self.assertFalse(self.client_request.aborted)
        self.assertIsNone(self.client_request.producer)

    def test_client_that_does_not_read_the_frame_is_reset(self) -> None:
        r, committed = self.stream(b"text/event-stream")
        r._bodyDataFinished(_CUT)
        self.assertFalse(self.client_request.aborted)
        self.clock.advance(CUT_GRACE)
        self.assertTrue(self.client_request.aborted)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_closed_client_cancels_the_reset(self) -> None:
        r, committed = self.stream(b"text/event-stream")
        r._bodyDataFinished(_CUT)
        self.client_request.disconnect()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertFalse(self.client_request.aborted)

    def test_ndjson_cut_ends_with_error_line(self) -> None:
        r, committed = self.stream(b"application/x-ndjson")
        r._bodyDataFinished(_CUT)
        self.assertEqual(
            self.client_request.written[-1],
            json.dumps({"error": TRUNCATED_MESSAGE}).encode() + b"\n",
        )
        self.assertTrue(self.client_request.closed_cleanly)

    def test_plain_body_cut_is_closed_after_what_was_relayed(self) -> None:
        """
        A cut non-streaming answer gets no frame: what was relayed (headers
        and part of the body) is flushed, then the connection closes short.
        """
        r, committed = self.stream(b"application/json")
        r._bodyDataFinished(_CUT)
        self.assertEqual(self.client_request.written, [b"data: {}\n\n"])
        self.assertTrue(self.client_request.closed_cleanly)
        self.assertFalse(self.client_request.aborted)
        self.assertFalse(self.client_request.finished)
        self.clock.advance(CUT_GRACE)
        self.assertTrue(self.client_request.aborted)

    def test_cut_answer_of_declared_length_gets_no_frame(self) -> None:
        """
        A stream that declared its length is cut without an error frame:
        the client would read the frame's bytes as the rest of the body.
        """
        attempt = self.start()
        r = response(200, {b"content-type": [b"application/x-ndjson"]})
        r.length = 100
        self.agent.pending[0].callback(r)
        r._bodyDataReceived(b'{"a": 1}\n')
        committed = self.successResultOf(attempt.result)
        assert isinstance(committed, Committed)
        r._bodyDataFinished(_CUT)
        self.assertEqual(self.successResultOf(committed.done), StreamEnd.TRUNCATED)
        self.assertEqual(self.client_request.written, [b'{"a": 1}\n'])
        self.assertTrue(self.client_request.closed_cleanly)
        self.assertFalse(self.client_request.finished)

    def test_error_frame_after_a_partial_line(self) -> None:
        self.assertEqual(
            error_frame(b"application/x-ndjson", "cut", at_line_start=False),
            b'\n{"error": "cut"}\n',
        )
        self.assertIsNone(error_frame(None, "cut"))

    def test_idle_timeout_refreshed_by_every_chunk(self) -> None:
        r, committed = self.stream(b"text/event-stream", idle=10.0)
        self.clock.advance(6)
        r._bodyDataReceived(b"data: {}\n\n")
        self.clock.advance(9)
        self.assertNoResult(committed.done)
        self.clock.advance(1)
        self.assertEqual(self.successResultOf(committed.done), StreamEnd.TRUNCATED)
        self.assertEqual(r._transport._producer.producerState, "stopped")
        frame = self.client_request.written[-1]
        error = json.loads(frame.strip()[len(b"data: ") :])["error"]
        self.assertEqual(error["message"], IDLE_MESSAGE)
        # A late end from the stopped upstream changes nothing.
        r._bodyDataFinished(_CUT)
        self.assertEqual(len(self.client_request.written), 3)
        self.clock.advance(CUT_GRACE)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_idle_timer_gone_after_a_complete_stream(self) -> None:
        r, committed = self.stream(b"text/event-stream", idle=10.0)
        r._bodyDataFinished(Failure(ResponseDone()))
        self.assertEqual(self.successResultOf(committed.done), StreamEnd.COMPLETE)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_one_timer_moved_through_the_stages(self) -> None:
        """
        The header timeout, the first body byte's and the stream's silence
        are one timer, moved at each stage, not a new one each time; each
        is due its own time after its stage began.
        """
        attempt = self.start(idle=10.0)
        [timer] = self.clock.getDelayedCalls()
        self.clock.advance(2)
        r = response(200, {b"content-type": [b"text/event-stream"]})
        self.agent.pending[0].callback(r)
        self.assertEqual(self.clock.getDelayedCalls(), [timer])
        self.assertEqual(timer.getTime(), 2 + TIMEOUT)
        self.clock.advance(3)
        r._bodyDataReceived(b"data: {}\n\n")
        self.assertIsInstance(self.successResultOf(attempt.result), Committed)
        self.assertEqual(self.clock.getDelayedCalls(), [timer])
        self.assertEqual(timer.getTime(), 5 + 10.0)

    def test_no_idle_timer_by_default(self) -> None:
        r, committed = self.stream(b"text/event-stream")
        self.assertEqual(self.clock.getDelayedCalls(), [])


class GateTests(SynchronousTestCase):
    def test_end_lets_go_of_the_rebound_write(self) -> None:
        """
        At its end the body's protocol drops the client's write it was
        rebound to at commit (and the attempt), and keeps its attributes
        in its class's shared table.
        """
        from nvproxy.proxy.attempt import _Gate
        from tests.objects import keeps_own_dict

        written: list[bytes] = []
        for rebound in (True, False):
            gate: Any = _Gate(None)  # type: ignore[arg-type]
            if rebound:
                gate.dataReceived = written.append
            gate.dataReceived(b"x")
            gate.connectionLost()
            self.assertEqual(gate.dataReceived.__func__, _Gate.dataReceived)
            self.assertIsNone(gate._attempt)
            self.assertFalse(keeps_own_dict(gate))
        self.assertEqual(written, [b"x"])
