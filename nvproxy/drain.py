# -*- test-case-name: tests.test_fleet -*-
"""
Node drain: take this node out of rotation for maintenance without cutting
requests (C{nvproxyctl drain}, C{POST /admin/drain}; undone by
C{nvproxyctl drain --off}, C{DELETE /admin/drain}).

A draining node says so in its node record (L{nvproxy.noderecord}); every
node, itself included, then orders it after every other owner, so it gets
new dispatches only when it is the only owner left.  In-flight work is not
touched.  The state persists in C{<state_dir>/drain.json} until undone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from twisted.logger import Logger

from nvproxy.files import atomic_write

log = Logger()

DRAIN_FILE = "drain.json"


class DrainState:
    """
    Whether this node drains, persisted; L{subscribe}rs are told of every
    change.
    """

    def __init__(self, state_dir: str) -> None:
        self._path = os.path.join(state_dir, DRAIN_FILE)
        self._subscribers: list[Callable[[], None]] = []
        self.draining = self._load()

    def subscribe(self, subscriber: Callable[[], None]) -> None:
        self._subscribers.append(subscriber)

    def set(self, draining: bool) -> bool:
        """
        Drain (or stop draining); persisted before it applies.  Answers
        whether anything changed.

        @raise OSError: it cannot be persisted (nothing changed then).
        """
        if draining == self.draining:
            return False
        data = json.dumps({"version": 1, "draining": draining}).encode() + b"\n"
        atomic_write(self._path, data)
        self.draining = draining
        log.info(
            "this node {action} draining",
            action="is now" if draining else "stopped",
        )
        for subscriber in list(self._subscribers):
            try:
                subscriber()
            except Exception:
                log.failure("drain subscriber failed")
        return True

    def _load(self) -> bool:
        try:
            with open(self._path, "rb") as f:
                doc = json.loads(f.read())
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as e:
            log.warn("ignoring unreadable {path}: {error}", path=self._path, error=e)
            return False
        draining = doc.get("draining") if isinstance(doc, dict) else None
        if not isinstance(draining, bool):
            log.warn("ignoring unreadable {path}: no draining flag", path=self._path)
            return False
        if draining:
            log.info("this node is draining (restored from {path})", path=self._path)
        return draining
