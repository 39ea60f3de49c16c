# -*- test-case-name: tests.test_etcd -*-
"""
The few etcd v3 calls discovery needs, over etcd's JSON gateway with treq
on the shared pool: leases (grant, keep alive, revoke), put, a prefix range
read and a prefix watch.

L{EtcdApi} is the narrow face the session depends on; L{EtcdClient}
implements it over a treq C{HTTPClient} against one or more endpoints,
tried in turn; L{nvproxy.testing.fakeetcd} implements it in memory.

The gateway speaks JSON with keys and values in base64 and 64-bit integers
as strings.  A watch is one long POST whose body is a stream of JSON
objects, one per line.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import treq
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol as _Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss

if TYPE_CHECKING:
    from treq.client import HTTPClient

log = Logger()

# a watch message is one JSON object; anything longer is not etcd talking
MAX_MESSAGE = 16 * 1024 * 1024


class EtcdUnavailable(Exception):
    """No endpoint answered (refused, reset, timed out, or 5xx)."""


class EtcdRefused(Exception):
    """
    etcd answered with an error (a bad request, an unknown lease).

    @ivar code: the HTTP status.
    """

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Compacted(Exception):
    """
    A watch's start revision was compacted away; read the range afresh.

    @ivar revision: the oldest revision etcd still holds.
    """

    def __init__(self, revision: int) -> None:
        super().__init__(f"revision compacted (oldest kept: {revision})")
        self.revision = revision


@attrs.frozen
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int


@attrs.frozen
class Range:
    """The answer of a range read: the store's revision, and what it holds."""

    revision: int
    kvs: tuple[KeyValue, ...]


@attrs.frozen
class WatchEvent:
    """One change: C{value} is C{None} for a delete."""

    key: bytes
    value: bytes | None
    mod_revision: int


@attrs.frozen
class WatchBatch:
    """What one watch message carried, at the store's C{revision}."""

    revision: int
    events: tuple[WatchEvent, ...]


class Watch(Protocol):
    """
    A running watch. C{done} fires with None when etcd ends the stream,
    fails with L{Compacted}, L{EtcdUnavailable} or L{EtcdRefused}, and with
    C{CancelledError} after L{cancel}.
    """

    done: Deferred[None]

    def cancel(self) -> None: ...


class EtcdApi(Protocol):
    """The calls, each bounded by the client's timeout (watches excepted)."""

    def grant(self, ttl: int) -> Deferred[int]:
        """A new lease of C{ttl} seconds; its id."""

    def keepalive(self, lease: int) -> Deferred[int]:
        """Refresh C{lease}; its TTL now, 0 when it has expired."""

    def revoke(self, lease: int) -> Deferred[None]:
        """End C{lease} now, deleting its keys."""

    def put(self, key: bytes, value: bytes, lease: int) -> Deferred[int]:
        """Write C{key} under C{lease}; the revision of the write."""

    def range_prefix(self, prefix: bytes) -> Deferred[Range]:
        """Every key under C{prefix}."""

    def watch(
        self,
        prefix: bytes,
        start_revision: int,
        deliver: Callable[[WatchBatch], None],
    ) -> Watch:
        """Watch C{prefix} from C{start_revision}, calling C{deliver} per
        message in order."""


