# -*- test-case-name: tests.test_vllm -*-
"""
The per-service wake/sleep state machine and its sleep-API driver.

See the diagram in L{nvproxy.vllm}.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import attrs
from automat import TypeMachineBuilder
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from nvproxy.automata import indexed
from nvproxy.config import VllmHold, VllmServiceConfig
from nvproxy.vllm._client import BadAnswer, NoAnswer, SleepApi
from nvproxy.vllm._errors import (
    Depth,
    ManagerStopped,
    Refused,
    WakeFailed,
    Waking,
    _depth_of_level,
)
from nvproxy.vllm._estimates import WakeEstimates

log = Logger()


class _Unreachable(Exception):
    """Still unreachable when the attempt's deadline passed: down."""


class _WakeError(Exception):
    """The wake (or sleep) never got where it should within its deadline."""


@attrs.frozen
class _Settings:
    """
    How one service is driven (see L{nvproxy.vllm.VllmManager}'s
    parameters of the same names).
    """

    wake_timeout: float = 600.0
    health_poll: float = 0.5
    call_timeout: float = 10.0
    escalate_by_wake: bool = False
    retry_after_estimate: bool = False


class _WakeMetrics(Protocol):
    """The metrics the machine reports to."""

    def held(self, service: str, count: int) -> None: ...
    def wake(self, service: str, depth: Depth) -> None: ...
    def woke(self, service: str, depth: Depth, seconds: float) -> None: ...
    def measured(self, service: str, depth: Depth, seconds: float) -> None: ...
    def slept(self, service: str, level: int | None) -> None: ...


@attrs.define(eq=False)
class _Hold:
    """One caller waiting for the service; C{timer} is its hold deadline."""

    deferred: Deferred[None]
    arrived: float
    timer: IDelayedCall | None = None


@attrs.define(eq=False)
class _Idle:
    """The idle-tier timer of an awake or asleep service."""

    timer: IDelayedCall | None = None

    def cancel(self) -> None:
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None


@attrs.define(eq=False)
class _Forwarded:
    """
    A request forwarded to the service that has no answer yet.  If the
    service turns out to be asleep, C{on_hold} gets a hold (from C{since})
    that fires once it is awake again, or fails at the hold deadline.
    """

    since: float
    on_hold: Callable[[Deferred[None]], None]
    hold: Deferred[None] | None = None


@attrs.define(eq=False)
class _Op:
    """An operation in flight at the service (a wake or a sleep)."""

    deferred: Deferred[Any]
    reply: Deferred[None] | None = None


class _Inputs(Protocol):
    def need(self) -> None:
        "Someone waits for the service to be awake (a hold is in the core)."

    def woke(self) -> None:
        "The wake operation succeeded: the service is awake and healthy."

    def wake_failed(self, level: int | None) -> None:
        "The wake operation failed twice; it stays asleep at C{level}."

    def unreachable(self) -> None:
        "The service stayed unreachable for the whole wake attempt."

    def check(self) -> None:
        "Look at the service without waking it (startup, after a failed sleep)."

    def found_awake(self) -> None:
        "The check found the service awake (and no reload pending)."

    def found_asleep(self, level: int | None) -> None:
        "The check found the service asleep; C{level} is the depth we know."

    def check_failed(self) -> None:
        "The check got no answer and there is no idle tier to retry it on."

    def recheck_failed(self) -> None:
        "Re-checking an awake service with active requests failed."

    def quiet(self) -> None:
        "The last active request ended: the idle clock restarts from it."

    def sleep(self, level: int, reply: Deferred[None] | None) -> None:
        "Admin asks for sleep at C{level}; validated by the state."

    def begin_sleep(self, level: int, reply: Deferred[None] | None) -> None:
        "Start the C{/sleep} operation (idle tier or validated admin call)."

    def slept(self, level: int | None) -> None:
        "The sleep operation succeeded."

    def sleep_failed(self) -> None:
        "The sleep operation failed; the state is unknown."

    def idle_due(self) -> None:
        "The idle-tier timer fired."

    def seen_awake(self) -> None:
        "The state poll found the service awake (and no reload pending)."

    def seen_asleep(self, level: int | None) -> None:
        "The state poll found the service asleep at C{level} (None: unknown)."

    def stop(self) -> None:
        "The owner stops: cancel everything."


