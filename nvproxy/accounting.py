# -*- test-case-name: tests.test_accounting -*-
"""
Per-request accounting: ordering and reservations (spec §5 steps 2-3, §6),
passive outlier ejection (L{nvproxy.outliers}), workload lifecycle events
with stats (§5.5) and metrics, composed into the one observer the dispatcher
calls.

L{Accounting} is process-wide (one reservation map, one workload recorder,
one set of metrics for every facade); L{RequestAccounting} is one request's
share of it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from itertools import filterfalse, islice

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from nvproxy.discovery import Lineup, NodeEntry
from nvproxy.dispatch import FailureKind, JobOutcome, RejectReason
from nvproxy.engines import Engine, RouteKind
from nvproxy.inferstats import StatsMeter
from nvproxy.metrics import Metrics, RequestMetrics
from nvproxy.outliers import OutlierTable
from nvproxy.readiness import ModelReadiness
from nvproxy.scheduler import ReservationMap, ReservationTracker, choose, order_owners
from nvproxy.workload import WorkloadRecorder, WorkloadTracker

log = Logger()

Awake = Callable[[NodeEntry, str | None], bool]
"""(node entry, model) -> whether the node serves without waking (a backend's)."""

ReadinessOf = Callable[[NodeEntry, str | None], ModelReadiness]
"""(node entry, model) -> how ready the node's model is (a backend's)."""

_STOPPED = frozenset({"client_gone", RejectReason.SHUTDOWN.value})
"""Job endings that abort the attempt in flight: its failure is ours."""


class Accounting:
    """
    The process-wide half: shared by every facade.
    """

    def __init__(
        self,
        clock: IReactorTime,
        reservations: ReservationMap,
        recorder: WorkloadRecorder,
        metrics: Metrics,
        pins: Mapping[str, str],
        outliers: OutlierTable | None = None,
    ) -> None:
        self.clock = clock
        self.reservations = reservations
        self.recorder = recorder
        self.metrics = metrics
        self.pins = pins
        self.outliers = outliers
        # engine -> requests begun and not finished (the node record's
        # in_flight)
        self.in_flight: dict[str, int] = {}

    def begin(
        self,
        engine: Engine,
        model: str | None,
        kind: RouteKind,
        awake: Awake | None = None,
        requester: str | None = None,
        readiness: ReadinessOf | None = None,
        request_id: str | None = None,
    ) -> RequestAccounting:
        """
        One request's accounting; C{readiness} (the facade backend's) orders
        owners by readiness after the pin and the priority list (C{awake},
        the older form, only awake before not); C{requester} is the name of
        the API key the request came with; C{request_id} goes in workload
        events.
        """
        inference = kind is RouteKind.INFERENCE and model is not None
        self.in_flight[engine.id] = self.in_flight.get(engine.id, 0) + 1
        return RequestAccounting(
            self,
            engine,
            model,
            awake,
            self.metrics.observer(self.clock, engine.id, kind.value, model, requester),
            self.recorder.begin(
                engine.id, model, requester_id=requester, request_id=request_id
            )
            if inference and model
            else None,
            ReservationTracker(self.reservations) if inference else None,
            StatsMeter(self.clock, engine.stream_dialect) if inference else None,
            readiness,
        )


class RequestAccounting:
    """
    One request's observer (L{nvproxy.dispatch.JobObserver}) and orderer.

    Outlier ejection: a TRANSPORT failure (L{failed_attempt}) is held
    against the node of the attempt in flight and only applied once the job
    moves on without it (L{between_attempts}) or ends for a reason of its own
    (L{finished}).  When the job ends because the client left or the proxy
    is shutting down, the attempt was aborted by us, whatever kind its
    failure reports, so the node is not ejected.  A commit reinstates the
    node.

    @ivar meter: measures the committed response body (inference only); the
        attempt feeds it only for a committed status below 400.
    """

    def __init__(
        self,
        shared: Accounting,
        engine: Engine,
        model: str | None,
        awake: Awake | None,
        metrics: RequestMetrics,
        workload: WorkloadTracker | None,
        reservations: ReservationTracker | None,
        meter: StatsMeter | None,
        readiness: ReadinessOf | None = None,
    ) -> None:
        self._shared = shared
        self._readiness = readiness
        self._engine = engine
        self._model = model
        self._awake = awake
        self._metrics = metrics
        self._workload = workload
        self._reservations = reservations
        self.meter = meter
        self._committed_status: int | None = None
        self._node: str | None = None
        self._suspect: str | None = None
        self._done = False
        if meter is not None:
            meter.started()

    # -- ordering ---------------------------------------------------------

    def order(
        self,
        entries: Sequence[NodeEntry],
        ranks: Mapping[str, tuple[int, float]] | None = None,
    ) -> list[NodeEntry]:
        """
        Order this round's eligible owners and take the round's reservation.
        Owners ejected after a transport failure come last (an eligible pin
        stays first); draining nodes come after all of those (a pin on one
        too), so they get new work only when no other owner is left; none is
        ever dropped or added.

        @param ranks: the readiness ranks of owners that are not this node,
            as the discovery snapshot has them (L{Snapshot.ranks}), taken as
            they are; every owner not in it is asked of the backend.  (A
            backend's readiness for an owner that is not this node is the
            snapshot's: L{nvproxy.proxy.backends.Backend.readiness}.)
        """
        if not entries:
            return []
        draining = [entry for entry in entries if entry.draining]
        if not draining:
            return self._order(list(entries), ranks=ranks)
        live = [entry for entry in entries if not entry.draining]
        if live:
            # Only the live ones take the round's reservation.
            return self._order(live, ranks=ranks) + self._order(
                draining, reserve=False, ranks=ranks
            )
        return self._order(list(entries), ranks=ranks)

    def first(self, lineup: Lineup, limit: int) -> list[NodeEntry]:
        """
        The first C{limit} owners of C{lineup} in the order L{order} gives
        them, taking the round's reservation as it does: a job dispatches to
        at most C{dispatch.max_attempts} owners, so a round needs no more.

        A fleet's model can have hundreds of owners, most of them alike.
        The round starts from the lineup's order and looks only at the
        owners that can differ from it (the pin, the scheduler's list,
        those carrying a load, the ejected and this node's own, whose
        readiness is live) and at as many others as it lists.  When every
        live owner fits in the round, it is L{order}'s.
        """
        shared, by_id = self._shared, lineup.by_id
        readiness = self._readiness
        if lineup.live <= limit or readiness is None:
            return self.order(lineup.entries, lineup.ranks)[:limit]
        reservations = shared.reservations
        pin = shared.pins.get(self._engine.id)
        head: list[str] = []
        if pin is not None and pin in by_id and not by_id[pin].draining:
            head.append(pin)
        snapshot = reservations.snapshot
        listed: list[str] = []
        if snapshot is not None and snapshot.priority:
            listed = [
                node
                for node in dict.fromkeys(snapshot.priority)
                if node in by_id and node != pin and not by_id[node].draining
            ]
        loads = reservations.loads_among(by_id)
        out = (
            shared.outliers.ejected_among(self._engine.id, by_id)
            if shared.outliers is not None
            else frozenset()
        )
        ranks, position, model = lineup.ranks, lineup.position, self._model
        special = {*loads, *out, *lineup.local}
        apart = {*head, *listed}
        aside = {*special, *apart} if apart else special
        # The rest sorted by (readiness, load, position) as order_owners
        # sorts them, the ejected after: every owner not set aside carries
        # no load and comes in the lineup's order.
        keys = [
            (ranks[node], 0.0, position[node], node)
            for node in islice(filterfalse(aside.__contains__, lineup.ranked), limit)
        ]
        contenders: Iterable[str] = special
        if len(keys) == limit and keys[-1][0] == ranks[lineup.ranked[0]]:
            # The round is full of unloaded owners that no other owner's
            # record says is readier: one set aside comes before them only
            # with no load (this node's own, or one the scheduler gives
            # none) or a readier live rank (this node's own).  A loaded or
            # ejected one comes after them all, however many are in flight.
            contenders = lineup.local
            if snapshot is not None:
                contenders = {
                    *contenders,
                    *(n for n, load in loads.items() if not load),
                }
        late: list[tuple[tuple[int, float], float, int, str]] = []
        for node in contenders:
            entry = by_id[node]
            if entry.draining or node in apart:
                continue  # (placed apart)
            rank = ranks[node] if node in ranks else readiness(entry, model).rank
            key = (rank, loads.get(node, 0.0), position[node], node)
            (late if node in out else keys).append(key)
        keys.sort()
        ordered = [key[3] for key in keys]
        if listed:
            # after the pin, the listed; the ejected of them after the rest
            # (an ejected pin stays first)
            ordered = [
                *(node for node in listed if node not in out),
                *ordered,
                *(node for node in listed if node in out),
            ]
        ordered[:0] = head
        if len(ordered) < limit:
            late.sort()
            ordered += [key[3] for key in late]
        if self._reservations is not None and not head:
            pick = self._pick(listed, out, loads, lineup, ordered)
            if pick != ordered[0]:
                ordered.remove(pick)
                ordered.insert(0, pick)
            self._reservations.adopt(reservations.reserve(pick))
        # (more live owners than the limit: the first are all live)
        return [by_id[node] for node in ordered[:limit]]

    @staticmethod
    def _pick(
        listed: list[str],
        out: Collection[str],
        loads: Mapping[str, float],
        lineup: Lineup,
        ordered: list[str],
    ) -> str:
        """
        The owner choose() reserves for a round of L{first}: the least
        loaded scheduler-listed one (the first on ties) among those not
        ejected, or among all when every live owner is ejected; without a
        listed one, the round's first, which is the readiest and least
        loaded of them.
        """
        if not listed:
            return ordered[0]
        every_out = sum(not lineup.by_id[node].draining for node in out) == lineup.live
        pool = [node for node in listed if every_out or node not in out]
        if not pool:
            return ordered[0]
        unloaded = next((node for node in pool if not loads.get(node)), None)
        if unloaded is not None:
            return unloaded
        return min(pool, key=loads.__getitem__)

    def _order(
        self,
        entries: Sequence[NodeEntry],
        reserve: bool = True,
        ranks: Mapping[str, tuple[int, float]] | None = None,
    ) -> list[NodeEntry]:
        shared = self._shared
        by_id = {entry.node_id: entry for entry in entries}
        if len(by_id) == 1:
            # One owner: nothing to order; the round's reservation is what
            # choose() gives one candidate (none when it is pinned).
            (node,) = by_id
            if self._reservations is not None and reserve:
                pinned = shared.pins.get(self._engine.id) == node
                self._reservations.adopt(
                    None if pinned else shared.reservations.reserve(node)
                )
            return [by_id[node]]
        awake_fn: Callable[[str], bool] | None = None
        if self._awake is not None:
            awake = self._awake
            model = self._model
            awake_fn = lambda node: awake(by_id[node], model)  # noqa: E731
        # A fleet's model can have hundreds of owners, most of them alike
        # (awake, unloaded, not ejected): readiness comes from the snapshot
        # where it can, loads and ejections are read once for the round,
        # not asked per owner.
        ready_fn: Callable[[str], tuple[int, float]] | None = None
        if self._readiness is not None:
            # Once per round: a waking owner's estimate shrinks with time.
            readiness, model = self._readiness, self._model
            known = ranks if ranks is not None else {}
            asked = {
                node: readiness(by_id[node], model).rank
                for node in by_id.keys() - known.keys()
            }
            every = {**known, **asked} if asked else known
            ready_fn = every.__getitem__
        ejected_fn: Callable[[str], bool] | None = None  # (None: none is)
        if shared.outliers is not None:
            out = shared.outliers.ejected_among(self._engine.id, by_id)
            if out:
                ejected_fn = out.__contains__
        loads = shared.reservations.loads_among(by_id)
        pin = shared.pins.get(self._engine.id)
        ordered = order_owners(
            by_id,
            pin=pin,
            snapshot=shared.reservations.snapshot,
            loads=loads,
            awake=awake_fn,
            ejected=ejected_fn,
            readiness=ready_fn,
        )
        if self._reservations is not None and reserve:
            ordered, reservation = choose(
                ordered,
                pin in by_id,
                shared.reservations,
                awake=awake_fn,
                ejected=ejected_fn,
                readiness=ready_fn,
                loads=loads,
            )
            self._reservations.adopt(reservation)
        return [by_id[node] for node in ordered]

    # -- JobObserver ------------------------------------------------------

    def admitted(self) -> None:
        if self._workload is not None:
            self._workload.admitted()

    def dispatching(self, node_id: str, attempt: int) -> None:
        self._node = node_id
        self._suspect = None
        if self._reservations is not None:
            self._reservations.dispatching(node_id, attempt)
        if self._workload is not None:
            self._workload.dispatching(node_id, attempt)
        self._metrics.dispatching(node_id, attempt)

    def between_attempts(self) -> None:
        self._eject_suspect()
        if self._reservations is not None:
            self._reservations.between_attempts()
        if self._workload is not None:
            self._workload.between_attempts()

    def committed(self, node_id: str, status: int) -> None:
        self._committed_status = status
        self._suspect = None
        if self._shared.outliers is not None:
            self._shared.outliers.served(self._engine.id, node_id)
        if self._workload is not None:
            self._workload.committed(node_id, status)
        self._metrics.committed(node_id, status)

    def failed_attempt(self, kind: str) -> None:
        self._metrics.failed_attempt(kind)
        if kind == FailureKind.TRANSPORT.value and not self._done:
            self._suspect = self._node

    def finished(self, outcome: JobOutcome) -> None:
        if outcome.reason not in _STOPPED:
            self._eject_suspect()
        self._suspect = None
        if not self._done:
            engine = self._engine.id
            left = self._shared.in_flight.get(engine, 0) - 1
            if left > 0:
                self._shared.in_flight[engine] = left
            else:
                self._shared.in_flight.pop(engine, None)
        self._done = True
        if self._reservations is not None:
            self._reservations.finished(outcome)
        stats = None
        status = self._committed_status
        if self.meter is not None and status is not None and status < 400:
            stats = self.meter.finish()
        if self._workload is not None:
            self._workload.finished(outcome, stats)
        self._metrics.finished(outcome, stats)

    def _eject_suspect(self) -> None:
        node, self._suspect = self._suspect, None
        outliers = self._shared.outliers
        if node is not None and outliers is not None:
            outliers.transport_failed(self._engine.id, node)
