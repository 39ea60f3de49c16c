# -*- test-case-name: tests.test_ctl -*-
"""
How C{nvproxyctl} shows the daemon's answers to people: tables and
sentences.  (C{--json} prints the answer itself instead.)  Every function
takes the decoded JSON answer and returns the text to print; none raises on
a field it does not know or that is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["FORMATTERS", "table"]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell, two spaces apart."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
        for row in [list(headers), *cells]
    ]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "-"
    return str(value)


def _seconds(value: object) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.1f}s"
    return None


def _wake_estimate(service: Mapping[str, Any]) -> str | None:
    """The estimate for the depth it sleeps at (else the shallowest)."""
    estimates = service.get("wake_estimates")
    if not isinstance(estimates, Mapping) or not estimates:
        return _seconds(service.get("wake_estimate_s"))
    depth = service.get("sleep_depth")
    value = estimates.get(depth) if depth in estimates else min(estimates.values())
    return _seconds(value)


def _discovery(answer: Any) -> str:
    d = answer.get("discovery") or {}
    provider = d.get("provider", "mesh")
    if provider != "etcd":
        return f"discovery: {provider}"
    age = d.get("snapshot_age_s")
    text = (
        f"discovery: etcd {d.get('endpoint') or ''} {d.get('state')}, revision"
        f" {d.get('revision')}, {d.get('records')} record(s), snapshot age"
        f" {_seconds(age) or '-'}"
    )
    if d.get("error"):
        text += f" ({d['error']})"
    return text


def _readiness_rows(answer: Any) -> list[list[object]]:
    rows: list[list[object]] = []
    for record in answer.get("records") or []:
        for engine, engine_record in sorted((record.get("engines") or {}).items()):
            for model, state in sorted((engine_record.get("models") or {}).items()):
                readiness = state.get("readiness")
                estimate = state.get("wake_estimate_s")
                rows.append(
                    [
                        record.get("node"),
                        engine,
                        model,
                        readiness,
                        None if readiness == "awake" else _seconds(estimate),
                        record.get("draining"),
                    ]
                )
    return rows


def status(answer: Any) -> str:
    parts = [f"node {answer.get('node_id')}: {answer.get('inflight', 0)} in flight"]
    if answer.get("draining"):
        parts[0] += ", draining (no new dispatches while others own its models)"
    parts[0] += "\n" + _discovery(answer)
    facades = answer.get("facades") or []
    parts.append(
        "facades:\n"
        + table(
            ["ENGINE", "PORT", "LISTENING", "ERROR", "SELECTED"],
            [
                [
                    f.get("engine"),
                    f.get("port"),
                    f.get("listening"),
                    f.get("error"),
                    f.get("selected"),
                ]
                for f in facades
            ],
        )
    )
    nodes: Mapping[str, Mapping[str, Sequence[str]]] = answer.get("nodes") or {}
    parts.append(
        "nodes:\n"
        + table(
            ["NODE", "ENGINE", "MODELS"],
            [
                [node, engine, list(models)]
                for node, engines in sorted(nodes.items())
                for engine, models in sorted(engines.items())
            ],
        )
    )
    readiness = _readiness_rows(answer)
    if readiness:
        parts.append(
            "readiness:\n"
            + table(
                ["NODE", "ENGINE", "MODEL", "READINESS", "WAKE EST.", "DRAINING"],
                readiness,
            )
        )
    services = answer.get("vllm") or []
    if services:
        parts.append(
            "vLLM services:\n"
            + table(
                ["SERVICE", "STATE", "DEPTH", "ACTIVE", "LAST ACTIVITY", "WAKE EST."],
                [
                    [
                        s.get("name"),
                        s.get("state"),
                        s.get("sleep_depth"),
                        s.get("active_requests"),
                        s.get("last_activity"),
                        _wake_estimate(s),
                    ]
                    for s in services
                ],
            )
        )
    reservations: Mapping[str, int] = answer.get("reservations") or {}
    parts.append(
        "reservations:\n" + table(["NODE", "RESERVED"], sorted(reservations.items()))
    )
    return "\n\n".join(parts)


def _ms_between(start: object, end: object) -> str | None:
    if isinstance(start, int) and isinstance(end, int):
        return f"{(end - start) / 1000:.1f}s"
    return None


def workloads(answer: Any) -> str:
    rows = []
    for entry in answer.get("workloads") or []:
        info = entry.get("workloadInfo", entry)
        stats = info.get("stats") or {}
        ttft = stats.get("ttftMs")
        tps = stats.get("tokensPerSecond")
        rows.append(
            [
                info.get("id"),
                info.get("engine"),
                info.get("model"),
                info.get("scheduledOn"),
                info.get("state"),
                None if ttft is None else f"{ttft}ms",
                None if tps is None else f"{tps:.1f}",
                _ms_between(info.get("createdAt"), info.get("completedAt")),
                info.get("requestId"),
            ]
        )
    if not rows:
        return "no workloads yet"
    return table(
        [
            "ID",
            "ENGINE",
            "MODEL",
            "NODE",
            "STATE",
            "TTFT",
            "TOK/S",
            "DURATION",
            "REQUEST ID",
        ],
        rows,
    )


def wake(answer: Any) -> str:
    return f"{answer.get('service')} is awake"


def sleep(answer: Any) -> str:
    return f"{answer.get('service')} is asleep (level {answer.get('level')})"


def set_port(answer: Any) -> str:
    return f"{answer.get('engine')} facade now listens on port {answer.get('port')}"


def select(answer: Any) -> str:
    node = answer.get("selected")
    if node is None:
        return f"{answer.get('engine')}: no node selected"
    return f"{answer.get('engine')}: requests go to {node} first"


def reload(answer: Any) -> str:
    changed = answer.get("changed") or []
    lines = [
        "configuration reloaded: "
        + (f"changed {', '.join(changed)}" if changed else "nothing changed")
    ]
    for key in answer.get("restart_required") or []:
        lines.append(f"{key} changed: it takes effect at the next restart")
    return "\n".join(lines)


def drain(answer: Any) -> str:
    if answer.get("draining"):
        return (
            f"{answer.get('node_id')} is draining: no new dispatches where another"
            " node owns the model; in-flight work finishes"
        )
    return f"{answer.get('node_id')} is back in rotation"


FORMATTERS: Mapping[str, Callable[[Any], str]] = {
    "drain": drain,
    "status": status,
    "workloads": workloads,
    "wake": wake,
    "sleep": sleep,
    "set-port": set_port,
    "select": select,
    "reload": reload,
}
"""The human form of each admin command's answer, by command name."""


def refusal(answer: Any, raw: bytes) -> list[str]:
    """The lines of a refusal: its message, then each of its C{errors}."""
    if isinstance(answer, Mapping):
        lines = [str(answer.get("error", "refused"))]
        lines += [str(e) for e in answer.get("errors") or []]
        return lines
    return [raw.decode("utf-8", "replace").strip() or "refused"]
