# -*- test-case-name: tests.test_vllm -*-
"""
The sleep API of one vLLM service (dev mode, ENGINES.md) over treq: what
the per-service machine and the state poll ask a service, each call bounded
by a timeout on the injected clock.

L{SleepApi} is the narrow face the machine depends on; L{SleepApiClient}
implements it over a treq C{HTTPClient} (C{StubTreq} in tests).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlencode

import treq
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

if TYPE_CHECKING:
    from treq.client import HTTPClient

log = Logger()


class NoAnswer(Exception):
    """The service did not answer at all (refused, reset, timed out, or a
    gateway status from C{/is_sleeping})."""


class BadAnswer(Exception):
    """
    The service answered, but not as the sleep API promises: an error
    status, or a body that cannot be read.

    @ivar code: the HTTP status, if it answered one.
    """

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class SleepApi(Protocol):
    """
    What the machine and the poll ask one vLLM service.  C{timeout}: the
    longest the call may take (None: the client's default); a call that is
    cancelled fails with C{CancelledError}, never with L{NoAnswer}.
    """

    def is_sleeping(self, timeout: float | None = None) -> Deferred[bool]:
        """C{GET /is_sleeping}; 404 (no dev mode) reads as False.

        @raise NoAnswer: no answer, or 502/503/504.
        @raise BadAnswer: any other error status, or an unreadable body."""

    def sleep(
        self, level: int, mode: str | None = "wait", timeout: float | None = None
    ) -> Deferred[None]:
        """C{POST /sleep?level=N&mode=M} (no C{mode} when None).

        @raise BadAnswer: not 200 (C{code} says which)."""

    def wake_up(
        self, tags: Sequence[str] = (), timeout: float | None = None
    ) -> Deferred[None]:
        """C{POST /wake_up} (C{?tags=...} for a staged wake).

        @raise BadAnswer: not 200."""

    def reload_weights(self, timeout: float | None = None) -> Deferred[None]:
        """C{POST /collective_rpc {"method": "reload_weights"}}.

        @raise BadAnswer: not 200."""

    def reset_prefix_cache(self, timeout: float | None = None) -> Deferred[None]:
        """C{POST /reset_prefix_cache}.

        @raise BadAnswer: not 200."""

    def health(self, timeout: float | None = None) -> Deferred[int]:
        """C{GET /health}: its status (200 when ready).

        @raise NoAnswer: no answer at all."""

    def metrics(self, timeout: float | None = None) -> Deferred[bytes]:
        """C{GET /metrics}: the Prometheus exposition.

        @raise BadAnswer: not 200."""


class SleepApiClient:
    """
    L{SleepApi} over treq for the service at C{base_url}.

    @param service: the service's name, for log lines.
    @param timeout: the default timeout of a call (headers and body each).
    """

    def __init__(
        self,
        http: HTTPClient,
        clock: IReactorTime,
        base_url: str,
        service: str,
        timeout: float = 10.0,
    ) -> None:
        self.http = http
        self.clock = clock
        self.base = base_url.rstrip("/")
        self.service = service
        self.timeout = timeout
        self._warned_no_dev_mode = False

    # -- SleepApi -----------------------------------------------------------

    def is_sleeping(self, timeout: float | None = None) -> Deferred[bool]:
        def read(reply: tuple[int, bytes]) -> bool:
            code, data = reply
            if code in (502, 503, 504):
                raise NoAnswer(f"GET /is_sleeping answered {code}")
            if code == 404:
                if not self._warned_no_dev_mode:
                    self._warned_no_dev_mode = True
                    log.warn(
                        "vLLM service {service} has no sleep API (dev mode off?)",
                        service=self.service,
                    )
                return False
            if code != 200:
                raise BadAnswer(f"GET /is_sleeping answered {code}", code)
            try:
                return bool(json.loads(data)["is_sleeping"])
            except (ValueError, KeyError, TypeError):
                raise BadAnswer("GET /is_sleeping: unreadable answer", code) from None

        return self.call("GET", "/is_sleeping", timeout).addCallback(read)

    def sleep(
        self, level: int, mode: str | None = "wait", timeout: float | None = None
    ) -> Deferred[None]:
        query: dict[str, Any] = {"level": level}
        if mode is not None:
            query["mode"] = mode
        return self._expect("POST", "/sleep?" + urlencode(query), timeout)

    def wake_up(
        self, tags: Sequence[str] = (), timeout: float | None = None
    ) -> Deferred[None]:
        path = "/wake_up"
        if tags:
            path += "?" + urlencode([("tags", tag) for tag in tags])
        return self._expect("POST", path, timeout)

    def reload_weights(self, timeout: float | None = None) -> Deferred[None]:
        return self._expect(
            "POST", "/collective_rpc", timeout, {"method": "reload_weights"}
        )

    def reset_prefix_cache(self, timeout: float | None = None) -> Deferred[None]:
        return self._expect("POST", "/reset_prefix_cache", timeout)

    def health(self, timeout: float | None = None) -> Deferred[int]:
        return self.call("GET", "/health", timeout).addCallback(lambda r: r[0])

    def metrics(self, timeout: float | None = None) -> Deferred[bytes]:
        def read(reply: tuple[int, bytes]) -> bytes:
            code, data = reply
            if code != 200:
                raise BadAnswer(f"GET /metrics answered {code}", code)
            return data

        return self.call("GET", "/metrics", timeout).addCallback(read)

    # -- one call -----------------------------------------------------------

    def call(
        self,
        method: str,
        path: str,
        timeout: float | None = None,
        body: object = None,
    ) -> Deferred[tuple[int, bytes]]:
        """
        One request: its status and whole body, each part within
        C{timeout}.

        @raise NoAnswer: it did not answer (refused, reset, timed out).
        @raise CancelledError: the returned Deferred was cancelled (twisted.web
            reports that as C{ResponseNeverReceived([CancelledError])}: a
            cancel means cancel, never "no answer").
        """
        limit = self.timeout if timeout is None else timeout
        cancelled = False

        def cancel(_: Deferred[tuple[int, bytes]]) -> None:
            nonlocal cancelled
            cancelled = True
            exchange.cancel()

        result: Deferred[tuple[int, bytes]] = Deferred(cancel)
        exchange = Deferred.fromCoroutine(self._exchange(method, path, limit, body))

        def answered(reply: tuple[int, bytes]) -> None:
            if not result.called:
                result.callback(reply)

        def failed(f: Failure) -> None:
            if result.called:
                return
            if cancelled or f.check(CancelledError):
                result.errback(CancelledError())
            else:
                result.errback(NoAnswer(f"{method} {path}: {type(f.value).__name__}"))

        exchange.addCallbacks(answered, failed)
        return result

    async def _exchange(
        self, method: str, path: str, limit: float, body: object
    ) -> tuple[int, bytes]:
        if body is None:
            d = self.http.request(method, self.base + path)
        else:
            d = self.http.request(method, self.base + path, json=body)
        d.addTimeout(limit, self.clock)
        response = await d
        content: Deferred[bytes] = treq.content(response)
        content.addTimeout(limit, self.clock)
        data = await content
        return response.code, data

    def _expect(
        self, method: str, path: str, timeout: float | None, body: object = None
    ) -> Deferred[None]:
        def ok(reply: tuple[int, bytes]) -> None:
            code = reply[0]
            if code != 200:
                raise BadAnswer(f"{method} {path} answered {code}", code)

        return self.call(method, path, timeout, body).addCallback(ok)