def prefix_end(prefix: bytes) -> bytes:
    """The C{range_end} that makes a range or watch cover C{prefix}."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"  # every key


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(data: Any) -> bytes:
    if not isinstance(data, str):
        return b""
    return base64.b64decode(data)


def _int(value: Any) -> int:
    # the gateway renders int64 as a string and omits zero values
    if value is None:
        return 0
    return int(value)


def _kv(raw: Any) -> KeyValue:
    return KeyValue(
        _unb64(raw.get("key")), _unb64(raw.get("value")), _int(raw.get("mod_revision"))
    )


def parse_watch_message(message: Any) -> WatchBatch | None:
    """
    One watch message: a batch of events, None for a message carrying none
    (the creation answer, a progress notice).

    @raise Compacted: the watch was cancelled because its start revision
        was compacted.
    @raise EtcdRefused: the watch was cancelled for another reason, or the
        gateway reported an error.
    """
    if not isinstance(message, dict):
        raise EtcdRefused("watch message is not an object", 200)
    if "error" in message:
        error = message["error"]
        text = error.get("message", "error") if isinstance(error, dict) else "error"
        raise EtcdRefused(f"watch failed: {text}", 200)
    result = message.get("result")
    if not isinstance(result, dict):
        raise EtcdRefused("watch message without result", 200)
    if result.get("canceled"):
        compacted = _int(result.get("compact_revision"))
        if compacted:
            raise Compacted(compacted)
        raise EtcdRefused(
            f"watch cancelled: {result.get('cancel_reason', 'no reason given')}", 200
        )
    revision = _int(result.get("header", {}).get("revision"))
    events = []
    for event in result.get("events") or ():
        kv = event.get("kv") or {}
        deleted = event.get("type") == "DELETE"
        events.append(
            WatchEvent(
                _unb64(kv.get("key")),
                None if deleted else _unb64(kv.get("value")),
                _int(kv.get("mod_revision")),
            )
        )
    if not events:
        return None
    return WatchBatch(revision, tuple(events))


class LineSplitter:
    """
    Cuts a byte stream into JSON messages, one per line, bounded by
    L{MAX_MESSAGE}.
    """

    def __init__(self, deliver: Callable[[Any], None]) -> None:
        self._deliver = deliver
        self._buffer = b""

    def feed(self, data: bytes) -> None:
        self._buffer += data
        while True:
            line, newline, rest = self._buffer.partition(b"\n")
            if not newline:
                break
            self._buffer = rest
            if line.strip():
                self._deliver(json.loads(line))
        if len(self._buffer) > MAX_MESSAGE:
            raise EtcdRefused("watch message too long", 200)

    def end(self) -> None:
        if self._buffer.strip():
            line, self._buffer = self._buffer, b""
            self._deliver(json.loads(line))


_DONE = Failure(ConnectionDone())

_JSON: dict[bytes | str, list[bytes | str]] = {b"content-type": [b"application/json"]}


class _WatchStream(_Protocol):
    """
    The body of a watch: messages to the splitter as they arrive; a cancel
    closes the connection (the pool never sees it again).
    """

    def __init__(self, splitter: LineSplitter, url: str) -> None:
        self._splitter = splitter
        self._url = url
        self.done: Deferred[None] = Deferred(lambda _: self._stop())

    def _stop(self) -> None:
        transport: Any = self.transport
        if transport is not None:
            transport.stopProducing()

    def dataReceived(self, data: bytes) -> None:
        if self.done.called:
            return
        try:
            self._splitter.feed(data)
        except Exception:
            self._stop()
            failure = Failure()
            if not failure.check(Compacted, EtcdRefused):
                failure = Failure(EtcdRefused(f"{self._url}: unreadable watch", 200))
            self.done.errback(failure)

    def connectionLost(self, reason: Failure = _DONE) -> None:
        if self.done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            try:
                self._splitter.end()
            except Exception:
                self.done.errback(EtcdRefused(f"{self._url}: unreadable watch", 200))
                return
            self.done.callback(None)
        else:
            self.done.errback(
                EtcdUnavailable(
                    f"{self._url}: watch broke ({reason.getErrorMessage()})"
                )
            )


class _TreqWatch:
    def __init__(self, done: Deferred[None]) -> None:
        self.done = done

    def cancel(self) -> None:
        self.done.cancel()


class EtcdClient:
    """
    L{EtcdApi} over treq.  C{endpoints} are base URLs
    (C{http://127.0.0.1:2379}); a call that finds one unavailable tries the
    next, and the client stays with the last one that answered.
    """

    def __init__(
        self,
        client: HTTPClient,
        clock: IReactorTime,
        endpoints: Sequence[str],
        timeout: float = 5.0,
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self._client = client
        self._clock = clock
        self._endpoints = [e.rstrip("/") for e in endpoints]
        self._current = 0
        self._timeout = timeout

    @property
    def endpoint(self) -> str:
        """The endpoint in use."""
        return self._endpoints[self._current]

    def _rotate(self) -> None:
        self._current = (self._current + 1) % len(self._endpoints)

    async def _call_one(self, path: str, body: dict[str, Any]) -> Any:
        url = f"{self.endpoint}{path}"
        try:
            response = await self._client.post(
                url, data=json.dumps(body).encode(), headers=_JSON
            )
            content = await treq.content(response)
        except CancelledError:
            raise
        except Exception as e:
            raise EtcdUnavailable(f"{url}: {type(e).__name__}") from e
        if response.code >= 500 and response.code not in (501,):
            raise EtcdUnavailable(f"{url}: HTTP {response.code}")
        try:
            answer = json.loads(content)
        except ValueError as e:
            raise EtcdRefused(f"{url}: unreadable answer", response.code) from e
        if response.code != 200:
            message = answer.get("message") if isinstance(answer, dict) else None
            raise EtcdRefused(f"{url}: {message or 'error'}", response.code)
        return answer

    def _call(self, path: str, body: dict[str, Any]) -> Deferred[Any]:
        async def call() -> Any:
            last: EtcdUnavailable | None = None
            for _ in self._endpoints:
                attempt = Deferred.fromCoroutine(self._call_one(path, body))
                attempt.addTimeout(self._timeout, self._clock)
                try:
                    return await attempt
                except CancelledError:
                    if attempt.called and not isinstance(
                        getattr(attempt, "result", None), Failure
                    ):
                        raise
                    last = EtcdUnavailable(f"{self.endpoint}{path}: timed out")
                except EtcdUnavailable as e:
                    last = e
                self._rotate()
            assert last is not None
            raise last

        return Deferred.fromCoroutine(call())

    def grant(self, ttl: int) -> Deferred[int]:
        async def grant() -> int:
            answer = await self._call("/v3/lease/grant", {"TTL": ttl})
            if answer.get("error"):
                raise EtcdRefused(f"lease grant: {answer['error']}", 200)
            return _int(answer.get("ID"))

        return Deferred.fromCoroutine(grant())

    def keepalive(self, lease: int) -> Deferred[int]:
        async def keepalive() -> int:
            answer = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
            result = answer.get("result", answer) if isinstance(answer, dict) else {}
            return _int(result.get("TTL"))

        return Deferred.fromCoroutine(keepalive())

    def revoke(self, lease: int) -> Deferred[None]:
        async def revoke() -> None:
            await self._call("/v3/lease/revoke", {"ID": str(lease)})

        return Deferred.fromCoroutine(revoke())

    def put(self, key: bytes, value: bytes, lease: int) -> Deferred[int]:
        async def put() -> int:
            body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
            if lease:
                body["lease"] = str(lease)
            answer = await self._call("/v3/kv/put", body)
            return _int(answer.get("header", {}).get("revision"))

        return Deferred.fromCoroutine(put())

    def range_prefix(self, prefix: bytes) -> Deferred[Range]:
        async def range_() -> Range:
            answer = await self._call(
                "/v3/kv/range",
                {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))},
            )
            kvs = tuple(_kv(kv) for kv in answer.get("kvs") or ())
            return Range(_int(answer.get("header", {}).get("revision")), kvs)

        return Deferred.fromCoroutine(range_())

    def watch(
        self,
        prefix: bytes,
        start_revision: int,
        deliver: Callable[[WatchBatch], None],
    ) -> Watch:
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
            }
        }

        def message(raw: Any) -> None:
            batch = parse_watch_message(raw)
            if batch is not None:
                deliver(batch)

        async def run() -> None:
            url = f"{self.endpoint}/v3/watch"
            opening = self._client.post(
                url, data=json.dumps(body).encode(), headers=_JSON, unbuffered=True
            )
            opening.addTimeout(self._timeout, self._clock)
            try:
                response = await opening
            except CancelledError:
                raise
            except Exception as e:
                self._rotate()
                raise EtcdUnavailable(f"{url}: {type(e).__name__}") from e
            if response.code != 200:
                await treq.content(response)
                if response.code >= 500:
                    self._rotate()
                    raise EtcdUnavailable(f"{url}: HTTP {response.code}")
                raise EtcdRefused(f"{url}: HTTP {response.code}", response.code)
            stream = _WatchStream(LineSplitter(message), url)
            response.deliverBody(stream)
            await stream.done

        return _TreqWatch(Deferred.fromCoroutine(run()))