class _Core:
    """
    Everything about one service that outlives a state: config, counters,
    held callers, and the driver of the sleep API (the wake and sleep
    sequences over C{client}).

    @param clock: every timer and timestamp.
    @param hold: how long a held caller waits, by depth.
    @param client: the service's sleep API.
    @param metrics: where wakes, sleeps and held callers are counted.
    @param changed: called whenever something persisted changed (the phase,
        the level, C{reload_pending}).
    @param settings: timeouts and the escalation choice.
    """

    machine: _Inputs

    def __init__(
        self,
        config: VllmServiceConfig,
        *,
        clock: IReactorTime,
        hold: VllmHold,
        client: SleepApi,
        metrics: _WakeMetrics,
        changed: Callable[[], None],
        settings: _Settings,
        estimates: WakeEstimates | None = None,
    ) -> None:
        self.config = config
        self.estimates = (
            estimates if estimates is not None else WakeEstimates([config.name], None)
        )
        # told of every phase change (the node record follows readiness)
        self.phase_changed: Callable[[], None] = lambda: None
        # when this wake sequence first called /wake_up: a measured wake runs
        # from then to the first healthy answer
        self.wake_called: float | None = None
        self.name = config.name
        self.clock = clock
        self.hold = hold
        self.client = client
        self.metrics = metrics
        self.changed = changed
        self.settings = settings
        # bumped by every phase change: a poll answer older than the last
        # change is dropped
        self.epoch = 0
        self._phase = "unknown"
        self.level: int | None = None
        self.unreachable = False
        # a wake sequence started and the weights are not reloaded yet:
        # persisted, and reload + reset run even if /is_sleeping says false
        self.reload_pending = False
        # the running wake re-checks an awake service (state_ttl passed)
        self.recheck = False
        self.active = 0
        self.last_activity = self.clock.seconds()
        self.verified_at = -math.inf
        self.holds: list[_Hold] = []
        self.forwarded: list[_Forwarded] = []
        self.wake_started: float | None = None
        self.waking_from: Depth | None = None
        self.sleep_target: int | None = None
        self.observed: dict[Depth, float] = {}
        self.last_sleep_error: BaseException | None = None

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, phase: str) -> None:
        self._phase = phase
        self.epoch += 1
        self.phase_changed()

    # -- depth and holds ----------------------------------------------------

    def depth(self) -> Depth:
        """The depth a held caller is told about."""
        if self.unreachable or self.phase == "down":
            return Depth.RESTARTING
        if self.phase == "sleeping":
            return _depth_of_level(self.sleep_target)
        return _depth_of_level(self.level)

    def remaining(self, depth: Depth) -> float:
        """
        Seconds a wake from C{depth} would still take: the learned estimate
        less what the running wake already took, never below 0.
        """
        typical = self.estimates.estimate(self.name, depth)
        started = (
            self.wake_called if self.wake_called is not None else self.wake_started
        )
        elapsed = 0.0
        if started is not None:
            elapsed = self.clock.seconds() - started
        return max(0.0, typical - elapsed)

    def estimate(self, depth: Depth) -> int:
        return max(1, math.ceil(self.remaining(depth)))

    def waking_error(self, failed: bool = False) -> Waking:
        depth = self.depth()
        kind = WakeFailed if failed else Waking
        estimate = self.estimate(depth)
        retry_after = estimate if self.settings.retry_after_estimate else None
        return kind(
            self.name, self.config.model, depth, estimate, retry_after=retry_after
        )

    def add_hold(self, deadline: bool, arrived: float | None = None) -> Deferred[None]:
        def cancel(d: Deferred[None]) -> None:
            self._drop(hold)

        now = self.clock.seconds()
        hold = _Hold(Deferred(cancel), now if arrived is None else arrived)
        if deadline:
            wait = hold.arrived + self.depth().hold(self.hold) - now
            hold.timer = self.clock.callLater(max(0.0, wait), self._expire, hold)
        self.holds.append(hold)
        self.metrics.held(self.name, len(self.holds))
        return hold.deferred

    def _drop(self, hold: _Hold) -> None:
        if hold.timer is not None and hold.timer.active():
            hold.timer.cancel()
        if hold in self.holds:
            self.holds.remove(hold)
            self.metrics.held(self.name, len(self.holds))

    def _expire(self, hold: _Hold) -> None:
        hold.timer = None
        self._drop(hold)
        error = self.waking_error()
        log.info(
            "vLLM service {service} not awake within the {depth} hold",
            service=self.name,
            depth=error.depth.value,
        )
        hold.deferred.errback(error)

    def extend_holds(self) -> None:
        """The depth got worse: give every held caller its longer hold."""
        wait = self.depth().hold(self.hold)
        now = self.clock.seconds()
        for hold in self.holds:
            if hold.timer is not None and hold.timer.active():
                due = hold.arrived + wait
                if due > hold.timer.getTime():
                    hold.timer.reset(max(0.0, due - now))

    def hold_forwarded(self) -> None:
        """
        The service sleeps while requests forwarded to it wait for an
        answer: hold each (from when it was forwarded) until it is awake.
        """
        for forwarded in self.forwarded:
            if forwarded.hold is None or forwarded.hold.called:
                forwarded.hold = self.add_hold(True, forwarded.since)
                forwarded.on_hold(forwarded.hold)

    def release(self, error: Exception | None) -> None:
        holds, self.holds = self.holds, []
        self.metrics.held(self.name, 0)
        for hold in holds:
            if hold.timer is not None and hold.timer.active():
                hold.timer.cancel()
            hold.timer = None
            if error is None:
                hold.deferred.callback(None)
            else:
                hold.deferred.errback(error)

    # -- idle tiers ---------------------------------------------------------

    def tier(self) -> tuple[int, float] | None:
        """The next idle tier: (level, idle seconds), or None."""
        config = self.config
        if self.phase == "awake":
            if config.idle_sleep > 0:
                return 1, config.idle_sleep
            if config.idle_offload > 0:
                return 2, config.idle_offload
        elif self.phase == "asleep" and self.level == 1 and config.idle_offload > 0:
            return 2, config.idle_offload
        return None

    def first_tier(self) -> float | None:
        """The idle time of the first configured tier, or None."""
        for idle in (self.config.idle_sleep, self.config.idle_offload):
            if idle > 0:
                return float(idle)
        return None

    def arm(self, idle: _Idle) -> None:
        idle.cancel()
        tier = self.tier()
        if tier is None:
            return
        now = self.clock.seconds()
        if self.active > 0:
            delay = tier[1]  # re-checked then; the end of a request (quiet) moves it
        else:
            delay = max(0.0, self.last_activity + tier[1] - now)
        idle.timer = self.clock.callLater(delay, self.machine.idle_due)

    def idle_level(self) -> int | None:
        """The level to sleep at now, if the idle tier still holds."""
        tier = self.tier()
        if tier is None or self.active > 0:
            return None
        # the same sum as the timer's due time in arm(): "now - last < idle"
        # can be true at the very time it is due (rounding), and a timer
        # re-armed for 0 s would then fire again at once, forever
        if self.clock.seconds() < self.last_activity + tier[1]:
            return None
        return tier[0]

    # -- what the state poll saw ---------------------------------------------

    def observe(self, sleeping: bool, level: int | None) -> None:
        """
        The state poll's answer: asleep at C{level} (None: the poll does not
        say, the level we know stands), or awake.  Awake with a reload
        pending is not awake yet: the next request's wake finishes it.
        """
        if sleeping:
            self.machine.seen_asleep(self.level if level is None else level)
        elif not self.reload_pending:
            self.machine.seen_awake()

    # -- operations ---------------------------------------------------------

    def set_reload_pending(self, pending: bool) -> None:
        if self.reload_pending != pending:
            self.reload_pending = pending
            self.changed()

    def start_check(self) -> _Op:
        d = Deferred.fromCoroutine(self._check())

        def ok(sleeping: bool | None) -> None:
            if self.phase != "unknown":
                return
            if sleeping is None:
                self.machine.check_failed()
            elif sleeping:
                self.machine.found_asleep(self.level)
            elif self.reload_pending:
                # woken but never reloaded (a wake cut short): finish it
                self.machine.need()
            else:
                self.machine.found_awake()

        def failed(f: Failure) -> None:
            if f.check(CancelledError) or self.phase != "unknown":
                return
            log.failure("vLLM service check", f)
            self.machine.check_failed()

        d.addCallbacks(ok, failed)
        d.addErrback(lambda f: log.failure("vLLM check bookkeeping", f))
        return _Op(d)

    def start_wake(self) -> _Op:
        self.wake_started = self.clock.seconds()
        self.wake_called = None
        self.waking_from = None
        d = Deferred.fromCoroutine(self._wake())

        def ok(_: object) -> None:
            if self.phase != "stopped":
                self.machine.woke()

        def failed(f: Failure) -> None:
            if f.check(CancelledError) or self.phase == "stopped":
                return
            if self.recheck and self.active > 0 and self.waking_from is None:
                # it serves a request right now: like a failed request, not down
                log.warn(
                    "vLLM service {service} re-check failed with {active} active"
                    " request(s); kept awake: {error}",
                    service=self.name,
                    active=self.active,
                    error=f"{type(f.value).__name__}: {f.value}",
                )
                self.machine.recheck_failed()
                return
            if f.check(_Unreachable):
                log.warn(
                    "vLLM service {service} unreachable: {error}",
                    service=self.name,
                    error=str(f.value),
                )
                self.machine.unreachable()
                return
            log.error(
                "vLLM service {service} failed to wake: {error}",
                service=self.name,
                error=f"{type(f.value).__name__}: {f.value}",
            )
            self.machine.wake_failed(self.level)

        d.addCallbacks(ok, failed)
        d.addErrback(lambda f: log.failure("vLLM wake bookkeeping", f))
        return _Op(d)

    def start_sleep(self, level: int, reply: Deferred[None] | None) -> _Op:
        escalate = self.phase == "asleep" and self.level == 1 and level == 2
        self.sleep_target = level
        d = Deferred.fromCoroutine(self._sleep(level, escalate))

        def ok(result: int) -> None:
            if self.phase != "stopped":
                self.machine.slept(result)

        def failed(f: Failure) -> None:
            if f.check(CancelledError) or self.phase == "stopped":
                return
            log.error(
                "vLLM service {service} failed to sleep: {error}",
                service=self.name,
                error=f"{type(f.value).__name__}: {f.value}",
            )
            self.last_sleep_error = f.value
            self.machine.sleep_failed()

        d.addCallbacks(ok, failed)
        d.addErrback(lambda f: log.failure("vLLM sleep bookkeeping", f))
        return _Op(d, reply)

    # -- the wake and sleep sequences over the sleep API -------------------

    def _left(self, deadline: float, limit: float) -> float:
        """The timeout of one call: C{limit}, but not past C{deadline}."""
        left = deadline - self.clock.seconds()
        if left <= 0:
            raise _WakeError("the attempt's deadline passed")
        return min(limit, left)

    async def _is_sleeping(self) -> bool:
        """C{GET /is_sleeping}. @raise NoAnswer: unreachable."""
        return await self.client.is_sleeping(self.settings.call_timeout)

    async def _pause(self) -> None:
        await deferLater(self.clock, self.settings.health_poll, lambda: None)

    async def _healthy(self, deadline: float) -> None:
        """Poll C{/health} until 200. @raise _Unreachable, _WakeError."""
        while True:
            reachable = True
            try:
                code = await self.client.health(self.settings.call_timeout)
            except NoAnswer:
                code, reachable = 0, False
            if code == 200:
                return
            if self.clock.seconds() >= deadline:
                if reachable:
                    raise _WakeError(f"/health still {code} at the deadline")
                raise _Unreachable("no answer from /health until the deadline")
            await self._pause()

    async def _probe(self, deadline: float) -> bool:
        """Whether it sleeps; waits out a down service until C{deadline}."""
        try:
            while True:
                try:
                    return await self._is_sleeping()
                except NoAnswer as e:
                    if not self.unreachable:
                        self.unreachable = True
                        self.extend_holds()
                        self.changed()
                    await self._healthy(deadline)
                    # /health answers but /is_sleeping does not
                    if self.clock.seconds() >= deadline:
                        raise _WakeError(f"{e} until the deadline") from e
                    await self._pause()
        finally:
            if self.unreachable:
                self.unreachable = False
                self.changed()

    async def _check(self) -> bool | None:
        """
        One non-waking look: whether it sleeps.  Without an answer it looks
        again after the first idle tier, or gives up (None) if there is none.
        """
        while True:
            try:
                return await self._is_sleeping()
            except (NoAnswer, BadAnswer) as e:
                if self.phase != "unknown":
                    raise CancelledError() from e
                retry = self.first_tier()
                log.info(
                    "vLLM service {service} not checked ({error}); again in {retry}s",
                    service=self.name,
                    error=str(e),
                    retry=retry,
                )
                if retry is None:
                    return None
                await deferLater(self.clock, retry, lambda: None)

    async def _wake(self) -> None:
        try:
            await self._wake_once()
        except (CancelledError, _Unreachable):
            raise
        except Exception as e:
            log.warn(
                "vLLM service {service} wake attempt failed ({error}); retrying",
                service=self.name,
                error=str(e),
            )
            await self._wake_once()

    async def _wake_once(self) -> None:
        settings, client = self.settings, self.client
        deadline = self.clock.seconds() + settings.wake_timeout
        left = self._left
        if await self._probe(deadline):
            # requests forwarded before it was found asleep wait for it too
            self.hold_forwarded()
            depth = self.depth()
            self.waking_from = depth
            self.metrics.wake(self.name, depth)
            log.info(
                "vLLM service {service} waking from {depth}",
                service=self.name,
                depth=depth.value,
            )
            self.set_reload_pending(True)
            if self.wake_called is None:
                self.wake_called = self.clock.seconds()
            await client.wake_up(timeout=left(deadline, settings.wake_timeout))
            while await self._is_sleeping():
                if self.clock.seconds() >= deadline:
                    raise _WakeError("still sleeping after /wake_up")
                await self._pause()
        if self.reload_pending:
            # also when an earlier attempt (or nvproxy instance) got past
            # /wake_up but not through the reload: never half-awake
            await client.reload_weights(left(deadline, settings.wake_timeout))
            await client.reset_prefix_cache(left(deadline, settings.call_timeout))
            self.set_reload_pending(False)
        await self._healthy(deadline)

    async def _sleep(self, level: int, escalate: bool) -> int:
        timeout = self.settings.wake_timeout
        deadline = self.clock.seconds() + timeout
        if escalate and self.settings.escalate_by_wake:
            await self._resleep(level, deadline)
            return level
        try:
            await self.client.sleep(level, "wait", timeout)
            return level
        except BadAnswer as e:
            if not escalate:
                raise _WakeError(f"POST /sleep?level={level} answered {e.code}") from e
            log.warn(
                "vLLM service {service} refused level 2 over level 1 ({code});"
                " waking it to offload",
                service=self.name,
                code=e.code,
            )
        await self._resleep(level, deadline)
        return level

    async def _resleep(self, level: int, deadline: float) -> None:
        timeout = self.settings.wake_timeout
        await self.client.wake_up(timeout=self._left(deadline, timeout))
        await self.client.sleep(level, "wait", self._left(deadline, timeout))


