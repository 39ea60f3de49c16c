# -*- test-case-name: tests.test_noderecord -*-
"""
How ready a node's model is to serve: the vocabulary the node record
(L{nvproxy.noderecord}), discovery snapshots and dispatch ordering share.

Best first::

    awake < waking < sleeping (level 1) < offloaded (level 2) < restarting

Plain engines (Ollama, LM Studio, llama.cpp) are always C{awake}.
"""

from __future__ import annotations

from typing import Final, Literal

from attrs import field, frozen, validators

Readiness = Literal["awake", "waking", "sleeping", "offloaded", "restarting"]

READINESS: Final[tuple[Readiness, ...]] = (
    "awake",
    "waking",
    "sleeping",
    "offloaded",
    "restarting",
)
"""Every readiness, best first."""

RANK: Final[dict[str, int]] = {name: rank for rank, name in enumerate(READINESS)}


def _estimate(value: float) -> float:
    return float(value)


@frozen
class ModelReadiness:
    """
    One model on one node: its readiness and the seconds a wake would take
    now (0 when awake).
    """

    readiness: Readiness = field(default="awake", validator=validators.in_(READINESS))
    wake_estimate_s: float = field(
        default=0.0, converter=_estimate, validator=validators.ge(0.0)
    )

    @property
    def rank(self) -> tuple[int, float]:
        """Sort key: the readiness class, then the wake estimate."""
        return (RANK[self.readiness], self.wake_estimate_s)


AWAKE: Final = ModelReadiness()
