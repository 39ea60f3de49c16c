# -*- test-case-name: tests.test_vllm -*-
"""
L{VllmManager}: the vLLM services of this node, and their admin routes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, gatherResults, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from nvproxy.config import VllmHold, VllmServiceConfig
from nvproxy.ports import atomic_write
from nvproxy.readiness import ModelReadiness, Readiness
from nvproxy.vllm._client import SleepApiClient
from nvproxy.vllm._errors import Depth, UnknownService
from nvproxy.vllm._estimates import WakeEstimates
from nvproxy.vllm._machine import _Core, _Forwarded, _ServiceMachine, _Settings
from nvproxy.vllm._poll import _Poller
from nvproxy.vllm._registry import VllmRegistry

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from treq.client import HTTPClient

log = Logger()

STATE_FILE = "vllm-state.json"


class _Metrics:
    """Prometheus metrics of the wake path; no-ops without a registry."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.on = registry is not None
        if registry is None:
            return
        from prometheus_client import Counter, Gauge, Histogram

        self._wakes = Counter(
            "nvproxy_vllm_wakes",
            "Wake sequences started, by depth.",
            ["service", "depth"],
            registry=registry,
        )
        self._latency = Histogram(
            "nvproxy_vllm_wake_seconds",
            "Time from the start of a wake to the service being awake.",
            ["service", "depth"],
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 180, 300, 600),
            registry=registry,
        )
        self._held = Gauge(
            "nvproxy_vllm_held_requests",
            "Requests waiting for their service to wake.",
            ["service"],
            registry=registry,
        )
        self._503 = Counter(
            "nvproxy_vllm_waking_503",
            "Depth-aware 503 answers, by depth.",
            ["service", "depth"],
            registry=registry,
        )
        self._duration = Histogram(
            "nvproxy_vllm_wake_duration_seconds",
            "Measured wakes: from the first wake call to the first healthy"
            " answer, by service and depth (what the wake estimate learns from).",
            ["service", "depth"],
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 180, 300, 600),
            registry=registry,
        )
        self._sleeps = Counter(
            "nvproxy_vllm_sleeps",
            "Sleeps completed, by level.",
            ["service", "level"],
            registry=registry,
        )

    def wake(self, service: str, depth: Depth) -> None:
        if self.on:
            self._wakes.labels(service, depth.value).inc()

    def woke(self, service: str, depth: Depth, seconds: float) -> None:
        if self.on:
            self._latency.labels(service, depth.value).observe(seconds)

    def measured(self, service: str, depth: Depth, seconds: float) -> None:
        if self.on:
            self._duration.labels(service, depth.value).observe(seconds)

    def estimates(self, registry: CollectorRegistry, estimates: WakeEstimates) -> None:
        """The learned estimates as a gauge, read at scrape time."""
        registry.register(_EstimateGauge(estimates))

    def held(self, service: str, count: int) -> None:
        if self.on:
            self._held.labels(service).set(count)

    def answered_503(self, service: str, depth: Depth) -> None:
        if self.on:
            self._503.labels(service, depth.value).inc()

    def slept(self, service: str, level: int | None) -> None:
        if self.on:
            self._sleeps.labels(service, str(level)).inc()


class _EstimateGauge:
    """C{nvproxy_vllm_wake_estimate_seconds{service,depth}}."""

    def __init__(self, estimates: WakeEstimates) -> None:
        self._estimates = estimates

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            "nvproxy_vllm_wake_estimate_seconds",
            "The learned wake estimate by service and depth (seeded from"
            " FD §6.2.1, an exponentially weighted average of measured wakes).",
            labels=["service", "depth"],
        )
        for service, depth, value in self._estimates.all():
            family.add_metric([service, depth.value], value)
        yield family