def _refuse(reply: Deferred[None] | None, why: str) -> None:
    if reply is not None:
        reply.errback(Refused(why))


builder = TypeMachineBuilder(_Inputs, _Core)
unknown = builder.state("unknown")
down = builder.state("down")
stopped = builder.state("stopped")


def _awake_data(inputs: _Inputs, core: _Core) -> _Idle:
    core.phase = "awake"
    core.level = None
    core.unreachable = False
    core.verified_at = core.clock.seconds()
    if core.waking_from is not None and core.wake_started is not None:
        took = core.verified_at - core.wake_started
        core.observed[core.waking_from] = took
        core.metrics.woke(core.name, core.waking_from, took)
        if core.wake_called is not None:
            measured = core.verified_at - core.wake_called
            core.estimates.observe(core.name, core.waking_from, measured)
            core.metrics.measured(core.name, core.waking_from, measured)
        log.info(
            "vLLM service {service} awake after {seconds:.1f}s from {depth}",
            service=core.name,
            seconds=took,
            depth=core.waking_from.value,
        )
    core.wake_started = None
    core.wake_called = None
    # a wake (or check) restarts the idle clock: the held callers may have
    # given up long ago, their retries are coming
    core.last_activity = core.verified_at
    core.changed()
    idle = _Idle()
    core.arm(idle)
    return idle


