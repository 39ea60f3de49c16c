# -*- test-case-name: tests.test_discovery -*-
"""
Who advertises which model, as immutable snapshots.

A L{Snapshot} maps engine -> node -> L{NodeEntry}.  Providers publish new
snapshots; readers take C{discovery.current} once per resolution and never see
it change under them.  L{PollingDiscovery} is the embedded provider: it polls
every known endpoint's model list (engine table's C{poll}) on a
L{LoopingCall} over the injected clock, and a node that fails its poll stops
advertising until it answers again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar

from attrs import field, frozen
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from nvproxy.engines import ENGINES
from nvproxy.logs import describe
from nvproxy.readiness import AWAKE, ModelReadiness

log = Logger()

NodeKind = Literal["local", "direct", "peer"]


@frozen
class Endpoint:
    """
    One engine endpoint of one node, as configured.

    @ivar base_url: where the engine (or, for a peer, its facade) answers.
    @ivar service: for a vLLM service, its name; C{None} otherwise.
    """

    node_id: str
    engine: str
    kind: NodeKind
    base_url: str
    service: str | None = None


@frozen
class NodeEntry:
    """
    What one node advertises for one engine.

    @ivar models: normalized model id -> the endpoint serving it.
    @ivar endpoints: every endpoint of this node for this engine that answered.
    @ivar readiness: per advertised model, how ready it is (from the node
        record, L{nvproxy.noderecord}); a model not listed is awake.
    @ivar draining: the node asked to be left out of new dispatches.
    """

    node_id: str
    kind: NodeKind
    models: Mapping[str, Endpoint]
    endpoints: tuple[Endpoint, ...]
    readiness: Mapping[str, ModelReadiness] = field(factory=dict)
    draining: bool = False

    def advertises(self, model: str) -> bool:
        return model in self.models

    def readiness_of(self, model: str | None) -> ModelReadiness:
        """How ready C{model} is here (awake when nothing says otherwise)."""
        if model is None:
            return AWAKE
        return self.readiness.get(model, AWAKE)


def _empty() -> Mapping[str, Mapping[str, NodeEntry]]:
    return {}


@frozen
class Snapshot:
    """
    An immutable view of the cluster's inventory.
    """

    generation: int = 0
    engines: Mapping[str, Mapping[str, NodeEntry]] = field(factory=_empty)
    # Every request asks for its model's owners: in a fleet of a thousand
    # nodes, sorting them all and testing each took longer than the rest of
    # the request.  A snapshot never changes, so each answer is worked out
    # once (on first use: most of a fleet's models are never asked for
    # between two snapshots).  Only answers naming a node are kept, so what
    # is kept is bounded by what the snapshot holds, whatever names clients
    # send.
    _nodes: dict[str, tuple[NodeEntry, ...]] = field(
        init=False, factory=dict, eq=False, repr=False
    )
    _owners: dict[tuple[str, str], tuple[NodeEntry, ...]] = field(
        init=False, factory=dict, eq=False, repr=False
    )
    _ranks: dict[tuple[str, str | None], dict[str, tuple[int, float]]] = field(
        init=False, factory=dict, eq=False, repr=False
    )
    _lineups: dict[tuple[str, str], Lineup] = field(
        init=False, factory=dict, eq=False, repr=False
    )

    def nodes(self, engine: str) -> tuple[NodeEntry, ...]:
        """
        Every node answering for C{engine}: local first, then by node id.
        """
        found = self._nodes.get(engine)
        if found is None:
            entries = self.engines.get(engine)
            if not entries:
                return ()
            found = tuple(sorted(entries.values(), key=_node_order))
            self._nodes[engine] = found
        return found

    def owners(self, engine: str, model: str) -> tuple[NodeEntry, ...]:
        """
        The nodes advertising C{model} (already normalized) for C{engine}, in
        the deterministic default order.
        """
        key = (engine, model)
        found = self._owners.get(key)
        if found is None:
            found = tuple(e for e in self.nodes(engine) if e.advertises(model))
            if found:
                self._owners[key] = found
        return found

    def ranks(self, engine: str, model: str | None) -> Mapping[str, tuple[int, float]]:
        """
        How ready C{model} is on each of its owners for C{engine} that is
        not this node (every node answering for C{engine} when C{model} is
        C{None}), as L{ModelReadiness.rank} of their node records: worked
        out once, where each request's order would otherwise ask every
        owner.  This node's readiness can be live (a vLLM service's), so
        it is not here; nor is any node when nobody advertises C{model}.
        """
        key = (engine, model)
        found = self._ranks.get(key)
        if found is None:
            entries = (
                self.nodes(engine) if model is None else self.owners(engine, model)
            )
            found = {
                entry.node_id: entry.readiness_of(model).rank
                for entry in entries
                if entry.kind != "local"
            }
            if entries:
                self._ranks[key] = found
        return found

    def lineup(self, engine: str, model: str) -> Lineup:
        """
        C{model}'s owners for C{engine} as every request's round starts
        from them (L{Lineup}), worked out once; empty when nobody
        advertises C{model}, and then not kept.
        """
        key = (engine, model)
        found = self._lineups.get(key)
        if found is None:
            entries = self.owners(engine, model)
            if not entries:
                return _NO_LINEUP
            found = Lineup.of(entries, self.ranks(engine, model))
            self._lineups[key] = found
        return found

    def node(self, engine: str, node_id: str) -> NodeEntry | None:
        return self.engines.get(engine, {}).get(node_id)


@frozen
class Lineup:
    """
    One model's owners for one engine, as a snapshot has them: what a
    round's order needs and does not change until the snapshot does, so
    that a request in a fleet of hundreds of owners looks at as few of them
    as it can dispatch to (L{nvproxy.accounting.RequestAccounting.first}).

    @ivar entries: the owners in the deterministic default order
        (L{Snapshot.owners}).
    @ivar by_id: the same, by node id.
    @ivar ranks: the readiness rank of each owner that is not this node
        (L{Snapshot.ranks}).
    @ivar position: each owner's place in C{entries}, the order's last
        tie-break.
    @ivar ranked: the owners that are neither this node nor draining,
        ordered by (rank, position): the order of a round in which none of
        them carries a load or is ejected.
    @ivar local: this node's own owners that are not draining, whose
        readiness is live.
    @ivar live: how many owners are not draining.
    """

    entries: tuple[NodeEntry, ...]
    by_id: Mapping[str, NodeEntry]
    ranks: Mapping[str, tuple[int, float]]
    position: Mapping[str, int]
    ranked: tuple[str, ...]
    local: tuple[str, ...]
    live: int

    @classmethod
    def of(
        cls, entries: Sequence[NodeEntry], ranks: Mapping[str, tuple[int, float]]
    ) -> Lineup:
        live = [entry for entry in entries if not entry.draining]
        position = {entry.node_id: place for place, entry in enumerate(entries)}
        ranked = sorted(
            (ranks[entry.node_id], position[entry.node_id], entry.node_id)
            for entry in live
            if entry.node_id in ranks
        )
        return cls(
            tuple(entries),
            {entry.node_id: entry for entry in entries},
            ranks,
            position,
            tuple(key[2] for key in ranked),
            tuple(entry.node_id for entry in live if entry.node_id not in ranks),
            len(live),
        )


_NO_LINEUP = Lineup((), {}, {}, {}, (), (), 0)


def _node_order(entry: NodeEntry) -> tuple[int, str]:
    return (0 if entry.kind == "local" else 1, entry.node_id)


Unsubscribe = Callable[[], None]


class Discovery:
    """
    Holds the current snapshot and tells subscribers when it changes.
    """

    def __init__(self) -> None:
        self.current = Snapshot()
        # Insertion-ordered; every in-flight job holds one, so removal must
        # not scan the others.
        self._subscribers: dict[object, Callable[[Snapshot], None]] = {}

    def publish(self, engines: Mapping[str, Mapping[str, NodeEntry]]) -> None:
        """
        Replace the snapshot when C{engines} differs from the current one.
        """
        if engines == self.current.engines:
            return
        self.current = Snapshot(self.current.generation + 1, engines)
        for subscriber in list(self._subscribers.values()):
            try:
                subscriber(self.current)
            except Exception:
                log.failure("discovery subscriber failed")

    def subscribe(self, subscriber: Callable[[Snapshot], None]) -> Unsubscribe:
        token = object()
        self._subscribers[token] = subscriber

        def unsubscribe() -> None:
            self._subscribers.pop(token, None)

        return unsubscribe


class InventoryClient:
    """
    What polling needs from HTTP: GET a URL, answer the decoded JSON.

    The composition root passes a treq-backed implementation on the shared
    pool; tests pass a dictionary-backed fake.
    """

    def get_json(self, url: str, timeout: float) -> Deferred[Any]:
        raise NotImplementedError


K = TypeVar("K")


class Poller(Service, Generic[K]):
    """
    A service that calls L{poll} every C{interval} seconds on the injected
    clock, from its start, and cancels the polls in flight (by key, in
    C{_inflight}) when it stops.  C{what} names it in the log line of a
    loop that died.
    """

    def __init__(self, clock: IReactorTime, interval: float, what: str) -> None:
        self._clock = clock
        self._interval = interval
        self._what = what
        self._inflight: dict[K, Deferred[None]] = {}
        self._waiters: dict[K, list[Deferred[None]]] = {}
        self._loop = LoopingCall(self.poll)
        self._loop.clock = clock

    def poll(self) -> Deferred[Any]:
        raise NotImplementedError

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._loop.start(self._interval, now=True).addErrback(
            lambda failure: log.failure(f"{self._what} stopped", failure)
        )

    def stopService(self) -> Deferred[None] | None:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._loop.running:
            self._loop.stop()
        for d in list(self._inflight.values()):
            d.cancel()
        return None


class PollingDiscovery(Poller[Endpoint]):
    """
    Polls every endpoint's model list every C{interval} seconds.

    @param annotate: called with (engine, entry) for each entry before it is
        published; answers the entry with readiness and draining filled in
        (L{nvproxy.noderecord.Fleet.annotate}).
    @param answered: called with each endpoint whose poll was answered with
        a model list (not for C{static_models}, which are never asked): the
        engine there is reachable, which reinstates an ejected owner
        (L{nvproxy.outliers}).
    """

    def __init__(
        self,
        discovery: Discovery,
        client: InventoryClient,
        clock: IReactorTime,
        endpoints: Iterable[Endpoint],
        interval: float = 2.0,
        static_models: Mapping[Endpoint, Sequence[str]] | None = None,
        answered: Callable[[Endpoint], None] | None = None,
        annotate: Callable[[str, NodeEntry], NodeEntry] | None = None,
    ) -> None:
        super().__init__(clock, interval, "inventory polling")
        self.discovery = discovery
        self._annotate = annotate
        self._answered = answered
        self._client = client
        self._endpoints: tuple[Endpoint, ...] = tuple(endpoints)
        self._static = dict(static_models or {})
        self._answers: dict[Endpoint, frozenset[str]] = {}
        self._fed: Mapping[str, Mapping[str, NodeEntry]] = {}

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """
        Replace the polled endpoints (a peer joined or left); forgotten
        endpoints stop advertising at once.
        """
        self._endpoints = tuple(endpoints)
        known = set(self._endpoints)
        for gone in [e for e in self._answers if e not in known]:
            del self._answers[gone]
        for gone in [e for e in self._inflight if e not in known]:
            self._inflight.pop(gone).cancel()
        self._publish()

    def poll(self) -> Deferred[Any]:
        """
        Poll every endpoint not already being polled; publish once all answer.
        """
        round_: list[Deferred[None]] = []
        for endpoint in self._endpoints:
            if endpoint in self._inflight:
                # Already being polled: wait for that answer, don't ask twice.
                waiter: Deferred[None] = Deferred()
                self._waiters.setdefault(endpoint, []).append(waiter)
                round_.append(waiter)
                continue
            d = self._poll_one(endpoint)
            if not d.called:
                self._inflight[endpoint] = d
            round_.append(d)
        done: Deferred[Any] = DeferredList(round_, consumeErrors=True)
        done.addCallback(lambda _: self._publish())
        return done

    def _poll_one(self, endpoint: Endpoint) -> Deferred[None]:
        engine = ENGINES[endpoint.engine]
        if endpoint in self._static:
            models = frozenset(
                engine.normalize_model(m) for m in self._static[endpoint]
            )
            self._answers[endpoint] = models
            return succeed(None)
        url = endpoint.base_url.rstrip("/") + engine.poll.path
        # A poll may take at most one interval (and at least a second) so a
        # dead node stops advertising within about two intervals.
        timeout = max(self._interval, 1.0)

        def answered(body: Any) -> None:
            models = frozenset(engine.normalize_model(m) for m in engine.poll.ids(body))
            if self._answers.get(endpoint) is None:
                log.info(
                    "{engine} node {node} answers at {url} with {count} models",
                    engine=endpoint.engine,
                    node=endpoint.node_id,
                    url=endpoint.base_url,
                    count=len(models),
                )
            self._answers[endpoint] = models
            if self._answered is not None:
                self._answered(endpoint)

        def failed(reason: Any) -> None:
            if self._answers.pop(endpoint, None) is not None:
                log.warn(
                    "{engine} node {node} stopped answering its model list: {error}",
                    engine=endpoint.engine,
                    node=endpoint.node_id,
                    error=describe(reason),
                )

        def settled(_: object) -> None:
            self._inflight.pop(endpoint, None)
            for waiter in self._waiters.pop(endpoint, []):
                waiter.callback(None)

        d = self._client.get_json(url, timeout)
        # Errback after callback: an answer of the wrong shape (answered
        # raises) stops advertising too.
        d.addCallback(answered)
        d.addErrback(failed)
        d.addBoth(settled)
        return d

    def set_fed(self, engines: Mapping[str, Mapping[str, NodeEntry]]) -> None:
        """
        Entries another provider knows without polling (etcd-fed peers),
        published with the polled ones (a polled entry of the same node
        wins) and annotated like them; publishes at once.
        """
        self._fed = engines
        self._publish()

    def republish(self) -> None:
        """
        Publish again from the last answers: readiness or draining changed
        (publishes nothing when the snapshot would be the same).
        """
        self._publish()

    def _publish(self) -> None:
        engines: dict[str, dict[str, NodeEntry]] = {}
        grouped: dict[tuple[str, str], list[Endpoint]] = {}
        for endpoint in self._endpoints:
            if endpoint in self._answers:
                grouped.setdefault((endpoint.engine, endpoint.node_id), []).append(
                    endpoint
                )
        for (engine_id, node_id), endpoints in grouped.items():
            models: dict[str, Endpoint] = {}
            for endpoint in endpoints:
                for model in sorted(self._answers[endpoint]):
                    models.setdefault(model, endpoint)
            entry = NodeEntry(node_id, endpoints[0].kind, models, tuple(endpoints))
            if self._annotate is not None:
                entry = self._annotate(engine_id, entry)
            engines.setdefault(engine_id, {})[node_id] = entry
        for engine_id, fed in self._fed.items():
            for node_id, entry in fed.items():
                if node_id in engines.get(engine_id, {}):
                    continue
                if self._annotate is not None:
                    entry = self._annotate(engine_id, entry)
                engines.setdefault(engine_id, {})[node_id] = entry
        self.discovery.publish(engines)
