# -*- test-case-name: tests.test_outliers -*-
"""
Tests for passive outlier ejection: the table (L{nvproxy.outliers}), the
ordering it drives (L{nvproxy.scheduler}), the decision at the accounting
layer of which failures eject (L{nvproxy.accounting}), the poll hook, the
metrics, the two settings, and the whole path on loopback.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.accounting import Accounting, RequestAccounting
from nvproxy.config import ConfigError, DispatchConfig, load_config
from nvproxy.discovery import (
    Discovery,
    Endpoint,
    InventoryClient,
    NodeEntry,
    PollingDiscovery,
)
from nvproxy.dispatch import (
    Dispatcher,
    DispatchPolicy,
    FailureKind,
    JobOutcome,
    Target,
)
from nvproxy.engines import ENGINES, RouteKind
from nvproxy.metrics import Metrics
from nvproxy.outliers import EjectionPolicy, OutlierTable
from nvproxy.scheduler import ReservationMap, choose, order_owners
from nvproxy.testing.dispatchfakes import FakeAttempt, RecordingSink
from nvproxy.testing.fakeengine import Behaviour
from nvproxy.testing.harness import facade_url
from nvproxy.workload import RingSink, WorkloadRecorder
from tests.test_accounting import _inference
from tests.test_forwarding import ProxyTestCase


class OutlierTableTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.table = OutlierTable(self.clock, EjectionPolicy(1.0, 30.0))

    def intervals(self, failures: int) -> list[float]:
        """Fail once right after each ejection ends; the intervals seen."""
        seen = []
        for _ in range(failures):
            self.table.transport_failed("ollama", "b")
            [ejection] = self.table.ejected()
            seen.append(ejection.interval)
            self.clock.advance(ejection.remaining)
        return seen

    def test_a_transport_failure_ejects_for_the_base_interval(self) -> None:
        self.table.transport_failed("ollama", "b")
        self.assertTrue(self.table.is_ejected("ollama", "b"))
        self.clock.advance(0.999)
        self.assertTrue(self.table.is_ejected("ollama", "b"))
        self.clock.advance(0.001)
        self.assertFalse(self.table.is_ejected("ollama", "b"))
        # Expiry is computed when asked: no timer is left behind.
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_each_ejection_in_a_row_doubles_up_to_the_maximum(self) -> None:
        self.assertEqual(self.intervals(7), [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0])
        self.assertEqual(self.table.totals(), {("ollama", "b"): 7})

    def test_failures_while_ejected_neither_extend_nor_double(self) -> None:
        """
        The other in-flight requests of one outage fail together: that is
        one ejection, not sixteen.
        """
        for _ in range(16):
            self.table.transport_failed("ollama", "b")
            self.clock.advance(0.01)
        [ejection] = self.table.ejected()
        self.assertEqual(
            (ejection.engine, ejection.node, ejection.interval, ejection.failures),
            ("ollama", "b", 1.0, 16),
        )
        self.assertAlmostEqual(ejection.remaining, 0.84)
        self.assertEqual(self.table.totals(), {("ollama", "b"): 1})
        self.clock.advance(0.84)
        self.assertFalse(self.table.is_ejected("ollama", "b"))

    def test_a_commit_reinstates_and_forgets_the_streak(self) -> None:
        self.intervals(3)
        self.table.transport_failed("ollama", "b")
        self.table.served("ollama", "b")
        self.assertFalse(self.table.is_ejected("ollama", "b"))
        self.assertEqual(self.intervals(1), [1.0])

    def test_an_answered_poll_reinstates_but_keeps_the_streak(self) -> None:
        """
        A node that answers polls and still fails requests is ejected for
        longer each time.
        """
        self.table.transport_failed("ollama", "b")
        self.table.answered("ollama", "b")
        self.assertFalse(self.table.is_ejected("ollama", "b"))
        self.assertEqual(self.table.ejected(), [])
        self.assertEqual(self.intervals(1), [2.0])

    def test_quiet_for_the_maximum_starts_over(self) -> None:
        self.intervals(3)  # the last one, 4 s, has just ended
        self.clock.advance(29.9)
        self.assertEqual(self.intervals(1), [8.0])
        self.clock.advance(30.0)
        self.assertEqual(self.intervals(1), [1.0])

    def test_per_engine_and_node(self) -> None:
        """
        A node's Ollama can be down while its LM Studio is up.
        """
        self.table.transport_failed("ollama", "b")
        self.assertTrue(self.table.is_ejected("ollama", "b"))
        self.assertFalse(self.table.is_ejected("lmstudio", "b"))
        self.assertFalse(self.table.is_ejected("ollama", "c"))
        self.table.answered("lmstudio", "b")
        self.table.served("ollama", "c")
        self.assertTrue(self.table.is_ejected("ollama", "b"))

    def test_ejected_among(self) -> None:
        """
        A round's owners asked at once: exactly those C{is_ejected} names,
        of that engine, among the owners given, until their interval ends.
        """
        owners = {"a", "b", "c"}
        self.assertEqual(self.table.ejected_among("ollama", owners), frozenset())
        self.table.transport_failed("ollama", "b")
        self.table.transport_failed("ollama", "d")  # not an owner this round
        self.table.transport_failed("lmstudio", "c")  # another engine
        self.table.transport_failed("ollama", "a")
        self.table.served("ollama", "a")  # reinstated
        self.assertEqual(self.table.ejected_among("ollama", owners), {"b"})
        self.assertEqual(
            self.table.ejected_among("ollama", owners),
            {n for n in owners if self.table.is_ejected("ollama", n)},
        )
        self.clock.advance(1.0)
        self.assertEqual(self.table.ejected_among("ollama", owners), frozenset())

    def test_disabled(self) -> None:
        table = OutlierTable(self.clock, EjectionPolicy(0.0, 30.0))
        table.transport_failed("ollama", "b")
        self.assertFalse(table.is_ejected("ollama", "b"))
        self.assertEqual((table.ejected(), dict(table.totals())), ([], {}))

    def test_reinstating_an_unknown_owner_is_harmless(self) -> None:
        self.table.answered("ollama", "b")
        self.table.served("ollama", "b")
        self.assertEqual(self.table.ejected(), [])

    def test_status(self) -> None:
        self.table.transport_failed("ollama", "b")
        self.table.transport_failed("vllm", "a")
        self.clock.advance(0.25)
        self.table.transport_failed("ollama", "b")
        self.assertEqual(
            self.table.status(),
            {
                "ollama": {
                    "b": {"remaining_s": 0.75, "interval_s": 1.0, "failures": 2}
                },
                "vllm": {"a": {"remaining_s": 0.75, "interval_s": 1.0, "failures": 1}},
            },
        )
        self.clock.advance(0.75)
        self.assertEqual(self.table.status(), {})

    def test_policy_intervals(self) -> None:
        policy = EjectionPolicy(0.5, 3.0)
        self.assertEqual(
            [policy.interval(n) for n in range(1, 6)], [0.5, 1.0, 2.0, 3.0, 3.0]
        )
        self.assertEqual(EjectionPolicy(2.0, 1.0).interval(3), 2.0)
        self.assertEqual(EjectionPolicy().interval(10_000), 30.0)
        self.assertRaises(ValueError, EjectionPolicy, -1.0)


class OrderingTests(SynchronousTestCase):
    """
    Ejected owners are demoted, never removed or added.
    """

    def test_ejected_owner_goes_last(self) -> None:
        self.assertEqual(
            order_owners(
                ["a", "b", "c"], pin=None, snapshot=None, ejected=lambda n: n == "a"
            ),
            ["b", "c", "a"],
        )

    def test_ejected_after_sleeping(self) -> None:
        self.assertEqual(
            order_owners(
                ["a", "b", "c"],
                pin=None,
                snapshot=None,
                awake=lambda n: n != "c",
                ejected=lambda n: n == "a",
            ),
            ["b", "c", "a"],
        )

    def test_the_only_owner_is_still_used(self) -> None:
        self.assertEqual(
            order_owners(["a"], pin=None, snapshot=None, ejected=lambda n: True),
            ["a"],
        )
        ordered, reservation = choose(
            ["a"], False, ReservationMap(), ejected=lambda n: True
        )
        self.assertEqual(ordered, ["a"])
        assert reservation is not None
        self.assertEqual(reservation.node_id, "a")

    def test_a_pin_on_an_ejected_node_wins(self) -> None:
        """
        The operator asked for that node: it stays first.
        """
        self.assertEqual(
            order_owners(
                ["a", "b"], pin="b", snapshot=None, ejected=lambda n: n == "b"
            ),
            ["b", "a"],
        )

    def test_an_ineligible_ejected_node_is_never_added(self) -> None:
        self.assertEqual(
            order_owners(
                ["a", "b"], pin="x", snapshot=None, ejected=lambda n: n in "ax"
            ),
            ["b", "a"],
        )

    def test_choose_never_reserves_an_ejected_owner_while_others_remain(self) -> None:
        reservations = ReservationMap()
        reservations.reserve("b")  # b is busier, a is idle but ejected
        ordered, reservation = choose(
            ["b", "a"], False, reservations, ejected=lambda n: n == "a"
        )
        self.assertEqual(ordered, ["b", "a"])
        assert reservation is not None
        self.assertEqual(reservation.node_id, "b")

    @given(
        owners=st.lists(st.sampled_from("abcdef"), max_size=6),
        ejected=st.sets(st.sampled_from("abcdef")),
        asleep=st.sets(st.sampled_from("abcdef")),
        pin=st.none() | st.sampled_from("abcdefx"),
        busy=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 3)),
    )
    def test_demoted_never_removed(
        self,
        owners: list[str],
        ejected: set[str],
        asleep: set[str],
        pin: str | None,
        busy: dict[str, int],
    ) -> None:
        """
        Whatever the state: the result is exactly the eligible owners, an
        eligible pin first, and no ejected owner before one that is not.
        """
        reservations = ReservationMap()
        for node, count in busy.items():
            for _ in range(count):
                reservations.reserve(node)
        ordered = order_owners(
            owners,
            pin=pin,
            snapshot=None,
            loads=reservations.load,
            awake=lambda n: n not in asleep,
            ejected=ejected.__contains__,
        )
        pinned = pin in owners
        ordered, _ = choose(
            ordered,
            pinned,
            reservations,
            awake=lambda n: n not in asleep,
            ejected=ejected.__contains__,
        )
        self.assertEqual(sorted(ordered), sorted(set(owners)))
        rest = ordered
        if pinned:
            self.assertEqual(ordered[0], pin)
            rest = ordered[1:]
        flags = [n in ejected for n in rest]
        self.assertEqual(flags, sorted(flags))


# -- which failures eject: the accounting layer, driven by a real Dispatcher --


def _entry(node: str) -> NodeEntry:
    endpoint = Endpoint(node, "ollama", "direct", f"http://{node}:11434")
    return NodeEntry(node, "direct", {"m:latest": endpoint}, (endpoint,))


class _Target:
    """
    A target whose attempts report their failures to the accounting as the
    real attempt does (C{on_failure} before the result), and whose abort
    reports TRANSPORT there too: the worst an attempt may do, so these tests
    hold whatever the attempt code reports when it is aborted.
    """

    def __init__(
        self,
        node_id: str,
        report: Callable[[str], None],
        script: Callable[[FakeAttempt], object] | None = None,
    ) -> None:
        self.node_id = node_id
        self._report = report
        self._script = script
        self.attempts: list[FakeAttempt] = []

    def start(self, final: bool) -> FakeAttempt:
        attempt = _ReportingAttempt(self.node_id, final)
        attempt.report = self._report
        self.attempts.append(attempt)
        if self._script is not None:
            self._script(attempt)
        return attempt


class _ReportingAttempt(FakeAttempt):
    report: Callable[[str], None]

    def fail(self, kind: FailureKind, status: int | None = None) -> bool:
        if self.state == "pending":
            self.report(kind.value)
        return super().fail(kind, status)

    def abort(self) -> None:
        if self.state == "pending":
            self.report(FailureKind.TRANSPORT.value)
        super().abort()


def _refuse(attempt: FakeAttempt) -> None:
    attempt.fail(FailureKind.TRANSPORT)


def _serve(attempt: FakeAttempt) -> None:
    attempt.commit()
    attempt.end()


class AccountingEjectionTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.outliers = OutlierTable(self.clock, EjectionPolicy(1.0, 30.0))
        self.pins: dict[str, str] = {}
        self.accounting = Accounting(
            self.clock,
            ReservationMap(),
            WorkloadRecorder(self.clock, [RingSink()], run_id="r"),
            Metrics(CollectorRegistry()),
            self.pins,
            outliers=self.outliers,
        )
        self.dispatcher = Dispatcher(
            self.clock,
            DispatchPolicy(max_attempts=3, deadline=60.0, backoff=(0.5,)),
            random=lambda: 0.5,
        )

    def job(
        self, scripts: dict[str, Callable[[FakeAttempt], object] | None]
    ) -> tuple[Deferred[JobOutcome], RequestAccounting, dict[str, _Target]]:
        acc = self.accounting.begin(ENGINES["ollama"], "m:latest", RouteKind.INFERENCE)
        targets = {
            node: _Target(node, acc.failed_attempt, script)
            for node, script in scripts.items()
        }
        entries = [_entry(node) for node in scripts]

        def resolve() -> Sequence[Target]:
            return [targets[e.node_id] for e in acc.order(entries)]

        d = self.dispatcher.dispatch(
            resolve, RecordingSink(), inference=True, observer=acc
        )
        return d, acc, targets

    def order(self, *nodes: str) -> list[str]:
        acc = self.accounting.begin(ENGINES["ollama"], "m:latest", RouteKind.OTHER)
        return [e.node_id for e in acc.order([_entry(n) for n in nodes])]

    def test_transport_failure_ejects_and_the_job_fails_over(self) -> None:
        d, _, targets = self.job({"a": _refuse, "b": _serve})
        self.assertEqual(len(targets["a"].attempts), 1)
        self.assertTrue(self.outliers.is_ejected("ollama", "a"))
        self.assertEqual(self.order("a", "b"), ["b", "a"])
        # A later request dispatches to the healthy owner first.
        d2, _, targets2 = self.job({"a": _refuse, "b": _serve})
        self.assertEqual(
            (len(targets2["a"].attempts), len(targets2["b"].attempts)), (0, 1)
        )
        self.clock.advance(1.0)
        self.assertEqual(self.order("a", "b"), ["a", "b"])

    def test_final_transport_failure_ejects(self) -> None:
        d, _, targets = self.job({"a": _refuse})
        self.clock.advance(0.5)  # two backoffs
        self.clock.advance(0.5)
        outcome = self.successResultOf(d)
        self.assertEqual(outcome.reason, "transport_final")
        # Three attempts, the last two while ejected: still the only owner.
        self.assertEqual(len(targets["a"].attempts), 3)
        self.assertTrue(self.outliers.is_ejected("ollama", "a"))

    def test_retryable_status_does_not_eject(self) -> None:
        d, _, _ = self.job(
            {
                "a": lambda attempt: attempt.respond(503),
                "b": _serve,
            }
        )
        self.assertEqual(self.successResultOf(d).node_id, "b")
        self.assertEqual(self.outliers.ejected(), [])

    def test_client_leaving_does_not_eject(self) -> None:
        """
        The client goes away while the attempt is in flight: the aborted
        attempt may report TRANSPORT, but the node did nothing wrong.
        """
        d, _, targets = self.job({"a": None})
        d.cancel()
        self.failureResultOf(d)
        self.assertEqual(targets["a"].attempts[0].calls, ["abort"])
        self.assertEqual(self.outliers.ejected(), [])
        self.assertEqual(dict(self.outliers.totals()), {})

    def test_shutdown_does_not_eject(self) -> None:
        d, _, targets = self.job({"a": None})
        self.dispatcher.shutdown()
        self.assertEqual(self.successResultOf(d).reason, "shutdown")
        self.assertEqual(targets["a"].attempts[0].calls, ["abort"])
        self.assertEqual(self.outliers.ejected(), [])

    def test_client_leaving_after_a_real_failure_keeps_the_ejection(self) -> None:
        """
        A genuine failure counted before the client left still ejects.
        """
        d, _, targets = self.job({"a": _refuse})
        self.assertTrue(self.outliers.is_ejected("ollama", "a"))
        d.cancel()  # during the backoff
        self.failureResultOf(d)
        self.assertTrue(self.outliers.is_ejected("ollama", "a"))

    def test_late_report_after_the_end_is_ignored(self) -> None:
        d, acc, _ = self.job({"a": None})
        d.cancel()
        self.failureResultOf(d)
        acc.failed_attempt(FailureKind.TRANSPORT.value)
        acc.between_attempts()
        self.assertEqual(self.outliers.ejected(), [])

    def test_commit_reinstates(self) -> None:
        self.outliers.transport_failed("ollama", "a")
        self.pins["ollama"] = "a"
        d, _, targets = self.job(
            {
                "a": _serve,
                "b": None,
            }
        )
        # The pin wins over the ejection, and its commit reinstates it.
        self.assertEqual(self.successResultOf(d).node_id, "a")
        self.assertEqual(self.outliers.ejected(), [])
        self.assertEqual(targets["b"].attempts, [])

    def test_target_lost_does_not_eject(self) -> None:
        d, acc, targets = self.job({"a": None, "b": None})
        attempt = targets["a"].attempts[0]
        acc.failed_attempt(FailureKind.TARGET_LOST.value)
        attempt.fail(FailureKind.TARGET_LOST)
        self.assertEqual(self.outliers.ejected(), [])
        _serve(targets["b"].attempts[0])
        self.successResultOf(d)


class MetricsTests(SynchronousTestCase):
    def test_gauge_and_counter(self) -> None:
        clock = Clock()
        outliers = OutlierTable(clock, EjectionPolicy(1.0, 30.0))
        registry = CollectorRegistry()
        Metrics(registry, outliers=outliers)

        def scrape() -> list[str]:
            return [
                line
                for line in generate_latest(registry).decode().splitlines()
                if line.startswith("nvproxy_node_eject")
            ]

        self.assertEqual(scrape(), [])
        outliers.transport_failed("ollama", "gpu-2")
        self.assertEqual(
            scrape(),
            [
                'nvproxy_node_ejected{engine="ollama",node="gpu-2"} 1.0',
                'nvproxy_node_ejections_total{engine="ollama",node="gpu-2"} 1.0',
            ],
        )
        clock.advance(1.0)
        outliers.transport_failed("ollama", "gpu-2")
        outliers.served("ollama", "gpu-2")
        self.assertEqual(
            scrape(),
            [
                'nvproxy_node_ejected{engine="ollama",node="gpu-2"} 0.0',
                'nvproxy_node_ejections_total{engine="ollama",node="gpu-2"} 2.0',
            ],
        )


class _Inventory(InventoryClient):
    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def get_json(self, url: str, timeout: float) -> Deferred[Any]:
        self.asked.append(url)
        answer = self.answers.get(url)
        if answer is None:
            return fail(ConnectionRefusedError())
        return succeed(answer)


class PollHookTests(SynchronousTestCase):
    def test_answered_polls_are_reported(self) -> None:
        """
        Only an endpoint that answered with a model list is reported: not
        one that failed, and not a static one (never asked).
        """
        up = Endpoint("up", "ollama", "direct", "http://up:11434")
        down = Endpoint("down", "ollama", "direct", "http://down:11434")
        static = Endpoint("local", "vllm", "local", "http://127.0.0.1:8001", "text")
        inventory = _Inventory({"http://up:11434/api/tags": {"models": []}})
        reported: list[Endpoint] = []
        polling = PollingDiscovery(
            Discovery(),
            inventory,
            Clock(),
            [up, down, static],
            static_models={static: ["m"]},
            answered=reported.append,
        )
        self.successResultOf(polling.poll())
        self.assertEqual(reported, [up])

    def test_a_poll_reinstates(self) -> None:
        clock = Clock()
        outliers = OutlierTable(clock)
        up = Endpoint("up", "ollama", "direct", "http://up:11434")
        polling = PollingDiscovery(
            Discovery(),
            _Inventory({"http://up:11434/api/tags": {"models": []}}),
            clock,
            [up],
            answered=lambda e: outliers.answered(e.engine, e.node_id),
        )
        outliers.transport_failed("ollama", "up")
        self.successResultOf(polling.poll())
        self.assertFalse(outliers.is_ejected("ollama", "up"))


class ConfigTests(SynchronousTestCase):
    def load(
        self,
        text: str = "",
        flags: Mapping[str, str | None] | None = None,
        env: dict[str, str] | None = None,
    ) -> DispatchConfig:
        path = self.mktemp()
        with open(path, "w") as f:
            f.write(text)
        return load_config(path, flags or {}, {"HOME": path, **(env or {})}).dispatch

    def test_defaults(self) -> None:
        config = self.load()
        self.assertEqual((config.eject_base, config.eject_max), (1.0, 30.0))

    def test_file_env_flags(self) -> None:
        text = '[dispatch]\neject_base = "250ms"\neject_max = "5s"\n'
        config = self.load(text)
        self.assertEqual((config.eject_base, config.eject_max), (0.25, 5.0))
        config = self.load(text, env={"NVPROXY_EJECT_MAX": "1m"})
        self.assertEqual((config.eject_base, config.eject_max), (0.25, 60.0))
        config = self.load(
            text,
            flags={"eject-base": "2s"},
            env={"NVPROXY_EJECT_BASE": "3s", "NVPROXY_EJECT_MAX": "1m"},
        )
        self.assertEqual((config.eject_base, config.eject_max), (2.0, 60.0))

    def test_zero_disables(self) -> None:
        config = self.load('[dispatch]\neject_base = "0"\n')
        self.assertEqual(config.eject_base, 0.0)
        self.assertFalse(EjectionPolicy(config.eject_base, config.eject_max).enabled)

    def test_errors(self) -> None:
        for text, flags, message in [
            (
                '[dispatch]\neject_max = "0"\n',
                {},
                'dispatch.eject_max: must be greater than 0, got "0"',
            ),
            (
                '[dispatch]\neject_base = "10s"\neject_max = "5s"\n',
                {},
                'dispatch.eject_max: must not be below dispatch.eject_base, got "5s"',
            ),
            (
                "",
                {"eject-base": "1m"},
                '--eject-base: must not be above dispatch.eject_max, got "1m"',
            ),
            ("", {"eject-base": "-1s"}, "--eject-base: "),
        ]:
            with self.assertRaises(ConfigError) as caught:
                self.load(text, flags)
            self.assertTrue(str(caught.exception).startswith(message), caught.exception)


# -- the whole path, on loopback ----------------------------------------------


class EjectionIntegrationTests(ProxyTestCase):
    """
    Two owners; the one ordered first (this node's engine) stops working.
    Discovery does not poll during these tests (a poll would drop a node
    whose port is closed, which is not what is under test), except where a
    test polls explicitly.
    """

    async def test_a_dead_owner_costs_one_failover_not_one_per_request(
        self,
    ) -> None:
        dead = await self.engine("ollama", ["m:latest"])
        alive = await self.engine("ollama", ["m:latest"])
        proxy = await self.proxy(
            {"ollama": dead.url},
            nodes={"gpu-2": {"ollama": alive.url}},
            poll_interval=3600.0,
            eject_base=60.0,
            eject_max=60.0,
        )
        await dead.stop()  # its port now refuses connections
        url = facade_url(proxy, "ollama") + "/api/generate"
        for _ in range(5):
            code, _, _ = await self.post(url, {"model": "m", "stream": False})
            self.assertEqual(code, 200)
        self.assertEqual(len(_inference(alive)), 5)
        text = generate_latest(proxy.registry).decode()
        self.assertIn('nvproxy_failovers_total{engine="ollama"} 1.0', text)
        self.assertIn('nvproxy_node_ejected{engine="ollama",node="local"} 1.0', text)
        self.assertIn(
            'nvproxy_node_ejections_total{engine="ollama",node="local"} 1.0', text
        )
        self.assertEqual(list(proxy.ops.status()["ejected"]), ["ollama"])
        self.assertEqual(list(proxy.ops.status()["ejected"]["ollama"]), ["local"])

        # It comes back and answers a poll: it is used again at once.
        await dead.listen(reactor)
        await proxy.polling.poll()
        self.assertEqual(proxy.ops.status()["ejected"], {})
        code, _, _ = await self.post(url, {"model": "m", "stream": False})
        self.assertEqual(code, 200)
        self.assertEqual((len(_inference(dead)), len(_inference(alive))), (1, 5))

    async def test_resetting_owner_is_tried_again_only_after_a_poll(self) -> None:
        """
        An owner that accepts and resets every inference request (while it
        still answers its model list) is asked once, not once per request,
        until it answers a poll; ``nvproxyctl status`` shows it meanwhile.
        """
        sick = await self.engine("ollama", ["m:latest"])
        healthy = await self.engine("ollama", ["m:latest"])
        sick.default = Behaviour(refuse=True)
        proxy = await self.proxy(
            {"ollama": sick.url},
            nodes={"gpu-2": {"ollama": healthy.url}},
            poll_interval=3600.0,
            eject_base=60.0,
            eject_max=60.0,
            admin=True,
        )
        url = facade_url(proxy, "ollama") + "/api/chat"
        code, _, _ = await self.post(url, {"model": "m", "messages": []})
        self.assertEqual(code, 200)
        asked = len(_inference(sick))
        self.assertGreaterEqual(asked, 1)
        for _ in range(4):
            code, _, _ = await self.post(url, {"model": "m", "messages": []})
            self.assertEqual(code, 200)
        self.assertEqual(len(_inference(sick)), asked)
        self.assertEqual(len(_inference(healthy)), 5)

        admin = f"http://127.0.0.1:{proxy.admin.bound_port()}"
        code, _, body = await self.client.request("GET", admin + "/admin/status")
        ejected = json.loads(body)["ejected"]
        self.assertEqual(list(ejected), ["ollama"])
        self.assertEqual(
            sorted(ejected["ollama"]["local"]),
            ["failures", "interval_s", "remaining_s"],
        )
        self.assertEqual(ejected["ollama"]["local"]["interval_s"], 60.0)

        sick.default = Behaviour()
        await proxy.polling.poll()
        code, _, _ = await self.post(url, {"model": "m", "messages": []})
        self.assertEqual(code, 200)
        self.assertEqual(len(_inference(sick)), asked + 1)
        self.assertEqual(len(_inference(healthy)), 5)