def _asleep_data(inputs: _Inputs, core: _Core, level: int | None) -> _Idle:
    core.phase = "asleep"
    core.level = level
    core.unreachable = False
    core.wake_started = None
    core.wake_called = None
    core.changed()
    idle = _Idle()
    core.arm(idle)
    return idle


def _checking_data(inputs: _Inputs, core: _Core) -> _Op:
    # the phase stays "unknown" (status, persisted intent) while it looks
    return core.start_check()


def _waking_data(inputs: _Inputs, core: _Core) -> _Op:
    core.recheck = core.phase == "awake"
    core.phase = "waking"
    core.changed()
    return core.start_wake()


def _sleeping_data(
    inputs: _Inputs, core: _Core, level: int, reply: Deferred[None] | None
) -> _Op:
    op = core.start_sleep(level, reply)
    core.phase = "sleeping"
    core.changed()
    return op


awake = builder.state("awake", _awake_data)
asleep = builder.state("asleep", _asleep_data)
checking = builder.state("checking", _checking_data)
waking = builder.state("waking", _waking_data)
sleeping = builder.state("sleeping", _sleeping_data)


def _cancel_idle(inputs: _Inputs, core: _Core, idle: _Idle) -> None:
    idle.cancel()


def _cancel_op(inputs: _Inputs, core: _Core, op: _Op) -> None:
    op.deferred.cancel()


