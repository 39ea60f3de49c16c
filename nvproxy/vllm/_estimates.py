# -*- test-case-name: tests.test_estimates -*-
"""
Learned wake estimates (DESIGN §4, FD §9's "re-tuned from latencies").

Each vLLM service keeps, per sleep depth, an exponentially weighted moving
average of the wakes it measured (from the first wake call to the first
healthy answer), seeded from FD §6.2.1's typical durations (6 / 45 / 300 s).
The estimates are persisted in C{<state_dir>/vllm-wake-estimates.json} on
every measurement, so a restart keeps what was learned; an unreadable or
foreign file is ignored with one log line.

File format (version 1)::

    {"version": 1,
     "services": {"text": {"sleeping": {"estimate": 7.5, "samples": 3}}}}
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

from twisted.logger import Logger

from nvproxy.files import atomic_write
from nvproxy.vllm._errors import _ESTIMATE, Depth

log = Logger()

ESTIMATES_FILE = "vllm-wake-estimates.json"

ALPHA = 0.3
"""Weight of the newest measurement in the moving average."""


class WakeEstimates:
    """
    Per (service, depth): the current estimate in seconds and how many wakes
    shaped it.

    @param state_dir: where the estimates persist; C{None}: in memory only.
    @param alpha: weight of each new measurement (0 < alpha <= 1).
    @param changed: called after every measurement.
    """

    def __init__(
        self,
        services: Iterable[str],
        state_dir: str | None,
        *,
        alpha: float = ALPHA,
        changed: Callable[[], None] | None = None,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self._alpha = alpha
        self._changed = changed
        self._path = (
            None if state_dir is None else os.path.join(state_dir, ESTIMATES_FILE)
        )
        self._estimates: dict[tuple[str, Depth], tuple[float, int]] = {}
        self._services = tuple(services)
        self._load()

    def estimate(self, service: str, depth: Depth) -> float:
        """The current estimate of a wake of C{service} from C{depth}."""
        value, _ = self._estimates.get((service, depth), (_ESTIMATE[depth], 0))
        return value

    def samples(self, service: str, depth: Depth) -> int:
        return self._estimates.get((service, depth), (0.0, 0))[1]

    def observe(self, service: str, depth: Depth, seconds: float) -> float:
        """
        One measured wake of C{service} from C{depth}; answers the new
        estimate.  The first measurement moves the seed by C{alpha} like any
        other: one slow wake does not make the next hold give up early.
        """
        if not math.isfinite(seconds) or seconds < 0:
            return self.estimate(service, depth)
        old, count = self._estimates.get((service, depth), (_ESTIMATE[depth], 0))
        new = old + self._alpha * (seconds - old)
        self._estimates[(service, depth)] = (new, count + 1)
        self._save()
        if self._changed is not None:
            self._changed()
        return new

    def all(self) -> list[tuple[str, Depth, float]]:
        """Every (service, depth, estimate), seeds included."""
        return [
            (service, depth, self.estimate(service, depth))
            for service in self._services
            for depth in Depth
        ]

    def _load(self) -> None:
        if self._path is None:
            return
        try:
            with open(self._path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return
        except OSError as e:
            log.warn("cannot read {path}: {error}", path=self._path, error=str(e))
            return
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("version") != 1:
                raise ValueError("not a version 1 estimates file")
            services = doc["services"]
            if not isinstance(services, dict):
                raise TypeError("services is not an object")
            loaded = dict(_entries(services))
        except (ValueError, KeyError, TypeError, OverflowError) as e:
            log.warn("ignoring unreadable {path}: {error}", path=self._path, error=e)
            return
        known = set(self._services)
        self._estimates.update(
            {key: value for key, value in loaded.items() if key[0] in known}
        )

    def _save(self) -> None:
        if self._path is None:
            return
        services: dict[str, dict[str, Any]] = {}
        for (service, depth), (value, count) in sorted(
            self._estimates.items(), key=lambda item: (item[0][0], item[0][1].value)
        ):
            services.setdefault(service, {})[depth.value] = {
                "estimate": round(value, 3),
                "samples": count,
            }
        data = json.dumps({"version": 1, "services": services}, sort_keys=True)
        try:
            atomic_write(self._path, data.encode() + b"\n")
        except OSError as e:
            log.error("cannot persist {path}: {error}", path=self._path, error=str(e))


def _entries(
    services: dict[str, Any],
) -> Iterable[tuple[tuple[str, Depth], tuple[float, int]]]:
    for service, depths in services.items():
        if not isinstance(depths, dict):
            raise TypeError(f"service {service!r} is not an object")
        for name, entry in depths.items():
            depth = Depth(name)
            value = entry["estimate"]
            count = entry.get("samples", 0)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(float(value))
                or value < 0
            ):
                raise ValueError(f"bad estimate for {service}/{name}")
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"bad sample count for {service}/{name}")
            yield (service, depth), (float(value), count)
