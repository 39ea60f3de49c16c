# -*- test-case-name: tests.test_vllm_machine -*-
"""
Random sequences against the vLLM service machine (L{nvproxy.vllm}): requests
that start, end or are given up, admin wakes and sleeps, sleeps and wakes
behind nvproxy's back (noticed by the state poll), wake failures, a service
that goes down and comes back, and idle timers running out, all on one
C{Clock} with L{FakeVLLM} in memory (C{StubTreq}).

After every step:

* a request is forwarded (released from its hold) only while the machine
  says the service is awake;
* no C{POST /sleep} reaches the service while a request is active;
* the fake saw nothing a correct proxy never makes it see (requests while
  asleep only after a sleep behind nvproxy's back);
* with nothing active, held or in progress, the only timers are the
  documented ones: the idle timer and the state poll;

and once everything is stopped, no C{DelayedCall} is left.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, ClassVar

import treq
from hypothesis import given, settings
from hypothesis import strategies as st
from treq.testing import StubTreq
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.test.requesthelper import DummyRequest
from zope.interface import implementer

from nvproxy.config import VllmHold, VllmServiceConfig
from nvproxy.dispatch import AttemptFailed, Committed, FailureKind, StreamEnd
from nvproxy.testing.fakevllm import (
    REQUEST_WHILE_ASLEEP,
    REQUEST_WHILE_WAKING,
    EngineState,
    FakeVLLM,
)
from nvproxy.vllm import VllmManager, WakingTarget

NAME = "text"
MODEL = "m"
URL = "http://text.test:8001"

Step = tuple[Any, ...]
"""
One step of a sequence:

  - C{("request", stream, final)}: a request through a L{WakingTarget};
  - C{("give_up", i)}: the client of a pending attempt goes away;
  - C{("advance", seconds)}: the clock moves on, timer by timer;
  - C{("sleep", level)} / C{("wake",)}: admin calls;
  - C{("external_sleep", level)} / C{("external_wake",)}: someone else
    sleeps or wakes the engine (only the state poll can tell);
  - C{("wake_failures", n)}: the engine's next C{n} wakes fail;
  - C{("down",)} / C{("up",)}: the engine dies (503) and comes back awake.
