"""
Tests for L{nvproxy.dispatch}: the Job retry state machine (spec §1.1,
§5.1-§5.4), driven with L{Clock} and the fakes in
L{nvproxy.testing.dispatchfakes}.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import pairwise

from hypothesis import given, settings
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.dispatch import (
    Attempt,
    AttemptFailed,
    ClientSink,
    Dispatcher,
    DispatchPolicy,
    FailureKind,
    JobObserver,
    JobOutcome,
    NullJobObserver,
    RejectReason,
    StreamEnd,
    Target,
    is_retryable_status,
)
from nvproxy.testing.dispatchfakes import (
    FakeAttempt,
    FakeDiscovery,
    FakeTarget,
    RecordingObserver,
    RecordingSink,
)
from tests.strategies import Action, dispatch_schedules

# Static checks that the fakes provide the protocols they stand for.
_target: Target = FakeTarget("x")
_attempt: Attempt = FakeAttempt("x", final=False)
_sink: ClientSink = RecordingSink()
_observer: JobObserver = RecordingObserver()
_null: JobObserver = NullJobObserver()

T_ADMITTED = ("admitted",)
T_BETWEEN = ("between_attempts",)


def _fixed(value: float = 0.5) -> Callable[[], float]:
    return lambda: value


def _cycle(values: list[float]) -> Callable[[], float]:
    def gen() -> Iterator[float]:
        while True:
            yield from values

    it = gen()
    return lambda: next(it)


class Harness:
    """
    One dispatcher, one discovery, one sink and observer, on a L{Clock}.
    C{random} defaults to 0.5, i.e. no jitter.
    """

    def __init__(
        self,
        policy: DispatchPolicy | None = None,
        random: Callable[[], float] = _fixed(),
    ) -> None:
        self.clock = Clock()
        self.policy = DispatchPolicy() if policy is None else policy
        self.dispatcher = Dispatcher(self.clock, self.policy, random)
        self.discovery = FakeDiscovery()
        self.sink = RecordingSink()
        self.observer = RecordingObserver()
        self.starts: list[tuple[float, str, bool]] = []

    def target(
        self, node_id: str, script: Callable[[FakeAttempt], object] | None = None
    ) -> FakeTarget:
        def record(attempt: FakeAttempt) -> None:
            self.starts.append((self.clock.seconds(), attempt.node_id, attempt.final))
            if script is not None:
                script(attempt)

        return FakeTarget(node_id, record)

    def advance(self, amount: float) -> None:
        """
        Like C{Clock.advance}, but each delayed call runs at its own time
        (C{Clock.advance} runs them all at the new time).
        """
        until = self.clock.seconds() + amount
        while True:
            due = [
                call.getTime()
                for call in self.clock.getDelayedCalls()
                if call.getTime() <= until
            ]
            if not due:
                break
            self.clock.rightNow = max(self.clock.rightNow, min(due))
            self.clock.advance(0)
        self.clock.rightNow = until

    def dispatch(
        self, inference: bool = True, present: bool = False
    ) -> Deferred[JobOutcome]:
        """
        Dispatch one job; with C{present}, the job asks the discovery
        whether a node is still in it (as the facades do) instead of
        resolving again.
        """
        return self.dispatcher.dispatch(
            self.discovery.resolve,
            self.sink,
            inference=inference,
            observer=self.observer,
            subscribe=self.discovery.subscribe,
            present=self._present if present else None,
        )

    def _present(self, node_id: str) -> bool:
        return node_id in {t.node_id for t in self.discovery.targets}

    def after(
        self, delay: float, action: Callable[[FakeAttempt], object]
    ) -> Callable[[FakeAttempt], None]:
        """A script that acts on each attempt C{delay} seconds after start."""

        def script(attempt: FakeAttempt) -> None:
            self.clock.callLater(delay, action, attempt)

        return script


def _status(code: int, inference: bool = True) -> Callable[[FakeAttempt], None]:
    return lambda attempt: attempt.respond(code, inference)


def _fail(
    kind: FailureKind, status: int | None = None
) -> Callable[[FakeAttempt], None]:
    def script(attempt: FakeAttempt) -> None:
        attempt.fail(kind, status)

    return script


def _dispatches(*nodes: str) -> list[tuple[object, ...]]:
    """The observer events of failed non-final attempts on C{nodes}."""
    events: list[tuple[object, ...]] = []
    for number, node in enumerate(nodes, 1):
        events += [("dispatching", node, number), T_BETWEEN]
    return events


class StatusTests(SynchronousTestCase):
    """
    L{is_retryable_status}: the pre-commit column of §5.4.
    """

    def test_table(self) -> None:
        for status in range(100, 600):
            for inference in (True, False):
                expected = (
                    (status == 404 and inference)
                    or status in (408, 429)
                    or 500 <= status <= 599
                )
                self.assertEqual(
                    is_retryable_status(status, inference),
                    expected,
                    (status, inference),
                )

    def test_rows(self) -> None:
        self.assertEqual(
            [is_retryable_status(s, True) for s in (200, 204, 302, 400, 401, 403)],
            [False] * 6,
        )
        self.assertEqual(
            [is_retryable_status(s, True) for s in (404, 408, 429, 500, 502, 503)],
            [True] * 6,
        )
        self.assertFalse(is_retryable_status(404, False))
        self.assertTrue(is_retryable_status(503, False))


class PolicyTests(SynchronousTestCase):
    def test_defaults(self) -> None:
        policy = DispatchPolicy()
        self.assertEqual(
            (policy.max_attempts, policy.deadline, policy.backoff, policy.jitter),
            (5, 600.0, (0.5, 1.0, 2.0, 4.0), 0.2),
        )

    def test_jitter(self) -> None:
        """
        random() in [0, 1) maps to a factor in [1 - jitter, 1 + jitter); the
        last backoff value repeats.
        """
        policy = DispatchPolicy()
        self.assertEqual(policy.delay(0, 0.5), 0.5)
        self.assertAlmostEqual(policy.delay(0, 0.0), 0.4)
        self.assertAlmostEqual(policy.delay(1, 0.75), 1.1)
        self.assertAlmostEqual(policy.delay(3, 0.5), 4.0)
        self.assertAlmostEqual(policy.delay(9, 0.5), 4.0)
        self.assertLess(policy.delay(9, 0.999999), 4.8)

    def test_validation(self) -> None:
        bads: list[dict[str, object]] = [
            {"max_attempts": 0},
            {"deadline": 0.0},
            {"backoff": ()},
            {"backoff": (1.0, 0.0)},
            {"backoff": (-1.0, 1.0)},
            {"jitter": 1.0},
            {"jitter": -0.1},
            {"retry_after": -1},
        ]
        for bad in bads:
            self.assertRaises(ValueError, DispatchPolicy, **bad)
        self.assertEqual(DispatchPolicy(backoff=[0, 1]).backoff, (0.0, 1.0))


class RejectReasonTests(SynchronousTestCase):
    def test_table(self) -> None:
        self.assertEqual(
            {r: (r.status, r.retry_later) for r in RejectReason},
            {
                RejectReason.NO_OWNER_AT_ADMISSION: (502, False),
                RejectReason.TRANSPORT_FINAL: (502, False),
                RejectReason.TARGET_LOST_FINAL: (502, False),
                RejectReason.NO_CONTENT_FINAL: (504, False),
                RejectReason.DEADLINE: (503, True),
                RejectReason.NO_OWNER: (503, True),
                RejectReason.EXHAUSTED: (503, True),
                RejectReason.SHUTDOWN: (503, True),
            },
        )
        self.assertEqual(
            RejectReason.DEADLINE.message, "deadline passed while attempts were failing"
        )
        self.assertEqual(RejectReason.NO_OWNER.message, "no owner became available")
        self.assertEqual(
            RejectReason.EXHAUSTED.message, "every dispatch attempt failed"
        )
        self.assertEqual(len({r.message for r in RejectReason}), len(RejectReason))


class CommitTests(SynchronousTestCase):
    """
    Commit ends the retrying; the outcome follows the stream's end (§5.4).
    """

    def test_first_attempt_completes(self) -> None:
        h = Harness()
        a = h.target("a")
        h.discovery.set(a)
        d = h.dispatch()
        self.assertNoResult(d)
        self.assertEqual(h.starts, [(0.0, "a", False)])
        a.last.commit(200)
        self.assertNoResult(d)
        self.assertEqual(h.dispatcher.inflight(), 1)
        a.last.end(StreamEnd.COMPLETE)
        outcome = JobOutcome("completed", 200, "a", 1, "complete")
        self.assertEqual(self.successResultOf(d), outcome)
        self.assertEqual(
            h.observer.events,
            [
                T_ADMITTED,
                ("dispatching", "a", 1),
                ("committed", "a", 200),
                ("finished", outcome),
            ],
        )
        self.assertEqual(h.sink.rejections, [])
        self.assertEqual(h.clock.getDelayedCalls(), [])
        self.assertEqual(h.dispatcher.inflight(), 0)
        self.assertEqual(h.discovery.subscribers, [])

    def test_truncated_2xx_is_completed(self) -> None:
        h = Harness()
        h.discovery.set(h.target("a", lambda at: at.commit(200)))
        d = h.dispatch()
        h.discovery.targets[0].last.end(StreamEnd.TRUNCATED)
        self.assertEqual(
            self.successResultOf(d), JobOutcome("completed", 200, "a", 1, "truncated")
        )

    def test_committed_non_2xx_is_failed(self) -> None:
        """
        A non-retryable status commits at once with budget left; committed
        non-2xx (3xx, 4xx) is failed.
        """
        for status in (302, 400, 401):
            h = Harness()
            h.discovery.set(h.target("a", _status(status)), h.target("b"))
            d = h.dispatch()
            h.discovery.targets[0].last.end()
            self.assertEqual(
                self.successResultOf(d),
                JobOutcome("failed", status, "a", 1, "complete"),
            )
            self.assertEqual(h.discovery.targets[1].attempts, [])

    def test_client_gone_while_streaming(self) -> None:
        h = Harness()
        h.discovery.set(h.target("a", lambda at: at.commit(200)))
        d = h.dispatch()
        h.discovery.targets[0].last.end(StreamEnd.CLIENT_GONE)
        self.assertEqual(
            self.successResultOf(d), JobOutcome("cancelled", 200, "a", 1, "client_gone")
        )

    def test_no_dispatch_after_commit(self) -> None:
        """
        Discovery changes and time after commit change nothing.
        """
        h = Harness()
        a, b = h.target("a", lambda at: at.commit(200)), h.target("b")
        h.discovery.set(a, b)
        d = h.dispatch()
        h.discovery.set(b)
        h.advance(10_000)
        self.assertEqual(a.last.calls, [])
        self.assertEqual(len(h.starts), 1)
        a.last.end()
        self.assertEqual(self.successResultOf(d).state, "completed")

    def test_stream_errback_is_truncated(self) -> None:
        h = Harness()
        h.discovery.set(h.target("a", lambda at: at.commit(200)))
        d = h.dispatch()
        h.discovery.targets[0].last.done.errback(RuntimeError("boom"))
        self.assertEqual(self.successResultOf(d).reason, "truncated")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class BoundsTests(SynchronousTestCase):
    """
    §5.1: dispatch budget, deadline, backoff between rounds.
    """

    def test_five_fast_503s(self) -> None:
        """
        With one owner, all five attempts go to it; the fifth is final and
        answers for itself: its 503 passes through, no proxy 503.
        """
        h = Harness()
        a = h.target("a", _status(503))
        h.discovery.set(a)
        d = h.dispatch()
        h.advance(0.5 + 1.0 + 2.0 + 4.0)
        self.assertEqual(
            h.starts,
            [
                (0.0, "a", False),
                (0.5, "a", False),
                (1.5, "a", False),
                (3.5, "a", False),
                (7.5, "a", True),
            ],
        )
        a.last.end()
        outcome = JobOutcome(
            "failed",
            503,
            "a",
            5,
            "complete",
            (AttemptFailed("a", FailureKind.STATUS, 503),) * 4,
        )
        self.assertEqual(self.successResultOf(d), outcome)
        self.assertEqual(h.sink.rejections, [])
        self.assertEqual(
            h.observer.events,
            [
                T_ADMITTED,
                *_dispatches("a", "a", "a", "a"),
                ("dispatching", "a", 5),
                ("committed", "a", 503),
                ("finished", outcome),
            ],
        )
        self.assertEqual(h.clock.getDelayedCalls(), [])

    def test_failover_within_round_is_immediate(self) -> None:
        """
        A round tries the resolver's candidates in order with no backoff;
        the backoff comes between rounds, and each round re-resolves.
        """
        h = Harness()
        a, b = h.target("a", _status(503)), h.target("b", _status(502))
        h.discovery.set(a, b)
        d = h.dispatch()
        self.assertEqual(h.starts, [(0.0, "a", False), (0.0, "b", False)])
        self.assertEqual(h.discovery.resolutions, 1)
        h.advance(0.5)
        self.assertEqual(h.starts[2:], [(0.5, "a", False), (0.5, "b", False)])
        self.assertEqual(h.discovery.resolutions, 2)
        h.advance(1.0)
        self.assertEqual(h.starts[4:], [(1.5, "a", True)])
        a.last.end()
        self.assertEqual(self.successResultOf(d).status, 503)

    def test_resolved_fresh_every_round(self) -> None:
        """
        A node that appears mid-retry is tried in the next round.
        """
        h = Harness()
        a = h.target("a", _status(500))
        b = h.target("b", lambda at: at.commit(200))
        h.discovery.set(a)
        d = h.dispatch()
        h.discovery.targets = [b, a]
        h.advance(0.5)
        self.assertEqual(h.starts, [(0.0, "a", False), (0.5, "b", False)])
        b.last.end()
        self.assertEqual(
            self.successResultOf(d),
            JobOutcome(
                "completed",
                200,
                "b",
                2,
                "complete",
                (AttemptFailed("a", FailureKind.STATUS, 500),),
            ),
        )

    def test_backoff_jitter(self) -> None:
        """
        Backoff values are jittered by the injected random source; the last
        value repeats.
        """
        h = Harness(
            DispatchPolicy(max_attempts=6, backoff=(1.0, 2.0)),
            _cycle([0.0, 0.999, 0.25]),
        )
        h.discovery.set(h.target("a", _status(503)))
        h.dispatch()
        h.advance(100)
        times = [t for t, _, _ in h.starts]
        gaps = [round(b - a, 6) for a, b in pairwise(times)]
        self.assertEqual(
            gaps, [0.8, round(2.0 * 1.1996, 6), 1.8, 1.6, round(2.0 * 1.1996, 6)]
        )

    def test_slow_failures_hit_the_deadline(self) -> None:
        """
        §5.1 worked example: at 240 s per attempt the fourth dispatch would
        start past 600 s, so the job ends after three attempts with 503
        DEADLINE and budget unspent.
        """
        h = Harness()
        a = h.target("a", h.after(240, lambda at: at.fail(FailureKind.NO_CONTENT, 200)))
        h.discovery.set(a)
        d = h.dispatch()
        h.advance(240)
        h.advance(0.5)
        h.advance(240)
        h.advance(1.0)
        self.assertNoResult(d)
        h.advance(240)
        self.assertEqual(
            h.starts, [(0.0, "a", False), (240.5, "a", False), (481.5, "a", False)]
        )
        self.assertEqual(h.sink.rejections, [(503, RejectReason.DEADLINE, 5)])
        outcome = self.successResultOf(d)
        self.assertEqual(
            (outcome.state, outcome.status, outcome.attempts, outcome.reason),
            ("failed", 503, 3, "deadline"),
        )
        self.assertEqual(h.observer.events[-1], ("finished", outcome))
        self.assertEqual(h.clock.seconds(), 721.5)
        self.assertEqual(h.clock.getDelayedCalls(), [])

    def test_in_flight_attempt_is_never_cut(self) -> None:
        """
        An attempt started just under the deadline runs to its end and is
        served.
        """
        h = Harness()
        first = h.after(599, lambda at: at.fail(FailureKind.TRANSPORT))
        a = h.target("a", lambda at: None if len(h.starts) > 1 else first(at))
        h.discovery.set(a)
        d = h.dispatch()
        h.advance(599.5)
        self.assertEqual(h.starts[-1], (599.5, "a", False))
        h.advance(3000)
        self.assertNoResult(d)
        a.last.commit(200)
        a.last.end()
        self.assertEqual(self.successResultOf(d).state, "completed")

    def test_no_dispatch_at_the_deadline(self) -> None:
        """
        A failure at exactly the deadline does not fail over, even within
        the round: 503 DEADLINE.
        """
        h = Harness()
        a = h.target("a", h.after(600, lambda at: at.fail(FailureKind.TRANSPORT)))
        b = h.target("b")
        h.discovery.set(a, b)
        d = h.dispatch()
        h.advance(600)
        self.assertEqual(b.attempts, [])
        self.assertEqual(h.sink.rejections, [(503, RejectReason.DEADLINE, 5)])
        self.assertEqual(self.successResultOf(d).reason, "deadline")

    def test_backoff_crossing_the_deadline(self) -> None:
        """
        A backoff that would end past the deadline ends at it, and the job
        answers 503 there.
        """
        h = Harness()
        a = h.target("a", h.after(599.8, lambda at: at.fail(FailureKind.TRANSPORT)))
        h.discovery.set(a)
        d = h.dispatch()
        h.advance(599.8)
        self.assertNoResult(d)
        self.assertEqual(len(h.clock.getDelayedCalls()), 1)
        h.advance(0.2)
        self.assertEqual(h.sink.rejections, [(503, RejectReason.DEADLINE, 5)])
        self.assertEqual(self.successResultOf(d).attempts, 1)
        self.assertEqual(h.clock.getDelayedCalls(), [])

    def test_created_at(self) -> None:
        """
        The deadline counts from the request's creation; a job admitted past
        it dispatches nothing.
        """
        h = Harness()
        h.advance(1000)
        h.discovery.set(
            h.target("a", h.after(60, lambda at: at.fail(FailureKind.TRANSPORT)))
        )
        d = h.dispatcher.dispatch(
            h.discovery.resolve, h.sink, inference=True, created_at=500.0
        )
        h.advance(200)
        self.assertEqual(h.starts, [(1000.0, "a", False), (1060.5, "a", False)])
        self.assertEqual(h.sink.rejections, [(503, RejectReason.DEADLINE, 5)])
        self.assertEqual(self.successResultOf(d).attempts, 2)

        late = h.dispatcher.dispatch(
            h.discovery.resolve, h.sink, inference=True, created_at=0.0
        )
        self.assertEqual(self.successResultOf(late).reason, "deadline")
        self.assertEqual(len(h.starts), 2)


class OwnerTests(SynchronousTestCase):
    """
    Waiting for an owner (§5.1) and target loss (§5.3).
    """

    def test_no_owner_at_admission(self) -> None:
        h = Harness()
        d = h.dispatch()
        outcome = JobOutcome("failed", 502, None, 0, "no_owner_at_admission")
        self.assertEqual(self.successResultOf(d), outcome)
        self.assertEqual(
            h.sink.rejections, [(502, RejectReason.NO_OWNER_AT_ADMISSION, None)]
        )
        self.assertEqual(h.observer.events, [T_ADMITTED, ("finished", outcome)])
        self.assertEqual(h.clock.getDelayedCalls(), [])

    def test_sole_owner_leaves_for_good(self) -> None:
        """
        The only owner drops out after one dispatch: the watcher cancels the
        attempt, the job waits (re-resolving, costing no attempt) until the
        deadline, then 503 NO_OWNER.
        """
        h = Harness()
        a = h.target("a")
        h.discovery.set(a)
        d = h.dispatch()
        h.advance(3)
        h.discovery.set()
        self.assertEqual(a.last.calls, ["cancel"])
        self.assertEqual(a.last.state, "cancelled")
        h.advance(596.9)
        self.assertNoResult(d)
        h.advance(0.1)
        self.assertEqual(h.clock.seconds(), 600.0)
        self.assertEqual(h.sink.rejections, [(503, RejectReason.NO_OWNER, 5)])
        outcome = JobOutcome(
            "failed",
            503,
            None,
            1,
            "no_owner",
            (AttemptFailed("a", FailureKind.TARGET_LOST),),
        )
        self.assertEqual(self.successResultOf(d), outcome)
        self.assertEqual(
            h.observer.events,
            [T_ADMITTED, *_dispatches("a"), ("finished", outcome)],
        )
        self.assertGreater(h.discovery.resolutions, 100)
        self.assertEqual(h.clock.getDelayedCalls(), [])
        self.assertEqual(h.discovery.subscribers, [])

    def test_owner_returns(self) -> None:
        """
        An owner that comes back before the deadline is dispatched on the
        next re-resolution; the wait cost no attempt.
        """
        h = Harness()
        a = h.target("a")
        h.discovery.set(a)
        d = h.dispatch()
        a.last.fail(FailureKind.TRANSPORT)
        h.discovery.set()
        h.advance(300)
        self.assertEqual(len(a.attempts), 1)
        h.discovery.set(a)
        h.advance(4)
        self.assertEqual(len(a.attempts), 2)
        self.assertFalse(a.last.final)
        a.last.commit(200)
        a.last.end()
        outcome = self.successResultOf(d)
        self.assertEqual((outcome.state, outcome.attempts), ("completed", 2))
        self.assertEqual(h.sink.rejections, [])

    def test_target_lost_fails_over(self) -> None:
        """
        Losing the in-flight attempt's node cancels only that attempt; the
        next candidate is tried at once.
        """
        h = Harness()
        a, b = h.target("a"), h.target("b")
        h.discovery.set(a, b)
        d = h.dispatch()
        h.discovery.set(b)
        self.assertEqual(a.last.calls, ["cancel"])
        self.assertEqual(h.starts, [(0.0, "a", False), (0.0, "b", False)])
        h.discovery.set(b)
        self.assertEqual(b.last.calls, [])
        b.last.commit(200)
        b.last.end()
        self.assertEqual(self.successResultOf(d).node_id, "b")

    def test_jobs_share_one_subscription(self) -> None:
        """
        Jobs dispatched with the same C{subscribe} hold one registration,
        made for the first and undone when the last ends; a change reaches
        each running job, and a job that ended is no longer told.
        """
        h = Harness()
        a, b = h.target("a"), h.target("b")
        h.discovery.set(a, b)
        first, second = h.dispatch(), h.dispatch()
        self.assertEqual(len(h.discovery.subscribers), 1)
        first_attempt, second_attempt = a.attempts
        first_attempt.commit(200)
        first_attempt.end()
        self.assertEqual(self.successResultOf(first).state, "completed")
        self.assertEqual(len(h.discovery.subscribers), 1)
        h.discovery.set(b)
        self.assertEqual(first_attempt.calls, [])
        self.assertEqual(second_attempt.calls, ["cancel"])
        b.last.commit(200)
        b.last.end()
        self.assertEqual(self.successResultOf(second).node_id, "b")
        self.assertEqual(h.discovery.subscribers, [])
        third = h.dispatch()
        self.assertEqual(len(h.discovery.subscribers), 1)
        b.last.commit(200)
        b.last.end()
        self.successResultOf(third)
        self.assertEqual(h.discovery.subscribers, [])

    def test_asynchronous_cancel(self) -> None:
        """
        cancel() may report TARGET_LOST later; a second discovery change does
        not cancel twice.
        """
        h = Harness()
        a = h.target("a", lambda at: setattr(at, "cancel_synchronously", False))
        h.discovery.set(a)
        d = h.dispatch()
        h.discovery.set()
        h.discovery.set()
        self.assertEqual(a.last.calls, ["cancel"])
        a.last.finish_cancel()
        h.discovery.set(a)
        h.advance(0.5)
        self.assertEqual(len(a.attempts), 2)
        a.last.commit(200)
        a.last.end()
        self.assertEqual(self.successResultOf(d).attempts, 2)

    def test_departed_node_of_the_round_is_skipped(self) -> None:
        """
        A node of the round that left discovery while another attempt was
        in flight is not dispatched to when that attempt fails (its answer
        would be thrown away at the next discovery change): the job backs
        off and resolves again.
        """
        h = Harness()
        a, b = h.target("a"), h.target("b")
        h.discovery.set(a, b)
        d = h.dispatch(present=True)
        h.discovery.set(a)  # b leaves; a, in flight, stays
        self.assertEqual(a.last.calls, [])
        a.last.fail(FailureKind.TRANSPORT)
        self.assertEqual(b.attempts, [])
        self.assertEqual(len(h.clock.getDelayedCalls()), 1)  # the backoff
        h.advance(1)
        self.assertEqual([node for _, node, _ in h.starts], ["a", "a"])
        a.last.commit(200)
        a.last.end()
        outcome = self.successResultOf(d)
        self.assertEqual((outcome.node_id, outcome.attempts), ("a", 2))
        self.assertEqual(b.attempts, [])

    def test_present_node_of_the_round_is_tried_at_once(self) -> None:
        """With the presence check, a round's node still there is failed
        over to at once, as without it."""
        h = Harness()
        a, b = h.target("a"), h.target("b")
        h.discovery.set(a, b)
        d = h.dispatch(present=True)
        a.last.fail(FailureKind.TRANSPORT)
        self.assertEqual(h.starts, [(0.0, "a", False), (0.0, "b", False)])
        b.last.commit(200)
        b.last.end()
        self.assertEqual(self.successResultOf(d).node_id, "b")

    def test_commit_races_discovery_loss(self) -> None:
        """
        The first byte claimed the attempt before the watcher: cancel() is a
        no-op, and the request is served, not retried.
        """
        h = Harness()
        a, b = h.target("a"), h.target("b")
        h.discovery.set(a, b)
        d = h.dispatch()
        self.assertTrue(a.last.claim_commit(200))
        h.discovery.set(b)
        self.assertEqual(a.last.calls, ["cancel"])
        a.last.deliver_commit()
        a.last.end()
        self.assertEqual(
            self.successResultOf(d), JobOutcome("completed", 200, "a", 1, "complete")
        )
        self.assertEqual(b.attempts, [])

    def test_discovery_loss_wins_the_claim(self) -> None:
        """
        If the watcher claims first, a first byte arriving later is ignored
        by the attempt; the job retries.
        """
        h = Harness()
        a, b = h.target("a"), h.target("b")
        h.discovery.set(a, b)
        d = h.dispatch()
        first = a.last
        h.discovery.set(b)
        self.assertFalse(first.claim_commit(200))
        b.last.commit(200)
        b.last.end()
        self.assertEqual(self.successResultOf(d).node_id, "b")


class FinalAttemptTests(SynchronousTestCase):
    """
    The final permitted attempt answers for itself (§5.4).
    """

    def run_job(
        self, script: Callable[[FakeAttempt], None], max_attempts: int = 5
    ) -> tuple[Harness, JobOutcome]:
        h = Harness(DispatchPolicy(max_attempts=max_attempts))
        h.discovery.set(h.target("a", script))
        d = h.dispatch()
        h.advance(100)
        return h, self.successResultOf(d)

    def test_no_content_retried_then_504(self) -> None:
        h, outcome = self.run_job(_fail(FailureKind.NO_CONTENT))
        self.assertEqual([s[2] for s in h.starts], [False] * 4 + [True])
        self.assertEqual(
            h.sink.rejections, [(504, RejectReason.NO_CONTENT_FINAL, None)]
        )
        self.assertEqual(
            (outcome.state, outcome.status, outcome.attempts, outcome.reason),
            ("failed", 504, 5, "no_content_final"),
        )
        self.assertEqual(len(outcome.failures), 5)
        self.assertEqual(
            h.observer.events,
            [
                T_ADMITTED,
                *_dispatches("a", "a", "a", "a"),
                ("dispatching", "a", 5),
                ("finished", outcome),
            ],
        )

    def test_transport_final_502(self) -> None:
        h, outcome = self.run_job(_fail(FailureKind.TRANSPORT), max_attempts=2)
        self.assertEqual(h.sink.rejections, [(502, RejectReason.TRANSPORT_FINAL, None)])
        self.assertEqual((outcome.status, outcome.attempts), (502, 2))

    def test_target_lost_final_502(self) -> None:
        """
        Cancelled by us with the budget spent: 502.
        """
        h = Harness(DispatchPolicy(max_attempts=1))
        a = h.target("a")
        h.discovery.set(a)
        d = h.dispatch()
        self.assertTrue(a.last.final)
        h.discovery.set()
        self.assertEqual(
            h.sink.rejections, [(502, RejectReason.TARGET_LOST_FINAL, None)]
        )
        self.assertEqual(self.successResultOf(d).reason, "target_lost_final")

    def test_final_status_failure_is_exhausted(self) -> None:
        """
        The guard: a final attempt that reports a retryable status instead
        of committing it leaves nothing to answer: 503 EXHAUSTED.
        """
        h, outcome = self.run_job(
            _fail(FailureKind.STATUS, 503),
            max_attempts=2,
        )
        self.assertEqual(h.sink.rejections, [(503, RejectReason.EXHAUSTED, 5)])
        self.assertEqual(outcome.reason, "exhausted")

    def test_final_commits_anything(self) -> None:
        h = Harness(DispatchPolicy(max_attempts=1))
        h.discovery.set(h.target("a", _status(429)))
        d = h.dispatch()
        h.discovery.targets[0].last.end()
        self.assertEqual(
            self.successResultOf(d), JobOutcome("failed", 429, "a", 1, "complete")
        )


class NonInferenceTests(SynchronousTestCase):
    """
    §5.1: resolve once, each candidate at most once, no backoff, no
    deadline; the last candidate is final.
    """

    def test_each_candidate_once(self) -> None:
        h = Harness()
        a, b, c = (h.target(n, _status(503)) for n in "abc")
        h.discovery.set(a, b, c)
        d = h.dispatch(inference=False)
        self.assertEqual(
            h.starts, [(0.0, "a", False), (0.0, "b", False), (0.0, "c", True)]
        )
        c.last.end()
        self.assertEqual(self.successResultOf(d).status, 503)
        self.assertEqual(h.discovery.resolutions, 1)
        self.assertEqual(h.clock.getDelayedCalls(), [])

    def test_pull_never_started_twice(self) -> None:
        """
        A single owner answering 503 to POST /api/pull: one attempt, final,
        its answer passed through; 404 is not retried either.
        """
        for status in (503, 404):
            h = Harness()
            a = h.target("a", _status(status, inference=False))
            h.discovery.set(a)
            d = h.dispatch(inference=False)
            h.advance(1000)
            self.assertEqual(h.starts, [(0.0, "a", True)])
            a.last.end()
            self.assertEqual(self.successResultOf(d).status, status)

    def test_capped_by_max_attempts(self) -> None:
        h = Harness(DispatchPolicy(max_attempts=2))
        targets = [h.target(n, _fail(FailureKind.TRANSPORT)) for n in "abc"]
        h.discovery.set(*targets)
        d = h.dispatch(inference=False)
        self.assertEqual(h.starts, [(0.0, "a", False), (0.0, "b", True)])
        self.assertEqual(self.successResultOf(d).reason, "transport_final")

    def test_no_deadline(self) -> None:
        h = Harness()
        a = h.target("a", h.after(700, lambda at: at.fail(FailureKind.TRANSPORT)))
        b = h.target("b", h.after(700, lambda at: at.commit(200)))
        h.discovery.set(a, b)
        d = h.dispatch(inference=False)
        h.advance(700)
        h.advance(700)
        self.assertEqual(h.starts, [(0.0, "a", False), (700.0, "b", True)])
        b.last.end()
        self.assertEqual(self.successResultOf(d).state, "completed")

    def test_no_owner(self) -> None:
        h = Harness()
        d = h.dispatch(inference=False)
        self.assertEqual(self.successResultOf(d).status, 502)

    def test_lost_target_is_not_re_resolved(self) -> None:
        h = Harness()
        a, b = h.target("a"), h.target("b")
        h.discovery.set(a)
        d = h.dispatch(inference=False)
        self.assertTrue(a.last.final)
        h.discovery.set(b)
        self.assertEqual(b.attempts, [])
        self.assertEqual(self.successResultOf(d).reason, "target_lost_final")


class CancellationTests(SynchronousTestCase):
    """
    §5.3: the client going away ends the job at once; shutdown cancels.
    """

    def assert_cancelled(
        self, h: Harness, d: Deferred[JobOutcome], expected: JobOutcome
    ) -> None:
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(h.observer.outcomes, [expected])
        self.assertEqual(h.sink.rejections, [])
        self.assertEqual(h.clock.getDelayedCalls(), [])
        self.assertEqual(h.dispatcher.inflight(), 0)
        self.assertEqual(h.discovery.subscribers, [])

    def test_in_flight(self) -> None:
        h = Harness()
        a = h.target("a")
        h.discovery.set(a)
        d = h.dispatch()
        self.assert_cancelled(
            h, d, JobOutcome("cancelled", None, None, 1, "client_gone")
        )
        self.assertEqual(a.last.calls, ["abort"])
        self.assertEqual(a.last.state, "aborted")

    def test_during_backoff(self) -> None:
        h = Harness()
        a = h.target("a", _status(503))
        h.discovery.set(a)
        d = h.dispatch()
        self.assertEqual(len(h.clock.getDelayedCalls()), 1)
        self.assert_cancelled(
            h,
            d,
            JobOutcome(
                "cancelled",
                None,
                None,
                1,
                "client_gone",
                (AttemptFailed("a", FailureKind.STATUS, 503),),
            ),
        )
        h.advance(1000)
        self.assertEqual(len(a.attempts), 1)

    def test_waiting_for_owner(self) -> None:
        h = Harness()
        a = h.target("a")
        h.discovery.set(a)
        d = h.dispatch()
        h.discovery.set()
        h.advance(30)
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(h.observer.outcomes[0].reason, "client_gone")
        self.assertEqual(h.clock.getDelayedCalls(), [])

    def test_while_streaming(self) -> None:
        h = Harness()
        a = h.target("a", lambda at: at.commit(200))
        h.discovery.set(a)
        d = h.dispatch()
        self.assert_cancelled(h, d, JobOutcome("cancelled", 200, "a", 1, "client_gone"))
        self.assertEqual((a.last.calls, a.last.state), (["abort"], "aborted"))

    def test_cancel_from_an_observer_hook(self) -> None:
        """
        A hook that cancels the job (re-entrantly, mid-transition) ends it
        once, cleanly, and nothing more is dispatched.
        """
        h = Harness()
        jobs: list[Deferred[JobOutcome]] = []

        class Canceller(RecordingObserver):
            def between_attempts(self) -> None:
                super().between_attempts()
                jobs[0].cancel()

        h.observer = Canceller()
        a, b = h.target("a"), h.target("b")
        h.discovery.set(a, b)
        jobs.append(h.dispatch())
        a.last.fail(FailureKind.TRANSPORT)
        self.failureResultOf(jobs[0], CancelledError)
        self.assertEqual(b.attempts, [])
        outcome = JobOutcome(
            "cancelled",
            None,
            None,
            1,
            "client_gone",
            (AttemptFailed("a", FailureKind.TRANSPORT),),
        )
        self.assertEqual(
            h.observer.events,
            [T_ADMITTED, *_dispatches("a"), ("finished", outcome)],
        )
        self.assertEqual(h.clock.getDelayedCalls(), [])

    def test_shutdown_in_flight(self) -> None:
        h = Harness()
        a, b = h.target("a"), h.target("b", lambda at: at.commit(200))
        h.discovery.set(a)
        d1 = h.dispatch()
        h.discovery.targets = [b]
        d2 = h.dispatch()
        self.assertEqual(h.dispatcher.inflight(), 2)
        h.dispatcher.shutdown()
        self.assertEqual(
            self.successResultOf(d1), JobOutcome("cancelled", 503, None, 1, "shutdown")
        )
        self.assertEqual(
            self.successResultOf(d2), JobOutcome("cancelled", 200, "b", 1, "shutdown")
        )
        self.assertEqual(h.sink.rejections, [(503, RejectReason.SHUTDOWN, 5)])
        self.assertEqual((a.last.calls, b.last.calls), (["abort"], ["abort"]))
        self.assertEqual(h.dispatcher.inflight(), 0)
        self.assertEqual(h.clock.getDelayedCalls(), [])

    def test_shutdown_during_backoff(self) -> None:
        h = Harness()
        h.discovery.set(h.target("a", _status(503)))
        d = h.dispatch()
        h.dispatcher.shutdown()
        self.assertEqual(self.successResultOf(d).reason, "shutdown")
        self.assertEqual(h.clock.getDelayedCalls(), [])

    def test_refused_after_shutdown(self) -> None:
        h = Harness()
        a = h.target("a")
        h.discovery.set(a)
        h.dispatcher.shutdown()
        d = h.dispatch()
        outcome = JobOutcome("cancelled", 503, None, 0, "shutdown")
        self.assertEqual(self.successResultOf(d), outcome)
        self.assertEqual(a.attempts, [])
        self.assertEqual(h.observer.events, [T_ADMITTED, ("finished", outcome)])


class DefensiveTests(SynchronousTestCase):
    """
    Contract violations by collaborators are logged and absorbed.
    """

    def test_start_raises(self) -> None:
        h = Harness()
        bad = FakeTarget("bad", raises=RuntimeError("no"))
        good = h.target("good", lambda at: at.commit(200))
        h.discovery.set(bad, good)
        d = h.dispatch()
        good.last.end()
        outcome = self.successResultOf(d)
        self.assertEqual((outcome.attempts, outcome.node_id), (2, "good"))
        self.assertEqual(
            outcome.failures, (AttemptFailed("bad", FailureKind.TRANSPORT),)
        )
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_result_errbacks(self) -> None:
        h = Harness(DispatchPolicy(max_attempts=1))
        h.discovery.set(h.target("a", lambda at: at.result.errback(RuntimeError("x"))))
        d = h.dispatch()
        self.assertEqual(self.successResultOf(d).reason, "transport_final")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_resolver_raises(self) -> None:
        h = Harness()

        def resolver() -> list[Target]:
            raise RuntimeError("broken")

        d = h.dispatcher.dispatch(resolver, h.sink, inference=True)
        self.assertEqual(self.successResultOf(d).status, 502)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_observer_and_sink_raise(self) -> None:
        class Broken(NullJobObserver):
            def admitted(self) -> None:
                raise RuntimeError("observer")

            def finished(self, outcome: JobOutcome) -> None:
                raise RuntimeError("observer")

        class BrokenSink:
            def reject(
                self, status: int, reason: RejectReason, retry_after: int | None
            ) -> None:
                raise RuntimeError("sink")

        from twisted.internet.testing import EventLoggingObserver
        from twisted.logger import globalLogPublisher

        logged = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        h = Harness()
        d = h.dispatcher.dispatch(
            h.discovery.resolve, BrokenSink(), inference=True, observer=Broken()
        )
        self.assertEqual(self.successResultOf(d).status, 502)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 3)
        self.assertEqual(
            sorted(e["what"] for e in logged if "what" in e),
            ["observer.admitted", "observer.finished", "sink.reject"],
        )

    def test_subscribe_notifies_at_once(self) -> None:
        """
        A discovery that calls back while subscribing does no harm.
        """
        h = Harness()
        h.discovery.set(h.target("a", lambda at: at.commit(200)))

        def subscribe(callback: Callable[[], None]) -> Callable[[], None]:
            callback()
            return h.discovery.subscribe(callback)

        d = h.dispatcher.dispatch(
            h.discovery.resolve, h.sink, inference=True, subscribe=subscribe
        )
        h.discovery.targets[0].last.end()
        self.assertEqual(self.successResultOf(d).state, "completed")
        self.assertEqual(h.discovery.subscribers, [])

    def test_duplicate_candidates(self) -> None:
        h = Harness()
        a = h.target("a", _status(503))
        h.discovery.set(a, a)
        h.dispatch()
        self.assertEqual(len(a.attempts), 1)


# -- properties -------------------------------------------------------------


class _Run:
    """
    One generated job: applies a fault schedule, records what happened, and
    checks the invariants as it goes.
    """

    def __init__(
        self,
        test: SynchronousTestCase,
        policy: DispatchPolicy,
        inference: bool,
        nodes: int,
        initial: frozenset[int],
        samples: list[float],
    ) -> None:
        self.test = test
        self.policy = policy
        self.inference = inference
        self.h = Harness(policy, _cycle(samples))
        self.attempts: list[FakeAttempt] = []
        self.dispatch_times: list[float] = []
        self.committed_at: int | None = None
        self.client_cancelled = False
        self.shut_down = False
        self.targets = [FakeTarget(f"n{i}", self._started) for i in range(nodes)]
        self.h.discovery.set(*(self.targets[i] for i in sorted(initial)))
        self.d = self.h.dispatch(inference)
        self.outcome: JobOutcome | None = None
        self.d.addBoth(self._ended)

    def _started(self, attempt: FakeAttempt) -> None:
        test = self.test
        test.assertIsNone(self.committed_at, "dispatch after commit")
        test.assertLess(len(self.attempts), self.policy.max_attempts)
        if self.inference:
            test.assertLess(self.h.clock.seconds(), self.policy.deadline)
        test.assertTrue(
            all(a.state not in ("pending", "committing") for a in self.attempts),
            "two attempts in flight",
        )
        self.attempts.append(attempt)
        self.dispatch_times.append(self.h.clock.seconds())

    def _ended(self, result: object) -> None:
        if isinstance(result, JobOutcome):
            self.outcome = result
        return None

    @property
    def finished(self) -> bool:
        return bool(self.h.observer.outcomes)

    def current(self, *states: str) -> FakeAttempt | None:
        if self.attempts and self.attempts[-1].state in states:
            return self.attempts[-1]
        return None

    def apply(self, action: Action) -> None:
        h = self.h
        verb = action[0]
        if verb == "advance":
            assert isinstance(action[1], float)
            h.advance(action[1])
        elif verb == "fail":
            if (attempt := self.current("pending")) is not None:
                assert isinstance(action[1], FailureKind)
                attempt.fail(action[1])
        elif verb == "respond":
            if (attempt := self.current("pending")) is not None:
                assert isinstance(action[1], int)
                attempt.respond(action[1], self.inference)
        elif verb == "claim":
            if (attempt := self.current("pending")) is not None:
                attempt.claim_commit(200)
        elif verb == "deliver":
            if (attempt := self.current("committing")) is not None:
                attempt.deliver_commit()
        elif verb == "end":
            if (attempt := self.current("committed")) is not None:
                assert isinstance(action[1], StreamEnd)
                attempt.end(action[1])
        elif verb == "discovery":
            assert isinstance(action[1], frozenset)
            inflight = self.current("pending", "committing", "committed")
            before = (
                None if inflight is None else (inflight.state, list(inflight.calls))
            )
            h.discovery.set(*(self.targets[i] for i in sorted(action[1])))
            if inflight is not None and before is not None:
                # §5.3: a lost target's attempt is cancelled once, pre-commit
                # (as the dispatcher sees it); nothing else is.
                state, calls = before
                lost = inflight.node_id not in {t.node_id for t in h.discovery.targets}
                expected = (
                    lost
                    and state in ("pending", "committing")
                    and "cancel" not in calls
                )
                self.test.assertEqual(
                    inflight.calls, [*calls, "cancel"] if expected else calls
                )
        elif verb == "cancel":
            if not self.finished:
                self.client_cancelled = True
            self.d.cancel()
        elif verb == "shutdown":
            if not self.finished:
                self.shut_down = True
            h.dispatcher.shutdown()
        self.note_commit()

    def note_commit(self) -> None:
        for number, attempt in enumerate(self.attempts, 1):
            if attempt.state in ("committed",) and self.committed_at is None:
                self.committed_at = number

    def drive_to_end(self) -> None:
        for _ in range(1000):
            if self.finished:
                return
            if (attempt := self.current("committing")) is not None:
                attempt.deliver_commit()
            elif (attempt := self.current("committed")) is not None:
                attempt.end(StreamEnd.COMPLETE)
            elif (attempt := self.current("pending")) is not None:
                attempt.fail(FailureKind.TRANSPORT)
            else:
                self.h.advance(50.0)
            self.note_commit()
        self.test.fail("job never finished")

    def check(self) -> None:
        test, h, policy = self.test, self.h, self.policy
        events = h.observer.events
        outcomes = h.observer.outcomes
        test.assertEqual(len(outcomes), 1, "exactly one finished")
        test.assertEqual(events[0], T_ADMITTED)
        test.assertEqual(events[-1], ("finished", outcomes[0]))
        outcome = outcomes[0]
        test.assertEqual(h.clock.getDelayedCalls(), [])
        test.assertEqual(h.dispatcher.inflight(), 0)
        test.assertEqual(h.discovery.subscribers, [])
        test.assertLessEqual(len(self.attempts), policy.max_attempts)
        test.assertEqual(outcome.attempts, len(self.attempts))
        numbers = [e[2] for e in events if e[0] == "dispatching"]
        test.assertEqual(numbers, list(range(1, len(self.attempts) + 1)))
        finals = [a.final for a in self.attempts]
        if self.inference:
            test.assertEqual(
                finals, [n == policy.max_attempts for n in range(1, len(finals) + 1)]
            )
            for t in self.dispatch_times:
                test.assertLess(t, policy.deadline)
        else:
            test.assertNotIn(True, finals[:-1])
            test.assertEqual(
                len({a.node_id for a in self.attempts}), len(self.attempts)
            )
        # The final answer follows the tables.
        if self.client_cancelled:
            test.assertEqual(outcome.state, "cancelled")
            test.assertEqual(outcome.reason, "client_gone")
            self.d.addErrback(lambda f: f.trap(CancelledError))
            test.assertIsNone(self.outcome)
        else:
            test.assertEqual(self.outcome, outcome)
        committed = [e for e in events if e[0] == "committed"]
        rejections = h.sink.rejections
        if committed:
            test.assertEqual(len(committed), 1)
            _, node, status = committed[0]
            test.assertEqual(rejections, [])
            test.assertEqual((outcome.node_id, outcome.status), (node, status))
            assert isinstance(status, int)
            if (
                self.client_cancelled
                or self.shut_down
                or outcome.reason == "client_gone"
            ):
                test.assertEqual(outcome.state, "cancelled")
            elif 200 <= status < 300:
                test.assertEqual(outcome.state, "completed")
            else:
                test.assertEqual(outcome.state, "failed")
            last = self.attempts[-1]
            test.assertTrue(
                last.final
                or not is_retryable_status(status, self.inference)
                or last.status == 200
            )
        elif self.client_cancelled:
            test.assertEqual(rejections, [])
            test.assertEqual((outcome.status, outcome.node_id), (None, None))
        else:
            test.assertEqual(len(rejections), 1)
            status, reason, retry_after = rejections[0]
            test.assertEqual((outcome.status, outcome.reason), (status, reason.value))
            test.assertEqual(status, reason.status)
            test.assertEqual(retry_after, policy.retry_after if status == 503 else None)
            if self.shut_down:
                test.assertEqual(reason, RejectReason.SHUTDOWN)
                test.assertEqual(outcome.state, "cancelled")
                return
            test.assertEqual(outcome.state, "failed")
            if not self.attempts:
                test.assertEqual(reason, RejectReason.NO_OWNER_AT_ADMISSION)
            elif self.attempts[-1].final:
                kind = outcome.failures[-1].kind
                test.assertEqual(
                    reason,
                    {
                        FailureKind.TRANSPORT: RejectReason.TRANSPORT_FINAL,
                        FailureKind.NO_CONTENT: RejectReason.NO_CONTENT_FINAL,
                        FailureKind.TARGET_LOST: RejectReason.TARGET_LOST_FINAL,
                    }[kind],
                )
            else:
                test.assertTrue(self.inference)
                test.assertIn(reason, (RejectReason.DEADLINE, RejectReason.NO_OWNER))
                test.assertGreaterEqual(h.clock.seconds(), policy.deadline)


class PropertyTests(SynchronousTestCase):
    @settings(max_examples=400)
    @given(dispatch_schedules())
    def test_invariants(
        self,
        schedule: tuple[
            DispatchPolicy, bool, int, frozenset[int], list[Action], list[float]
        ],
    ) -> None:
        """
        Random attempt results, clock advances, discovery changes, client
        cancels and shutdowns: never more than max_attempts dispatches, none
        after commit, none at/after the deadline, exactly one finished, the
        answer follows the tables, no timers left.
        """
        policy, inference, nodes, initial, actions, samples = schedule
        run = _Run(self, policy, inference, nodes, initial, samples)
        for action in actions:
            run.apply(action)
        run.drive_to_end()
        run.check()
