# -*- test-case-name: tests.test_statuspage -*-
"""
C{GET /admin/events}: the status page's view as Server-Sent Events.

On connect a client gets one C{snapshot} event (the whole view); then, each
time a poll of the status (every L{StatusFeed} C{interval}, on the injected
clock, only while a client is connected) finds a section changed, one
C{update} event with the changed sections only, each replacing the
client's copy whole.  A comment line keeps idle connections open through
proxies.  Every event's C{data} is one line of JSON::

    event: snapshot
    id: 7
    data: {"seq": 7, "now": 1764620000000, "view": {"node": ..., "nodes": [...], ...}}

    event: update
    id: 8
    data: {"seq": 8, "now": 1764620001000, "changed": {"workloads": [...]}}

    : keepalive

Each client is a push producer on its connection: while the connection
does not take more, events wait in the client's own buffer, bounded in
bytes; a client whose buffer would overflow is disconnected (it reconnects
and gets a fresh snapshot).  A disconnect removes the client at once, and
the poll stops with the last client.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from nvproxy.statuspage._view import view

__all__ = ["StatusFeed", "StatusSource"]

log = Logger()


class StatusSource(Protocol):
    """What the page shows: L{nvproxy.ops.Operations}' status and workloads."""

    def status(self) -> Mapping[str, Any]: ...

    def recent_workloads(self, limit: int) -> list[Any]: ...


def _event(kind: str, seq: int, data: Mapping[str, Any]) -> bytes:
    body = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return b"event: %s\nid: %d\ndata: %s\n\n" % (kind.encode(), seq, body.encode())


_KEEPALIVE = b": keepalive\n\n"


@implementer(IPushProducer)
class _Client:
    """
    One connected C{/admin/events} request: writes while the connection
    takes them, buffers (bounded) while it is paused.
    """

    def __init__(self, feed: StatusFeed, request: Any, limit: int) -> None:
        self._feed = feed
        self._request = request
        self._limit = limit
        self._paused = False
        self._queue: deque[bytes] = deque()
        self._queued = 0
        self.gone = False
        self.done: Deferred[None] = Deferred(lambda _d: self._lost(None))
        request.registerProducer(self, True)
        request.notifyFinish().addBoth(self._lost)

    def send(self, data: bytes) -> None:
        if self.gone:
            return
        if not self._paused:
            self._request.write(data)
            return
        if self._queued + len(data) > self._limit:
            log.info(
                "status events: dropped a client that did not keep up"
                " ({queued} bytes waiting)",
                queued=self._queued,
            )
            self._drop()
            return
        self._queue.append(data)
        self._queued += len(data)

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        while self._queue and not self._paused and not self.gone:
            data = self._queue.popleft()
            self._queued -= len(data)
            self._request.write(data)

    def stopProducing(self) -> None:
        self._lost(None)

    def _drop(self) -> None:
        transport = getattr(getattr(self._request, "channel", None), "transport", None)
        self._lost(None)
        if transport is not None and hasattr(transport, "abortConnection"):
            transport.abortConnection()
        else:
            self._request.loseConnection()

    def _lost(self, reason: Failure | None) -> None:
        if self.gone:
            return
        self.gone = True
        self._queue.clear()
        self._queued = 0
        self._feed._forget(self)


class StatusFeed:
    """
    The page's view, and the clients streaming it.

    @param interval: seconds between polls of the status while a client is
        connected.
    @param buffer_bytes: how much one client may have waiting before it is
        dropped.
    @param max_clients: more concurrent streams are refused (503).
    @param workloads: how many recent workloads the view carries.
    @param keepalive: seconds without an event before a comment is sent.
    """

    def __init__(
        self,
        source: StatusSource,
        clock: IReactorTime,
        *,
        interval: float = 1.0,
        buffer_bytes: int = 1 << 20,
        max_clients: int = 32,
        workloads: int = 50,
        keepalive: float = 15.0,
    ) -> None:
        self._source = source
        self._clock = clock
        self._interval = interval
        self._buffer = buffer_bytes
        self.max_clients = max_clients
        self._workloads = workloads
        self._keepalive = keepalive
        self._clients: dict[_Client, None] = {}
        self._loop: LoopingCall | None = None
        self._last: dict[str, Any] | None = None
        self._seq = 0
        self._sent = clock.seconds()

    @property
    def clients(self) -> int:
        return len(self._clients)

    def view(self) -> dict[str, Any]:
        """The current view (what a C{snapshot} carries)."""
        return view(
            self._source.status(), self._source.recent_workloads(self._workloads)
        )

    def _now_ms(self) -> int:
        return round(self._clock.seconds() * 1000)

    def connect(self, request: Any) -> Deferred[None]:
        """
        Stream to C{request}: a snapshot now, updates after.  The Deferred
        never fires on its own; cancelling it (Klein does on disconnect)
        removes the client.
        """
        request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")
        # Bring every client up to date first, so the new one's snapshot and
        # the next update are computed from the same view.
        self._poll()
        assert self._last is not None
        client = _Client(self, request, self._buffer)
        self._clients[client] = None
        snapshot = {"seq": self._seq, "now": self._now_ms(), "view": self._last}
        client.send(_event("snapshot", self._seq, snapshot))
        if self._loop is None and not client.gone:
            loop = LoopingCall(self._tick)
            loop.clock = self._clock
            self._loop = loop
            loop.start(self._interval, now=False).addErrback(
                lambda f: log.failure("status events poll failed", failure=f)
            )
        return client.done

    def _tick(self) -> None:
        if not self._poll():
            if self._clock.seconds() - self._sent >= self._keepalive:
                self._broadcast(_KEEPALIVE)

    def _poll(self) -> bool:
        """Recompute the view; tell the clients what changed.  Changed?"""
        current = self.view()
        last = self._last
        self._last = current
        if last is None:
            self._seq += 1
            return True
        changed = {k: v for k, v in current.items() if last.get(k) != v}
        if not changed:
            return False
        self._seq += 1
        data = {"seq": self._seq, "now": self._now_ms(), "changed": changed}
        self._broadcast(_event("update", self._seq, data))
        return True

    def _broadcast(self, data: bytes) -> None:
        self._sent = self._clock.seconds()
        for client in list(self._clients):
            client.send(data)

    def _forget(self, client: _Client) -> None:
        self._clients.pop(client, None)
        if not self._clients:
            loop, self._loop = self._loop, None
            if loop is not None and loop.running:
                loop.stop()
            # A reconnecting client starts from a fresh view.
            self._last = None

    def close(self) -> None:
        """Drop every client (the admin listener is stopping)."""
        for client in list(self._clients):
            client._drop()
