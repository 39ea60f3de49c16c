# -*- test-case-name: tests.test_vllm -*-
"""
The state poll of one vLLM service: its C{vllm:engine_sleep_state} gauge on
C{/metrics} (C{GET /is_sleeping} when the gauge is absent or C{/metrics}
fails), every C{poll_interval}, without waking it or counting as activity.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from nvproxy.vllm._client import BadAnswer, NoAnswer, SleepApi
from nvproxy.vllm._machine import _Core

log = Logger()

GAUGE = "vllm:engine_sleep_state"

# one sample line: the name, an optional label set, the value (a timestamp
# may follow); label values are quoted strings that may hold "}" or '\"'
_SAMPLE = re.compile(
    rb"^vllm:engine_sleep_state(?:\{((?:[^\"}]|\"(?:[^\"\\]|\\.)*\")*)\})?"
    rb"[ \t]+(\S+)",
    re.MULTILINE,
)
_SLEEP_STATE = re.compile(rb'(?:^|,)\s*sleep_state\s*=\s*"([^"]*)"')

# how long a stop waits for a poll in flight before cancelling it: treq
# cannot cancel a body read, and a connection handed back to the pool after
# it was closed would outlive the stop
_STOP_WAIT = 1.0


@attrs.frozen
class Observed:
    """
    What a look at a service found.

    @ivar level: the sleep level when C{sleeping} (1 or 2), if it is known.
    """

    sleeping: bool
    level: int | None = None


def parse_sleep_state(metrics: bytes) -> Observed | None:
    """
    The state told by the C{vllm:engine_sleep_state} gauge of a Prometheus
    exposition: one sample per C{sleep_state} (C{awake}, C{weights_offloaded}
    = level 1, C{discard_all} = level 2), value 1 for the one that holds.
    With several engines (data parallel) any sleeping engine makes the
    service asleep, the deepest level wins.

    @return: None if the gauge is absent or tells nothing readable.
    """
    seen: dict[bytes, float] = {}
    for match in _SAMPLE.finditer(metrics):
        labels, raw = match.group(1) or b"", match.group(2)
        state = _SLEEP_STATE.search(labels)
        try:
            value = float(raw)
        except ValueError:
            continue
        if state is None or value != value:  # no label, or NaN
            continue
        name = state.group(1)
        if name == b"awake":
            seen[name] = min(seen.get(name, value), value)
        else:
            seen[name] = max(seen.get(name, value), value)
    if seen.get(b"discard_all", 0.0) >= 0.5:
        return Observed(True, 2)
    if seen.get(b"weights_offloaded", 0.0) >= 0.5:
        return Observed(True, 1)
    if b"awake" not in seen:
        return None
    if seen[b"awake"] >= 0.5:
        return Observed(False)
    return Observed(True, None)


class _Poller:
    """
    Polls one service (over C{client}) every C{interval} while it is not
    being woken or put to sleep by nvproxy (those operations look for
    themselves), and hands what it finds to L{_Core.observe} unless the
    state changed meanwhile.
    One poll at a time: the next is scheduled when one ends.
    """

    def __init__(self, core: _Core, client: SleepApi, interval: float) -> None:
        self.core = core
        self.client = client
        self.interval = interval
        self._timer: IDelayedCall | None = None
        self._look: Deferred[Any] | None = None
        self._stopped = True
        self._failing = False

    def start(self) -> None:
        self._stopped = False
        self._schedule()

    def stop(self) -> Deferred[None]:
        """
        No more polls; fires when the one in flight (if any) has ended, at
        most C{_STOP_WAIT} later (then it is cancelled).
        """
        self._stopped = True
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()
        look, self._look = self._look, None
        if look is None:
            return succeed(None)
        done: Deferred[None] = Deferred()
        give_up = self.core.clock.callLater(_STOP_WAIT, look.cancel)

        def ended(_: object) -> None:
            if give_up.active():
                give_up.cancel()
            done.callback(None)

        look.addBoth(ended)
        return done

    def _schedule(self) -> None:
        self._timer = self.core.clock.callLater(self.interval, self._tick)

    def _tick(self) -> None:
        self._timer = None
        core = self.core
        if self._stopped:
            return
        if core.phase in ("waking", "sleeping", "stopped"):
            self._schedule()
            return
        epoch = core.epoch
        look = self._look = Deferred.fromCoroutine(self._once())

        def seen(observed: Observed | None) -> None:
            if self._look is not look:
                return  # stopped meanwhile
            if observed is None:
                if not self._failing:
                    self._failing = True
                    log.info(
                        "vLLM service {service} state poll got no answer",
                        service=core.name,
                    )
                return
            if self._failing:
                self._failing = False
                log.info(
                    "vLLM service {service} state poll answers again",
                    service=core.name,
                )
            if core.epoch == epoch:
                core.observe(observed.sleeping, observed.level)

        def failed(f: Failure) -> None:
            if not f.check(CancelledError):
                log.failure("vLLM state poll", f)

        def next_poll(_: object) -> None:
            if self._look is look:
                self._look = None
                self._schedule()

        look.addCallbacks(seen, failed).addBoth(next_poll)

    async def _once(self) -> Observed | None:
        """The gauge, else C{/is_sleeping}; None without an answer."""
        try:
            observed = parse_sleep_state(await self.client.metrics())
        except (NoAnswer, BadAnswer):
            observed = None
        if observed is not None:
            return observed
        if self._stopped:
            return None
        try:
            return Observed(await self.client.is_sleeping())
        except (NoAnswer, BadAnswer):
            return None
