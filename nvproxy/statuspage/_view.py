# -*- test-case-name: tests.test_statuspage -*-
"""
What the status page shows, computed from C{GET /admin/status} and the
recent workloads: plain JSON, no I/O.  The same document is the C{snapshot}
event of C{GET /admin/events}; its top-level keys are the units of the
C{update} events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["READINESS", "SECTIONS", "view"]

READINESS = ("awake", "waking", "sleeping", "offloaded", "restarting")
"""The readiness of a model on a node (the node record's)."""

SECTIONS = (
    "node",
    "draining",
    "nodes",
    "models",
    "services",
    "inflight",
    "facades",
    "workloads",
)
"""The top-level keys of a view, each replaced whole by an C{update}."""


def _service_readiness(service: Mapping[str, Any]) -> str:
    """A local vLLM service's readiness, from its state (no node record)."""
    state = service.get("state")
    if state == "awake":
        return "awake"
    if state == "waking":
        return "waking"
    if state == "down":
        return "restarting"
    depth = service.get("sleep_depth")
    if depth in ("sleeping", "offloaded", "restarting"):
        return str(depth)
    # Asleep at an unknown depth, or not checked yet: assume the deepest
    # sleep that still holds the model (DESIGN §4, unknown -> offloaded).
    return "offloaded"


def _records(status: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    records = status.get("records")
    if not isinstance(records, list):
        return None
    return [r for r in records if isinstance(r, Mapping) and "node" in r]


Placement = tuple[str, str, str, str, float | None]
"""(model, engine, node, readiness, wake estimate)"""


def _from_records(
    records: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, dict[str, Any]], list[Placement]]:
    nodes: dict[str, dict[str, Any]] = {}
    placements: list[Placement] = []
    for record in records:
        node_id = str(record["node"])
        engines: dict[str, Any] = {}
        for engine, data in sorted((record.get("engines") or {}).items()):
            models = data.get("models") or {}
            engines[engine] = {
                "models": len(models),
                "in_flight": data.get("in_flight"),
                "port": data.get("port"),
            }
            for model, info in sorted(models.items()):
                readiness = info.get("readiness", "awake")
                estimate = info.get("wake_estimate_s")
                placements.append(
                    (
                        model,
                        engine,
                        node_id,
                        readiness if readiness in READINESS else "awake",
                        float(estimate) if isinstance(estimate, int | float) else None,
                    )
                )
        nodes[node_id] = {
            "id": node_id,
            "draining": bool(record.get("draining", False)),
            "generation": record.get("generation"),
            "engines": engines,
        }
    return nodes, placements


def _from_status(
    status: Mapping[str, Any],
) -> tuple[dict[str, dict[str, Any]], list[Placement]]:
    own = str(status.get("node_id", ""))
    local_models: dict[str, str] = {}
    for service in status.get("vllm") or []:
        local_models[str(service.get("model"))] = _service_readiness(service)
    nodes: dict[str, dict[str, Any]] = {}
    placements: list[Placement] = []
    for node_id, engines in sorted((status.get("nodes") or {}).items()):
        entry: dict[str, Any] = {}
        for engine, models in sorted(engines.items()):
            entry[engine] = {"models": len(models), "in_flight": None, "port": None}
            for model in models:
                readiness = "awake"
                if engine == "vllm" and node_id in (own, "local"):
                    readiness = local_models.get(model, "awake")
                placements.append(
                    (str(model), str(engine), str(node_id), readiness, None)
                )
        nodes[node_id] = {
            "id": node_id,
            "draining": False,
            "generation": None,
            "engines": entry,
        }
    return nodes, placements


def _workload(entry: Mapping[str, Any]) -> dict[str, Any]:
    info = entry.get("workloadInfo") or {}
    stats = info.get("stats") or {}
    created = info.get("createdAt")
    completed = info.get("completedAt")
    duration = None
    if isinstance(created, int) and isinstance(completed, int):
        duration = completed - created
    return {
        "id": info.get("id"),
        "requestId": info.get("requestId"),
        "model": info.get("model"),
        "engine": info.get("engine"),
        "node": info.get("scheduledOn"),
        "state": info.get("state"),
        "error": info.get("error"),
        "createdAt": created,
        "completedAt": completed,
        "durationMs": duration,
        "ttftMs": stats.get("ttftMs"),
        "tokensPerSecond": stats.get("tokensPerSecond"),
        "completionTokens": stats.get("completionTokens"),
        "truncated": bool(info.get("truncated", False)),
    }


def view(
    status: Mapping[str, Any], workloads: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """
    The page's document: C{node} (this node's id), C{nodes} (every known
    node, this one first, with per engine the number of models, in-flight
    count and reservations), C{models} (per model and engine where it is
    served and how ready), C{services} (this node's vLLM services),
    C{inflight}, C{facades} and C{workloads} (the most recent first).

    Readiness comes from C{status["records"]} (node records) when present,
    else from the status itself: this node's vLLM services by their state,
    every other model awake.
    """
    own = str(status.get("node_id", ""))
    records = _records(status)
    if records is not None:
        nodes, placements = _from_records(records)
    else:
        nodes, placements = _from_status(status)
    reservations = status.get("reservations") or {}
    loads = status.get("loads") or {}
    for node_id, node in nodes.items():
        node["self"] = node_id in (own, "local")
        node["reservations"] = reservations.get(node_id, loads.get(node_id, 0))
    ordered = sorted(nodes.values(), key=lambda n: (not n["self"], n["id"]))
    by_model: dict[tuple[str, str], list[dict[str, Any]]] = {}
    rank = {readiness: n for n, readiness in enumerate(READINESS)}
    for model, engine, node_id, readiness, estimate in placements:
        by_model.setdefault((model, engine), []).append(
            {"node": node_id, "readiness": readiness, "wake_estimate_s": estimate}
        )

    def readiest(place: dict[str, Any]) -> tuple[int, str]:
        return rank.get(place["readiness"], 0), str(place["node"])

    models: list[dict[str, Any]] = [
        {"name": model, "engine": engine, "where": sorted(where, key=readiest)}
        for (model, engine), where in sorted(by_model.items())
    ]
    services = [
        {
            "name": s.get("name"),
            "model": s.get("model"),
            "state": s.get("state"),
            "readiness": _service_readiness(s),
            "sleep_depth": s.get("sleep_depth"),
            "active_requests": s.get("active_requests", 0),
            "held_requests": s.get("held_requests", 0),
            "last_activity": s.get("last_activity"),
        }
        for s in status.get("vllm") or []
    ]
    facades = [
        {
            "engine": f.get("engine"),
            "port": f.get("port"),
            "listening": f.get("listening"),
        }
        for f in status.get("facades") or []
    ]
    draining = bool(status.get("draining", False))
    if own in nodes:
        draining = draining or bool(nodes[own]["draining"])
    return {
        "node": own,
        "draining": draining,
        "nodes": ordered,
        "models": models,
        "services": services,
        "inflight": status.get("inflight", 0),
        "facades": facades,
        "workloads": [_workload(w) for w in workloads],
    }
