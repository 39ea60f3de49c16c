# -*- test-case-name: tests.test_shutdown -*-
"""
The shutdown drain: what happens between SIGTERM (or the broker link
closing, or C{stopService}) and the process exiting.

1. Every listening port is closed at once: no new connection is accepted.
2. Requests not yet committed (still choosing a node, backing off, holding
   for a vLLM wake) are answered 503 with C{Retry-After} in their engine's
   dialect: they never reached an engine, so the client can retry elsewhere.
   A request arriving on an open keep-alive connection gets the same answer.
3. Committed requests go on streaming until they end or C{shutdown.grace}
   passes; whatever is left then ends as C{cancelled} (reason
   C{"shutdown"}).  A second SIGTERM ends the grace at once.
4. Client connections still open are closed after their buffered bytes are
   written (bounded by L{FLUSH_TIMEOUT}), then the daemon's other services
   stop, the pool closes and twistd exits with status 0.

The drain as a state machine::

    serving --begin--> draining [grace timer] --jobs_done------> done
                          |                  --grace_expired--> done
                          |                  --force----------> done
                          +-- begin: the same Deferred

The signals that drive it are L{nvproxy.signals}'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from attrs import define, field
from automat import TypeMachineBuilder
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from nvproxy.automata import indexed

__all__ = ["FLUSH_TIMEOUT", "Drainable", "Shutdown"]

log = Logger()

FLUSH_TIMEOUT = 2.0
"""Seconds client connections get to write what they have buffered."""


class Drainable(Protocol):
    """What the drain asks of the dispatcher."""

    def drain(self) -> None:
        """Refuse new jobs; answer every uncommitted job 503."""

    def idle(self) -> Deferred[None]:
        """Fires once no job is in flight."""

    def shutdown(self) -> None:
        """Cancel every job still in flight."""

    def inflight(self) -> int:
        """Jobs not yet finished."""


class _DrainInputs(Protocol):
    def begin(self) -> Deferred[None]:
        "Start draining (SIGTERM, link closed, stopService)."

    def jobs_done(self) -> None:
        "The last job in flight finished."

    def grace_expired(self) -> None:
        "shutdown.grace passed."

    def force(self) -> None:
        "A second SIGTERM: end the drain now."


@define
class _DrainCore:
    clock: IReactorTime
    grace: float
    dispatcher: Drainable
    close_ports: Callable[[], Deferred[Any]]
    close_connections: Callable[[float], Deferred[Any]]
    result: Deferred[None] = field(factory=Deferred)
    begun: bool = False
    started_at: float = 0.0
    ports_closed: Deferred[Any] | None = None

    def finish(self, how: str) -> None:
        log.info(
            "shutdown: drain ended ({how}) after {elapsed:.1f}s",
            how=how,
            elapsed=self.clock.seconds() - self.started_at,
        )
        waits: list[Deferred[Any]] = [self.close_connections(FLUSH_TIMEOUT)]
        if self.ports_closed is not None:
            waits.append(self.ports_closed)
        done = gatherResults(waits, consumeErrors=True)
        done.addErrback(lambda reason: log.failure("shutdown: closing", reason))
        done.addBoth(lambda _: self.result.callback(None))

    def cancel_rest(self) -> None:
        left = self.dispatcher.inflight()
        if left:
            log.info(
                "shutdown: cancelling {count} request(s) still in flight", count=left
            )
        self.dispatcher.shutdown()


@define
class _Draining:
    timer: IDelayedCall


def _start_draining(inputs: _DrainInputs, core: _DrainCore) -> _Draining:
    core.begun = True
    core.started_at = core.clock.seconds()
    core.ports_closed = core.close_ports()
    core.dispatcher.drain()
    log.info(
        "shutdown: ports closed; draining {count} committed request(s), grace {grace}s",
        count=core.dispatcher.inflight(),
        grace=core.grace,
    )
    timer = core.clock.callLater(core.grace, inputs.grace_expired)
    # Possibly at once (nothing in flight): the machine queues it.
    core.dispatcher.idle().addCallback(lambda _: inputs.jobs_done())
    return _Draining(timer)


def _build() -> Callable[[_DrainCore], _DrainInputs]:
    builder = TypeMachineBuilder(_DrainInputs, _DrainCore)
    serving = builder.state("serving")
    draining = builder.state("draining", _start_draining)
    done = builder.state("done")

    @serving.upon(_DrainInputs.begin).to(draining)
    def _begin(c: _DrainInputs, core: _DrainCore) -> Deferred[None]:
        return core.result

    @draining.upon(_DrainInputs.begin).loop()
    def _again(c: _DrainInputs, core: _DrainCore, d: _Draining) -> Deferred[None]:
        return core.result

    @draining.upon(_DrainInputs.jobs_done).to(done)
    def _drained(c: _DrainInputs, core: _DrainCore, d: _Draining) -> None:
        if d.timer.active():
            d.timer.cancel()
        core.finish("every request finished")

    @draining.upon(_DrainInputs.grace_expired).to(done)
    def _expired(c: _DrainInputs, core: _DrainCore, d: _Draining) -> None:
        core.cancel_rest()
        core.finish("grace expired")

    @draining.upon(_DrainInputs.force).to(done)
    def _forced(c: _DrainInputs, core: _DrainCore, d: _Draining) -> None:
        if d.timer.active():
            d.timer.cancel()
        core.cancel_rest()
        core.finish("second signal")

    @done.upon(_DrainInputs.begin).loop()
    def _over(c: _DrainInputs, core: _DrainCore) -> Deferred[None]:
        return core.result

    serving.upon(_DrainInputs.jobs_done).loop().returns(None)
    serving.upon(_DrainInputs.grace_expired).loop().returns(None)
    serving.upon(_DrainInputs.force).loop().returns(None)
    # The cancelled jobs' idle notification, a late timer.
    done.upon(_DrainInputs.jobs_done).loop().returns(None)
    done.upon(_DrainInputs.grace_expired).loop().returns(None)
    done.upon(_DrainInputs.force).loop().returns(None)
    return indexed(builder.build())


_DrainMachine = _build()


class Shutdown:
    """
    The daemon's drain: L{begin} once stopping starts, L{force} on a second
    signal.

    @param grace: seconds committed requests get to finish.
    @param close_ports: stops every listening port.
    @param close_connections: closes every client connection once its
        buffered bytes are written, within the given seconds.
    """

    def __init__(
        self,
        clock: IReactorTime,
        grace: float,
        dispatcher: Drainable,
        close_ports: Callable[[], Deferred[Any]],
        close_connections: Callable[[float], Deferred[Any]],
    ) -> None:
        self._core = _DrainCore(
            clock, grace, dispatcher, close_ports, close_connections
        )
        self._machine = _DrainMachine(self._core)

    @property
    def grace(self) -> float:
        """Seconds committed requests get; a reload may change it."""
        return self._core.grace

    @grace.setter
    def grace(self, seconds: float) -> None:
        self._core.grace = seconds

    @property
    def draining(self) -> bool:
        """Whether the drain has begun (perhaps ended)."""
        return self._core.begun

    def begin(self) -> Deferred[None]:
        """
        Drain; fires once the drain is over and connections are closed.  Every
        call returns a Deferred on the same end.
        """
        result = self._machine.begin()
        mine: Deferred[None] = Deferred()

        def fire(value: None) -> None:
            mine.callback(None)
            return value

        result.addCallback(fire)
        return mine

    def force(self) -> None:
        """End the drain now: what is in flight is cancelled."""
        self._machine.force()
