# -*- test-case-name: tests.test_scheduler -*-
"""Tests for nvproxy.scheduler: ordering, choosing and the reservation map."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.scheduler import (
    Reservation,
    ReservationMap,
    ReservationTracker,
    SchedulerSnapshot,
    choose,
    order_owners,
)

NODES = ("a", "b", "c")
node_ids = st.sampled_from(NODES)


class SchedulerSnapshotTests(SynchronousTestCase):
    def test_frozen_copies(self) -> None:
        """
        A snapshot copies its mappings, so later mutation of the caller's dicts
        cannot change an applied snapshot.
        """
        pending = {"a": 1}
        snap = SchedulerSnapshot(1, ["a"], pending, {"a": 0.5})
        pending["a"] = 9
        self.assertEqual(snap.pending["a"], 1)
        self.assertEqual(snap.priority, ("a",))

    def test_negative_generation(self) -> None:
        self.assertRaises(ValueError, SchedulerSnapshot, -1)


class ReservationMapTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.map = ReservationMap()

    def test_load_without_snapshot(self) -> None:
        self.assertEqual(self.map.load("a"), 0.0)
        self.map.reserve("a")
        self.assertEqual(self.map.load("a"), 1.0)
        self.assertEqual(self.map.reservations("a"), 1)

    def test_load_adds_pending_pressure_reservations(self) -> None:
        self.map.apply_snapshot(SchedulerSnapshot(1, (), {"a": 2}, {"a": 0.5}))
        self.map.reserve("a")
        self.assertEqual(self.map.load("a"), 3.5)
        self.assertEqual(dict(self.map.snapshot_of_loads()), {"a": 3.5})

    def test_snapshot_of_loads_lists_every_known_node(self) -> None:
        self.map.apply_snapshot(SchedulerSnapshot(1, ("c",), {"a": 1}, {"b": 0.25}))
        self.map.reserve("d")
        self.assertEqual(
            dict(self.map.snapshot_of_loads()),
            {"a": 1.0, "b": 0.25, "c": 0.0, "d": 1.0},
        )

    def test_stamped_with_current_generation(self) -> None:
        self.assertEqual(self.map.reserve("a").generation, -1)
        self.map.apply_snapshot(SchedulerSnapshot(7))
        self.assertEqual(self.map.reserve("a").generation, 7)

    def test_applied_at_most_once(self) -> None:
        """
        A snapshot is applied only if newer: a redelivery or an older one is
        ignored and does not clear live reservations.
        """
        self.assertTrue(self.map.apply_snapshot(SchedulerSnapshot(0)))
        self.assertTrue(self.map.apply_snapshot(SchedulerSnapshot(2)))
        self.map.reserve("a")
        self.assertFalse(self.map.apply_snapshot(SchedulerSnapshot(2, ("a",))))
        self.assertFalse(self.map.apply_snapshot(SchedulerSnapshot(1)))
        self.assertEqual(self.map.reservations("a"), 1)
        self.assertEqual(self.map.generation, 2)
        self.assertEqual(self.map.snapshot, SchedulerSnapshot(2))

    def test_newer_snapshot_supersedes(self) -> None:
        self.map.reserve("a")
        self.assertTrue(self.map.apply_snapshot(SchedulerSnapshot(1, (), {"a": 1})))
        self.assertEqual(self.map.reservations("a"), 0)
        self.assertEqual(self.map.load("a"), 1.0)

    def test_double_release(self) -> None:
        first = self.map.reserve("a")
        self.map.reserve("a")
        first.release()
        first.release()
        self.assertEqual(self.map.reservations("a"), 1)
        self.assertTrue(first.released)
        self.assertFalse(first.live)

    def test_release_after_newer_snapshot_dropped(self) -> None:
        """
        Releasing a claim that a newer snapshot already counted is dropped: it
        must not take a reservation made after the snapshot off the count.
        """
        old = self.map.reserve("a")
        self.map.apply_snapshot(SchedulerSnapshot(1, (), {"a": 1}))
        new = self.map.reserve("a")
        old.release()
        self.assertEqual(self.map.reservations("a"), 1)
        self.assertEqual(self.map.load("a"), 2.0)
        new.release()
        self.assertEqual(self.map.load("a"), 1.0)

    def test_generation_race(self) -> None:
        """
        Snapshots arriving out of order: the older one is ignored, and releases
        of claims taken before the newest are dropped.
        """
        r1 = self.map.reserve("a")
        self.map.apply_snapshot(SchedulerSnapshot(5, (), {"a": 1}))
        r2 = self.map.reserve("a")
        self.assertFalse(self.map.apply_snapshot(SchedulerSnapshot(4)))
        r1.release()
        self.assertEqual(self.map.load("a"), 2.0)
        r2.release()
        self.assertEqual(self.map.load("a"), 1.0)

    def test_move_live(self) -> None:
        r = self.map.reserve("a")
        r.move("b")
        self.assertEqual(
            (self.map.reservations("a"), self.map.reservations("b")), (0, 1)
        )
        r.move("b")
        self.assertEqual(self.map.reservations("b"), 1)
        r.release()
        self.assertEqual(self.map.reservations("b"), 0)
        self.assertEqual(dict(self.map.snapshot_of_loads()), {})

    def test_move_stale_counts_afresh(self) -> None:
        """
        A claim superseded by a snapshot that then follows a dispatch to another
        node is counted there at the current generation.
        """
        r = self.map.reserve("a")
        self.map.apply_snapshot(SchedulerSnapshot(1, (), {"a": 1}))
        r.move("b")
        self.assertEqual(r.generation, 1)
        self.assertEqual((self.map.load("a"), self.map.load("b")), (1.0, 1.0))
        r.release()
        self.assertEqual((self.map.load("a"), self.map.load("b")), (1.0, 0.0))

    def test_move_released_does_nothing(self) -> None:
        r = self.map.reserve("a")
        r.release()
        r.move("b")
        self.assertEqual(self.map.reservations("b"), 0)
        self.assertEqual(r.node_id, "a")

    def test_load_never_negative_with_bad_input(self) -> None:
        self.map.apply_snapshot(SchedulerSnapshot(1, (), {"a": -3}, {"a": -0.5}))
        self.assertEqual(self.map.load("a"), 0.0)


class ReservationMachine(RuleBasedStateMachine):
    """
    Random interleavings of reserve / move / release / apply_snapshot, checked
    against a model: counts match, load is never negative and always equals
    pending + pressure + live reservations.
    """

    reservations = Bundle("reservations")

    def __init__(self) -> None:
        super().__init__()
        self.map = ReservationMap()
        self.generation = -1
        self.pending: dict[str, int] = {}
        # model: id(reservation) -> [node, generation, released]
        self.model: dict[int, list[object]] = {}
        self.all: list[Reservation] = []

    @rule(target=reservations, node=node_ids)
    def reserve(self, node: str) -> Reservation:
        r = self.map.reserve(node)
        assert r.generation == self.generation
        self.model[id(r)] = [node, self.generation, False]
        self.all.append(r)
        return r

    @rule(r=reservations, node=node_ids)
    def move(self, r: Reservation, node: str) -> None:
        r.move(node)
        entry = self.model[id(r)]
        if not entry[2]:
            entry[0] = node
            entry[1] = self.generation

    @rule(r=reservations)
    def release(self, r: Reservation) -> None:
        r.release()
        self.model[id(r)][2] = True

    @rule(r=consumes(reservations))
    def release_and_forget(self, r: Reservation) -> None:
        r.release()
        r.release()
        self.model[id(r)][2] = True

    @rule(
        delta=st.integers(min_value=-2, max_value=2),
        pending=st.dictionaries(node_ids, st.integers(0, 3)),
    )
    def apply_snapshot(self, delta: int, pending: dict[str, int]) -> None:
        gen = max(0, self.generation + delta)
        applied = self.map.apply_snapshot(SchedulerSnapshot(gen, NODES, pending))
        assert applied == (gen > self.generation)
        if applied:
            self.generation = gen
            self.pending = pending

    @invariant()
    def counts_match_model(self) -> None:
        expected = Counter(
            node
            for node, gen, released in self.model.values()
            if not released and gen == self.generation
        )
        live = Counter(r.node_id for r in self.all if r.live)
        for node in NODES:
            assert self.map.reservations(node) == expected[node] == live[node]

    @invariant()
    def load_never_negative(self) -> None:
        for node in NODES:
            load = self.map.load(node)
            assert load >= 0
            assert load == self.pending.get(node, 0) + self.map.reservations(node)


ReservationMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
ReservationMachineTests = ReservationMachine.TestCase


class OrderOwnersTests(SynchronousTestCase):
    def test_default_order_keeps_discovery_order(self) -> None:
        """
        Without a pin, priority or load, the order is the one discovery gives
        (this node first, then by id), duplicates collapsed.
        """
        self.assertEqual(
            order_owners(["local", "a", "b", "a"], pin=None, snapshot=None),
            ["local", "a", "b"],
        )

    def test_default_order_local_loaded(self) -> None:
        self.assertEqual(
            order_owners(
                ["local", "a", "b"], pin=None, snapshot=None, loads={"local": 2}
            ),
            ["a", "b", "local"],
        )

    def test_eligible_pin_first(self) -> None:
        snap = SchedulerSnapshot(1, ("a", "b"))
        self.assertEqual(
            order_owners(["a", "b", "c"], pin="c", snapshot=snap),
            ["c", "a", "b"],
        )

    def test_ineligible_pin_ignored(self) -> None:
        """A pin that is not an owner never broadens the set."""
        snap = SchedulerSnapshot(1, ("x", "b"))
        self.assertEqual(
            order_owners(["a", "b"], pin="x", snapshot=snap),
            ["b", "a"],
        )

    def test_priority_then_default(self) -> None:
        """
        Scheduler-listed owners in the scheduler's order, then the rest in
        default order; listed non-owners are dropped.
        """
        snap = SchedulerSnapshot(1, ("d", "z", "b"))
        self.assertEqual(
            order_owners(["a", "b", "c", "d"], pin=None, snapshot=snap),
            ["d", "b", "a", "c"],
        )

    def test_default_order_by_load(self) -> None:
        self.assertEqual(
            order_owners(
                ["a", "b", "c"], pin=None, snapshot=None, loads={"a": 2, "b": 1}
            ),
            ["c", "b", "a"],
        )
        self.assertEqual(
            order_owners(["a", "b", "c"], pin=None, snapshot=None, loads=lambda n: 0.0),
            ["a", "b", "c"],
        )

    def test_awake_first_stable(self) -> None:
        snap = SchedulerSnapshot(1, ("c", "a"))
        asleep = {"c", "b"}
        self.assertEqual(
            order_owners(
                ["a", "b", "c", "d"],
                pin=None,
                snapshot=snap,
                awake=lambda n: n not in asleep,
            ),
            ["a", "d", "c", "b"],
        )

    def test_sleeping_pin_stays_first(self) -> None:
        self.assertEqual(
            order_owners(
                ["a", "b", "c"], pin="c", snapshot=None, awake=lambda n: n != "c"
            ),
            ["c", "a", "b"],
        )

    @given(
        owners=st.lists(st.sampled_from("abcdef")),
        pin=st.none() | st.sampled_from("abcdefx"),
        priority=st.lists(st.sampled_from("abcdefx"), unique=True),
        asleep=st.sets(st.sampled_from("abcdef")),
    )
    @settings(deadline=None)
    def test_permutation_of_owners(
        self, owners: list[str], pin: str | None, priority: list[str], asleep: set[str]
    ) -> None:
        """The order is always exactly the owner set: never broadened."""
        ordered = order_owners(
            owners,
            pin=pin,
            snapshot=SchedulerSnapshot(1, tuple(priority)),
            awake=lambda n: n not in asleep,
        )
        self.assertEqual(sorted(ordered), sorted(set(owners)))
        if pin in owners:
            self.assertEqual(ordered[0], pin)


class ChooseTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.map = ReservationMap()

    def test_pinned_takes_nothing(self) -> None:
        self.map.apply_snapshot(SchedulerSnapshot(1, ("a", "b")))
        self.assertEqual(choose(["b", "a"], True, self.map), (["b", "a"], None))
        self.assertEqual(dict(self.map.snapshot_of_loads()), {"a": 0.0, "b": 0.0})

    def test_empty(self) -> None:
        self.assertEqual(choose([], False, self.map), ([], None))

    def test_least_loaded_listed_to_front(self) -> None:
        self.map.apply_snapshot(
            SchedulerSnapshot(1, ("a", "b", "c"), {"a": 2, "b": 1, "c": 1})
        )
        ordered, r = choose(["a", "b", "c", "d"], False, self.map)
        self.assertEqual(ordered, ["b", "a", "c", "d"])
        assert r is not None
        self.assertEqual((r.node_id, r.generation), ("b", 1))
        self.assertEqual(self.map.reservations("b"), 1)

    def test_unlisted_not_picked(self) -> None:
        """An idle unlisted node is not picked over a listed one."""
        self.map.apply_snapshot(SchedulerSnapshot(1, ("a",), {"a": 5}))
        ordered, r = choose(["a", "d"], False, self.map)
        self.assertEqual(ordered, ["a", "d"])
        assert r is not None
        self.assertEqual(r.node_id, "a")

    def test_no_scheduler_all_candidates(self) -> None:
        self.map.reserve("a")
        ordered, _ = choose(["a", "b"], False, self.map)
        self.assertEqual(ordered, ["b", "a"])

    def test_awake_pick(self) -> None:
        """Reservation never moves a sleeping node ahead of an awake one."""
        self.map.apply_snapshot(SchedulerSnapshot(1, ("a", "b"), {"a": 5}))
        ordered, _ = choose(["a", "b"], False, self.map, awake=lambda n: n == "a")
        self.assertEqual(ordered, ["a", "b"])

    def test_burst_spreads_evenly(self) -> None:
        self.map.apply_snapshot(SchedulerSnapshot(1, NODES))
        for n in range(1, 50):
            ordered = order_owners(NODES, pin=None, snapshot=self.map.snapshot)
            choose(ordered, False, self.map)
            counts = [self.map.reservations(node) for node in NODES]
            self.assertEqual(sum(counts), n)
            self.assertLessEqual(max(counts) - min(counts), 1)

    @given(st.integers(min_value=1, max_value=60))
    @settings(deadline=None)
    def test_burst_spreads_without_scheduler(self, n: int) -> None:
        reservations = ReservationMap()
        for _ in range(n):
            choose(order_owners(NODES, pin=None, snapshot=None), False, reservations)
        counts = [reservations.reservations(node) for node in NODES]
        self.assertLessEqual(max(counts) - min(counts), 1)


class ReservationTrackerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.map = ReservationMap()
        self.tracker = ReservationTracker(self.map)

    def loads(self) -> dict[str, int]:
        return {n: self.map.reservations(n) for n in NODES}

    def test_reserve_on_first_dispatch_move_release(self) -> None:
        self.tracker.dispatching("a")
        self.assertEqual(self.loads(), {"a": 1, "b": 0, "c": 0})
        self.tracker.dispatching("b")
        self.assertEqual(self.loads(), {"a": 0, "b": 1, "c": 0})
        self.tracker.between_attempts()
        self.assertEqual(self.loads(), {"a": 0, "b": 0, "c": 0})
        self.tracker.dispatching("c")
        self.assertEqual(self.loads(), {"a": 0, "b": 0, "c": 1})
        self.tracker.finished()
        self.tracker.finished()
        self.assertEqual(self.loads(), {"a": 0, "b": 0, "c": 0})
        self.tracker.dispatching("a")
        self.assertEqual(self.loads(), {"a": 0, "b": 0, "c": 0})

    def test_adopted_reservation_follows(self) -> None:
        ordered, r = choose(["a", "b"], False, self.map)
        self.tracker.adopt(r)
        self.tracker.dispatching(ordered[0])
        self.assertEqual(self.loads(), {"a": 1, "b": 0, "c": 0})
        self.tracker.dispatching(ordered[1])
        self.assertEqual(self.loads(), {"a": 0, "b": 1, "c": 0})
        self.tracker.finished()
        self.assertEqual(self.loads(), {"a": 0, "b": 0, "c": 0})

    def test_pinned_round_takes_none(self) -> None:
        """
        While a pin applies, failover inside the round takes no claim; the next
        round's reservation is followed again.
        """
        self.tracker.adopt(None)
        self.tracker.dispatching("a", 1)
        self.tracker.between_attempts()
        self.tracker.dispatching("b", 2)
        self.assertEqual(self.loads(), {"a": 0, "b": 0, "c": 0})
        self.tracker.between_attempts()
        _, r = choose(["b", "c"], False, self.map)
        self.tracker.adopt(r)
        self.tracker.dispatching("b", 3)
        self.assertEqual(self.loads(), {"a": 0, "b": 1, "c": 0})
        self.tracker.between_attempts()
        self.tracker.dispatching("c", 4)
        self.assertEqual(self.loads(), {"a": 0, "b": 0, "c": 1})
        self.tracker.finished()
        self.assertEqual(self.loads(), {"a": 0, "b": 0, "c": 0})

    def test_adopt_replaces_held(self) -> None:
        self.tracker.dispatching("a")
        _, r = choose(["b"], False, self.map)
        self.tracker.adopt(r)
        self.assertEqual(self.loads(), {"a": 0, "b": 1, "c": 0})
        self.assertIs(self.tracker.held, r)

    def test_adopt_after_finish_releases(self) -> None:
        self.tracker.finished()
        _, r = choose(["a"], False, self.map)
        self.tracker.adopt(r)
        self.assertEqual(self.loads(), {"a": 0, "b": 0, "c": 0})


def _reference_order(
    owners: list[str],
    *,
    pin: str | None,
    snapshot: SchedulerSnapshot | None,
    load: Callable[[str], float],
    awake: Callable[[str], bool] | None,
    ejected: Callable[[str], bool] | None,
    readiness: Callable[[str], tuple[int, float]] | None,
) -> list[str]:
    """L{order_owners} as it was before its keys were made without a call
    per owner: the reference the fast one must agree with."""
    given = list(dict.fromkeys(owners))
    position = {node_id: index for index, node_id in enumerate(given)}
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
    if readiness is not None:
        ready = readiness
        rest = sorted(eligible - seen, key=lambda n: (ready(n), load(n), position[n]))
    else:
        rest = sorted(eligible - seen, key=lambda n: (load(n), position[n]))
    tail = listed + rest
    if awake is not None and readiness is None:
        tail = [n for n in tail if awake(n)] + [n for n in tail if not awake(n)]
    if ejected is not None:
        out = {n for n in tail if ejected(n)}
        if out:
            tail = [n for n in tail if n not in out] + [n for n in tail if n in out]
    return head + tail


def _reference_pick(
    ordered: list[str],
    load: Callable[[str], float],
    listed: frozenset[str],
    *,
    awake: Callable[[str], bool] | None,
    ejected: Callable[[str], bool] | None,
    readiness: Callable[[str], tuple[int, float]] | None,
) -> str:
    """The node L{choose} reserved before it took a load mapping."""
    pool = ordered
    if ejected is not None:
        pool = [n for n in pool if not ejected(n)] or pool
    if awake is not None and readiness is None:
        pool = [n for n in pool if awake(n)] or pool
    on_list = [n for n in pool if n in listed]
    if on_list:
        pool = on_list
    elif readiness is not None:
        ranks = {n: readiness(n) for n in pool}
        best_rank = min(ranks.values())
        pool = [n for n in pool if ranks[n] == best_rank]
    return min(pool, key=load)


FLEET = tuple(f"n{i}" for i in range(12))
fleet_nodes = st.sampled_from(FLEET)
ranks = st.sampled_from([(0, 0.0), (0, 0.0), (0, 2.0), (1, 5.0), (1, 30.0), (3, 9.0)])


class FleetOrderTests(SynchronousTestCase):
    """
    The round's order and pick, with every owner's load read at once
    (L{ReservationMap.loads_among}) and keys made without a Python call per
    owner, are exactly what they were with a question per owner.
    """

    @given(
        owners=st.lists(fleet_nodes, max_size=20),
        pin=st.none() | st.sampled_from((*FLEET, "x")),
        listed=st.none() | st.lists(st.sampled_from((*FLEET, "x")), unique=True),
        pending=st.dictionaries(fleet_nodes, st.integers(-1, 3)),
        pressure=st.dictionaries(fleet_nodes, st.sampled_from([0.0, 0.25, 1.5])),
        reserved=st.lists(fleet_nodes, max_size=8),
        rank=st.none() | st.dictionaries(fleet_nodes, ranks),
        asleep=st.none() | st.sets(fleet_nodes),
        out=st.none() | st.sets(fleet_nodes),
    )
    @settings(deadline=None, max_examples=300)
    def test_same_order_and_pick(
        self,
        owners: list[str],
        pin: str | None,
        listed: list[str] | None,
        pending: dict[str, int],
        pressure: dict[str, float],
        reserved: list[str],
        rank: dict[str, tuple[int, float]] | None,
        asleep: set[str] | None,
        out: set[str] | None,
    ) -> None:
        maps = ReservationMap(), ReservationMap()
        for reservations in maps:
            if listed is not None:
                reservations.apply_snapshot(
                    SchedulerSnapshot(1, tuple(listed), pending, pressure)
                )
            for node in reserved:
                reservations.reserve(node)
        fast, slow = maps
        readiness = None if rank is None else (lambda n: rank.get(n, (0, 0.0)))
        awake = None if asleep is None else (lambda n: n not in asleep)
        ejected = None if out is None else out.__contains__
        loads = fast.loads_among(set(owners))
        for node in FLEET:
            self.assertEqual(
                loads.get(node, 0.0), fast.load(node) if node in owners else 0.0
            )
        ordered = order_owners(
            owners,
            pin=pin,
            snapshot=fast.snapshot,
            loads=loads,
            awake=awake,
            ejected=ejected,
            readiness=readiness,
        )
        expected = _reference_order(
            owners,
            pin=pin,
            snapshot=slow.snapshot,
            load=slow.load,
            awake=awake,
            ejected=ejected,
            readiness=readiness,
        )
        self.assertEqual(ordered, expected)
        pinned = pin in owners
        chosen, reservation = choose(
            ordered,
            pinned,
            fast,
            awake=awake,
            ejected=ejected,
            readiness=readiness,
            loads=loads,
        )
        if pinned or not ordered:
            self.assertIsNone(reservation)
            self.assertEqual(chosen, ordered)
            return
        best = _reference_pick(
            expected,
            slow.load,
            frozenset(listed or ()),
            awake=awake,
            ejected=ejected,
            readiness=readiness,
        )
        assert reservation is not None
        self.assertEqual(reservation.node_id, best)
        self.assertEqual(chosen, [best, *(n for n in ordered if n != best)])
