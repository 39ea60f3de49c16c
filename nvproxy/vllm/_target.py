# -*- test-case-name: tests.test_vllm -*-
"""
L{WakingTarget}: a dispatch target that waits for its vLLM service.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from nvproxy.dispatch import (
    Attempt,
    AttemptFailed,
    Committed,
    FailureKind,
    StreamEnd,
    Target,
)
from nvproxy.vllm._errors import Waking, waking_503_body
from nvproxy.vllm._manager import VllmManager

if TYPE_CHECKING:
    from nvproxy.proxy.client import ClientSide

log = Logger()


class WakingTarget:
    """
    A L{Target} for a local vLLM service: each attempt counts as an active
    request, waits until the service is awake, then runs C{inner}'s attempt.

    When the hold passes (L{Waking}, also L{WakeFailed}):

    * a non-final attempt with other owners to try (C{retry_elsewhere})
      reports C{AttemptFailed(node, STATUS, 503)}, so dispatch tries another
      owner (DESIGN §5: retryable elsewhere);
    * otherwise (the final attempt, or this service is the only owner, where
      a retry would only hold the request again) the attempt answers the
      client itself with FD §6.2.1's 503 (C{Retry-After} by depth, the
      C{model_waking} body) and reports it as C{Committed(node, 503)} with
      C{done} already fired: the job ends failed with status 503, the body
      unchanged.

    Other failures of the wait (the manager stopped) are TRANSPORT failures.

    Once forwarded, the attempt waits for C{inner}'s answer.  Should the
    service turn out to be asleep before it came (put to sleep behind
    nvproxy's back), the manager wakes it and holds this attempt too, from
    when it was forwarded: the engine answers once awake; if C{inner} has
    not committed by the hold deadline of the depth (or the wake failed),
    C{inner} is cancelled and the attempt ends as the depth-aware 503 above.
    """

    def __init__(
        self,
        inner: Target,
        manager: VllmManager,
        service: str,
        client: ClientSide,
        model: str | None = None,
        retry_elsewhere: bool = True,
    ) -> None:
        config = manager.registry.service(service)
        self.retry_elsewhere = retry_elsewhere
        self.node_id = inner.node_id
        self.inner = inner
        self.manager = manager
        self.service = service
        self.client = client
        self.model = model if model is not None else config.model

    def start(self, final: bool) -> Attempt:
        return _WakingAttempt(self, final)


class _WakingAttempt:
    def __init__(self, target: WakingTarget, final: bool) -> None:
        self.result: Deferred[Committed | AttemptFailed] = Deferred()
        self._target = target
        self._final = final
        self._inner: Attempt | None = None
        self._answered: Callable[[], None] | None = None
        self._expired: Waking | None = None
        self._over = False
        self._finished = False
        target.manager.request_started(target.service)
        self._waiting: Deferred[None] | None = None
        waiting = target.manager.ensure_awake(target.service)
        if not waiting.called:
            self._waiting = waiting
        waiting.addCallbacks(self._awake, self._not_awake)

    def _finish(self, served: bool) -> None:
        if not self._finished:
            self._finished = True
            self._target.manager.request_finished(self._target.service, served)

    def _fire(self, outcome: Committed | AttemptFailed) -> None:
        if not self.result.called:
            self.result.callback(outcome)

    def _awake(self, _: None) -> None:
        self._waiting = None
        if self._over:
            return
        node = self._target.node_id
        try:
            inner = self._target.inner.start(self._final)
        except Exception:
            log.failure("vLLM inner target failed to start")
            self._finish(False)
            self._fire(AttemptFailed(node, FailureKind.TRANSPORT))
            return
        self._inner = inner
        self._answered = self._target.manager.forwarded(
            self._target.service, self._held
        )
        inner.result.addCallback(self._relay)

    def _held(self, hold: Deferred[None]) -> None:
        """The service was found asleep while C{inner} waits for it."""

        def expired(failure: Failure) -> None:
            inner = self._inner
            error = failure.value
            if not isinstance(error, Waking) or inner is None:
                return  # cancelled (answered), or the manager stopped
            if inner.result.called or self._expired is not None:
                return
            log.info(
                "vLLM service {service} still asleep at the {depth} hold:"
                " the forwarded request is given up",
                service=self._target.service,
                depth=error.depth.value,
            )
            self._expired = error
            inner.cancel()

        hold.addErrback(expired)

    def _relay(self, outcome: Committed | AttemptFailed) -> None:
        answered, self._answered = self._answered, None
        if answered is not None:
            answered()
        if isinstance(outcome, AttemptFailed) and self._expired is not None:
            self._finish(False)
            self._waking(self._expired)
            return
        if isinstance(outcome, Committed):
            served = outcome.status < 500

            def ended(how: StreamEnd) -> StreamEnd:
                self._finish(served)
                return how

            outcome.done.addCallback(ended)
        else:
            self._finish(False)
        self._fire(outcome)

    def _not_awake(self, failure: Failure) -> None:
        self._waiting = None
        if self._over:
            return
        self._finish(False)
        node = self._target.node_id
        error = failure.value
        if not isinstance(error, Waking):
            log.warn(
                "vLLM service {service} not available: {error}",
                service=self._target.service,
                error=f"{type(error).__name__}: {error}",
            )
            self._fire(AttemptFailed(node, FailureKind.TRANSPORT))
            return
        self._waking(error)

    def _waking(self, error: Waking) -> None:
        """End as the depth-aware 503 (or retryable elsewhere)."""
        node = self._target.node_id
        self._target.manager.answered_503(self._target.service, error.depth)
        if not self._final and self._target.retry_elsewhere:
            self._fire(AttemptFailed(node, FailureKind.STATUS, 503))
            return
        how = self._answer(error)
        self._fire(Committed(node, 503, succeed(how)))

    def _answer(self, error: Waking) -> StreamEnd:
        client = self._target.client
        request = client.request
        if client.gone or request.finished:
            return StreamEnd.CLIENT_GONE
        body = waking_503_body(self._target.model, error)
        request.setResponseCode(503)
        headers = request.responseHeaders
        headers.setRawHeaders(b"content-type", [b"application/json"])
        headers.setRawHeaders(b"content-length", [b"%d" % len(body)])
        headers.setRawHeaders(b"retry-after", [b"%d" % error.retry_after])
        request.write(body)
        request.finish()
        return StreamEnd.COMPLETE

    def _stop_waiting(self) -> bool:
        """Stop a wait still pending; whether there was one."""
        if self.result.called or self._inner is not None:
            return False
        self._over = True
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.cancel()
        self._finish(False)
        return True

    def cancel(self) -> None:
        if self._inner is not None:
            self._inner.cancel()
        elif self._stop_waiting():
            self._fire(AttemptFailed(self._target.node_id, FailureKind.TARGET_LOST))

    def abort(self) -> None:
        if self._inner is not None:
            self._inner.abort()
        elif self._stop_waiting():
            self._fire(AttemptFailed(self._target.node_id, FailureKind.TRANSPORT))
