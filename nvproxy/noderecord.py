# -*- test-case-name: tests.test_noderecord -*-
"""
The node record: what one node tells the others about itself (DESIGN §3,
C{docs/node-record.rst}).

One versioned JSON document per node::

    {"version": 1, "node": "node-a", "generation": 17, "draining": false,
     "engines": {"vllm": {"port": 8000, "in_flight": 2,
                          "models": {"Qwen3-8B": {"readiness": "sleeping",
                                                  "wake_estimate_s": 12.5}}}}}

Pieces:

* L{NodeRecord} (with L{EngineRecord} and L{ModelReadiness}): the value,
  L{encode} and L{decode} (validation; L{BadRecord}, L{FutureRecord}).
* L{LocalRecord}: this node's record, built from the discovery snapshot's
  local entries, the vLLM services' states and the in-flight accounting;
  its generation bumps whenever the content changes, and subscribers are
  told (L{LocalRecord.subscribe}: the hook a record publisher such as etcd
  uses).
* L{PeerRecords}: polls every peer's C{GET /_nvproxy/node} (peer mode,
  pinned mTLS) and keeps the last valid record of each; a malformed or
  newer-versioned one is ignored with one log line per peer per state
  change.
* L{Fleet}: readiness and draining per (engine, node, model) for discovery
  snapshots (L{Fleet.annotate}), the records for status, and the
  C{nvproxy_model_readiness} gauge (L{ReadinessCollector}).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, Final, Protocol

from attrs import evolve, field, frozen
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from nvproxy.discovery import Discovery, InventoryClient, NodeEntry, Poller
from nvproxy.logs import describe
from nvproxy.readiness import AWAKE, READINESS, ModelReadiness

log = Logger()

VERSION: Final = 1
"""The record version this node writes and the newest it reads."""

NODE_PATH: Final = "/_nvproxy/node"
"""Where each facade answers the record, in peer mode only."""

__all__ = [
    "NODE_PATH",
    "VERSION",
    "BadRecord",
    "EngineRecord",
    "Fleet",
    "FutureRecord",
    "LocalRecord",
    "NodeRecord",
    "PeerRecords",
    "ReadinessCollector",
    "decode",
    "encode",
]


def _models(value: Mapping[str, ModelReadiness]) -> Mapping[str, ModelReadiness]:
    return MappingProxyType(dict(value))


def _engines(value: Mapping[str, EngineRecord]) -> Mapping[str, EngineRecord]:
    return MappingProxyType(dict(value))


@frozen
class EngineRecord:
    """
    One engine of a node: its facade port, the requests this node's process
    has in flight for it, and per advertised model its readiness.
    """

    port: int
    in_flight: int = 0
    models: Mapping[str, ModelReadiness] = field(factory=dict, converter=_models)


@frozen
class NodeRecord:
    """One node's record (version 1)."""

    node: str
    generation: int
    draining: bool = False
    engines: Mapping[str, EngineRecord] = field(factory=dict, converter=_engines)
    version: int = VERSION

    def content(self) -> tuple[object, ...]:
        """Everything but the generation: what a change is measured on."""
        return (self.version, self.node, self.draining, dict(self.engines))


class BadRecord(ValueError):
    """A record that is not a valid version-1 node record."""


class FutureRecord(BadRecord):
    """A record of a newer version than this node reads."""


def encode(record: NodeRecord) -> dict[str, Any]:
    """The JSON object of C{record} (keys as in the documented schema)."""
    return {
        "version": record.version,
        "node": record.node,
        "generation": record.generation,
        "draining": record.draining,
        "engines": {
            engine_id: {
                "port": engine.port,
                "in_flight": engine.in_flight,
                "models": {
                    model: {
                        "readiness": state.readiness,
                        "wake_estimate_s": round(state.wake_estimate_s, 3),
                    }
                    for model, state in sorted(engine.models.items())
                },
            }
            for engine_id, engine in sorted(record.engines.items())
        },
    }


