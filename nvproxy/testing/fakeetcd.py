# -*- test-case-name: tests.test_etcd -*-
"""
An in-memory etcd on an injected clock: revisions, leases that expire,
prefix watches that replay history from a start revision, compaction, and
outages — enough to drive L{nvproxy.etcd} sessions without processes, and
to count the work a change costs each node.

L{FakeEtcd} is the store; L{FakeEtcd.client} gives each node its own
L{nvproxy.etcd.EtcdApi}.  Calls answer synchronously (already-fired
Deferreds); C{down} makes every call fail with
L{nvproxy.etcd.EtcdUnavailable} and breaks every watch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from nvproxy.etcd._client import (
    Compacted,
    EtcdRefused,
    EtcdUnavailable,
    KeyValue,
    Range,
    WatchBatch,
    WatchEvent,
    prefix_end,
)


@attrs.define(eq=False)
class _Lease:
    ttl: int
    expiry: IDelayedCall | None = None
    keys: set[bytes] = attrs.Factory(set)


@attrs.define(eq=False)
class _Watcher:
    prefix: bytes
    end: bytes
    deliver: Callable[[WatchBatch], None]
    done: Deferred[None]
    client: FakeEtcdClient

    def cancel(self) -> None:
        self.client.store._watchers.discard(self)
        if not self.done.called:
            self.done.cancel()


class FakeEtcd:
    """
    The store.  C{calls} counts every call by (client name, method);
    C{delivered} counts watch batches delivered by client name.
    """

    def __init__(self, clock: IReactorTime) -> None:
        self.clock = clock
        self.revision = 1
        self.compacted = 0
        self.down = False
        self._kvs: dict[bytes, tuple[bytes, int, int]] = {}  # value, lease, mod
        self._history: list[tuple[int, WatchEvent]] = []
        self._leases: dict[int, _Lease] = {}
        self._next_lease = 1000
        self._watchers: set[_Watcher] = set()
        self.calls: Counter[tuple[str, str]] = Counter()
        self.delivered: Counter[str] = Counter()

    def client(self, name: str) -> FakeEtcdClient:
        return FakeEtcdClient(self, name)

    # -- operator actions -------------------------------------------------

    def stop(self) -> None:
        """An outage: calls fail, watches break."""
        self.down = True
        for watcher in list(self._watchers):
            self._watchers.discard(watcher)
            watcher.done.errback(EtcdUnavailable("etcd stopped"))

    def start(self) -> None:
        self.down = False

    def compact(self, revision: int | None = None) -> None:
        """Forget history up to C{revision} (the current one by default)."""
        self.compacted = self.revision if revision is None else revision
        self._history = [(r, e) for r, e in self._history if r > self.compacted]

    def keys(self) -> dict[bytes, bytes]:
        return {k: v for k, (v, _, _) in self._kvs.items()}

    # -- internals ----------------------------------------------------------

    def _event(self, event: WatchEvent) -> None:
        self._history.append((self.revision, event))
        batch = WatchBatch(self.revision, (event,))
        for watcher in list(self._watchers):
            if watcher.prefix <= event.key < watcher.end:
                self.delivered[watcher.client.name] += 1
                watcher.deliver(batch)

    def _put(self, key: bytes, value: bytes, lease: int) -> int:
        old = self._kvs.get(key)
        if old is not None and old[1] in self._leases and old[1] != lease:
            self._leases[old[1]].keys.discard(key)
        self.revision += 1
        self._kvs[key] = (value, lease, self.revision)
        if lease:
            self._leases[lease].keys.add(key)
        self._event(WatchEvent(key, value, self.revision))
        return self.revision

    def _expire(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        if lease.expiry is not None and lease.expiry.active():
            lease.expiry.cancel()
        for key in sorted(lease.keys):
            if key in self._kvs and self._kvs[key][1] == lease_id:
                del self._kvs[key]
                self.revision += 1
                self._event(WatchEvent(key, None, self.revision))

    def _arm(self, lease_id: int) -> None:
        lease = self._leases[lease_id]
        if lease.expiry is not None and lease.expiry.active():
            lease.expiry.cancel()
        lease.expiry = self.clock.callLater(lease.ttl, self._expire, lease_id)


class FakeEtcdClient:
    """One node's L{nvproxy.etcd.EtcdApi} on a L{FakeEtcd}."""

    def __init__(self, store: FakeEtcd, name: str) -> None:
        self.store = store
        self.name = name

    def _check(self, method: str) -> None:
        self.store.calls[self.name, method] += 1
        if self.store.down:
            raise EtcdUnavailable("etcd is down")

    def _answer(self, method: str, value: Callable[[], Any]) -> Deferred[Any]:
        try:
            self._check(method)
            return succeed(value())
        except Exception as e:
            return fail(e)

    def grant(self, ttl: int) -> Deferred[int]:
        def grant() -> int:
            store = self.store
            store._next_lease += 1
            store._leases[store._next_lease] = _Lease(ttl)
            store._arm(store._next_lease)
            return store._next_lease

        return self._answer("grant", grant)

    def keepalive(self, lease: int) -> Deferred[int]:
        def keepalive() -> int:
            if lease not in self.store._leases:
                return 0
            self.store._arm(lease)
            return self.store._leases[lease].ttl

        return self._answer("keepalive", keepalive)

    def revoke(self, lease: int) -> Deferred[None]:
        return self._answer("revoke", lambda: self.store._expire(lease))

    def put(self, key: bytes, value: bytes, lease: int) -> Deferred[int]:
        def put() -> int:
            if lease and lease not in self.store._leases:
                raise EtcdRefused("etcdserver: requested lease not found", 400)
            return self.store._put(key, value, lease)

        return self._answer("put", put)

    def range_prefix(self, prefix: bytes) -> Deferred[Range]:
        def range_() -> Range:
            end = prefix_end(prefix)
            kvs = tuple(
                KeyValue(k, v, mod)
                for k, (v, _, mod) in sorted(self.store._kvs.items())
                if prefix <= k < end
            )
            return Range(self.store.revision, kvs)

        return self._answer("range", range_)

    def watch(
        self,
        prefix: bytes,
        start_revision: int,
        deliver: Callable[[WatchBatch], None],
    ) -> _Watcher:
        holder: list[_Watcher] = []
        done: Deferred[None] = Deferred(
            lambda _: self.store._watchers.discard(holder[0])
        )
        watcher = _Watcher(prefix, prefix_end(prefix), deliver, done, self)
        holder.append(watcher)
        try:
            self._check("watch")
        except EtcdUnavailable as e:
            done.errback(e)
            return watcher
        store = self.store
        if start_revision <= store.compacted:
            done.errback(Compacted(store.compacted + 1))
            return watcher
        for revision, event in store._history:
            if revision >= start_revision and watcher.prefix <= event.key < watcher.end:
                store.delivered[self.name] += 1
                deliver(WatchBatch(revision, (event,)))
        store._watchers.add(watcher)
        return watcher