# need: wake (or re-check) unless a wake is running or a sleep must finish.
unknown.upon(_Inputs.need).to(waking).returns(None)
down.upon(_Inputs.need).to(waking).returns(None)
waking.upon(_Inputs.need).loop().returns(None)
sleeping.upon(_Inputs.need).loop().returns(None)
awake.upon(_Inputs.need).to(waking)(_cancel_idle)
asleep.upon(_Inputs.need).to(waking)(_cancel_idle)
checking.upon(_Inputs.need).to(waking)(_cancel_op)


@stopped.upon(_Inputs.need).loop()
def _need_stopped(inputs: _Inputs, core: _Core) -> None:
    core.release(ManagerStopped())


# the check (startup, after a failed sleep): where is it, without waking it
unknown.upon(_Inputs.check).to(checking).returns(None)
for _state in (awake, asleep, checking, waking, sleeping, down, stopped):
    _state.upon(_Inputs.check).loop().returns(None)


@checking.upon(_Inputs.found_awake).to(awake)
def _found_awake(inputs: _Inputs, core: _Core, op: _Op) -> None:
    # nobody asked: the first request still checks (someone may sleep it
    # directly before that); the idle clock runs from now
    core.verified_at = -math.inf


checking.upon(_Inputs.found_asleep).to(asleep).returns(None)
checking.upon(_Inputs.check_failed).to(unknown).returns(None)