"""

_STEPS: dict[str, st.SearchStrategy[Step]] = {
    "request": st.tuples(st.just("request"), st.booleans(), st.booleans()),
    "give_up": st.tuples(st.just("give_up"), st.integers(min_value=0, max_value=7)),
    "advance": st.tuples(
        st.just("advance"), st.sampled_from([0.1, 0.5, 1.0, 3.0, 11.0, 31.0, 65.0])
    ),
    "sleep": st.tuples(st.just("sleep"), st.sampled_from([1, 2])),
    "wake": st.just(("wake",)),
    "external_sleep": st.tuples(st.just("external_sleep"), st.sampled_from([1, 2])),
    "external_wake": st.just(("external_wake",)),
    "wake_failures": st.tuples(
        st.just("wake_failures"), st.integers(min_value=1, max_value=3)
    ),
    "down": st.just(("down",)),
    "up": st.just(("up",)),
}
# requests and time are what everything else acts upon: drawn more often
_KINDS = [*["request"] * 4, *["advance"] * 3, "give_up", "sleep", "sleep", "wake"]
_KINDS += ["external_sleep", "external_wake", "wake_failures", "down", "up"]
steps: st.SearchStrategy[Step] = st.sampled_from(_KINDS).flatmap(_STEPS.__getitem__)

worlds = st.fixed_dictionaries(
    {
        "asleep_at_start": st.sampled_from([None, 1, 2]),
        "wake_latency": st.sampled_from([0.0, 0.6, 4.0]),
        "chunk_interval": st.sampled_from([0.0, 0.4]),
        "poll_interval": st.sampled_from([None, 5.0]),
        "idle_sleep": st.sampled_from([0, 20]),
        "idle_offload": st.sampled_from([0, 60]),
    }
)


@implementer(IResource)
class _Watch:
    """In front of the fake: checks every C{POST /sleep} as it arrives."""

    isLeaf: ClassVar[bool] = True

    def __init__(self, world: _World) -> None:
        self.world = world

    def getChildWithDefault(self, name: bytes, request: IRequest) -> IResource:
        return self

    def putChild(self, path: bytes, child: IResource) -> None:
        raise NotImplementedError()

    def render(self, request: Any) -> Any:
        world = self.world
        if request.path == b"/sleep":
            active = world.status()["active_requests"]
            if active or world.in_engine:
                world.broken.append(
                    f"POST /sleep with {active} active request(s),"
                    f" {world.in_engine} in the engine"
                )
        return world.fake.resource().render(request)


class _Client:
    """The part of a client side the waking target uses."""

    def __init__(self) -> None:
        self.request = DummyRequest([b""])
        self.gone = False


class _Inner:
    """An inference request sent to the fake (the forwarded attempt)."""

    def __init__(self, world: _World, stream: bool) -> None:
        self.result: Deferred[Committed | AttemptFailed] = Deferred()
        self.done: Deferred[StreamEnd] = Deferred()
        self.world = world
        self.over = False
        world.in_engine += 1
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": stream,
        }
        stub: Any = world.stub
        self._d: Deferred[Any] = stub.post(
            URL + "/v1/chat/completions", json=body, unbuffered=True
        )
        self._d.addCallbacks(self._response, self._failed)

    def _end(self) -> None:
        if not self.over:
            self.over = True
            self.world.in_engine -= 1

    def _failed(self, failure: Failure) -> None:
        self._end()
        if not self.result.called:
            self.result.callback(AttemptFailed("node", FailureKind.TRANSPORT))

    def _response(self, response: Any) -> None:
        self.result.callback(Committed("node", response.code, self.done))
        body: Deferred[bytes] = treq.content(response)

        def ended(how: StreamEnd) -> None:
            self._end()
            self.done.callback(how)

        body.addCallbacks(
            lambda _: ended(StreamEnd.COMPLETE), lambda _: ended(StreamEnd.TRUNCATED)
        )

    def cancel(self) -> None:
        self._d.cancel()

    def abort(self) -> None:
        self._d.cancel()


class _Target:
    node_id = "node"

    def __init__(self, world: _World, stream: bool) -> None:
        self.world = world
        self.stream = stream

    def start(self, final: bool) -> _Inner:
        world = self.world
        if not world.manager.is_awake(NAME):
            world.broken.append(f"forwarded while {world.status()['state']}")
        return _Inner(world, self.stream)


class _World:
    """One example: a clock, the fake behind a watch, a manager."""

    def __init__(self, config: dict[str, Any], state_dir: str) -> None:
        self.clock = Clock()
        self.fake = FakeVLLM(
            clock=self.clock,
            model=MODEL,
            wake_latency=config["wake_latency"],
            chunk_interval=config["chunk_interval"],
            # as vLLM on CPU: a request reaching a sleeper waits inside it
            crash_on_request_while_asleep=False,
            down_mode="503",
        )
        if config["asleep_at_start"] is not None:
            self.fake.force_sleep(config["asleep_at_start"])
        self.stub = StubTreq(_Watch(self))
        self.broken: list[str] = []
        self.in_engine = 0
        self.behind_our_back = False
        self.attempts: list[Any] = []
        service = VllmServiceConfig(
            NAME,
            URL,
            MODEL,
            idle_sleep=config["idle_sleep"],
            idle_offload=config["idle_offload"],
        )
        self.manager = VllmManager(
            (service,),
            VllmHold(sleeping=10, offloaded=30, restarting=40),
            self.stub,  # type: ignore[arg-type]
            self.clock,
            state_dir,
            poll_interval=config["poll_interval"],
            wake_timeout=20,
            health_poll=2,
            call_timeout=5,
        )
        self.manager.startService()
        self.pump()

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.manager.status()[0]
        return status

    def pump(self) -> None:
        for _ in range(20):
            self.stub.flush()

    def advance(self, seconds: float) -> None:
        """Move the clock from timer to timer, pumping after each."""
        end = self.clock.seconds() + seconds
        for _ in range(2000):
            due = [call.getTime() for call in self.clock.getDelayedCalls()]
            step = min([end, *due]) - self.clock.seconds()
            self.clock.advance(max(0.0, step))
            self.pump()
            if self.clock.seconds() >= end:
                return
        raise AssertionError("timers keep firing without the clock moving on")

    def run(self, step: Step) -> None:
        kind = step[0]
        fake = self.fake
        if kind == "request":
            target = WakingTarget(
                _Target(self, step[1]),  # type: ignore[arg-type]
                self.manager,
                NAME,
                _Client(),  # type: ignore[arg-type]
            )
            self.attempts.append(target.start(final=step[2]))
        elif kind == "give_up":
            pending = [a for a in self.attempts if not a.result.called]
            if pending:
                pending[step[1] % len(pending)].cancel()
        elif kind == "advance":
            self.advance(step[1])
        elif kind == "sleep":
            self.manager.sleep(NAME, step[1]).addErrback(lambda _: None)
        elif kind == "wake":
            self.manager.wake(NAME).addErrback(lambda _: None)
        elif kind == "external_sleep":
            if fake.state is EngineState.AWAKE and fake.running == 0:
                self.behind_our_back = True
                fake.force_sleep(step[1])
        elif kind == "external_wake":
            if fake.state is EngineState.ASLEEP:
                fake.force_wake()
        elif kind == "wake_failures":
            fake.wake_failures = step[1]
        elif kind == "down":
            if fake.state is not EngineState.DOWN:
                fake.set_down()
        elif kind == "up":
            if fake.state is EngineState.DOWN:
                fake.set_up()
        self.pump()

    def check(self) -> None:
        """The invariants that hold after every step."""
        assert not self.broken, self.broken
        allowed = {REQUEST_WHILE_ASLEEP} if self.behind_our_back else set()
        seen = [v for v in self.fake.violations if v.kind not in allowed]
        assert not seen, seen
        if self.behind_our_back:
            # a request reaching a sleeper it did not know asleep: never a
            # waking one (nvproxy only ever wakes it itself)
            waking = [v for v in self.fake.violations if v.kind == REQUEST_WHILE_WAKING]
            assert not waking, waking
        status = self.status()
        quiet = (
            status["active_requests"] == 0
            and status["held_requests"] == 0
            and status["state"] in ("awake", "asleep", "down")
        )
        if quiet:
            names = sorted(_timer_name(call) for call in self.clock.getDelayedCalls())
            assert all(name in ("idle_due", "_tick") for name in names), (
                f"{status['state']}: timers {names}"
            )
            assert names.count("idle_due") <= 1 and names.count("_tick") <= 1, names

    def stop(self) -> None:
        """Stop everything; then no timer may be left."""
        stopped = self.manager.stopService()
        self.pump()
        self.advance(2)  # a poll in flight is waited for, at most 1 s
        assert stopped.called
        self.fake.stop()
        self.pump()
        for attempt in self.attempts:
            assert attempt.result.called, "an attempt outlived the stop"
        left = self.clock.getDelayedCalls()
        assert left == [], [_timer_name(call) for call in left]


def _timer_name(call: Any) -> str:
    """C{idle_due} (the idle timer), C{_tick} (the state poll), or what."""
    name = str(getattr(call.func, "__name__", call.func))
    for known in ("idle_due", "_tick"):
        if known in name:
            return known
    return name


class ServiceMachineSequenceTests(SynchronousTestCase):
    @settings(max_examples=200)
    @given(worlds, st.lists(steps, min_size=5, max_size=40), st.booleans())
    def test_random_sequences(
        self, config: dict[str, Any], sequence: list[Step], settle: bool
    ) -> None:
        """
        The invariants of the module docstring hold after every step; then
        (after everything settled, or in the middle of things) it stops and
        leaves no timer behind.
        """
        with tempfile.TemporaryDirectory() as state_dir:
            world = _World(config, os.path.join(state_dir, "state"))
            world.check()
            for step in sequence:
                world.run(step)
                world.check()
            if settle:
                # everything ends: streams finish, holds expire, wakes end
                world.advance(120)
                world.check()
                status = world.status()
                assert status["held_requests"] == 0, status
                if not (world.behind_our_back and config["poll_interval"] is None):
                    # (unpolled, a request sent to a sleeper nvproxy believes
                    # awake waits inside it: the poll is what notices)
                    assert status["active_requests"] == 0, status
            # stopped (settled or in the middle of things): no timer is left
            world.stop()
