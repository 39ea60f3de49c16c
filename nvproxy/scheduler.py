# -*- test-case-name: tests.test_scheduler -*-
"""
Candidate ordering and the process-wide reservation map (spec §5 steps 2-3, §6).

Pure logic: nothing here does I/O or reads a clock.

Ordering (:func:`order_owners`, §5 step 2)::

    eligible pin ▸ scheduler priority list ▸ default order (sorted ids)
    then, when ``awake`` is given: awake owners before sleeping ones, stable,
    except that an eligible pin stays first even while it sleeps;
    or, when ``readiness`` is given instead (the fleet's node records): the
    owners not on the priority list by readiness class (awake ▸ waking ▸
    sleeping ▸ offloaded ▸ restarting), then wake estimate, then load, then
    default order;
    then, when ``ejected`` is given: ejected owners last, stable, again except
    an eligible pin.

Choosing (:func:`choose`, §5 step 3): unless an eligible pin applies, reserve the
least estimated-loaded scheduler-listed candidate (ties keep order) and move it to
the front; never an ejected one while another candidate is not ejected.

Reservations (:class:`ReservationMap`, §6)::

    reserve(n) ─► live, counted on n at the current generation
       │ move(m): the claim follows the dispatch to m
       │ apply_snapshot(newer): superseded — no longer counted, its release is dropped
       ▼
    release() ─► released (idempotent)

A reservation is only ever counted while it is live *and* stamped with the current
generation, and every counted reservation is uncounted exactly once, so a node's
reservation count — and so its estimated load — can never go below zero.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from itertools import compress, count, repeat
from operator import eq
from types import MappingProxyType

from attrs import field, frozen, validators

__all__ = [
    "Reservation",
    "ReservationMap",
    "ReservationTracker",
    "SchedulerSnapshot",
    "choose",
    "order_owners",
]


def _node_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _frozen_mapping(value: Mapping[str, float]) -> Mapping[str, float]:
    return MappingProxyType(dict(value))


def _frozen_int_mapping(value: Mapping[str, int]) -> Mapping[str, int]:
    return MappingProxyType(dict(value))


@frozen(hash=False)
class SchedulerSnapshot:
    """
    One ``node/set-priority`` delivery from the scheduler.

    :ivar generation: increases with every new snapshot; a snapshot is applied at
        most once (§6), so a redelivery or a reordered older one is ignored.
    :ivar priority: node ids, best first.
    :ivar pending: the scheduler's count of work pending per node.
    :ivar gpu_pressure: the scheduler's GPU pressure per node, in the same units.
    """

    generation: int = field(validator=validators.ge(0))
    priority: tuple[str, ...] = field(default=(), converter=_node_tuple)
    pending: Mapping[str, int] = field(factory=dict, converter=_frozen_int_mapping)
    gpu_pressure: Mapping[str, float] = field(factory=dict, converter=_frozen_mapping)


class Reservation:
    """
    One in-flight dispatch this process has made since the last snapshot (§6).

    Obtained from :meth:`ReservationMap.reserve`; never constructed directly.
    """

    __slots__ = ("_generation", "_map", "_node_id", "_released")

    def __init__(self, owner: ReservationMap, node_id: str, generation: int) -> None:
        self._map = owner
        self._node_id = node_id
        self._generation = generation
        self._released = False

    @property
    def node_id(self) -> str:
        """The node this claim is counted against."""
        return self._node_id

    @property
    def generation(self) -> int:
        """The snapshot generation this claim was counted against."""
        return self._generation

    @property
    def released(self) -> bool:
        return self._released

    @property
    def live(self) -> bool:
        """
        Whether this claim currently adds to its node's estimated load: not
        released, and not superseded by a newer snapshot.
        """
        return not self._released and self._generation == self._map.generation

    def move(self, node_id: str) -> None:
        """
        Make the claim follow the dispatch to ``node_id``.

        A live claim moves from its node to ``node_id``. A claim superseded by a
        newer snapshot was counted by that snapshot on the node that refused the
        request, but the dispatch to ``node_id`` happens after the snapshot, so it is
        counted afresh there, stamped with the current generation. Moving a released
        reservation does nothing.
        """
        if self._released:
            return
        if self._generation == self._map.generation:
            if node_id == self._node_id:
                return
            self._map._uncount(self._node_id)
        else:
            self._generation = self._map.generation
        self._node_id = node_id
        self._map._count(node_id)

    def release(self) -> None:
        """
        End the claim. Idempotent. A release of a claim stamped with an older
        generation than the current one is dropped: the snapshot already counted
        (and superseded) it, and applying it would double-count the completion.
        """
        if self._released:
            return
        self._released = True
        if self._generation == self._map.generation:
            self._map._uncount(self._node_id)

    def __repr__(self) -> str:
        state = "released" if self._released else ("live" if self.live else "stale")
        return (
            f"<Reservation node={self._node_id!r} "
            f"generation={self._generation} {state}>"
        )


_NO_GENERATION = -1


class ReservationMap:
    """
    The one process-wide reservation map, shared by every facade (§6): estimated
    load for a node is ``pending + gpu_pressure + live reservations``.
    """

    def __init__(self) -> None:
        self._snapshot: SchedulerSnapshot | None = None
        self._generation = _NO_GENERATION
        self._counts: dict[str, int] = {}
        #: Called after any count changes (the broker's node activity).
        self.on_change: Callable[[], None] | None = None

    @property
    def generation(self) -> int:
        """The generation of the applied snapshot; ``-1`` before the first one."""
        return self._generation

    @property
    def snapshot(self) -> SchedulerSnapshot | None:
        """The applied snapshot, or ``None`` while no scheduler has spoken."""
        return self._snapshot

    def apply_snapshot(self, snapshot: SchedulerSnapshot) -> bool:
        """
        Apply ``snapshot`` unless its generation is not newer than the current one.

        :return: whether it was applied. A newer snapshot supersedes every
            reservation taken before it; an ignored one changes nothing, so a
            redelivery never clears live reservations.
        """
        if snapshot.generation <= self._generation:
            return False
        self._snapshot = snapshot
        self._generation = snapshot.generation
        self._counts.clear()
        self._changed()
        return True

    def reserve(self, node_id: str) -> Reservation:
        """Take a claim on ``node_id``, stamped with the current generation."""
        self._count(node_id)
        return Reservation(self, node_id, self._generation)

    def reservations(self, node_id: str) -> int:
        """The number of live reservations counted against ``node_id``."""
        return self._counts.get(node_id, 0)

    def load(self, node_id: str) -> float:
        """Estimated load of ``node_id``; never negative."""
        snap = self._snapshot
        pending: float = 0
        pressure = 0.0
        if snap is not None:
            pending = snap.pending.get(node_id, 0)
            pressure = snap.gpu_pressure.get(node_id, 0.0)
        return max(0.0, pending + pressure + self._counts.get(node_id, 0))

    def loads_among(self, nodes: Collection[str]) -> dict[str, float]:
        """
        The load of each of C{nodes} that can have one (reserved on, or
        named by the scheduler's snapshot); every other one's is 0.  One
        round's loads at once, without a call per owner: a fleet's model can
        have hundreds of owners, and most of them carry nothing.
        """
        counts = self._counts
        # A node the scheduler says nothing about carries its count alone
        # (no call per reserved node: a burst reserves on many).
        loads: dict[str, float] = {
            node: count for node, count in counts.items() if node in nodes
        }
        snap = self._snapshot
        if snap is not None:
            for node in snap.pending.keys() | snap.gpu_pressure.keys():
                if node in nodes:
                    loads[node] = self.load(node)
        return loads

    def snapshot_of_loads(self) -> Mapping[str, float]:
        """Estimated load of every node known to the snapshot or reserved on."""
        nodes: set[str] = set(self._counts)
        if self._snapshot is not None:
            nodes.update(self._snapshot.pending)
            nodes.update(self._snapshot.gpu_pressure)
            nodes.update(self._snapshot.priority)
        return MappingProxyType({n: self.load(n) for n in sorted(nodes)})

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _count(self, node_id: str) -> None:
        self._counts[node_id] = self._counts.get(node_id, 0) + 1
        self._changed()

    def _uncount(self, node_id: str) -> None:
        remaining = self._counts.get(node_id, 0) - 1
        if remaining > 0:
            self._counts[node_id] = remaining
        else:
            # Unreachable below zero by construction; dropping the key keeps
            # snapshot_of_loads() from listing nodes nobody knows about.
            self._counts.pop(node_id, None)
        self._changed()


def _load_function(
    loads: Mapping[str, float] | Callable[[str], float] | None,
) -> Callable[[str], float]:
    if loads is None:
        return lambda node_id: 0.0
    if isinstance(loads, Mapping):
        mapping = loads
        return lambda node_id: mapping.get(node_id, 0.0)
    return loads


def order_owners(
    owners: Iterable[str],
    *,
    pin: str | None,
    snapshot: SchedulerSnapshot | None,
    loads: Mapping[str, float] | Callable[[str], float] | None = None,
    awake: Callable[[str], bool] | None = None,
    ejected: Callable[[str], bool] | None = None,
    readiness: Callable[[str], tuple[int, float]] | None = None,
) -> list[str]:
    """
    Order the eligible owners (§5 step 2).

    1. An eligible pin (one among ``owners``) first. An ineligible pin is ignored:
       it never adds a node to the set (§5: a manual selection cannot override the
       capability gate).
    2. Then the owners on the scheduler's priority list, in its order.
    3. Then the rest in deterministic default order: ascending ``loads`` (missing =
       0), ties in the order ``owners`` gives them (discovery lists this node
       first, then the others by id, so an idle local engine is preferred).

    When ``awake`` is given (vLLM), owners it reports awake come before sleeping
    ones, stable within each group, so a sleeping node is woken only when no awake
    owner has the model. An eligible pin is the exception: it stays first even
    while asleep, because an operator who pinned a node asked for that node, and a
    pin that yielded whenever its node slept could never wake it.

    When ``ejected`` is given (passive outlier ejection,
    :mod:`nvproxy.outliers`), owners it reports ejected come last, after
    sleeping ones, stable: they are demoted, never removed, so one is still
    tried when no other owner is left. An eligible pin stays first even while
    ejected: the operator asked for that node.

    When ``readiness`` is given (node id -> (readiness class, wake estimate),
    lower is readier), the pin and the priority list keep their places (§5
    step 2 unchanged) and the other owners are sorted by it before load, so a
    sleeping owner comes after every awake one anywhere in the fleet;
    ``awake`` is then ignored.

    Duplicates in ``owners`` are collapsed.
    """
    given = list(dict.fromkeys(owners))
    eligible = set(given)
    head: list[str] = []
    if pin is not None and pin in eligible:
        head.append(pin)
    seen = set(head)
    listed: list[str] = []
    if snapshot is not None:
        for node_id in snapshot.priority:
            if node_id in eligible and node_id not in seen:
                listed.append(node_id)
                seen.add(node_id)
    others = [node_id for node_id in given if node_id not in seen] if seen else given
    # Sorted by (readiness, load, position in owners): each key made by
    # map, not by a Python function per owner (a fleet's model can have
    # hundreds of owners); the position (count) breaks every tie, so the
    # node ids themselves are never compared.
    if isinstance(loads, Mapping):
        load_keys: Iterable[float] = map(loads.get, others, repeat(0.0))
    else:
        load_keys = map(_load_function(loads), others)
    keys: Iterable[tuple[object, ...]]
    if readiness is not None:
        keys = zip(map(readiness, others), load_keys, count(), others)
    else:
        keys = zip(load_keys, count(), others)
    rest: list[str] = [key[-1] for key in sorted(keys)]  # type: ignore[misc]
    tail = listed + rest
    if awake is not None and readiness is None:
        tail = [n for n in tail if awake(n)] + [n for n in tail if not awake(n)]
    if ejected is not None:
        out = {n for n in tail if ejected(n)}
        if out:
            tail = [n for n in tail if n not in out] + [n for n in tail if n in out]
    return head + tail


def choose(
    ordered: Iterable[str],
    pinned: bool,
    reservations: ReservationMap,
    *,
    awake: Callable[[str], bool] | None = None,
    listed: Collection[str] | None = None,
    ejected: Callable[[str], bool] | None = None,
    readiness: Callable[[str], tuple[int, float]] | None = None,
    loads: Mapping[str, float] | None = None,
) -> tuple[list[str], Reservation | None]:
    """
    Reserve a candidate and move it to the front (§5 step 3, §6).

    :param ordered: the output of :func:`order_owners`.
    :param pinned: whether an *eligible* pin applies this round; then nothing is
        reserved and the order is kept.
    :param reservations: the process-wide map; its snapshot's priority list says
        which candidates are scheduler-listed unless ``listed`` is given.
    :param awake: as for :func:`order_owners`; when some candidates are awake the
        pick is made among them only, so reservation never undoes awake-first.
    :param listed: override for the scheduler-listed node set.
    :param ejected: as for :func:`order_owners`; the pick is made among the
        candidates not ejected when there are any, so reservation never undoes
        ejected-last (nor, among those, awake-first).
    :param readiness: as for :func:`order_owners`; with no scheduler-listed
        candidate the pick is made among the readiest ones only (same class
        and wake estimate as the readiest), so reservation never undoes
        readiness order. ``awake`` is then ignored.
    :param loads: the candidates' loads as :meth:`ReservationMap.loads_among`
        gives them (a node not in it carries none); by default each is asked
        of ``reservations``.

    The pick is the least estimated-loaded scheduler-listed candidate, ties
    keeping order. With no scheduler opinion about any candidate (no snapshot
    yet, or none of them listed) every candidate is in the running, so the
    reservations alone still spread a burst across idle nodes.
    """
    candidates = list(ordered)
    if pinned or not candidates:
        return candidates, None
    pool = candidates
    if ejected is not None:
        pool = [n for n in pool if not ejected(n)] or pool
    if awake is not None and readiness is None:
        pool = [n for n in pool if awake(n)] or pool
    if listed is None:
        snap = reservations.snapshot
        listed = frozenset(snap.priority) if snap is not None else frozenset()
    on_list = [n for n in pool if n in listed] if listed else []
    if on_list:
        pool = on_list
    elif readiness is not None:
        ranks = list(map(readiness, pool))
        best_rank = min(ranks)
        pool = list(compress(pool, map(eq, ranks, repeat(best_rank))))
    if loads is None:
        best = min(pool, key=reservations.load)  # min keeps the first on ties
    else:
        # No load is below 0: the first unloaded one is the pick, and a round
        # in an idle fleet looks no further.
        unloaded = next((node for node in pool if not loads.get(node)), None)
        best = unloaded if unloaded is not None else min(pool, key=loads.__getitem__)
    reservation = reservations.reserve(best)
    candidates.remove(best)
    return [best, *candidates], reservation


class ReservationTracker:
    """
    The reservation half of a job's observer (§6). It structurally satisfies the
    dispatcher's ``JobObserver`` (``admitted`` and ``committed`` do nothing), so it
    can be composed with the workload tracker.

    * :meth:`adopt` takes the reservation :func:`choose` returned for a round.
      ``adopt(None)`` says an eligible pin applies: no claim is taken until a later
      ``adopt`` of a real reservation.
    * :meth:`dispatching` moves the held claim to the node the attempt targets;
      with nothing held (the first dispatch, or the first after a release) and no
      pin, it reserves that node.
    * :meth:`between_attempts` releases — nothing runs between attempts, before a
      failover or a backoff — and :meth:`finished` releases when the job ends; both
      are idempotent, and nothing is reserved after :meth:`finished`.
    """

    def __init__(self, reservations: ReservationMap) -> None:
        self._map = reservations
        self._held: Reservation | None = None
        self._pinned = False
        self._done = False

    @property
    def held(self) -> Reservation | None:
        """The reservation currently held, if any."""
        return self._held

    def adopt(self, reservation: Reservation | None) -> None:
        """Hold the round's reservation from :func:`choose` (``None``: pinned)."""
        if self._held is not None and self._held is not reservation:
            self._held.release()
        if self._done:
            if reservation is not None:
                reservation.release()
            self._held = None
            return
        self._held = reservation
        self._pinned = reservation is None

    def admitted(self) -> None:
        pass

    def dispatching(self, node_id: str, attempt: int = 0) -> None:
        if self._done:
            return
        if self._held is not None:
            self._held.move(node_id)
        elif not self._pinned:
            self._held = self._map.reserve(node_id)

    def between_attempts(self) -> None:
        self._release()

    def committed(self, node_id: str, status: int) -> None:
        pass

    def finished(self, outcome: object = None) -> None:
        self._release()
        self._done = True

    def _release(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None
