# -*- test-case-name: tests.test_vllm -*-
"""
Errors and sleep depths of the vLLM backend (FD §6.2.1).
"""

from __future__ import annotations

import enum
import json

from nvproxy.config import VllmHold


class UnknownModel(Exception):
    """No service serves this model: 404 C{model_not_found}, no wake."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model {model!r} does not exist")
        self.model = model


class ModelRequired(Exception):
    """The request names no model and its path has no default: 400."""

    def __init__(self, path: str) -> None:
        super().__init__(f"a model is required for {path}")
        self.path = path


class UnknownService(Exception):
    """No vLLM service of this name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown vLLM service {name!r}")
        self.name = name


class Refused(Exception):
    """An admin action refused in the service's current state (409)."""


class ManagerStopped(Exception):
    """The manager stopped while the caller waited."""


class Depth(enum.Enum):
    """How deep a service sleeps, as FD §6.2.1's C{sleep_depth}."""

    SLEEPING = "sleeping"
    OFFLOADED = "offloaded"
    RESTARTING = "restarting"

    @property
    def retry_after(self) -> int:
        return _RETRY_AFTER[self]

    def hold(self, hold: VllmHold) -> float:
        if self is Depth.SLEEPING:
            return hold.sleeping
        if self is Depth.OFFLOADED:
            return hold.offloaded
        return hold.restarting


_RETRY_AFTER = {Depth.SLEEPING: 10, Depth.OFFLOADED: 60, Depth.RESTARTING: 600}
_ESTIMATE = {Depth.SLEEPING: 6.0, Depth.OFFLOADED: 45.0, Depth.RESTARTING: 300.0}
_FROM = {
    Depth.SLEEPING: "is waking from sleep",
    Depth.OFFLOADED: "is waking from offload",
    Depth.RESTARTING: "is restarting",
}


def _depth_of_level(level: int | None) -> Depth:
    return Depth.SLEEPING if level == 1 else Depth.OFFLOADED


class Waking(Exception):
    """
    The service did not become awake within the hold deadline of its depth
    (FD §6.2.1); the wake goes on.  Answer 503 with C{Retry-After}.
    """

    def __init__(
        self,
        service: str,
        model: str,
        depth: Depth,
        estimated_wake_seconds: int,
        *,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(f"vLLM service {service!r} {_FROM[depth]}")
        self.service = service
        self.model = model
        self.depth = depth
        # FD §6.2.1 by depth, unless [engines.vllm] retry_after = "estimate"
        self.retry_after = depth.retry_after if retry_after is None else retry_after
        self.estimated_wake_seconds = estimated_wake_seconds

    @property
    def message(self) -> str:
        return f"Model {self.model!r} {_FROM[self.depth]}; retry shortly"


class WakeFailed(Waking):
    """The wake sequence failed twice (FD §6.6); also a depth-aware 503."""

    @property
    def message(self) -> str:
        return f"Model {self.model!r} failed to wake; retry shortly"


def waking_503_body(model: str, exc: Waking) -> bytes:
    """The OpenAI-style body of FD §6.2.1's depth-aware 503."""
    if isinstance(exc, WakeFailed):
        message = f"Model {model!r} failed to wake; retry shortly"
    else:
        message = f"Model {model!r} {_FROM[exc.depth]}; retry shortly"
    return json.dumps(
        {
            "error": {
                "type": "model_waking",
                "code": "model_waking",
                "message": message,
                "sleep_depth": exc.depth.value,
                "estimated_wake_seconds": exc.estimated_wake_seconds,
            }
        }
    ).encode()
