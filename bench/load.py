"""
The load generator: C{concurrency} workers on one C{twisted.web.client.Agent}
with its own persistent pool, each sending requests back to back for a fixed
time, recording latency and time to first body byte per request.
"""

from __future__ import annotations

import json
import math
import resource
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
from attrs import frozen
from twisted.internet.defer import CancelledError, Deferred, gatherResults
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from nvproxy.proxy.upstream import BytesProducer

Now = Callable[[], float]


@frozen
class Workload:
    """
    One kind of request: a chat, streamed or not, in Ollama's dialect
    (C{POST /api/chat}, NDJSON when streamed) or OpenAI's
    (C{POST /v1/chat/completions}, SSE when streamed).  C{tokens} asks for
    that many tokens (C{options.num_predict} / C{max_tokens}), which the
    native engine honours; None leaves it to the engine's default.
    """

    model: str
    stream: bool
    api: str = "ollama"
    tokens: int | None = None

    @property
    def path(self) -> str:
        return "/api/chat" if self.api == "ollama" else "/v1/chat/completions"

    def body(self) -> bytes:
        document: dict[str, Any] = {
            "model": self.model,
            "stream": self.stream,
            "messages": [{"role": "user", "content": "say hello"}],
        }
        if self.tokens is not None:
            if self.api == "ollama":
                document["options"] = {"num_predict": self.tokens}
            else:
                document["max_tokens"] = self.tokens
        return json.dumps(document).encode("utf-8")


@attrs.define
class Samples:
    """What one path measured over all its rounds."""

    latencies: list[float] = attrs.field(factory=list)
    ttfbs: list[float] = attrs.field(factory=list)
    lines: int = 0
    errors: int = 0
    elapsed: float = 0.0
    error_kinds: dict[str, int] = attrs.field(factory=dict)
    # seconds each chunk arrived after the engine wrote it (native engine and
    # load generator only: the chunk carries its send time)
    delays: list[float] = attrs.field(factory=list)
    client_cpu: float = 0.0  # the load generator's CPU seconds
    connects: int = 0  # connections opened (native load generator only)

    @property
    def ok(self) -> int:
        return len(self.latencies)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


def percentile(values: Sequence[float], q: float) -> float:
    """The C{q}-th percentile (nearest rank) of C{values}; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


class _Body(Protocol):
    """Reads a response body: first-byte time, line count, end."""

    def __init__(self, now: Now) -> None:
        self._now = now
        self.first: float | None = None
        self.lines = 0
        self._last = b""
        self.done: Deferred[None] = Deferred(self._abort)

    def _abort(self, d: Deferred[None]) -> None:
        # deliverBody hands us a producer proxy; stopping it drops the connection.
        producer = cast(IPushProducer | None, self.transport)
        if producer is not None:
            producer.stopProducing()

    def dataReceived(self, data: bytes) -> None:
        if self.first is None:
            self.first = self._now()
        # non-empty lines, as the native load generator counts them: an SSE
        # event ends with a blank line, which is not a chunk of its own
        blank = data.count(b"\n\n") + (data[:1] == b"\n" and self._last == b"\n")
        self.lines += data.count(b"\n") - blank
        self._last = data[-1:]

    def connectionLost(self, reason: Failure = ResponseDone) -> None:  # type: ignore[assignment]
        if self.done.called:
            return
        if reason.check(ResponseDone):
            self.done.callback(None)
        else:
            self.done.errback(reason)


class LoadGenerator:
    """
    Sends one L{Workload} to one URL with a fixed number of workers.

    The pool keeps up to C{concurrency} connections per host, so every worker
    holds its own keep-alive connection: nothing is dialled per request once
    the pool is warm.
    """

    def __init__(
        self, reactor: Any, now: Now, concurrency: int, timeout: float = 30.0
    ) -> None:
        self._reactor = reactor
        self._now = now
        self.concurrency = concurrency
        self.timeout = timeout
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = concurrency + 2
        self.pool.retryAutomatically = False
        self._agent = Agent(reactor, pool=self.pool)

    async def one(self, url: bytes, body: bytes, samples: Samples) -> None:
        """One request; errors and timeouts are counted, never raised."""
        attempt = Deferred.fromCoroutine(self._one(url, body, samples))
        timer = self._reactor.callLater(self.timeout, attempt.cancel)
        try:
            await attempt
        finally:
            if timer.active():
                timer.cancel()

    async def _one(self, url: bytes, body: bytes, samples: Samples) -> None:
        start = self._now()
        try:
            response: IResponse = await self._agent.request(
                b"POST",
                url,
                Headers({b"content-type": [b"application/json"]}),
                BytesProducer(body),
            )
        except CancelledError:
            samples.error("timeout")
            return
        except Exception as e:
            samples.error(type(e).__name__)
            return
        reader = _Body(self._now)
        response.deliverBody(reader)
        try:
            await reader.done
        except CancelledError:
            samples.error("timeout")
            return
        except Exception as e:
            samples.error(type(e).__name__)
            return
        end = self._now()
        if response.code != 200:
            samples.error(f"HTTP {response.code}")
            return
        first = reader.first if reader.first is not None else end
        samples.latencies.append(end - start)
        samples.ttfbs.append(first - start)
        samples.lines += reader.lines

    async def round(
        self,
        url: str,
        workload: Workload,
        duration: float,
        samples: Samples,
        max_requests: int = 1_000_000,
    ) -> None:
        """Run all workers for C{duration} seconds (and C{max_requests})."""
        target, body = url.encode("ascii"), workload.body()
        cpu = _own_cpu()
        start = self._now()
        stop_at = start + duration
        budget = [max_requests]

        async def worker() -> None:
            while self._now() < stop_at and budget[0] > 0:
                budget[0] -= 1
                await self.one(target, body, samples)

        workers = [Deferred.fromCoroutine(worker()) for _ in range(self.concurrency)]
        await gatherResults(workers, consumeErrors=True)
        samples.elapsed += self._now() - start
        samples.client_cpu += _own_cpu() - cpu

    def close(self) -> Deferred[None]:
        closed: Deferred[None] = self.pool.closeCachedConnections()
        return closed


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def perf_now() -> float:
    """The load generator's clock: monotonic, high resolution."""
    return time.perf_counter()