# the wake operation ends
@waking.upon(_Inputs.woke).to(awake)
def _woke(inputs: _Inputs, core: _Core, op: _Op) -> None:
    core.release(None)


@waking.upon(_Inputs.wake_failed).to(asleep)
def _wake_failed(inputs: _Inputs, core: _Core, op: _Op, level: int | None) -> None:
    core.release(core.waking_error(failed=True))


@waking.upon(_Inputs.unreachable).to(down)
def _unreachable(inputs: _Inputs, core: _Core, op: _Op) -> None:
    core.phase = "down"
    core.wake_started = None
    core.changed()
    core.release(core.waking_error(failed=True))


@waking.upon(_Inputs.recheck_failed).to(awake)
def _recheck_failed(inputs: _Inputs, core: _Core, op: _Op) -> None:
    core.verified_at = -math.inf  # the next request checks again
    core.release(core.waking_error(failed=True))


# admin sleep requests, validated by state
@awake.upon(_Inputs.sleep).loop()
def _sleep_awake(
    inputs: _Inputs, core: _Core, idle: _Idle, level: int, reply: Deferred[None] | None
) -> None:
    if core.active > 0:
        _refuse(reply, f"{core.active} active request(s)")
    else:
        inputs.begin_sleep(level, reply)


@asleep.upon(_Inputs.sleep).loop()
def _sleep_asleep(
    inputs: _Inputs, core: _Core, idle: _Idle, level: int, reply: Deferred[None] | None
) -> None:
    if core.level is not None and core.level >= level:
        if reply is not None:
            reply.callback(None)
    elif core.active > 0:
        _refuse(reply, f"{core.active} active request(s)")
    else:
        inputs.begin_sleep(level, reply)


