# -*- test-case-name: tests.test_attempt -*-
"""
One upstream attempt over the shared L{Agent}: header timeout, commit gate,
first-body timeout, and the commit-versus-cancel claim (spec §5.2, §5.3).

States (one claim decides each exit; the loser of a race is a no-op)::

    WAITING_HEADERS --response--> GATED --first byte / EOF--> COMMITTED --> ENDED
          |                         |
          +---- transport error ----+--> FAILED    (retryable, or the final answer)
          +---- cancel (target lost)+--> CANCELLED
          +---- abort (client gone)-+--> ABORTED   (also from COMMITTED)

After commit the gate protocol's C{dataReceived} is rebound to the client
request's C{write}: each relayed chunk costs exactly one call, no parsing, no
lookups, no Deferreds.  The upstream transport is registered as a streaming
producer on the client request, so a slow client pauses the upstream read.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto
from typing import Any

from attrs import frozen
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IResponse

from nvproxy.dispatch import (
    AttemptFailed,
    Committed,
    FailureKind,
    StreamEnd,
    is_retryable_status,
)
from nvproxy.inferstats import StatsMeter
from nvproxy.logs import Logger, describe
from nvproxy.proxy.client import (
    IDLE_MESSAGE,
    TRUNCATED_MESSAGE,
    ClientSide,
    error_frame,
)
from nvproxy.proxy.headers import OwnHeaders
from nvproxy.proxy.upstream import (
    REQUEST_DROP,
    body_producer,
    end_to_end,
    release_body,
)

log = Logger()
_DONE = Failure(ResponseDone())


@frozen
class UpstreamRequest:
    """
    What is sent upstream, the same for every attempt of one job.

    @ivar path: path and query, exactly as the client sent them.
    @ivar content: the buffered request body (rewound per attempt).
    """

    method: bytes
    path: bytes
    headers: Headers
    content: Any
    inference: bool


class _State(Enum):
    # Members are singletons: identity hashes them in C, where Enum's
    # __hash__ is a Python call (two per claim, three claims a request).
    __hash__ = object.__hash__

    WAITING_HEADERS = auto()
    GATED = auto()
    COMMITTED = auto()
    ENDED = auto()
    FAILED = auto()
    CANCELLED = auto()
    ABORTED = auto()


# The claims each state can make; anything else is a lost race and a no-op.
_TRANSITIONS: dict[_State, frozenset[_State]] = {
    _State.WAITING_HEADERS: frozenset(
        {_State.GATED, _State.FAILED, _State.CANCELLED, _State.ABORTED}
    ),
    _State.GATED: frozenset(
        {_State.COMMITTED, _State.FAILED, _State.CANCELLED, _State.ABORTED}
    ),
    _State.COMMITTED: frozenset({_State.ENDED, _State.ABORTED}),
    _State.ENDED: frozenset(),
    _State.FAILED: frozenset(),
    _State.CANCELLED: frozenset(),
    _State.ABORTED: frozenset(),
}


class _Gate(Protocol):
    """
    Receives the upstream body.  Before commit each call goes to the attempt;
    at commit C{dataReceived} is rebound to the client's C{write}.
    """

    def __init__(self, attempt: HttpAttempt) -> None:
        self._attempt: HttpAttempt | None = attempt

    def dataReceived(self, data: bytes) -> None:
        if self._attempt is not None:
            self._attempt._first_bytes(data)

    def connectionLost(self, reason: Failure = _DONE) -> None:
        # The last call: let go of the attempt, so the attempt -> gate ->
        # attempt cycle never outlives the response and refcounting frees
        # the request's objects (no cyclic garbage per request).
        attempt, self._attempt = self._attempt, None
        # and of the client's write it was rebound to at commit: Twisted's
        # response parser holds this protocol in a cycle of its own
        # (HTTPClientParser <-> _ChunkedTransferDecoder)
        # (a deletion, not self.__dict__.pop: see nvproxy.proxy.cork.cover)
        try:
            del self.dataReceived
        except AttributeError:
            pass
        if attempt is not None:
            attempt._body_ended(reason)


@frozen
class AttemptSettings:
    """
    What every attempt to an HTTP upstream shares: the data-path agent (on
    the shared pool), the clock, the cooperator that streams large bodies,
    and the timeouts of spec §5.1 (C{response_timeout}: headers, then the
    first body byte; C{0} disables both) and C{dispatch.stream_idle_timeout}.
    """

    agent: IAgent
    clock: IReactorTime
    cooperator: Any
    response_timeout: float
    stream_idle_timeout: float = 0.0


@frozen
class HttpTarget:
    """
    A dispatch target reached over HTTP at C{url}: a local engine, a direct
    node's engine, or a peer's facade.  Implements L{nvproxy.dispatch.Target}.
    """

    settings: AttemptSettings
    node_id: str
    url: bytes
    request: UpstreamRequest
    client: ClientSide
    meter: StatsMeter | None = None
    on_failure: Callable[[str], None] | None = None

    def start(self, final: bool) -> HttpAttempt:
        return HttpAttempt(self, final)


class HttpAttempt:
    """
    One dispatch to one upstream URL.  Implements L{nvproxy.dispatch.Attempt}.
    """

    def __init__(self, target: HttpTarget, final: bool) -> None:
        settings = target.settings
        request = target.request
        clock = settings.clock
        self.node_id = target.node_id
        self._meter = target.meter
        self._on_failure = target.on_failure
        self._idle_timeout = settings.stream_idle_timeout
        self._last_chunk = 0.0
        self.result: Deferred[Committed | AttemptFailed] = Deferred()
        self._clock = clock
        self._client = target.client
        self._final = final
        self._inference = request.inference
        self._timeout = response_timeout = settings.response_timeout
        self._state = _State.WAITING_HEADERS
        self._timer: IDelayedCall | None = None
        self._timed_out = False
        self._gate: _Gate | None = None
        self._response: IResponse | None = None
        self._done: Deferred[StreamEnd] = Deferred()
        self._producer_registered = False
        headers = end_to_end(request.headers, REQUEST_DROP, into=OwnHeaders())
        self._content: Any = request.content
        self._producer = body_producer(request.content, settings.cooperator)
        self._pending: Deferred[IResponse] | None = settings.agent.request(
            request.method, target.url, headers, self._producer
        )
        if response_timeout > 0:
            self._timer = clock.callLater(response_timeout, self._time_up)
        self._pending.addCallbacks(self._headers, self._dial_failed)

    def _cancel_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()

    # -- claims -----------------------------------------------------------

    def _claim(self, new: _State) -> bool:
        if new in _TRANSITIONS[self._state]:
            self._state = new
            return True
        return False

    def _stop_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _rearm(self, delay: float) -> None:
        """
        The attempt's one timer, due C{delay} from now.  It is moved, not
        replaced, from one stage to the next (headers, first body byte,
        silence in a stream): a new timer and a cancelled one cost the
        reactor ten times what moving one does.
        """
        timer = self._timer
        if timer is not None and timer.active():
            timer.reset(delay)
        else:
            self._timer = self._clock.callLater(delay, self._time_up)

    def _time_up(self) -> None:
        """The timer fired: what it means is the stage the attempt is in."""
        self._timer = None
        state = self._state
        if state is _State.WAITING_HEADERS:
            self._header_timeout()
        elif state is _State.GATED:
            self._first_body_timeout()
        elif state is _State.COMMITTED:
            self._idle_check()

    def _fail(self, kind: FailureKind, status: int | None = None) -> None:
        self._stop_timer()
        if self._on_failure is not None:
            self._on_failure(kind.value)
        if not self.result.called:
            self.result.callback(AttemptFailed(self.node_id, kind, status))

    # -- headers ----------------------------------------------------------

    def _header_timeout(self) -> None:
        self._timed_out = True
        self._cancel_pending()

    def _dial_failed(self, reason: Failure) -> None:
        if self._claim(_State.FAILED):
            log.debug(
                "attempt to {node} failed before headers: {error}",
                node=self.node_id,
                error=_describe(reason, self._timed_out),
            )
            self._fail(FailureKind.TRANSPORT)

    def _headers(self, response: IResponse) -> None:
        self._pending = None  # nothing left to cancel at this stage
        if self._state is not _State.WAITING_HEADERS:
            _discard(response, self._clock)
            return
        status = response.code
        if not self._final and is_retryable_status(status, self._inference):
            self._claim(_State.FAILED)
            self._fail(FailureKind.STATUS, status)
            _discard(response, self._clock)
            return
        self._claim(_State.GATED)
        self._response = response
        if self._timeout > 0:
            self._rearm(self._timeout)  # the first body byte's, from now
        self._gate = _Gate(self)
        response.deliverBody(self._gate)

    # -- the commit gate --------------------------------------------------

    def _first_body_timeout(self) -> None:
        if self._claim(_State.FAILED):
            assert self._response is not None
            status = self._response.code
            self._stop_upstream()
            self._fail(FailureKind.NO_CONTENT, status)

    def _commit(self) -> bool:
        """
        Claim the commit and start the client's answer; the caller then
        tells the dispatcher (L{_tell}).
        """
        if not self._claim(_State.COMMITTED):
            return False
        # The timer is left to _first_bytes (the stream's silence) or _end.
        response = self._response
        assert response is not None
        self._client.start(
            response.code, response.phrase, response.headers, response.length
        )
        release_body(self._content, self._producer)
        self._content = self._producer = None
        return True

    def _tell(self) -> None:
        """Fire C{result} with the commit (nothing else fires it then)."""
        response = self._response
        assert response is not None
        self.result.callback(Committed(self.node_id, response.code, self._done))

    def _first_bytes(self, data: bytes) -> None:
        # The dispatcher hears of the commit after the first bytes are
        # written: a whole answer (its Content-Length reached) leaves in
        # that write, and its client does not wait for the job's commit
        # bookkeeping (the workload event, the metrics, the outlier table):
        # one client at a time, the answer's read to its send went from
        # 67 to 49-59 us.
        # Whatever happens in the write (an abort: the dispatcher has left
        # the attempt and ignores it), the result fires.
        if not self._commit():
            return
        try:
            self._relay_first(data)
        finally:
            self._tell()

    def _relay_first(self, data: bytes) -> None:
        gate = self._gate
        assert gate is not None
        client = self._client
        if client.gone:
            # Committed to a client that has just left: nothing to relay.
            self._stop_timer()
            self._stop_upstream()
            return
        write = client.request.write
        meter = self._meter
        response = self._response
        assert response is not None
        if meter is not None and response.code < 400:
            # Stats (§5.5) see each chunk once: O(chunk), no parsing.
            feed = meter.feed
            plain = write

            def relay(data: bytes) -> None:
                plain(data)
                feed(data)

            write = relay
        if self._idle_timeout > 0:
            # dispatch.stream_idle_timeout: one clock read per chunk, and a
            # timer that re-arms itself from the last chunk's time.
            seconds = self._clock.seconds
            stamped = write

            def timed(data: bytes) -> None:
                self._last_chunk = seconds()
                stamped(data)

            write = timed
            self._last_chunk = seconds()
            self._rearm(self._idle_timeout)
        else:
            self._stop_timer()
        # Register before the first write: a write that fills the client's
        # buffer pauses only a producer registered already.
        client.request.registerProducer(gate.transport, True)
        self._producer_registered = True
        write(data)
        if self._state is _State.COMMITTED and not client.gone:
            gate.dataReceived = write  # type: ignore[method-assign]

    def _body_ended(self, reason: Failure) -> None:
        # isinstance, not Failure.check: check names every class in the
        # value's MRO (reflect.qual) on each call
        clean = isinstance(reason.value, (ResponseDone, PotentialDataLoss))
        if self._state is _State.GATED:
            if clean:
                # EOF with no body bytes is a commit (spec §5.2).
                if self._commit():
                    self._tell()
                    self._end(StreamEnd.COMPLETE)
            elif self._claim(_State.FAILED):
                self._fail(FailureKind.TRANSPORT)
            return
        if self._state is _State.COMMITTED:
            self._end(StreamEnd.COMPLETE if clean else StreamEnd.TRUNCATED)
            return

    def _idle_check(self) -> None:
        due = self._last_chunk + self._idle_timeout
        now = self._clock.seconds()
        if now < due:
            self._rearm(due - now)
            return
        log.info(
            "upstream {node} sent nothing for {seconds}s: stream cut",
            node=self.node_id,
            seconds=self._idle_timeout,
        )
        self._stop_upstream()
        self._end(StreamEnd.TRUNCATED, IDLE_MESSAGE)

    def _end(self, how: StreamEnd, why: str = TRUNCATED_MESSAGE) -> None:
        self._claim(_State.ENDED)
        self._stop_timer()
        self._unregister()
        if how is StreamEnd.COMPLETE:
            self._client.finish()
        else:
            log.debug("upstream {node} ended mid-stream", node=self.node_id)
            response = self._response
            assert response is not None
            types = response.headers.getRawHeaders(b"content-type")
            meter = self._meter
            at_line_start = meter.at_line_start if meter is not None else True
            frame = error_frame(types[0] if types else None, why, at_line_start)
            self._client.cut(frame, self._clock)
        if not self._done.called:
            self._done.callback(how)

    def _unregister(self) -> None:
        if self._producer_registered:
            self._producer_registered = False
            if not self._client.gone:
                self._client.request.unregisterProducer()

    def _stop_upstream(self) -> None:
        gate = self._gate
        if gate is not None and gate.transport is not None:
            IPushProducer(gate.transport).stopProducing()

    # -- Attempt protocol -------------------------------------------------

    def cancel(self) -> None:
        """
        The target left discovery: abandon the attempt unless it committed.
        """
        if not self._claim(_State.CANCELLED):
            return
        self._stop_timer()
        self._cancel_pending()
        self._stop_upstream()
        self._fail(FailureKind.TARGET_LOST)

    def abort(self) -> None:
        """
        The client went away or we are shutting down: tear everything down.
        """
        committed = self._state is _State.COMMITTED
        if not self._claim(_State.ABORTED):
            return
        self._stop_timer()
        self._cancel_pending()
        self._unregister()
        self._stop_upstream()
        if committed:
            # Shutdown with the client still there: end its stream as cut
            # (not finished, which would make it look whole).
            self._client.abort()
            if not self._done.called:
                self._done.callback(StreamEnd.CLIENT_GONE)
        elif not self.result.called:
            self.result.callback(AttemptFailed(self.node_id, FailureKind.TRANSPORT))


DRAIN_LIMIT = 64 * 1024
"""Bytes of a discarded response read to keep its connection for reuse."""

DRAIN_TIMEOUT = 5.0
"""Seconds a discarded response may take to end before its connection closes."""


class _Drain(Protocol):
    """
    Reads and drops a response we will not relay.  A short body (an error
    document) is read to its end, so the connection goes back to the pool
    whole; a long or slow one is stopped, and the pool never hands out a
    connection being closed (L{nvproxy.proxy.upstream.ProxyPool}).  Stopping is
    never done from the response callback itself: the rest of the response
    may be in the same socket read, and would complete it after the stop.
    """

    def __init__(self, clock: IReactorTime) -> None:
        self._left = DRAIN_LIMIT
        self._clock = clock
        self._timer: IDelayedCall | None = None

    def connectionMade(self) -> None:
        self._timer = self._clock.callLater(DRAIN_TIMEOUT, self._stop)

    def dataReceived(self, data: bytes) -> None:
        self._left -= len(data)
        if self._left < 0:
            self._stop()

    def _stop(self) -> None:
        self._cancel()
        if self.transport is not None:
            IPushProducer(self.transport).stopProducing()

    def _cancel(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def connectionLost(self, reason: Failure = _DONE) -> None:
        self._cancel()


def _discard(response: IResponse, clock: IReactorTime) -> None:
    """
    Throw away a response we will not relay (see L{_Drain}).
    """
    response.deliverBody(_Drain(clock))


def _describe(reason: Failure, timed_out: bool) -> str:
    if timed_out:
        return "response header timeout"
    if reason.check(CancelledError):
        return "cancelled"
    value = reason.value
    inner = getattr(value, "reasons", None)
    if inner:
        value = inner[0].value
    return describe(value)
