# -*- test-case-name: tests.test_dispatch -*-
"""
Test doubles for L{nvproxy.dispatch}: scriptable attempts and targets, a
discovery that can lose and regain nodes, a recording sink and observer.

A L{FakeAttempt} models the real attempt's single claim (spec §5.3): it is
C{pending} until one of commit, failure, cancel or abort claims it; the loser
of a race is a no-op.  A commit can be claimed (the first byte arrived) before
it is delivered (C{result} fires), which is how a test stages a discovery loss
racing a commit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from attrs import define, field
from twisted.internet.defer import Deferred

from nvproxy.dispatch import (
    AttemptFailed,
    Committed,
    FailureKind,
    JobOutcome,
    RejectReason,
    StreamEnd,
    Target,
    is_retryable_status,
)

ClaimState = Literal[
    "pending", "committing", "committed", "failed", "cancelled", "aborted"
]


@define(eq=False)
class FakeAttempt:
    """
    One scripted attempt.  Drive it with L{commit}, L{fail}, L{end}, or the
    two-step L{claim_commit} / L{deliver_commit}.

    @ivar calls: C{"cancel"} / C{"abort"} as they were called, in order.
    """

    node_id: str
    final: bool
    result: Deferred[Committed | AttemptFailed] = field(factory=lambda: Deferred())
    state: ClaimState = "pending"
    status: int | None = None
    done: Deferred[StreamEnd] = field(factory=lambda: Deferred())
    calls: list[str] = field(factory=list)
    cancel_synchronously: bool = True

    def _claim(self, new: ClaimState, *allowed: ClaimState) -> bool:
        if self.state in allowed:
            self.state = new
            return True
        return False

    # -- scripting ----------------------------------------------------------

    def commit(self, status: int = 200) -> Deferred[StreamEnd]:
        """
        First byte arrived: claim and deliver the commit.  Returns C{done}.
        """
        self.claim_commit(status)
        self.deliver_commit()
        return self.done

    def claim_commit(self, status: int = 200) -> bool:
        """
        Win (or lose) the commit claim without firing C{result} yet.
        """
        if self._claim("committing", "pending"):
            self.status = status
            return True
        return False

    def deliver_commit(self) -> None:
        """
        Fire C{result} with the claimed commit.
        """
        if self._claim("committed", "committing"):
            assert self.status is not None
            self.result.callback(Committed(self.node_id, self.status, self.done))

    def fail(self, kind: FailureKind, status: int | None = None) -> bool:
        """
        Fail before commit (no-op if something else claimed the attempt).
        """
        if self._claim("failed", "pending"):
            self.result.callback(AttemptFailed(self.node_id, kind, status))
            return True
        return False

    def respond(self, status: int, inference: bool = True) -> None:
        """
        What the real attempt does with a status: commit it when final or not
        retryable, else fail with STATUS.
        """
        if not self.final and is_retryable_status(status, inference):
            self.fail(FailureKind.STATUS, status)
        else:
            self.commit(status)

    def end(self, how: StreamEnd = StreamEnd.COMPLETE) -> None:
        """
        The committed copy ended.
        """
        if self.state == "committed" and not self.done.called:
            self.done.callback(how)

    def finish_cancel(self) -> None:
        """
        For C{cancel_synchronously=False}: fire the TARGET_LOST result now.
        """
        if self.state == "cancelled" and not self.result.called:
            self.result.callback(AttemptFailed(self.node_id, FailureKind.TARGET_LOST))

    # -- the Attempt protocol -----------------------------------------------

    def cancel(self) -> None:
        self.calls.append("cancel")
        if self._claim("cancelled", "pending") and self.cancel_synchronously:
            self.finish_cancel()

    def abort(self) -> None:
        self.calls.append("abort")
        was = self.state
        if not self._claim(
            "aborted", "pending", "committing", "committed", "cancelled"
        ):
            return
        if was == "committed":
            if not self.done.called:
                self.done.callback(StreamEnd.CLIENT_GONE)
        elif not self.result.called:
            self.result.callback(AttemptFailed(self.node_id, FailureKind.TRANSPORT))


Script = Callable[[FakeAttempt], object]


@define(eq=False)
class FakeTarget:
    """
    A target that records its attempts; C{script}, if given, runs on each new
    attempt right after it starts (it may answer synchronously, or schedule
    an answer on a clock).
    """

    node_id: str
    script: Script | None = None
    attempts: list[FakeAttempt] = field(factory=list)
    raises: BaseException | None = None

    def start(self, final: bool) -> FakeAttempt:
        if self.raises is not None:
            raise self.raises
        attempt = FakeAttempt(self.node_id, final)
        self.attempts.append(attempt)
        if self.script is not None:
            self.script(attempt)
        return attempt

    @property
    def last(self) -> FakeAttempt:
        return self.attempts[-1]


@define(eq=False)
class FakeDiscovery:
    """
    A live snapshot of targets: C{resolve} is a L{nvproxy.dispatch.Resolver},
    C{subscribe} matches L{nvproxy.dispatch.Dispatcher.dispatch}'s.
    """

    targets: list[FakeTarget] = field(factory=list)
    subscribers: list[Callable[[], None]] = field(factory=list)
    resolutions: int = 0

    def resolve(self) -> Sequence[Target]:
        self.resolutions += 1
        return list(self.targets)

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        self.subscribers.append(callback)

        def unsubscribe() -> None:
            self.subscribers.remove(callback)

        return unsubscribe

    def set(self, *targets: FakeTarget) -> None:
        """
        Replace the snapshot and notify subscribers.
        """
        self.targets = list(targets)
        for callback in list(self.subscribers):
            callback()


@define(eq=False)
class RecordingSink:
    """
    A L{nvproxy.dispatch.ClientSink} that records C{(status, reason,
    retry_after)}.
    """

    rejections: list[tuple[int, RejectReason, int | None]] = field(factory=list)

    def reject(
        self, status: int, reason: RejectReason, retry_after: int | None
    ) -> None:
        self.rejections.append((status, reason, retry_after))


Event = tuple[object, ...]


@define(eq=False)
class RecordingObserver:
    """
    A L{nvproxy.dispatch.JobObserver} that records every hook as a tuple,
    for whole-list comparisons.
    """

    events: list[Event] = field(factory=list)

    def admitted(self) -> None:
        self.events.append(("admitted",))

    def dispatching(self, node_id: str, attempt: int) -> None:
        self.events.append(("dispatching", node_id, attempt))

    def between_attempts(self) -> None:
        self.events.append(("between_attempts",))

    def committed(self, node_id: str, status: int) -> None:
        self.events.append(("committed", node_id, status))

    def finished(self, outcome: JobOutcome) -> None:
        self.events.append(("finished", outcome))

    @property
    def outcomes(self) -> list[JobOutcome]:
        return [e[-1] for e in self.events if isinstance(e[-1], JobOutcome)]
