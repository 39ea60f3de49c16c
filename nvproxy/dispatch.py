# -*- test-case-name: tests.test_dispatch -*-
"""
The Job: nvproxy's retry state machine (spec §1.1, §5.1-§5.4).

A L{Dispatcher} runs one Job per client request.  A Job resolves owners,
starts L{Attempt}s on L{Target}s, absorbs failures that happen before the
engine begins producing output, backs off between rounds, and ends in exactly
one L{JobOutcome}.  It is pure logic over an injected clock, an injected
random source and the protocols below; HTTP lives in L{nvproxy.proxy.attempt}.

The machine (an Automat TypeMachine; each state's data owns what must be
cancelled when the job stops)::

         idle
           | start
           v
  +----> deciding ---------------- conclude(reason) ----------------> done
  |        |   |                                                       ^
  |        |   +-- back_off --> waiting [IDelayedCall] -- stop -------->|
  |        |                      |                     (cancel timer) |
  +--------|---- timer_fired -----+                                    |
  |        | dispatch_to                                               |
  |        v                                                           |
  +--- attempting [Attempt] -------------------- stop (abort) -------->|
 attempt_  |  ^                                                        |
 failed    |  +-- discovery_changed: node gone -> attempt.cancel()     |
           |      (loop; the attempt then reports TARGET_LOST)         |
           | attempt_committed                                         |
           v                                                           |
       streaming [Attempt, Committed] ---- stream_ended, stop (abort) -+

    stop(cause) (client gone, shutdown) leaves every live state, deciding
    included, for done: the in-flight attempt is aborted, the backoff timer
    cancelled; done absorbs late inputs.  deciding is transient: whatever
    entered it computes the next step (a pure decision over the core) and
    feeds it back as dispatch_to, back_off or conclude.

Decisions taken here where the spec and DESIGN.md are silent:

  - Target lost on the final attempt: the budget is spent and nothing else
    can answer, so it is a 502 (L{RejectReason.TARGET_LOST_FINAL}).
  - A round is resolved when it begins; when an attempt fails, the round's
    nodes that have left discovery since (the presence check says so) are
    skipped, so the job never dispatches to a node whose answer the next
    discovery change would throw away.  If none is left, the job backs off
    and resolves again, as after a round.
  - A backoff that would end at or after the deadline is cut to end at the
    deadline, and the job then answers its 503 right there: no dispatch can
    start at the deadline, and the wait for an owner is the full grace period.
  - 503 answers carry C{Retry-After: policy.retry_after} (default 5 s).
  - Shutdown before commit answers 503 L{RejectReason.SHUTDOWN} (the client is
    still connected); after commit the copy is aborted.  Either way the job
    is C{cancelled} with reason C{"shutdown"}, and its Deferred fires with the
    outcome.  Jobs dispatched after L{Dispatcher.shutdown} are refused the
    same way, with nothing dispatched.
  - L{JobObserver.between_attempts} is called once per absorbed failure (a
    failed attempt that was not final), before whatever follows: failover,
    backoff, or the 503 that ends the loop.  It is not repeated for each
    re-resolution while waiting for an owner.
  - Defensive paths, each logged: a target whose C{start} raises counts as a
    dispatch that failed at the transport; a C{result} that errbacks is a
    TRANSPORT failure; a C{done} that errbacks is a truncated stream; a
    resolver that raises resolves to nobody; a final attempt reporting a
    retryable STATUS (it should have committed it) ends the job with the
    EXHAUSTED guard; an observer or sink that raises is logged and ignored.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from operator import attrgetter
from random import random as _default_random
from typing import Literal, Protocol

from attrs import define, field, frozen, validators
from automat import TypeMachineBuilder
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from nvproxy.automata import indexed
from nvproxy.logs import Logger, debug_shown

__all__ = [
    "Attempt",
    "AttemptFailed",
    "ClientSink",
    "Committed",
    "DispatchPolicy",
    "Dispatcher",
    "FailureKind",
    "JobObserver",
    "JobOutcome",
    "NullJobObserver",
    "RejectReason",
    "Resolver",
    "StreamEnd",
    "Target",
    "is_retryable_status",
]

log = Logger()


def is_retryable_status(status: int, inference: bool) -> bool:
    """
    Whether an upstream status, arriving before commit with budget remaining,
    is retried rather than passed through (spec §5.4).

    404 is retryable on inference routes only (positive inventory can be
    stale); 408, 429 and every 5xx are retryable; 2xx, 3xx and the other 4xx
    are not (the same request would fail identically everywhere).
    """
    if status == 404:
        return inference
    return status in (408, 429) or 500 <= status <= 599


def _valid_backoff(
    instance: object, attribute: object, value: tuple[float, ...]
) -> None:
    # The last delay repeats while waiting for an owner: zero would spin.
    if not value or value[-1] <= 0 or any(delay < 0 for delay in value):
        raise ValueError(
            f"backoff needs delays >= 0 and a last delay > 0, got {value!r}"
        )


def _delays(value: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(delay) for delay in value)


@frozen
class DispatchPolicy:
    """
    The bounds of one job (spec §5.1).

    @ivar max_attempts: at most this many dispatches; the last is final.
    @ivar deadline: seconds from job creation after which no new dispatch
        starts ("no new attempts after", never a cut of one in flight).
    @ivar backoff: delay before each new round, by round; the last repeats
        (it must be positive: it paces the wait for an owner).
    @ivar jitter: each delay is scaled by a factor in [1-jitter, 1+jitter).
    @ivar retry_after: the Retry-After (seconds) sent with the proxy's 503s.
    """

    max_attempts: int = field(default=5, validator=validators.ge(1))
    deadline: float = field(default=600.0, validator=validators.gt(0))
    backoff: tuple[float, ...] = field(
        default=(0.5, 1.0, 2.0, 4.0), converter=_delays, validator=_valid_backoff
    )
    jitter: float = field(
        default=0.2, validator=[validators.ge(0.0), validators.lt(1.0)]
    )
    retry_after: int = field(default=5, validator=validators.ge(0))

    def delay(self, index: int, sample: float) -> float:
        """
        The backoff before round C{index + 1}, jittered by C{sample} in [0, 1).
        """
        base = self.backoff[min(index, len(self.backoff) - 1)]
        return base * (1.0 + self.jitter * (2.0 * sample - 1.0))


class FailureKind(enum.Enum):
    """
    Why an attempt ended before commit.
    """

    STATUS = "status"
    """A retryable status (L{is_retryable_status}) before commit."""
    TRANSPORT = "transport"
    """Dial or connection error, or the response header timeout."""
    NO_CONTENT = "no_content"
    """Headers arrived, then the first-body timeout passed (§5.2)."""
    TARGET_LOST = "target_lost"
    """Cancelled because the target left discovery (§5.3)."""


class StreamEnd(enum.Enum):
    """
    How the copy of a committed response to the client ended.
    """

    COMPLETE = "complete"
    TRUNCATED = "truncated"
    """The upstream died mid-copy; still a completed job (§1.1)."""
    CLIENT_GONE = "client_gone"


@frozen
class Committed:
    """
    The attempt won the commit claim (first body byte, or EOF) and is
    already relaying to the client.

    @ivar done: fires (never errbacks) when the copy to the client ends.
    """

    node_id: str
    status: int
    done: Deferred[StreamEnd] = field(eq=False)


@frozen
class AttemptFailed:
    """
    The attempt ended before commit.  C{status} is set for STATUS (and may be
    for NO_CONTENT: the status whose body never came).
    """

    node_id: str
    kind: FailureKind
    status: int | None = None


class Attempt(Protocol):
    """
    One dispatch to one target, started by L{Target.start}.

    The Dispatcher adds its callbacks to C{result} and C{done} and consumes
    their results; chain anything of your own before handing them out.
    """

    @property
    def result(self) -> Deferred[Committed | AttemptFailed]:
        """
        Fires exactly once, never errbacks, with L{Committed} or
        L{AttemptFailed}.
        """

    def cancel(self) -> None:
        """
        The target left discovery.  If the attempt has not committed, claim
        "cancelled" (one atomic claim against commit; a delivered first byte
        wins), tear down, and fire C{result} with
        C{AttemptFailed(node_id, FailureKind.TARGET_LOST)}, synchronously or
        later.  A no-op once committed, and on a second call.
        """

    def abort(self) -> None:
        """
        The job is over (client gone, or shutdown): tear everything down,
        also after commit (the relay stops; the client connection is the
        facade's to close).  Idempotent and synchronous.  The Dispatcher has
        already left the attempt and ignores what follows, but the Deferreds
        must not dangle for the attempt's own chains: if C{result} has not
        fired it fires before abort() returns with an L{AttemptFailed} (kind
        TRANSPORT), and if the attempt had committed and C{done} has not fired
        it fires with L{StreamEnd.CLIENT_GONE}.
        """


class Target(Protocol):
    """
    An eligible owner, as the resolver hands it out.
    """

    @property
    def node_id(self) -> str:
        """The node this target dispatches to."""

    def start(self, final: bool) -> Attempt:
        """
        Start one attempt now.

        @param final: this is the final permitted attempt: it commits ANY
            status (status and body passed through unchanged).  A non-final
            attempt reports a retryable status (L{is_retryable_status}) as
            C{AttemptFailed(kind=STATUS)} without committing.
        """


_node_id = attrgetter("node_id")

Resolver = Callable[[], Sequence[Target]]
"""
Ordered eligible owners from the live discovery snapshot (ordering and
reservations are the caller's).  Called at admission, at every new round, and
on every discovery change while an attempt is in flight.  It may list only
the first C{max_attempts} owners, as the facades' does: a job never
dispatches to more.  (Then a round whose owners all leave discovery while
the job fails over ends there, and the job waits out a backoff and resolves
a new one, where a round listing every owner would go on to the next.)
"""


class RejectReason(enum.Enum):
    """
    Why the proxy answers with its own error rather than an upstream's.
    C{value} is stable (it becomes L{JobOutcome.reason} and log/JSON fields).
    """

    NO_OWNER_AT_ADMISSION = "no_owner_at_admission"
    TRANSPORT_FINAL = "transport_final"
    TARGET_LOST_FINAL = "target_lost_final"
    NO_CONTENT_FINAL = "no_content_final"
    DEADLINE = "deadline"
    NO_OWNER = "no_owner"
    EXHAUSTED = "exhausted"
    SHUTDOWN = "shutdown"

    @property
    def status(self) -> int:
        return _REJECT_STATUS[self]

    @property
    def message(self) -> str:
        """A stable human message for the error body."""
        return _REJECT_MESSAGE[self]

    @property
    def retry_later(self) -> bool:
        """Whether the answer carries Retry-After (the 503s)."""
        return self.status == 503


_REJECT_STATUS: dict[RejectReason, int] = {
    RejectReason.NO_OWNER_AT_ADMISSION: 502,
    RejectReason.TRANSPORT_FINAL: 502,
    RejectReason.TARGET_LOST_FINAL: 502,
    RejectReason.NO_CONTENT_FINAL: 504,
    RejectReason.DEADLINE: 503,
    RejectReason.NO_OWNER: 503,
    RejectReason.EXHAUSTED: 503,
    RejectReason.SHUTDOWN: 503,
}

_REJECT_MESSAGE: dict[RejectReason, str] = {
    RejectReason.NO_OWNER_AT_ADMISSION: "no node advertises the requested model",
    RejectReason.TRANSPORT_FINAL: (
        "the final dispatch attempt failed to reach the engine"
    ),
    RejectReason.TARGET_LOST_FINAL: (
        "the node of the final dispatch attempt left the cluster"
    ),
    RejectReason.NO_CONTENT_FINAL: (
        "the final dispatch attempt answered but produced no content"
    ),
    RejectReason.DEADLINE: "deadline passed while attempts were failing",
    RejectReason.NO_OWNER: "no owner became available",
    RejectReason.EXHAUSTED: "every dispatch attempt failed",
    RejectReason.SHUTDOWN: "the proxy is shutting down",
}


class ClientSink(Protocol):
    """
    How a job answers with a proxy-generated error; the engine-dialect body
    (from C{reason.message}) is the sink's business.  Called at most once per
    job, never after commit.
    """

    def reject(
        self, status: int, reason: RejectReason, retry_after: int | None
    ) -> None: ...


JobState = Literal["completed", "failed", "cancelled"]


@frozen
class JobOutcome:
    """
    How a job ended (the workload's terminal state, spec §5.4).

    @ivar status: the status the client got (upstream's or the proxy's);
        None if it got none (gone before commit).
    @ivar node_id: the node that served, if committed.
    @ivar attempts: dispatches made.
    @ivar reason: a L{RejectReason} value, a L{StreamEnd} value,
        C{"client_gone"} or C{"shutdown"}.
    @ivar failures: the absorbed and final pre-commit failures, in order.
    """

    state: JobState
    status: int | None
    node_id: str | None
    attempts: int
    reason: str | None
    failures: tuple[AttemptFailed, ...] = ()


class JobObserver(Protocol):
    """
    Lifecycle hooks (workload events, reservations).  Subclass
    L{NullJobObserver} to implement only some.
    """

    def admitted(self) -> None:
        """The job exists; called first, once."""

    def dispatching(self, node_id: str, attempt: int) -> None:
        """Just before C{target.start()}; C{attempt} counts from 1."""

    def between_attempts(self) -> None:
        """A non-final attempt failed; the job goes on without it (yet)."""

    def committed(self, node_id: str, status: int) -> None:
        """An attempt committed; no further dispatch will happen."""

    def finished(self, outcome: JobOutcome) -> None:
        """Exactly once, on every exit path, last."""


class NullJobObserver:
    """
    A L{JobObserver} that ignores everything.
    """

    def admitted(self) -> None:
        pass

    def dispatching(self, node_id: str, attempt: int) -> None:
        pass

    def between_attempts(self) -> None:
        pass

    def committed(self, node_id: str, status: int) -> None:
        pass

    def finished(self, outcome: JobOutcome) -> None:
        pass


# -- the machine ----------------------------------------------------------

_StopCause = Literal["client_gone", "shutdown"]


class _JobInputs(Protocol):
    def start(self) -> None:
        "Admission: resolve and dispatch, or reject."

    def dispatch_to(self, target: Target, final: bool) -> None:
        "Decided: start an attempt on C{target}."

    def back_off(self, delay: float, at_deadline: bool) -> None:
        "Decided: wait, then re-resolve (or, at the deadline, end)."

    def conclude(self, reason: RejectReason) -> None:
        "Decided: answer with the proxy's own error."

    def attempt_committed(self, attempt: Attempt, committed: Committed) -> None:
        "The attempt in flight committed."

    def attempt_failed(self, attempt: Attempt, failed: AttemptFailed) -> None:
        "The attempt in flight failed before commit."

    def timer_fired(self) -> None:
        "The backoff elapsed."

    def stream_ended(self, end: StreamEnd) -> None:
        "The committed copy ended."

    def discovery_changed(self) -> None:
        "The discovery snapshot changed."

    def stop(self, cause: _StopCause) -> None:
        "The client went away, or we are shutting down."


@frozen
class _Dispatch:
    target: Target
    final: bool


@frozen
class _Wait:
    delay: float
    at_deadline: bool


@frozen
class _Reject:
    reason: RejectReason


_Step = _Dispatch | _Wait | _Reject


@define
class _InFlight:
    """State data of C{attempting}: the attempt we may have to cancel/abort."""

    attempt: Attempt
    node_id: str
    final: bool
    number: int
    cancelling: bool = False


@define
class _Backoff:
    """State data of C{waiting}: the timer we may have to cancel."""

    call: IDelayedCall
    at_deadline: bool


@define
class _Streaming:
    """State data of C{streaming}: the committed attempt."""

    attempt: Attempt
    committed: Committed


def _guarded(what: str, call: Callable[..., None], *args: object) -> None:
    """
    Run a hook, C{call(*args)}; a raising observer or sink must not wedge
    the machine.  The arguments go in as they are, not in a closure: most
    jobs run four hooks.
    """
    try:
        call(*args)
    except Exception:
        log.failure("dispatch: {what} raised", what=what)


def _client_gone(
    core: _JobCore, machine: _JobInputs, result: Deferred[JobOutcome]
) -> None:
    core.client_gone = True
    machine.stop("client_gone")


Subscribe = Callable[[Callable[[], None]], Callable[[], None]]
"""Registers a discovery-change callback; returns its unsubscribe function."""


class _Watch:
    """
    One discovery registration for every running job dispatched with the
    same C{subscribe}: each change is told to each of them, in the order
    they were dispatched, and a job costs a dict entry instead of a
    registration and an unsubscribe closure of its own.
    """

    def __init__(self, forget: Callable[[], object]) -> None:
        self._jobs: dict[int, _JobInputs] = {}
        self._forget = forget
        self._unsubscribe: Callable[[], None] | None = None
        self.closed = False

    def join(self, job: int, machine: _JobInputs) -> None:
        self._jobs[job] = machine

    def subscribed(self, unsubscribe: Callable[[], None]) -> None:
        self._unsubscribe = unsubscribe
        if self.closed:  # the only job ended while subscribing
            _guarded("unsubscribe", unsubscribe)

    def changed(self) -> None:
        for machine in list(self._jobs.values()):
            _guarded("discovery_changed", machine.discovery_changed)

    def leave(self, job: int) -> None:
        if self._jobs.pop(job, None) is None or self._jobs:
            return
        self.closed = True
        self._forget()
        if self._unsubscribe is not None:
            _guarded("unsubscribe", self._unsubscribe)


@define
class _JobCore:
    """
    Everything a job knows that is not owned by one state.  Its decision
    methods are pure over this data and the clock; the machine executes them.
    """

    job: int
    clock: IReactorTime
    policy: DispatchPolicy
    random: Callable[[], float]
    resolver: Resolver
    sink: ClientSink
    inference: bool
    observer: JobObserver
    created_at: float
    present: Callable[[str], bool] | None = None
    result: Deferred[JobOutcome] = field(init=False)
    on_finish: Callable[[], None] = lambda: None
    dispatches: int = 0
    round: list[Target] = field(factory=list)
    backoffs: int = 0
    ownerless: bool = False
    client_gone: bool = False
    committed: bool = False
    failures: list[AttemptFailed] = field(factory=list)

    # -- decisions --------------------------------------------------------

    @property
    def deadline_at(self) -> float:
        return self.created_at + self.policy.deadline

    def past_deadline(self) -> bool:
        return self.inference and self.clock.seconds() >= self.deadline_at

    def resolve(self) -> list[Target] | None:
        """
        The live candidates, each node once, in the resolver's order; None if
        the resolver raised.
        """
        try:
            candidates = list(self.resolver())
        except Exception:
            log.failure("dispatch: resolver raised (job {job})", job=self.job)
            return None
        if len(set(map(_node_id, candidates))) == len(candidates):
            return candidates  # (a resolver lists each node once: one pass in C)
        seen: set[str] = set()
        unique: list[Target] = []
        for target in candidates:
            if target.node_id not in seen:
                seen.add(target.node_id)
                unique.append(target)
        return unique

    def admit(self) -> _Step:
        candidates = self.resolve() or []
        if not candidates:
            return _Reject(RejectReason.NO_OWNER_AT_ADMISSION)
        if not self.inference:
            # Resolved once, each tried at most once (§5.1).
            candidates = candidates[: self.policy.max_attempts]
        self.round = candidates
        return self.next_in_round()

    def next_in_round(self) -> _Step:
        if self.dispatches >= self.policy.max_attempts:
            return _Reject(RejectReason.EXHAUSTED)
        if self.past_deadline():
            return _Reject(RejectReason.DEADLINE)
        target = self.round.pop(0)
        number = self.dispatches + 1
        final = number == self.policy.max_attempts or (
            not self.inference and not self.round
        )
        return _Dispatch(target, final)

    def after_failure(self, inflight: _InFlight, failed: AttemptFailed) -> _Step:
        self.failures.append(failed)
        log.debug(
            "dispatch: job {job} attempt {attempt} on {node} failed: {kind} {status}",
            job=self.job,
            attempt=inflight.number,
            node=inflight.node_id,
            kind=failed.kind.value,
            status=failed.status,
            final=inflight.final,
        )
        if inflight.final:
            return _Reject(_FINAL_FAILURE[failed.kind])
        _guarded("observer.between_attempts", self.observer.between_attempts)
        if self.inference:
            self.round = [t for t in self.round if self.still_present(t.node_id)]
        if self.round:
            return self.next_in_round()
        if not self.inference:
            return _Reject(RejectReason.EXHAUSTED)  # unreachable: last is final
        return self.wait()

    def still_present(self, node_id: str) -> bool:
        """
        Whether a node of the current round still owns what the job asks
        for.  The round was resolved when it began; a node that has left
        discovery since is not dispatched to, or its answer would be thrown
        away on the next discovery change (the attempt is cancelled then),
        after the engine did the work.  Without a presence check, or when
        it raises (logged), a node counts as present.
        """
        if self.present is None:
            return True
        try:
            return self.present(node_id)
        except Exception:
            log.failure("dispatch: presence check raised")
            return True

    def wait(self) -> _Step:
        remaining = self.deadline_at - self.clock.seconds()
        if remaining <= 0:
            return self.out_of_time()
        delay = self.policy.delay(self.backoffs, self.random())
        self.backoffs += 1
        if delay >= remaining:
            return _Wait(remaining, True)
        return _Wait(delay, False)

    def after_tick(self, at_deadline: bool) -> _Step:
        if at_deadline:
            return self.out_of_time()
        candidates = self.resolve()
        if candidates is None:
            # The resolver broke; keep the previous verdict on owners.
            return self.wait()
        self.ownerless = not candidates
        if not candidates:
            return self.wait()
        self.round = candidates
        return self.next_in_round()

    def out_of_time(self) -> _Reject:
        return _Reject(
            RejectReason.NO_OWNER if self.ownerless else RejectReason.DEADLINE
        )

    # -- endings ----------------------------------------------------------

    def finish(self, outcome: JobOutcome) -> None:
        if debug_shown():
            log.debug(
                "dispatch: job {job} {state}: status {status} node {node}"
                " after {attempts} attempt(s) ({reason})",
                job=self.job,
                state=outcome.state,
                status=outcome.status,
                node=outcome.node_id,
                attempts=outcome.attempts,
                reason=outcome.reason,
            )
        self.on_finish()
        _guarded("observer.finished", self.observer.finished, outcome)
        # A client cancel errbacks the Deferred with CancelledError itself.
        if not self.client_gone and not self.result.called:
            self.result.callback(outcome)

    def reject(self, reason: RejectReason) -> None:
        retry_after = self.policy.retry_after if reason.retry_later else None
        _guarded("sink.reject", self.sink.reject, reason.status, reason, retry_after)
        state: JobState = "cancelled" if reason is RejectReason.SHUTDOWN else "failed"
        self.finish(
            JobOutcome(
                state,
                reason.status,
                None,
                self.dispatches,
                reason.value,
                tuple(self.failures),
            )
        )

    def stopped(self, cause: _StopCause, committed: Committed | None = None) -> None:
        if committed is None and cause == "shutdown":
            self.reject(RejectReason.SHUTDOWN)
            return
        self.finish(
            JobOutcome(
                "cancelled",
                None if committed is None else committed.status,
                None if committed is None else committed.node_id,
                self.dispatches,
                cause,
                tuple(self.failures),
            )
        )


_FINAL_FAILURE: dict[FailureKind, RejectReason] = {
    FailureKind.TRANSPORT: RejectReason.TRANSPORT_FINAL,
    FailureKind.NO_CONTENT: RejectReason.NO_CONTENT_FINAL,
    FailureKind.TARGET_LOST: RejectReason.TARGET_LOST_FINAL,
    # A final attempt must commit any status; if it did not, nothing answered.
    FailureKind.STATUS: RejectReason.EXHAUSTED,
}


def _perform(c: _JobInputs, step: _Step) -> None:
    """
    Feed a decision back into the machine (Automat runs it right after the
    current transition).
    """
    if isinstance(step, _Dispatch):
        c.dispatch_to(step.target, step.final)
    elif isinstance(step, _Wait):
        c.back_off(step.delay, step.at_deadline)
    else:
        c.conclude(step.reason)


@frozen
class _Stillborn:
    """An L{Attempt} for a target whose C{start} raised."""

    node_id: str
    result: Deferred[Committed | AttemptFailed]

    def cancel(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _start_attempt(
    c: _JobInputs, core: _JobCore, target: Target, final: bool
) -> _InFlight:
    core.dispatches += 1
    number = core.dispatches
    node_id = target.node_id
    if debug_shown():
        log.debug(
            "dispatch: job {job} to {node} attempt {attempt}",
            job=core.job,
            node=node_id,
            attempt=number,
            final=final,
        )
    _guarded("observer.dispatching", core.observer.dispatching, node_id, number)
    attempt: Attempt
    try:
        attempt = target.start(final)
    except Exception:
        log.failure("dispatch: {node} failed to start an attempt", node=node_id)
        attempt = _Stillborn(
            node_id, succeed(AttemptFailed(node_id, FailureKind.TRANSPORT))
        )

    def deliver(outcome: Committed | AttemptFailed) -> None:
        if isinstance(outcome, Committed):
            c.attempt_committed(attempt, outcome)
        else:
            c.attempt_failed(attempt, outcome)

    def broken(reason: Failure) -> None:
        log.failure("dispatch: attempt on {node} errbacked", reason, node=node_id)
        c.attempt_failed(attempt, AttemptFailed(node_id, FailureKind.TRANSPORT))

    attempt.result.addCallbacks(deliver, broken).addErrback(_machine_failed, core.job)
    return _InFlight(attempt, node_id, final, number)


def _schedule_tick(
    c: _JobInputs, core: _JobCore, delay: float, at_deadline: bool
) -> _Backoff:
    log.debug("dispatch: job {job} backing off {delay:.3f}s", job=core.job, delay=delay)
    return _Backoff(core.clock.callLater(delay, c.timer_fired), at_deadline)


def _start_streaming(
    c: _JobInputs, core: _JobCore, attempt: Attempt, committed: Committed
) -> _Streaming:
    # (Functions with arguments, not closures: a stream keeps them to its end.)
    committed.done.addCallbacks(
        c.stream_ended, _stream_broken, errbackArgs=(c, committed.node_id)
    ).addErrback(_machine_failed, core.job)
    return _Streaming(attempt, committed)


def _stream_broken(reason: Failure, c: _JobInputs, node_id: str) -> None:
    log.failure("dispatch: stream from {node} errbacked", reason, node=node_id)
    c.stream_ended(StreamEnd.TRUNCATED)


def _machine_failed(reason: Failure, job: int) -> None:
    log.failure("dispatch: job {job} machine", reason, job=job)


def _build_machine() -> Callable[[_JobCore], _JobInputs]:
    builder = TypeMachineBuilder(_JobInputs, _JobCore)
    idle = builder.state("idle")
    deciding = builder.state("deciding")
    attempting = builder.state("attempting", _start_attempt)
    waiting = builder.state("waiting", _schedule_tick)
    streaming = builder.state("streaming", _start_streaming)
    done = builder.state("done")

    @idle.upon(_JobInputs.start).to(deciding)
    def _admit(c: _JobInputs, core: _JobCore) -> None:
        _guarded("observer.admitted", core.observer.admitted)
        _perform(c, core.admit())

    deciding.upon(_JobInputs.dispatch_to).to(attempting).returns(None)
    deciding.upon(_JobInputs.back_off).to(waiting).returns(None)

    @deciding.upon(_JobInputs.conclude).to(done)
    def _conclude(c: _JobInputs, core: _JobCore, reason: RejectReason) -> None:
        core.reject(reason)

    @attempting.upon(_JobInputs.attempt_failed).to(deciding)
    def _failed(
        c: _JobInputs,
        core: _JobCore,
        inflight: _InFlight,
        attempt: Attempt,
        failed: AttemptFailed,
    ) -> None:
        _perform(c, core.after_failure(inflight, failed))

    @attempting.upon(_JobInputs.attempt_committed).to(streaming)
    def _committed(
        c: _JobInputs,
        core: _JobCore,
        inflight: _InFlight,
        attempt: Attempt,
        committed: Committed,
    ) -> None:
        if debug_shown():
            log.debug(
                "dispatch: job {job} committed to {node} with {status}",
                job=core.job,
                node=committed.node_id,
                status=committed.status,
            )
        core.committed = True
        _guarded(
            "observer.committed",
            core.observer.committed,
            committed.node_id,
            committed.status,
        )

    @attempting.upon(_JobInputs.discovery_changed).loop()
    def _check_target(c: _JobInputs, core: _JobCore, inflight: _InFlight) -> None:
        if inflight.cancelling:
            return
        if core.present is not None:
            # A side-effect-free check: resolving would also re-order and
            # re-reserve, moving the claim off the node doing the work.
            if core.still_present(inflight.node_id):
                return
        else:
            candidates = core.resolve()
            if candidates is None:
                return
            if inflight.node_id in {target.node_id for target in candidates}:
                return
        log.debug(
            "dispatch: job {job} target {node} left discovery; cancelling"
            " attempt {attempt}",
            job=core.job,
            node=inflight.node_id,
            attempt=inflight.number,
        )
        inflight.cancelling = True
        inflight.attempt.cancel()

    @attempting.upon(_JobInputs.stop).to(done)
    def _stop_attempt(
        c: _JobInputs, core: _JobCore, inflight: _InFlight, cause: _StopCause
    ) -> None:
        inflight.attempt.abort()
        core.stopped(cause)

    @waiting.upon(_JobInputs.timer_fired).to(deciding)
    def _tick(c: _JobInputs, core: _JobCore, backoff: _Backoff) -> None:
        _perform(c, core.after_tick(backoff.at_deadline))

    @waiting.upon(_JobInputs.stop).to(done)
    def _stop_waiting(
        c: _JobInputs, core: _JobCore, backoff: _Backoff, cause: _StopCause
    ) -> None:
        backoff.call.cancel()
        core.stopped(cause)

    @streaming.upon(_JobInputs.stream_ended).to(done)
    def _ended(
        c: _JobInputs, core: _JobCore, streaming: _Streaming, end: StreamEnd
    ) -> None:
        committed = streaming.committed
        state: JobState
        if end is StreamEnd.CLIENT_GONE:
            state = "cancelled"
        elif 200 <= committed.status < 300:
            state = "completed"  # also when truncated (§1.1)
        else:
            state = "failed"
        core.finish(
            JobOutcome(
                state,
                committed.status,
                committed.node_id,
                core.dispatches,
                end.value,
                tuple(core.failures),
            )
        )

    @streaming.upon(_JobInputs.stop).to(done)
    def _stop_streaming(
        c: _JobInputs, core: _JobCore, streaming: _Streaming, cause: _StopCause
    ) -> None:
        streaming.attempt.abort()
        core.stopped(cause, streaming.committed)

    @deciding.upon(_JobInputs.stop).to(done)
    def _stop_deciding(c: _JobInputs, core: _JobCore, cause: _StopCause) -> None:
        core.stopped(cause)

    # Nothing to do: the commit already won, or nothing is in flight.
    idle.upon(_JobInputs.discovery_changed).loop().returns(None)
    waiting.upon(_JobInputs.discovery_changed).loop().returns(None)
    streaming.upon(_JobInputs.discovery_changed).loop().returns(None)
    deciding.upon(_JobInputs.discovery_changed).loop().returns(None)

    # Late arrivals after the end: decisions queued behind a stop, results of
    # an aborted attempt, a second stop.
    done.upon(_JobInputs.dispatch_to).loop().returns(None)
    done.upon(_JobInputs.back_off).loop().returns(None)
    done.upon(_JobInputs.conclude).loop().returns(None)
    done.upon(_JobInputs.attempt_committed).loop().returns(None)
    done.upon(_JobInputs.attempt_failed).loop().returns(None)
    done.upon(_JobInputs.stream_ended).loop().returns(None)
    done.upon(_JobInputs.discovery_changed).loop().returns(None)
    done.upon(_JobInputs.stop).loop().returns(None)

    return indexed(builder.build())


_JobMachine = _build_machine()


# -- the public face ------------------------------------------------------


class Dispatcher:
    """
    Runs Jobs: one per client request, each bounded by the policy.
    """

    def __init__(
        self,
        clock: IReactorTime,
        policy: DispatchPolicy,
        random: Callable[[], float] = _default_random,
    ) -> None:
        """
        @param random: returns a float in [0, 1) for the backoff jitter.
        """
        self._clock = clock
        self._policy = policy
        self._random = random
        self._jobs: dict[int, _JobInputs] = {}
        self._cores: dict[int, _JobCore] = {}
        self._idle: list[Deferred[None]] = []
        self._ids = itertools.count(1)
        self._stopped = False
        self._watches: dict[Subscribe, _Watch] = {}

    def dispatch(
        self,
        resolver: Resolver,
        sink: ClientSink,
        *,
        inference: bool,
        observer: JobObserver | None = None,
        subscribe: Subscribe | None = None,
        created_at: float | None = None,
        present: Callable[[str], bool] | None = None,
    ) -> Deferred[JobOutcome]:
        """
        Run one job to its end.

        @param resolver: the live, ordered candidates (see L{Resolver}).
        @param sink: answers the proxy's own errors (at most once).
        @param inference: the §5.1 budget applies (rounds, backoff, deadline);
            otherwise candidates are resolved once and each tried at most
            once, the last one final.
        @param subscribe: registers a discovery-change callback and returns
            its unsubscribe function.  On change, if the in-flight attempt's
            node is no longer in C{resolver()}, that attempt is cancelled
            (§5.3).  Jobs dispatched with the same C{subscribe} share one
            registration, made for the first of them and undone when the
            last one ends (L{_Watch}).
        @param present: whether a node still owns what the job asks for;
            when given, a discovery change asks it instead of C{resolver()}
            (which may have side effects such as taking reservations), and
            an inference job skips the round's nodes it says have left.
        @param created_at: when the request was created (C{clock.seconds()}
            scale); the deadline counts from it.  Default: now.

        @return: fires with the L{JobOutcome}.  Cancelling it means the client
            went away: the job ends at once as C{cancelled} (reason
            C{"client_gone"}), the in-flight attempt is aborted (also while
            streaming), the backoff timer cancelled, the observer still gets
            C{finished}; the Deferred itself fails with C{CancelledError}.
        """
        observer = NullJobObserver() if observer is None else observer
        job = next(self._ids)
        if self._stopped:
            return self._refuse(sink, observer)
        core = _JobCore(
            job=job,
            clock=self._clock,
            policy=self._policy,
            random=self._random,
            resolver=resolver,
            sink=sink,
            inference=inference,
            observer=observer,
            created_at=self._clock.seconds() if created_at is None else created_at,
            present=present,
        )
        machine = _JobMachine(core)

        # (Bound arguments, not closures: an open stream keeps both.)
        core.result = Deferred(partial(_client_gone, core, machine))
        watch = None if subscribe is None else self._watch(subscribe, job, machine)
        core.on_finish = partial(self._forget, job, watch)
        self._jobs[job] = machine
        self._cores[job] = core
        machine.start()
        return core.result

    def _forget(self, job: int, watch: _Watch | None) -> None:
        self._jobs.pop(job, None)
        self._cores.pop(job, None)
        if watch is not None:
            watch.leave(job)
        if not self._jobs:
            waiters, self._idle = self._idle, []
            for waiter in waiters:
                waiter.callback(None)

    def _watch(self, subscribe: Subscribe, job: int, machine: _JobInputs) -> _Watch:
        # A watch that closed has already left the table (its forget).
        watch = self._watches.get(subscribe)
        fresh = watch is None
        if watch is None:
            watch = self._watches[subscribe] = _Watch(
                lambda: self._watches.pop(subscribe, None)
            )
        watch.join(job, machine)
        if fresh:
            watch.subscribed(subscribe(watch.changed))
        return watch

    def _refuse(self, sink: ClientSink, observer: JobObserver) -> Deferred[JobOutcome]:
        reason = RejectReason.SHUTDOWN
        outcome = JobOutcome("cancelled", reason.status, None, 0, reason.value)
        _guarded("observer.admitted", observer.admitted)
        _guarded(
            "sink.reject", sink.reject, reason.status, reason, self._policy.retry_after
        )
        _guarded("observer.finished", observer.finished, outcome)
        return succeed(outcome)

    def shutdown(self) -> None:
        """
        Cancel every job in flight (C{cancelled}, reason C{"shutdown"}) and
        refuse new ones with 503 L{RejectReason.SHUTDOWN}.
        """
        self._stopped = True
        for machine in list(self._jobs.values()):
            machine.stop("shutdown")

    @property
    def policy(self) -> DispatchPolicy:
        """What jobs dispatched now follow."""
        return self._policy

    def set_policy(self, policy: DispatchPolicy) -> None:
        """Jobs dispatched from now on follow C{policy} (a reload)."""
        self._policy = policy

    def drain(self) -> None:
        """
        Refuse new jobs and answer every job not yet committed with 503
        L{RejectReason.SHUTDOWN} (it never reached an engine, so its client
        may retry elsewhere); committed jobs go on streaming.
        """
        self._stopped = True
        for job, machine in list(self._jobs.items()):
            core = self._cores.get(job)
            if core is not None and not core.committed:
                machine.stop("shutdown")

    def idle(self) -> Deferred[None]:
        """
        Fires once no job is in flight (at once if none is).
        """
        if not self._jobs:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._idle.append(waiter)
        return waiter

    def inflight(self) -> int:
        """
        Jobs not yet finished.
        """
        return len(self._jobs)