class VllmManager(Service):
    """
    The vLLM services of this node: wake on demand, hold, idle sleep, admin
    control, and persisted wake intent (C{<state_dir>/vllm-state.json}).

    @param http: the control-plane treq client (every call to a service).
    @param poll_interval: how often each service's state is polled (its
        C{vllm:engine_sleep_state} gauge, else C{/is_sleeping}); None: never.
    @param state_ttl: how long evidence that a service is awake (a poll, a
        wake, a served request) is trusted; past it, the next request
        re-checks first (the re-check holds the request).  With polling it
        only runs out while the polls fail.
    @param health_poll: the interval of C{/health} and C{/is_sleeping} polls.
    @param call_timeout: the timeout of short calls (C{/is_sleeping},
        C{/health}, C{/reset_prefix_cache}).
    @param wake_timeout: the deadline of one wake attempt (health polls
        included, also while the service is down) and of one sleep; each
        call of it gets at most what is left.
    @param escalate_by_wake: offload a level-1 sleeper by waking it and
        sleeping it at level 2, rather than C{/sleep?level=2} directly.
    @param metrics: where to register Prometheus metrics, if anywhere.
    @param retry_after_estimate: the depth-aware 503's C{Retry-After} is the
        wake estimate (rounded up, at least 1) instead of FD §6.2.1's value
        for the depth (C{[engines.vllm] retry_after = "estimate"}).
    """

    def __init__(
        self,
        services: Sequence[VllmServiceConfig],
        hold: VllmHold,
        http: HTTPClient,
        clock: IReactorTime,
        state_dir: str,
        *,
        poll_interval: float | None = None,
        state_ttl: float = 10.0,
        health_poll: float = 0.5,
        call_timeout: float = 10.0,
        wake_timeout: float = 600.0,
        escalate_by_wake: bool = False,
        metrics: CollectorRegistry | None = None,
        retry_after_estimate: bool = False,
    ) -> None:
        self.registry = VllmRegistry(services)
        self.retry_after_estimate = retry_after_estimate
        self._subscribers: dict[object, Callable[[], None]] = {}
        self._notice: Any = None
        # Learned wake times, persisted (survive restarts and rebuilds).
        self.estimates = WakeEstimates(
            [s.name for s in self.registry.services], state_dir
        )
        self.hold = hold
        self.http = http
        self.clock = clock
        self.poll_interval = poll_interval
        self.state_ttl = state_ttl
        self.health_poll = health_poll
        self.call_timeout = call_timeout
        self.wake_timeout = wake_timeout
        self.escalate_by_wake = escalate_by_wake
        self.metrics = _Metrics(metrics)
        if metrics is not None:
            self.metrics.estimates(metrics, self.estimates)
        self._path = os.path.join(state_dir, STATE_FILE)
        self._written: bytes | None = None
        self._stopping = False
        self._started = False
        self._cores: dict[str, _Core] = {}
        self._pollers: dict[str, _Poller] = {}
        self._build()

    def _build(self) -> None:
        """One fresh machine per service (learned wake times carry over)."""
        old = self._cores
        self._cores = {}
        self._pollers = {}
        settings = _Settings(
            wake_timeout=self.wake_timeout,
            health_poll=self.health_poll,
            call_timeout=self.call_timeout,
            escalate_by_wake=self.escalate_by_wake,
            retry_after_estimate=self.retry_after_estimate,
        )
        for service in self.registry.services:
            client = SleepApiClient(
                self.http, self.clock, service.url, service.name, self.call_timeout
            )
            core = _Core(
                service,
                clock=self.clock,
                hold=self.hold,
                client=client,
                metrics=self.metrics,
                changed=self.changed,
                settings=settings,
                estimates=self.estimates,
            )
            core.phase_changed = self._phase_changed
            core.machine = _ServiceMachine(core)
            if service.name in old:
                core.observed = old[service.name].observed
            self._cores[service.name] = core
            if self.poll_interval is not None and self.poll_interval > 0:
                poller = _Poller(core, client, self.poll_interval)
                self._pollers[service.name] = poller

    def _core(self, name: str) -> _Core:
        try:
            return self._cores[name]
        except KeyError:
            raise UnknownService(name) from None

    # -- lifecycle ----------------------------------------------------------

    def startService(self) -> None:
        """
        Start (or restart after L{stopService}): a restart builds fresh
        machines and recovers from the state file as a new process would.
        """
        super().startService()  # type: ignore[no-untyped-call]
        if self._started:
            self._build()
        self._started = True
        self._stopping = False
        self._recover()
        for poller in self._pollers.values():
            poller.start()

    def stopService(self) -> Deferred[None]:
        """
        Stop every machine (holds fail with L{ManagerStopped}); fires once
        no state poll is in flight any more.
        """
        super().stopService()  # type: ignore[no-untyped-call]
        self._stopping = True
        polls = [poller.stop() for poller in self._pollers.values()]
        for core in self._cores.values():
            core.machine.stop()
        if self._notice is not None and self._notice.active():
            self._notice.cancel()
        self._notice = None
        return gatherResults(polls).addCallback(lambda _: None)

    def _recover(self) -> None:
        """
        FD §6.4: bring services we were keeping awake back to a known state;
        look at every other one once (C{GET /is_sleeping}, no wake): a
        rebooted vLLM boots awake whatever we persisted (FD §6.6), and an
        awake service needs its idle timer.  A persisted level is only the
        depth if it is found asleep (also during a wake: a wake from level 1
        cut by a restart still answers with the level-1 depth).
        """
        saved = self._load()
        for name, core in self._cores.items():
            if core.phase != "unknown":
                continue
            entry = saved.get(name)
            if not isinstance(entry, dict):
                entry = {}
            intent = entry.get("intent")
            level = entry.get("level")
            core.reload_pending = entry.get("reload_pending") is True
            core.level = level if level in (1, 2) else None
            if intent in ("awake", "waking"):
                log.info(
                    "vLLM service {service} was {intent}: checking it",
                    service=name,
                    intent=intent,
                )
                core.machine.need()
            else:
                core.machine.check()

    def _load(self) -> dict[str, Any]:
        try:
            with open(self._path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return {}
        except OSError as e:
            log.warn("cannot read {path}: {error}", path=self._path, error=str(e))
            return {}
        try:
            doc = json.loads(raw)
            services = doc["services"]
            if not isinstance(services, dict):
                raise TypeError("services is not an object")
        except (ValueError, KeyError, TypeError) as e:
            log.warn("ignoring unreadable {path}: {error}", path=self._path, error=e)
            return {}
        self._written = raw
        return services

    def changed(self) -> None:
        """Persist the wake intent of every service if it changed."""
        if self._stopping:
            return
        services: dict[str, dict[str, Any]] = {}
        for name, c in self._cores.items():
            level = c.sleep_target if c.phase == "sleeping" else c.level
            services[name] = {
                "intent": c.phase,
                "level": level,
                "reload_pending": c.reload_pending,
            }
        data = json.dumps({"version": 1, "services": services}, sort_keys=True)
        raw = data.encode()
        if raw == self._written:
            return
        try:
            atomic_write(self._path, raw)
        except OSError as e:
            log.error("cannot persist {path}: {error}", path=self._path, error=str(e))
            return
        self._written = raw

    # -- request path -------------------------------------------------------

    def ensure_awake(self, name: str) -> Deferred[None]:
        """
        Fire once service C{name} is known awake (at once if it is and the
        knowledge is fresh).  Cancelling stops the wait, not the wake.

        @raise UnknownService: at once.
        @return: fails with L{Waking} when the hold of the depth passes, with
            L{WakeFailed} when the wake sequence failed twice.
        """
        core = self._core(name)
        if (
            core.phase == "awake"
            and self.clock.seconds() - core.verified_at <= self.state_ttl
        ):
            return succeed(None)
        d = core.add_hold(deadline=True)
        core.machine.need()
        return d

    def forwarded(
        self, name: str, on_hold: Callable[[Deferred[None]], None]
    ) -> Callable[[], None]:
        """
        A request was forwarded to service C{name} (it counts as active
        already) and waits for its answer.  Should the service turn out to
        be asleep meanwhile, it is woken and C{on_hold} gets a hold: it
        fires once the service is awake again, or fails with L{Waking} (or
        L{WakeFailed}) at the hold deadline of the depth, counted from now.

        @return: call it once the answer came (or the attempt ended): it
            drops the registration and any hold still pending.
        """
        core = self._core(name)
        entry = _Forwarded(self.clock.seconds(), on_hold)
        core.forwarded.append(entry)

        def answered() -> None:
            if entry in core.forwarded:
                core.forwarded.remove(entry)
            hold, entry.hold = entry.hold, None
            if hold is not None and not hold.called:
                hold.cancel()

        return answered

    def request_started(self, name: str) -> None:
        core = self._core(name)
        core.active += 1
        core.last_activity = self.clock.seconds()

    def request_finished(self, name: str, served: bool = True) -> None:
        """
        @param served: the service answered (below 500): evidence that it is
            awake.  False forces a re-check before the next request.
        """
        core = self._core(name)
        core.active = max(0, core.active - 1)
        now = core.last_activity = self.clock.seconds()
        if not served:
            core.verified_at = -math.inf
        elif core.phase == "awake":
            core.verified_at = now
        if core.active == 0:
            core.machine.quiet()  # the idle timer runs from now

    def is_awake(self, name: str) -> bool:
        return self._core(name).phase == "awake"

    def readiness(self, name: str) -> ModelReadiness:
        """
        How ready service C{name} is (the node record's readiness): awake,
        waking (with what is left of its estimate), or asleep at its depth
        (going to sleep counts as the depth it is going to; unknown counts
        as offloaded; down as restarting) with the learned estimate.
        """
        core = self._core(name)
        phase = core.phase
        if phase == "awake":
            return ModelReadiness("awake", 0.0)
        if phase == "waking":
            depth = core.waking_from or core.depth()
            return ModelReadiness("waking", core.remaining(depth))
        depth = Depth.RESTARTING if phase == "stopped" else core.depth()
        readiness: Readiness = depth.value
        return ModelReadiness(readiness, core.estimates.estimate(name, depth))

    def subscribe(self, subscriber: Callable[[], None]) -> Callable[[], None]:
        """
        Call C{subscriber} (soon after, on the clock; several changes in a
        row are told once) whenever a service's state changes.
        """
        token = object()
        self._subscribers[token] = subscriber

        def unsubscribe() -> None:
            self._subscribers.pop(token, None)

        return unsubscribe

    def _phase_changed(self) -> None:
        # Never from inside a state machine transition: a subscriber may
        # dispatch, and so feed the machine again.
        if self._notice is None and self._subscribers and not self._stopping:
            self._notice = self.clock.callLater(0, self._tell)

    def _tell(self) -> None:
        self._notice = None
        for subscriber in list(self._subscribers.values()):
            try:
                subscriber()
            except Exception:
                log.failure("vLLM state subscriber failed")

    def answered_503(self, name: str, depth: Depth) -> None:
        self.metrics.answered_503(name, depth)

    # -- admin --------------------------------------------------------------

    def wake(self, name: str) -> Deferred[None]:
        """Wake C{name} with no hold deadline; fails with L{WakeFailed}."""
        core = self._core(name)
        d = core.add_hold(deadline=False)
        core.machine.need()
        return d

    def sleep(self, name: str, level: int) -> Deferred[None]:
        """
        Sleep C{name} at C{level} (1 or 2) with C{mode=wait}.

        @return: fails with L{Refused} with active requests, during a wake or
            a sleep, or when the service is down.
        """
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        core = self._core(name)
        reply: Deferred[None] = Deferred()
        core.machine.sleep(level, reply)
        return reply

    def reconfigure(
        self,
        hold: VllmHold,
        state_ttl: float,
        services: Sequence[VllmServiceConfig],
    ) -> None:
        """
        A configuration reload: new holds and C{state_ttl} for requests from
        now on, and each service's new idle times from its next idle
        period.  The services themselves (names, URLs, models, aliases,
        routes) must be the ones running.
        """
        self.hold = hold
        self.state_ttl = state_ttl
        by_name = {service.name: service for service in services}
        for core in self._cores.values():
            core.hold = hold
            new = by_name.get(core.name)
            if new is not None:
                core.config = new

    def status(self) -> list[dict[str, Any]]:
        out = []
        for core in self._cores.values():
            depth: str | None = None
            if core.phase in ("waking", "down", "sleeping"):
                depth = core.depth().value
            elif core.phase == "asleep":
                depth = "unknown" if core.level is None else core.depth().value
            out.append(
                {
                    "name": core.name,
                    "model": core.config.model,
                    "url": core.config.url,
                    "state": core.phase,
                    "sleep_depth": depth,
                    "sleep_level": core.level,
                    "active_requests": core.active,
                    "held_requests": len(core.holds),
                    "last_activity": core.last_activity,
                    "wake_in_progress": core.phase == "waking",
                    "readiness": self.readiness(core.name).readiness,
                    "wake_estimates": {
                        depth.value: round(self.estimates.estimate(core.name, depth), 3)
                        for depth in Depth
                    },
                }
            )
        return out