def _sleep_unknown(
    inputs: _Inputs, core: _Core, level: int, reply: Deferred[None] | None
) -> None:
    if core.active > 0:
        _refuse(reply, f"{core.active} active request(s)")
    else:
        inputs.begin_sleep(level, reply)


unknown.upon(_Inputs.sleep).loop()(_sleep_unknown)
checking.upon(_Inputs.sleep, nodata=True).loop()(_sleep_unknown)


def _refusing(why: str) -> Any:
    def refuse(
        inputs: _Inputs, core: _Core, level: int, reply: Deferred[None] | None
    ) -> None:
        _refuse(reply, why)

    return refuse


def _stopped_reply(
    inputs: _Inputs, core: _Core, level: int, reply: Deferred[None] | None
) -> None:
    if reply is not None:
        reply.errback(ManagerStopped())


for _state, _refusal in (
    (waking, _refusing("a wake is in progress")),
    (sleeping, _refusing("a sleep is in progress")),
):
    _state.upon(_Inputs.sleep, nodata=True).loop()(_refusal)
    _state.upon(_Inputs.begin_sleep, nodata=True).loop()(_refusal)
for _input in (_Inputs.sleep, _Inputs.begin_sleep):
    down.upon(_input).loop()(_refusing("the service is down"))
    stopped.upon(_input).loop()(_stopped_reply)


# the sleep operation
def _begin_idle(
    inputs: _Inputs, core: _Core, idle: _Idle, level: int, reply: Deferred[None] | None
) -> None:
    idle.cancel()


def _begin_checking(
    inputs: _Inputs, core: _Core, op: _Op, level: int, reply: Deferred[None] | None
) -> None:
    op.deferred.cancel()


awake.upon(_Inputs.begin_sleep).to(sleeping)(_begin_idle)
asleep.upon(_Inputs.begin_sleep).to(sleeping)(_begin_idle)
checking.upon(_Inputs.begin_sleep).to(sleeping)(_begin_checking)
unknown.upon(_Inputs.begin_sleep).to(sleeping).returns(None)


@sleeping.upon(_Inputs.slept).to(asleep)
def _slept(inputs: _Inputs, core: _Core, op: _Op, level: int | None) -> None:
    core.metrics.slept(core.name, level)
    log.info(
        "vLLM service {service} asleep at level {sleep_level}",
        service=core.name,
        sleep_level=level,
    )
    if op.reply is not None:
        op.reply.callback(None)
    if core.holds:
        inputs.need()


@sleeping.upon(_Inputs.sleep_failed).to(unknown)
def _sleep_failed(inputs: _Inputs, core: _Core, op: _Op) -> None:
    core.phase = "unknown"
    core.level = None
    core.changed()
    if op.reply is not None:
        error = core.last_sleep_error
        op.reply.errback(error if isinstance(error, Exception) else Refused("failed"))
    if core.holds:
        inputs.need()
    else:
        inputs.check()  # awake or asleep? (the idle timer needs to know)


# idle tiers
def _idle_due(inputs: _Inputs, core: _Core, idle: _Idle) -> None:
    idle.timer = None
    level = core.idle_level()
    if level is None:
        core.arm(idle)
    else:
        inputs.begin_sleep(level, None)


def _rearm(inputs: _Inputs, core: _Core, idle: _Idle) -> None:
    core.arm(idle)


