# -*- test-case-name: tests.test_outliers -*-
"""
Passive outlier ejection: an owner whose attempt just failed at the
transport is ordered last for a short, growing interval, so a node that died
between two discovery polls does not cost every request a failed connect
(or, where connects hang, a dial timeout) first.

Keyed by (engine, node): a node's Ollama can be down while its vLLM is up,
and each is reached at its own address.

One owner's record::

    healthy --transport failure--> ejected for base * 2^(streak-1), at most max
       ^                              |  more transport failures: counted only
       |                              |  the interval passes: healthy, streak kept
       |                              |  one of its endpoints answers a poll:
       |                              |      healthy at once, streak kept
       +------- an attempt commits ---+  (from any state: the record is forgotten)

A streak is forgotten once the owner has gone C{max} seconds since its last
ejection ended without a new transport failure, so the next failure starts
again at C{base}.  Transport failures that arrive while the owner is already
ejected (the other in-flight requests of the same outage) neither extend nor
double the ejection: a burst of concurrent failures is one event.

Ejection only reorders: an ejected owner is still tried, after every other
eligible owner, and is never added to a set it is not eligible for.

Nothing here does I/O; time comes from the injected clock and expiry is
computed when asked, so no timer is ever left behind.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any

from attrs import define, field, frozen, validators
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

__all__ = ["Ejection", "EjectionPolicy", "OutlierTable"]

log = Logger()

OwnerKey = tuple[str, str]
"""(engine id, node id)."""


@frozen
class EjectionPolicy:
    """
    How long an owner stays ejected.

    @ivar base: the first ejection of a streak, in seconds; C{0} disables
        ejection altogether.
    @ivar maximum: the longest ejection; each further ejection of a streak
        doubles the previous one up to it.
    """

    base: float = field(default=1.0, validator=validators.ge(0.0))
    maximum: float = field(default=30.0, validator=validators.ge(0.0))

    @property
    def enabled(self) -> bool:
        return self.base > 0

    def interval(self, streak: int) -> float:
        """The length of the C{streak}-th ejection in a row (from 1)."""
        ceiling = max(self.maximum, self.base)
        # Capped before it can overflow: 2**60 seconds is long enough.
        return min(self.base * 2.0 ** min(streak - 1, 60), ceiling)


@frozen
class Ejection:
    """
    One owner ejected now, as status and metrics show it.

    @ivar remaining: seconds until it is ordered normally again (unless a
        poll or a commit reinstates it earlier).
    @ivar interval: the length of this ejection.
    @ivar failures: transport failures since its last committed attempt.
    """

    engine: str
    node: str
    remaining: float
    interval: float
    failures: int


@define
class _Record:
    streak: int = 0
    failures: int = 0
    until: float = 0.0
    interval: float = 0.0


class OutlierTable:
    """
    The process-wide ejection table, shared by every facade.
    """

    def __init__(
        self, clock: IReactorTime, policy: EjectionPolicy | None = None
    ) -> None:
        self._clock = clock
        self.policy = EjectionPolicy() if policy is None else policy
        self._records: dict[OwnerKey, _Record] = {}
        self._totals: dict[OwnerKey, int] = {}

    # -- what happened ----------------------------------------------------

    def transport_failed(self, engine: str, node: str) -> None:
        """
        An attempt to C{node}'s C{engine} failed at the transport (refused,
        reset, dial or header timeout): eject it unless it already is.
        """
        policy = self.policy
        if not policy.enabled:
            return
        now = self._clock.seconds()
        key = (engine, node)
        record = self._records.get(key)
        if record is None:
            record = self._records[key] = _Record()
        elif now < record.until:
            record.failures += 1
            return
        elif now - record.until >= policy.maximum:
            # Quiet for long enough: this is a new outage, not the same one.
            record.streak = 0
            record.failures = 0
        record.failures += 1
        record.streak += 1
        record.interval = policy.interval(record.streak)
        record.until = now + record.interval
        self._totals[key] = self._totals.get(key, 0) + 1
        log.info(
            "{engine} node {node} ejected for {interval}s after a transport"
            " failure ({failures} since its last answer)",
            engine=engine,
            node=node,
            interval=record.interval,
            failures=record.failures,
        )

    def served(self, engine: str, node: str) -> None:
        """
        An attempt to C{node}'s C{engine} committed: reinstate it and forget
        its streak.
        """
        record = self._records.pop((engine, node), None)
        if record is not None and self._clock.seconds() < record.until:
            log.info(
                "{engine} node {node} reinstated: an attempt succeeded",
                engine=engine,
                node=node,
            )

    def answered(self, engine: str, node: str) -> None:
        """
        One of C{node}'s C{engine} endpoints answered a discovery poll:
        reinstate it now, but keep its streak, so a node that answers polls
        and still fails requests is ejected for longer each time.
        """
        record = self._records.get((engine, node))
        if record is None:
            return
        now = self._clock.seconds()
        if now < record.until:
            record.until = now
            log.info(
                "{engine} node {node} reinstated: it answered a poll",
                engine=engine,
                node=node,
            )

    # -- what it means ----------------------------------------------------

    def is_ejected(self, engine: str, node: str) -> bool:
        if not self._records:
            return False
        record = self._records.get((engine, node))
        return record is not None and self._clock.seconds() < record.until

    def ejected_among(self, engine: str, nodes: Collection[str]) -> frozenset[str]:
        """
        Which of C{nodes} are ejected now for C{engine}: one look at the
        ejected, not one question per owner of a round.
        """
        if not self._records:
            return frozenset()
        now = self._clock.seconds()
        return frozenset(
            node
            for (of, node), record in self._records.items()
            if of == engine and now < record.until and node in nodes
        )

    def ejected(self) -> list[Ejection]:
        """Every owner ejected now, by engine then node."""
        now = self._clock.seconds()
        self._forget_calm(now)
        return [
            Ejection(engine, node, record.until - now, record.interval, record.failures)
            for (engine, node), record in sorted(self._records.items())
            if now < record.until
        ]

    def totals(self) -> Mapping[OwnerKey, int]:
        """Ejections so far per owner (never reset: a counter's source)."""
        return MappingProxyType(self._totals)

    def status(self) -> dict[str, dict[str, dict[str, Any]]]:
        """
        C{{engine: {node: {"remaining_s", "interval_s", "failures"}}}} for
        every owner ejected now (the admin status's C{"ejected"}).
        """
        result: dict[str, dict[str, dict[str, Any]]] = {}
        for ejection in self.ejected():
            result.setdefault(ejection.engine, {})[ejection.node] = {
                "remaining_s": round(ejection.remaining, 3),
                "interval_s": ejection.interval,
                "failures": ejection.failures,
            }
        return result

    def _forget_calm(self, now: float) -> None:
        maximum = self.policy.maximum
        for key in [
            key
            for key, record in self._records.items()
            if now - record.until >= maximum and now >= record.until
        ]:
            del self._records[key]
