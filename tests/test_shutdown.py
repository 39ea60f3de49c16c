"""
Tests for L{nvproxy.shutdown}: the drain on a Clock with the real
dispatcher and its fakes.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.dispatch import Dispatcher, DispatchPolicy, JobOutcome, RejectReason
from nvproxy.shutdown import FLUSH_TIMEOUT, Shutdown
from nvproxy.testing.dispatchfakes import (
    FakeAttempt,
    FakeDiscovery,
    FakeTarget,
    RecordingObserver,
    RecordingSink,
)


class _Parts:
    def __init__(self, grace: float = 30.0) -> None:
        self.clock = Clock()
        self.dispatcher = Dispatcher(self.clock, DispatchPolicy(), lambda: 0.5)
        self.events: list[str] = []
        self.connections: Deferred[object] = Deferred()
        self.shutdown = Shutdown(
            self.clock,
            grace,
            self.dispatcher,
            self._close_ports,
            self._close_connections,
        )

    def _close_ports(self) -> Deferred[object]:
        self.events.append("ports closed")
        return succeed(None)

    def _close_connections(self, timeout: float) -> Deferred[object]:
        self.events.append(f"connections closing within {timeout}")
        return self.connections

    def job(
        self, commit: bool
    ) -> tuple[Deferred[JobOutcome], RecordingSink, list[FakeAttempt]]:
        attempts: list[FakeAttempt] = []

        def script(attempt: FakeAttempt) -> None:
            attempts.append(attempt)
            if commit:
                attempt.commit(200)

        discovery = FakeDiscovery()
        discovery.set(FakeTarget("a", script))
        sink = RecordingSink()
        d = self.dispatcher.dispatch(
            discovery.resolve, sink, inference=True, observer=RecordingObserver()
        )
        return d, sink, attempts


class DrainTests(SynchronousTestCase):
    def test_nothing_in_flight(self) -> None:
        """
        With nothing in flight the drain closes the ports and connections and
        ends at once, leaving no timer.
        """
        p = _Parts()
        d = p.shutdown.begin()
        self.assertNoResult(d)
        self.assertEqual(
            p.events, ["ports closed", f"connections closing within {FLUSH_TIMEOUT}"]
        )
        p.connections.callback(None)
        self.successResultOf(d)
        self.assertEqual(p.clock.getDelayedCalls(), [])

    def test_committed_finishes_uncommitted_refused(self) -> None:
        """
        An uncommitted job is answered 503 SHUTDOWN with Retry-After at once;
        a committed one streams on and the drain ends when it does.
        """
        p = _Parts()
        held, held_sink, _ = p.job(commit=False)
        streaming, _, attempts = p.job(commit=True)
        p.connections.callback(None)
        d = p.shutdown.begin()
        self.assertEqual(
            self.successResultOf(held),
            JobOutcome("cancelled", 503, None, 1, "shutdown"),
        )
        self.assertEqual(held_sink.rejections, [(503, RejectReason.SHUTDOWN, 5)])
        self.assertNoResult(streaming)
        self.assertNoResult(d)
        p.clock.advance(10)
        attempts[0].end()
        self.assertEqual(self.successResultOf(streaming).state, "completed")
        self.successResultOf(d)
        self.assertEqual(p.clock.getDelayedCalls(), [])

    def test_new_job_refused_while_draining(self) -> None:
        p = _Parts()
        p.job(commit=True)
        p.shutdown.begin()
        refused, sink, attempts = p.job(commit=True)
        self.assertEqual(self.successResultOf(refused).reason, "shutdown")
        self.assertEqual(attempts, [])
        self.assertEqual(sink.rejections, [(503, RejectReason.SHUTDOWN, 5)])

    def test_grace_expires(self) -> None:
        """
        What is still streaming when the grace ends is cancelled.
        """
        p = _Parts(grace=5)
        streaming, _, attempts = p.job(commit=True)
        p.connections.callback(None)
        d = p.shutdown.begin()
        p.clock.advance(4.9)
        self.assertNoResult(d)
        p.clock.advance(0.1)
        self.assertEqual(
            self.successResultOf(streaming),
            JobOutcome("cancelled", 200, "a", 1, "shutdown"),
        )
        self.assertEqual(attempts[0].calls, ["abort"])
        self.successResultOf(d)

    def test_force(self) -> None:
        """
        A second signal ends the drain at once, cancelling what is left and
        the grace timer.
        """
        p = _Parts()
        streaming, _, _ = p.job(commit=True)
        p.connections.callback(None)
        d = p.shutdown.begin()
        self.assertTrue(p.shutdown.draining)
        p.shutdown.force()
        self.assertEqual(self.successResultOf(streaming).state, "cancelled")
        self.successResultOf(d)
        self.assertEqual(p.clock.getDelayedCalls(), [])

    def test_begin_twice(self) -> None:
        """
        A second begin (link closed, then stopService) waits on the same end.
        """
        p = _Parts()
        p.job(commit=True)
        first, second = p.shutdown.begin(), p.shutdown.begin()
        self.assertEqual(p.events.count("ports closed"), 1)
        p.connections.callback(None)
        p.shutdown.force()
        self.successResultOf(first)
        self.successResultOf(second)
        self.successResultOf(p.shutdown.begin())

    def test_force_before_begin_is_ignored(self) -> None:
        p = _Parts()
        p.shutdown.force()
        self.assertFalse(p.shutdown.draining)
        self.assertEqual(p.events, [])