for _state in (awake, asleep):
    _state.upon(_Inputs.idle_due).loop()(_idle_due)
    _state.upon(_Inputs.quiet).loop()(_rearm)
for _state in (unknown, checking, waking, sleeping, down, stopped):
    _state.upon(_Inputs.quiet).loop().returns(None)


# the state poll: what the service says, whoever slept or woke it
@awake.upon(_Inputs.seen_awake).loop()
def _still_awake(inputs: _Inputs, core: _Core, idle: _Idle) -> None:
    core.verified_at = core.clock.seconds()  # evidence; not activity


@awake.upon(_Inputs.seen_asleep).to(asleep)
def _slept_behind(inputs: _Inputs, core: _Core, idle: _Idle, level: int | None) -> None:
    idle.cancel()
    log.warn(
        "vLLM service {service} found asleep (level {sleep_level}) while nvproxy"
        " had it awake; {active} active request(s)",
        service=core.name,
        sleep_level=level,
        active=core.active,
    )
    if core.active > 0:
        # whatever was forwarded waits inside the engine: wake it (the wake
        # holds each such request, bounded by the hold of the depth)
        inputs.need()


@asleep.upon(_Inputs.seen_asleep).loop()
def _still_asleep(inputs: _Inputs, core: _Core, idle: _Idle, level: int | None) -> None:
    if level is not None and level != core.level:
        log.info(
            "vLLM service {service} found asleep at level {sleep_level}"
            " (was {previous})",
            service=core.name,
            sleep_level=level,
            previous=core.level,
        )
        core.level = level
        core.changed()
        core.arm(idle)  # the next tier depends on the level


def _log_found(core: _Core, what: str) -> None:
    log.info(
        "vLLM service {service} found {found} by the state poll",
        service=core.name,
        found=what,
    )


@asleep.upon(_Inputs.seen_awake).to(awake)
def _woken_behind(inputs: _Inputs, core: _Core, idle: _Idle) -> None:
    idle.cancel()
    _log_found(core, "awake")


def _seen_awake_nodata(inputs: _Inputs, core: _Core) -> None:
    _log_found(core, "awake")


def _seen_asleep_nodata(inputs: _Inputs, core: _Core, level: int | None) -> None:
    _log_found(core, "asleep")


def _seen_awake_checking(inputs: _Inputs, core: _Core, op: _Op) -> None:
    op.deferred.cancel()
    _log_found(core, "awake")


def _seen_asleep_checking(
    inputs: _Inputs, core: _Core, op: _Op, level: int | None
) -> None:
    op.deferred.cancel()
    _log_found(core, "asleep")


for _state in (unknown, down):
    _state.upon(_Inputs.seen_awake).to(awake)(_seen_awake_nodata)
    _state.upon(_Inputs.seen_asleep).to(asleep)(_seen_asleep_nodata)
checking.upon(_Inputs.seen_awake).to(awake)(_seen_awake_checking)
checking.upon(_Inputs.seen_asleep).to(asleep)(_seen_asleep_checking)
for _state in (waking, sleeping, stopped):
    # nvproxy's own operation looks for itself
    _state.upon(_Inputs.seen_awake).loop().returns(None)
    _state.upon(_Inputs.seen_asleep).loop().returns(None)


# stop
def _stop(inputs: _Inputs, core: _Core) -> None:
    core.phase = "stopped"
    core.release(ManagerStopped())


def _stop_idle(inputs: _Inputs, core: _Core, idle: _Idle) -> None:
    idle.cancel()
    _stop(inputs, core)


def _stop_op(inputs: _Inputs, core: _Core, op: _Op) -> None:
    _stop(inputs, core)
    op.deferred.cancel()
    if op.reply is not None and not op.reply.called:
        op.reply.errback(ManagerStopped())


for _state in (unknown, down):
    _state.upon(_Inputs.stop).to(stopped)(_stop)
for _state in (awake, asleep):
    _state.upon(_Inputs.stop).to(stopped)(_stop_idle)
for _state in (checking, waking, sleeping):
    _state.upon(_Inputs.stop).to(stopped)(_stop_op)
stopped.upon(_Inputs.stop).loop().returns(None)

_ServiceMachine = indexed(builder.build())
del builder