def _int(value: object, what: str, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise BadRecord(f"{what} must be an integer >= {low}")
    return value


def _object(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise BadRecord(f"{what} must be an object")
    return value


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRecord(f"{what} must be a non-empty string")
    return value


def _seconds(value: object, at: str) -> float:
    what = f"{at}.wake_estimate_s must be a finite number >= 0"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadRecord(what)
    try:
        seconds = float(value)
    except OverflowError:
        raise BadRecord(what) from None
    if not math.isfinite(seconds) or seconds < 0:
        raise BadRecord(what)
    return seconds


def decode(document: object) -> NodeRecord:
    """
    Validate a received record.  Unknown fields are ignored (fields may be
    added, never renamed).

    @raise FutureRecord: C{version} is newer than L{VERSION}.
    @raise BadRecord: anything else wrong with it.
    """
    doc = _object(document, "the record")
    version = _int(doc.get("version"), "version", 1)
    if version > VERSION:
        raise FutureRecord(f"version {version} is newer than {VERSION}")
    node = _text(doc.get("node"), "node")
    generation = _int(doc.get("generation"), "generation")
    draining = doc.get("draining", False)
    if not isinstance(draining, bool):
        raise BadRecord("draining must be true or false")
    engines: dict[str, EngineRecord] = {}
    for engine_id, raw in _object(doc.get("engines"), "engines").items():
        where = f"engines.{engine_id}"
        engine = _object(raw, where)
        port = _int(engine.get("port"), f"{where}.port")
        if port > 65535:
            raise BadRecord(f"{where}.port must be at most 65535")
        in_flight = _int(engine.get("in_flight", 0), f"{where}.in_flight")
        models: dict[str, ModelReadiness] = {}
        for model, state in _object(engine.get("models"), f"{where}.models").items():
            at = f"{where}.models.{model}"
            state = _object(state, at)
            readiness = state.get("readiness")
            if readiness not in READINESS:
                raise BadRecord(f"{at}.readiness must be one of {', '.join(READINESS)}")
            models[model] = ModelReadiness(
                readiness, _seconds(state.get("wake_estimate_s", 0.0), at)
            )
        engines[engine_id] = EngineRecord(port, in_flight, models)
    return NodeRecord(node, generation, draining, engines, version)


# -- this node --------------------------------------------------------------


Unsubscribe = Callable[[], None]


class LocalRecord:
    """
    This node's record, rebuilt from live state on every L{current}.

    @param ports: engine -> this node's facade port, for every facade.
    @param readiness: (engine, model) -> the readiness of a local model
        (vLLM services; plain engines' models are awake).
    @param in_flight: engine -> the requests in flight for it here.
    @param draining: whether this node drains.
    """

    def __init__(
        self,
        node_id: str,
        discovery: Discovery,
        *,
        ports: Callable[[], Mapping[str, int]],
        readiness: Callable[[str, str], ModelReadiness],
        in_flight: Callable[[str], int],
        draining: Callable[[], bool],
    ) -> None:
        self.node_id = node_id
        self._discovery = discovery
        self._ports = ports
        self._readiness = readiness
        self._in_flight = in_flight
        self._draining = draining
        self._record = NodeRecord(node_id, 0)
        self._subscribers: dict[object, Callable[[NodeRecord], None]] = {}

    def readiness(self, engine: str, model: str) -> ModelReadiness:
        """How ready this node's C{model} of C{engine} is now."""
        return self._readiness(engine, model)

    def draining(self) -> bool:
        return self._draining()

    def build(self, generation: int) -> NodeRecord:
        """This node's record from the current state, at C{generation}."""
        snapshot = self._discovery.current
        engines: dict[str, EngineRecord] = {}
        for engine_id, port in sorted(self._ports().items()):
            entry = snapshot.node(engine_id, self.node_id)
            models = {}
            if entry is not None and entry.kind == "local":
                models = {
                    model: self._readiness(engine_id, model)
                    for model in sorted(entry.models)
                }
            engines[engine_id] = EngineRecord(port, self._in_flight(engine_id), models)
        return NodeRecord(self.node_id, generation, self._draining(), engines)

    def current(self) -> NodeRecord:
        """
        This node's record now: the generation bumps (and subscribers are
        told) when anything in it changed since the last look.
        """
        self.refresh()
        return self._record

    def refresh(self) -> None:
        """Look again; tell subscribers if the record changed."""
        built = self.build(self._record.generation)
        if built.content() == self._record.content():
            return
        self._record = evolve(built, generation=self._record.generation + 1)
        for subscriber in list(self._subscribers.values()):
            try:
                subscriber(self._record)
            except Exception:
                log.failure("node record subscriber failed")

    def subscribe(self, subscriber: Callable[[NodeRecord], None]) -> Unsubscribe:
        """
        Call C{subscriber} with the new record each time its generation
        bumps (after L{refresh}, which the composition root calls on every
        readiness, drain and discovery change).
        """
        token = object()
        self._subscribers[token] = subscriber

        def unsubscribe() -> None:
            self._subscribers.pop(token, None)

        return unsubscribe


# -- peers ------------------------------------------------------------------


class PeerRecords(Poller[str]):
    """
    Polls each peer's record every C{interval} seconds and keeps the last
    valid one.  A peer that does not answer, answers something invalid, or
    names another node loses its record (its models count as awake again,
    as before records existed); each change of a peer's state is logged
    once.

    @param changed: called after a poll round in which a record changed.
    """

    def __init__(
        self,
        client: InventoryClient,
        clock: IReactorTime,
        interval: float,
        changed: Callable[[], None],
    ) -> None:
        super().__init__(clock, interval, "node record polling")
        self._client = client
        self._changed = changed
        self._peers: dict[str, str] = {}
        self.records: dict[str, NodeRecord] = {}
        self._state: dict[str, str] = {}

    def set_peers(self, peers: Mapping[str, str]) -> None:
        """Peer id -> a base URL of one of its facades (any: one record)."""
        self._peers = dict(peers)
        gone = [p for p in self.records if p not in self._peers]
        for peer in gone:
            del self.records[peer]
        for peer in [p for p in self._inflight if p not in self._peers]:
            self._inflight.pop(peer).cancel()
        for peer in [p for p in self._state if p not in self._peers]:
            del self._state[peer]
        if gone:
            self._changed()

    def poll(self) -> Deferred[Any]:
        """Ask every peer not already being asked; fires once all answered."""
        before = dict(self.records)
        round_: list[Deferred[None]] = []
        for peer, base in sorted(self._peers.items()):
            if peer in self._inflight:
                # An answer to a question asked before now may predate the
                # change the caller wants to see: ask again after it.
                waiter: Deferred[None] = Deferred()
                self._waiters.setdefault(peer, []).append(waiter)
                round_.append(waiter.addCallback(self._again, peer))
                continue
            round_.append(self._start(peer, base))

        def done(_: object) -> None:
            if self.records != before:
                self._changed()

        return DeferredList(round_, consumeErrors=True).addCallback(done)

    def _start(self, peer: str, base: str) -> Deferred[None]:
        d = self._poll_one(peer, base)
        if not d.called:
            self._inflight[peer] = d
        return d

    def _again(self, _: object, peer: str) -> Deferred[None]:
        base = self._peers.get(peer)
        if base is None or peer in self._inflight or not self.running:
            return succeed(None)
        return self._start(peer, base)

    def _poll_one(self, peer: str, base: str) -> Deferred[None]:
        url = base.rstrip("/") + NODE_PATH
        timeout = max(self._interval, 1.0)

        def answered(body: object) -> None:
            try:
                record = decode(body)
                if record.node != peer:
                    raise BadRecord(f"it is the record of node {record.node!r}")
            except BadRecord as e:
                self.records.pop(peer, None)
                kind = "future" if isinstance(e, FutureRecord) else "malformed"
                self._tell(
                    peer,
                    kind,
                    "node {peer}: ignoring its {kind} node record: {error}",
                    error=str(e),
                )
                return
            self.records[peer] = record
            self._tell(peer, "ok", "node {peer}: node record received")

        def failed(reason: Any) -> None:
            self.records.pop(peer, None)
            self._tell(
                peer,
                "unanswered",
                "node {peer}: no node record: {error}",
                error=describe(reason),
            )

        def settled(_: object) -> None:
            self._inflight.pop(peer, None)
            for waiter in self._waiters.pop(peer, []):
                waiter.callback(None)

        d = self._client.get_json(url, timeout)
        d.addCallbacks(answered, failed)
        d.addErrback(lambda f: log.failure("node record bookkeeping", f))
        d.addBoth(settled)
        return d

    def _tell(self, peer: str, state: str, message: str, **fields: Any) -> None:
        """Log C{message} once per change of C{peer}'s state."""
        if self._state.get(peer) == state:
            return
        self._state[peer] = state
        if state == "ok":
            log.info(message, peer=peer, **fields)
        else:
            log.warn(message, peer=peer, kind=state, **fields)


# -- the fleet --------------------------------------------------------------


class PeerRecordSource(Protocol):
    """Where peers' last records are: L{PeerRecords} (the mesh) or etcd."""

    @property
    def records(self) -> Mapping[str, NodeRecord]: ...


class Fleet:
    """
    What this node knows of every node's readiness and draining: its own
    (live) and its peers' (their last records).
    """

    def __init__(
        self,
        local: LocalRecord,
        peers: PeerRecordSource | None = None,
    ) -> None:
        self.local = local
        self.peers = peers
        self.node_id = local.node_id

    def annotate(self, engine: str, entry: NodeEntry) -> NodeEntry:
        """
        C{entry} with its models' readiness and the node's draining: for
        this node from live state, for a peer from its record (awake and
        not draining without one), for a direct node unchanged (awake).
        """
        if entry.kind == "local" and entry.node_id == self.node_id:
            readiness = {m: self.local_readiness(engine, m) for m in entry.models}
            return evolve(
                entry,
                readiness={m: r for m, r in readiness.items() if r != AWAKE},
                draining=self.local.draining(),
            )
        if entry.kind == "peer" and self.peers is not None:
            record = self.peers.records.get(entry.node_id)
            if record is None:
                return entry
            engine_record = record.engines.get(engine)
            readiness = {}
            if engine_record is not None:
                readiness = {
                    m: r
                    for m, r in engine_record.models.items()
                    if m in entry.models and r != AWAKE
                }
            if readiness == entry.readiness and record.draining == entry.draining:
                # (the entry already says so: etcd's are made from the
                # record, and an unchanged entry keeps a publish cheap)
                return entry
            return evolve(entry, readiness=readiness, draining=record.draining)
        return entry

    def local_readiness(self, engine: str, model: str) -> ModelReadiness:
        return self.local.readiness(engine, model)

    def records(self) -> list[dict[str, Any]]:
        """This node's record first, then every known peer's, by id."""
        out = [encode(self.local.current())]
        if self.peers is not None:
            out.extend(encode(r) for _, r in sorted(self.peers.records.items()))
        return out


class ReadinessCollector:
    """
    C{nvproxy_model_readiness{node,engine,model,readiness}}: 1 for each
    advertised model's current readiness, 0 for the others.  The model label
    only ever carries names the snapshot advertises.
    """

    def __init__(self, discovery: Discovery) -> None:
        self._discovery = discovery

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            "nvproxy_model_readiness",
            "Readiness of each advertised model per node (1 for the current one)",
            labels=["node", "engine", "model", "readiness"],
        )
        snapshot = self._discovery.current
        for engine_id in sorted(snapshot.engines):
            for entry in snapshot.nodes(engine_id):
                for model in sorted(entry.models):
                    now = entry.readiness_of(model).readiness
                    for readiness in READINESS:
                        family.add_metric(
                            [entry.node_id, engine_id, model, readiness],
                            1 if readiness == now else 0,
                        )
        yield family
