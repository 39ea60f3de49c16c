# -*- test-case-name: tests.test_etcd -*-
"""
One node's session with etcd: its record under a lease it keeps alive, and a
watch of every node's record.

::

    idle ──start──► connecting ──connected──► live
                     ▲    │                     │ failed (watch broke,
                     │    │ failed              │ keepalive or put failed)
                     │    ▼                     ▼
                     └─retry── lost ◄───────────┘
                                            compacted: live ─► connecting
    (any) ──stop──► stopped                           (fresh range read)

C{connecting} refreshes (or grants) the lease, puts the current record and,
the first time or after a compaction, reads the whole prefix; C{live} holds
the watch (from the last revision seen, so a broken watch resumes without a
gap) and the keep-alive timer at a third of the TTL.  A record change is put
at once while live (one put at a time; a change during a put is put after
it) and by the next C{connecting} otherwise.  What the session knows of
other nodes survives an outage: it is replaced only by what etcd says when
it answers again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import attrs
from automat import TypeMachineBuilder
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from nvproxy.automata import indexed
from nvproxy.etcd._client import Compacted, EtcdApi, Watch, WatchBatch
from nvproxy.logs import describe

log = Logger()


class Counters(Protocol):
    """What the session reports to metrics."""

    def watch_connected(self) -> None: ...
    def keepalive_failed(self) -> None: ...


class _NoCounters:
    def watch_connected(self) -> None:
        pass

    def keepalive_failed(self) -> None:
        pass


@attrs.frozen
class SessionSettings:
    """
    @ivar prefix: the key prefix (C{/nvproxy/}); records live under
        C{PREFIX + "nodes/"}.
    @ivar lease_ttl: seconds; the lease is kept alive at a third of it.
    @ivar backoff: the first retry delay after a failure, doubled up to
        C{backoff_max}.
    """

    prefix: str = "/nvproxy/"
    lease_ttl: float = 10.0
    backoff: float = 0.5
    backoff_max: float = 10.0

    @property
    def nodes_prefix(self) -> bytes:
        return (self.prefix + "nodes/").encode()


@attrs.define(eq=False)
class _Op:
    deferred: Deferred[Any]


@attrs.define(eq=False)
class _Live:
    watch: Watch
    keepalive: IDelayedCall | None = None
    call: Deferred[Any] | None = None

    def cancel(self) -> None:
        if self.keepalive is not None and self.keepalive.active():
            self.keepalive.cancel()
        self.keepalive = None
        if self.call is not None:
            self.call.cancel()
        self.watch.cancel()


@attrs.define(eq=False)
class _Timer:
    call: IDelayedCall

    def cancel(self) -> None:
        if self.call.active():
            self.call.cancel()


class _Inputs(Protocol):
    def start(self) -> None:
        "The service starts."

    def connected(self) -> None:
        "Lease refreshed, record put, snapshot current: watch from here."

    def failed(self, reason: Failure) -> None:
        "etcd stopped answering (or refused) while connecting or live."

    def compacted(self) -> None:
        "The watch's revision was compacted: read the prefix afresh."

    def retry(self) -> None:
        "The backoff timer fired."

    def record_changed(self) -> None:
        "This node's record changed."

    def stop(self) -> None:
        "The service stops (the lease is revoked by the caller)."


@attrs.define(eq=False)
class _Core:
    api: EtcdApi
    clock: IReactorTime
    settings: SessionSettings
    record: Callable[[], bytes]
    node_id: str
    deliver: Callable[[Mapping[str, bytes]], None]
    counters: Counters
    random: Callable[[], float]
    lease: int = 0
    revision: int = 0
    reread: bool = True
    records: dict[str, bytes] = attrs.Factory(dict)
    delay: float = 0.0
    down_since: float | None = None
    synced_at: float | None = None
    error: str | None = None
    state: str = "idle"
    put_dirty: bool = False
    machine: Any = None

    @property
    def view(self) -> Mapping[str, bytes]:
        """The records, read-only and live (never copied per change)."""
        return MappingProxyType(self.records)

    # -- connecting ------------------------------------------------------

    def start_connect(self) -> _Op:
        self.state = "connecting"

        async def connect() -> None:
            if self.lease:
                if await self.api.keepalive(self.lease) <= 0:
                    self.lease = 0
            if not self.lease:
                self.lease = await self.api.grant(
                    max(1, round(self.settings.lease_ttl))
                )
            self.put_dirty = False
            await self.api.put(self._key(self.node_id), self.record(), self.lease)
            if self.reread:
                answer = await self.api.range_prefix(self.settings.nodes_prefix)
                records: dict[str, bytes] = {}
                for kv in answer.kvs:
                    node = self._node_of(kv.key)
                    if node is not None:
                        records[node] = kv.value
                self.revision = answer.revision
                self.reread = False
                self._replace(records)

        d = Deferred.fromCoroutine(connect())
        d.addCallbacks(lambda _: self.machine.connected(), self._failed)
        return _Op(d)

    def _failed(self, reason: Failure) -> None:
        if reason.check(CancelledError):
            return
        self.machine.failed(reason)

    # -- live ------------------------------------------------------------

    def start_live(self) -> _Live:
        self.state = "live"
        self.delay = 0.0
        self.error = None
        self.synced_at = self.clock.seconds()
        if self.down_since is not None:
            log.info(
                "etcd: reachable again after {seconds:.1f}s, at revision {revision}",
                seconds=self.clock.seconds() - self.down_since,
                revision=self.revision,
            )
            self.down_since = None
        watch = self.api.watch(
            self.settings.nodes_prefix, self.revision + 1, self._batch
        )
        self.counters.watch_connected()
        live = _Live(watch)
        watch.done.addCallbacks(self._watch_ended, self._watch_failed)
        self._arm(live)
        if self.put_dirty:
            self.put(live)
        return live

    def _watch_ended(self, _: object) -> None:
        self.machine.failed(Failure(ConnectionError("etcd ended the watch")))

    def _watch_failed(self, reason: Failure) -> None:
        if reason.check(CancelledError):
            return
        if reason.check(Compacted):
            log.info(
                "etcd: revision {revision} was compacted; reading the prefix afresh",
                revision=self.revision,
            )
            self.reread = True
            self.machine.compacted()
            return
        self.machine.failed(reason)

    def _arm(self, live: _Live) -> None:
        live.keepalive = self.clock.callLater(
            self.settings.lease_ttl / 3, self._keepalive, live
        )

    def _keepalive(self, live: _Live) -> None:
        live.keepalive = None
        if live.call is not None:
            # a put is in flight; keep the lease on the next tick
            self._arm(live)
            return
        d = self.api.keepalive(self.lease)

        def answered(ttl: int) -> None:
            live.call = None
            if ttl <= 0:
                # it expired (a long stall): our record is gone, put it again
                self.counters.keepalive_failed()
                self.lease = 0
                self.machine.failed(Failure(ConnectionError("lease expired")))
                return
            self._arm(live)
            if self.put_dirty:
                # the record changed while the keep-alive was in flight
                self.put(live)

        def failed(reason: Failure) -> None:
            live.call = None
            if reason.check(CancelledError):
                return
            self.counters.keepalive_failed()
            self.machine.failed(reason)

        live.call = d
        d.addCallbacks(answered, failed)

    def put(self, live: _Live) -> None:
        if live.call is not None:
            self.put_dirty = True
            return
        self.put_dirty = False
        d = self.api.put(self._key(self.node_id), self.record(), self.lease)

        def done(_: object) -> None:
            live.call = None
            if self.put_dirty:
                self.put(live)

        def failed(reason: Failure) -> None:
            live.call = None
            if reason.check(CancelledError):
                return
            self.put_dirty = True
            self.machine.failed(reason)

        live.call = d
        d.addCallbacks(done, failed)

    def _batch(self, batch: WatchBatch) -> None:
        changed = False
        for event in batch.events:
            self.revision = max(self.revision, event.mod_revision)
            node = self._node_of(event.key)
            if node is None:
                continue
            if event.value is None:
                changed |= self.records.pop(node, None) is not None
            elif self.records.get(node) != event.value:
                self.records[node] = event.value
                changed = True
        self.revision = max(self.revision, batch.revision)
        self.synced_at = self.clock.seconds()
        if changed:
            self.deliver(self.view)

    # -- lost ------------------------------------------------------------

    def start_lost(self, reason: Failure) -> _Timer:
        was = self.state
        self.state = "lost"
        self.error = describe(reason)
        if self.down_since is None:
            self.down_since = self.clock.seconds()
            log.warn(
                "etcd: unavailable ({error}) while {state}; serving from the last"
                " snapshot and retrying",
                error=self.error,
                state=was,
            )
        self.delay = min(
            self.settings.backoff_max,
            max(self.settings.backoff, self.delay * 2),
        )
        jittered = self.delay * (0.8 + 0.4 * self.random())
        return _Timer(self.clock.callLater(jittered, self.machine.retry))

    # -- helpers ---------------------------------------------------------

    def _key(self, node: str) -> bytes:
        return self.settings.nodes_prefix + node.encode()

    def _node_of(self, key: bytes) -> str | None:
        prefix = self.settings.nodes_prefix
        if not key.startswith(prefix) or len(key) == len(prefix):
            return None
        try:
            return key[len(prefix) :].decode()
        except UnicodeDecodeError:
            return None

    def _replace(self, records: dict[str, bytes]) -> None:
        changed = records != self.records
        self.records.clear()
        self.records.update(records)
        if changed:
            self.deliver(self.view)


builder = TypeMachineBuilder(_Inputs, _Core)
idle = builder.state("idle")
stopped = builder.state("stopped")
connecting = builder.state("connecting", lambda inputs, core: core.start_connect())
live = builder.state("live", lambda inputs, core: core.start_live())
lost = builder.state("lost", lambda inputs, core, reason: core.start_lost(reason))

idle.upon(_Inputs.start).to(connecting).returns(None)
idle.upon(_Inputs.record_changed).loop().returns(None)
idle.upon(_Inputs.stop).to(stopped).returns(None)


def _cancel_op(inputs: _Inputs, core: _Core, op: _Op) -> None:
    op.deferred.cancel()


def _cancel_live(inputs: _Inputs, core: _Core, data: _Live) -> None:
    data.cancel()


def _cancel_timer(inputs: _Inputs, core: _Core, timer: _Timer) -> None:
    timer.cancel()


connecting.upon(_Inputs.connected).to(live).returns(None)
connecting.upon(_Inputs.failed).to(lost).returns(None)


@connecting.upon(_Inputs.record_changed).loop()
def _connecting_changed(inputs: _Inputs, core: _Core, op: _Op) -> None:
    # the put may already be done: put again once live
    core.put_dirty = True


@connecting.upon(_Inputs.stop).to(stopped)
def _stop_connecting(inputs: _Inputs, core: _Core, op: _Op) -> None:
    core.state = "stopped"
    op.deferred.cancel()


@connecting.upon(_Inputs.compacted).loop()
def _compacted_connecting(inputs: _Inputs, core: _Core, op: _Op) -> None:
    pass


@live.upon(_Inputs.failed).to(lost)
def _live_failed(inputs: _Inputs, core: _Core, data: _Live, reason: Failure) -> None:
    data.cancel()


@live.upon(_Inputs.compacted).to(connecting)
def _live_compacted(inputs: _Inputs, core: _Core, data: _Live) -> None:
    data.cancel()


@live.upon(_Inputs.record_changed).loop()
def _live_changed(inputs: _Inputs, core: _Core, data: _Live) -> None:
    core.put(data)


@live.upon(_Inputs.stop).to(stopped)
def _stop_live(inputs: _Inputs, core: _Core, data: _Live) -> None:
    core.state = "stopped"
    data.cancel()


@lost.upon(_Inputs.retry).to(connecting)
def _retry(inputs: _Inputs, core: _Core, timer: _Timer) -> None:
    pass


@lost.upon(_Inputs.record_changed).loop()
def _lost_changed(inputs: _Inputs, core: _Core, timer: _Timer) -> None:
    pass


@lost.upon(_Inputs.failed).loop()
def _lost_failed(inputs: _Inputs, core: _Core, timer: _Timer, reason: Failure) -> None:
    pass


@lost.upon(_Inputs.compacted).loop()
def _lost_compacted(inputs: _Inputs, core: _Core, timer: _Timer) -> None:
    pass


@lost.upon(_Inputs.stop).to(stopped)
def _stop_lost(inputs: _Inputs, core: _Core, timer: _Timer) -> None:
    core.state = "stopped"
    timer.cancel()


for _input in (
    _Inputs.start,
    _Inputs.connected,
    _Inputs.retry,
    _Inputs.record_changed,
    _Inputs.stop,
):
    stopped.upon(_input).loop().returns(None)
stopped.upon(_Inputs.failed).loop().returns(None)
stopped.upon(_Inputs.compacted).loop().returns(None)
idle.upon(_Inputs.failed).loop().returns(None)
idle.upon(_Inputs.connected).loop().returns(None)
idle.upon(_Inputs.retry).loop().returns(None)
idle.upon(_Inputs.compacted).loop().returns(None)
connecting.upon(_Inputs.start).loop().returns(None)
connecting.upon(_Inputs.retry).loop().returns(None)
live.upon(_Inputs.start).loop().returns(None)
live.upon(_Inputs.connected).loop().returns(None)
live.upon(_Inputs.retry).loop().returns(None)
lost.upon(_Inputs.start).loop().returns(None)
lost.upon(_Inputs.connected).loop().returns(None)

SessionMachine = indexed(builder.build())


class Session:
    """
    The session's public face: start it, tell it when the record changes,
    read what it knows, stop it (revoking the lease, so this node leaves
    every snapshot at once rather than after the TTL).
    """

    def __init__(
        self,
        api: EtcdApi,
        clock: IReactorTime,
        settings: SessionSettings,
        node_id: str,
        record: Callable[[], bytes],
        deliver: Callable[[Mapping[str, bytes]], None],
        counters: Counters | None = None,
        random: Callable[[], float] = lambda: 0.5,
    ) -> None:
        self._core = _Core(
            api,
            clock,
            settings,
            record,
            node_id,
            deliver,
            counters or _NoCounters(),
            random,
        )
        self._machine = SessionMachine(self._core)
        self._core.machine = self._machine

    @property
    def state(self) -> str:
        """C{idle}, C{connecting}, C{live}, C{lost} or C{stopped}."""
        return self._core.state

    @property
    def records(self) -> Mapping[str, bytes]:
        """Every node's record as last seen, by node id (this one included);
        a live read-only view, also what C{deliver} is given on each change
        (copy it to keep it)."""
        return self._core.view

    def start(self) -> None:
        self._machine.start()

    def record_changed(self) -> None:
        self._machine.record_changed()

    def stop(self) -> Deferred[None]:
        """Stop; fires once the lease is revoked (or that failed)."""
        lease = self._core.lease
        self._machine.stop()
        if not lease:
            return Deferred.fromCoroutine(_nothing())
        d = self._core.api.revoke(lease)
        d.addTimeout(2.0, self._core.clock)
        d.addErrback(lambda _: None)
        return d

    def status(self) -> dict[str, Any]:
        core = self._core
        now = core.clock.seconds()
        if core.synced_at is None:
            age: float | None = None
        elif core.state == "live":
            age = 0.0
        else:
            age = now - core.synced_at
        return {
            "provider": "etcd",
            "state": core.state,
            "revision": core.revision,
            "records": len(core.records),
            "snapshot_age_s": None if age is None else round(age, 3),
            "error": core.error,
        }

    def snapshot_age(self) -> float | None:
        age = self.status()["snapshot_age_s"]
        return None if age is None else float(age)


async def _nothing() -> None:
    return None
