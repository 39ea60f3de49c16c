"""
The soak's per-request checks: given what every client saw (L{Answer}),
every receipt and node event the engine doubles recorded, and the daemon's
workload events, list the violations of spec §1.1 and §5.1-§5.5.

Pure functions over plain data, so they can be read (and tested) apart from
the processes that produced the data.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.soak.client import Answer

TERMINAL = {"workload:completed", "workload:errored"}

# The messages of the proxy's own answers (nvproxy.dispatch.RejectReason).
PROXY_REASONS = {
    "no node advertises the requested model": ("no_owner_at_admission", 502),
    "the final dispatch attempt failed to reach the engine": ("transport_final", 502),
    "the node of the final dispatch attempt left the cluster": (
        "target_lost_final",
        502,
    ),
    "the final dispatch attempt answered but produced no content": (
        "no_content_final",
        504,
    ),
    "deadline passed while attempts were failing": ("deadline", 503),
    "no owner became available": ("no_owner", 503),
    "every dispatch attempt failed": ("exhausted", 503),
    "the proxy is shutting down": ("shutdown", 503),
}

# A node event (stop or hide) this close before or after an engine wrote a
# body excuses a redispatch: the proxy may have cancelled the attempt for a
# lost target (§5.3) before it read bytes already on the wire.
EXCUSE_BEFORE = 1.5
EXCUSE_AFTER = 0.3
DISCONNECT_SLACK = 1.0


@dataclass(frozen=True)
class Bounds:
    max_attempts: int
    deadline: float
    dial_timeout: float
    header_timeout: float
    backoff_max: float
    slack: float = 3.0

    @property
    def longest(self) -> float:
        """
        The longest a request may take (§5.1): the deadline plus one whole
        attempt (dial, headers, first content), plus a backoff and slack
        for a loaded machine.
        """
        return (
            self.deadline
            + self.dial_timeout
            + 2 * self.header_timeout
            + self.backoff_max * 1.2
            + self.slack
        )


@dataclass
class Violation:
    kind: str
    soak: str
    detail: str


@dataclass
class Workload:
    id: str
    model: str
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def dispatches(self) -> list[str]:
        return [
            e["scheduledOn"]
            for method, e in self.pairs
            if method == "workload:submitted" and e.get("scheduledOn")
        ]

    @property
    def pairs(self) -> list[tuple[str, dict[str, Any]]]:
        return [(e["method"], e["params"]["workloadInfo"]) for e in self.events]

    @property
    def terminal(self) -> dict[str, Any] | None:
        found = [info for method, info in self.pairs if method in TERMINAL]
        return found[-1] if found else None

    @property
    def created_ms(self) -> int:
        return int(self.pairs[0][1]["createdAt"])


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    excused: Counter[str] = field(default_factory=Counter)
    states: Counter[str] = field(default_factory=Counter)
    dispatches: int = 0

    def add(self, kind: str, soak: str, detail: str) -> None:
        self.violations.append(Violation(kind, soak, detail))


def workloads_from(
    lines: Iterable[dict[str, Any]], report: Report
) -> dict[str, Workload]:
    """Group the event log by workload id; checks C{seq} over the file."""
    result: dict[str, Workload] = {}
    last_seq = 0
    for note in lines:
        info = note["params"]["workloadInfo"]
        seq = int(info["seq"])
        if seq <= last_seq:
            report.add(
                "seq-not-increasing",
                f"workload {info['id']}",
                f"seq {seq} after {last_seq} in the event log",
            )
        last_seq = seq
        w = result.setdefault(info["id"], Workload(info["id"], info["model"]))
        w.events.append(note)
    return result


def _excused(
    events: Sequence[dict[str, Any]], node: str, t: float
) -> dict[str, Any] | None:
    for e in events:
        if (
            e["node"] == node
            and e["event"] in ("stop", "hide")
            and t - EXCUSE_BEFORE <= e["t"] <= t + EXCUSE_AFTER
        ):
            return e
    return None


def _read_late(
    rs: Sequence[dict[str, Any]],
    w: Workload | None,
    answered: Mapping[str, Any],
    after: float,
) -> list[dict[str, Any]]:
    """
    The receipts of C{rs} that an engine read after C{after} although the
    proxy had dispatched them, and let go of them, before the dispatch that
    C{answered} (the receipt the client's answer came from) answered.

    A receipt's C{t_recv} is when the engine process got to the request,
    not when it was sent: the soak runs every engine, the proxy and the
    client on the same few cores, and an engine that is not scheduled for
    some milliseconds reads a request that much later, after the proxy has
    given the attempt up (a node that hid its model, say) and another node
    has answered.  Such a receipt never got an answer head: it ended with
    the proxy's close, or with the engine's own fault (an abort) when the
    engine acted before it saw that close.  The workload's dispatch events,
    each emitted as the dispatch is made (and checked against the receipts:
    no receipt without one), say which nodes were dispatched to before the
    answering one; a late receipt at a node is explained only while that
    node has such a dispatch left that no earlier receipt of it accounts
    for.
    """
    if w is None:
        return []
    order = w.dispatches
    last = max((i for i, n in enumerate(order) if n == answered["node"]), default=None)
    if last is None:
        return []
    before = Counter(order[:last])
    for r in rs:
        if r is not answered and r["t_recv"] <= after:
            before[r["node"]] -= 1
    late = []
    for r in rs:
        if r["t_recv"] > after and r["t_head"] is None and before[r["node"]] > 0:
            before[r["node"]] -= 1
            late.append(r)
    return late


def _node_event_during(events: Sequence[dict[str, Any]], lo: float, hi: float) -> bool:
    return any(
        e["event"] in ("stop", "hide") and lo - 1.0 <= e["t"] <= hi for e in events
    )


def _brief(r: Mapping[str, Any]) -> str:
    return f"{r['node']}#{r['receipt']}:{r['fault']}->{r['end']}@{r['t_recv']:.3f}"


def _answer_brief(a: Answer) -> str:
    if a.disconnected:
        return f"client disconnected ({a.plan}) after {a.duration:.2f}s"
    if a.status is None:
        return f"no status ({a.error}) after {a.duration:.2f}s"
    return (
        f"{a.status} complete={a.complete} error={a.error} "
        f"markers={sorted(a.markers())} body={a.body[:120]!r} after {a.duration:.2f}s"
    )


def match_workloads(
    answers: Sequence[Answer], workloads: Mapping[str, Workload], report: Report
) -> dict[str, Workload]:
    """
    Each worker sends its requests one after another with its own model, so
    its workloads, in id order, are its requests in order.
    """
    by_model: dict[str, list[Workload]] = defaultdict(list)
    for w in workloads.values():
        by_model[w.model].append(w)
    for ws in by_model.values():
        ws.sort(key=lambda w: int(w.id))
    by_worker: dict[str, list[Answer]] = defaultdict(list)
    for a in answers:
        by_worker[a.model].append(a)
    matched: dict[str, Workload] = {}
    for model, mine in by_worker.items():
        mine.sort(key=lambda a: a.index)
        ws = by_model.get(model, [])
        if len(ws) != len(mine):
            report.add(
                "workload-count",
                model,
                f"{len(mine)} requests but {len(ws)} workloads for model {model}",
            )
        for a, w in zip(mine, ws, strict=False):
            created = w.created_ms / 1000
            if not (a.wall_send - 0.05 <= created <= a.wall_end + 2.0):
                report.add(
                    "workload-mismatch",
                    a.soak,
                    f"workload {w.id} created at {created:.3f}, request sent "
                    f"{a.wall_send:.3f} ended {a.wall_end:.3f}",
                )
            matched[a.soak] = w
    return matched


def check(
    answers: Sequence[Answer],
    receipts: Sequence[dict[str, Any]],
    node_events: Sequence[dict[str, Any]],
    workload_lines: Iterable[dict[str, Any]],
    bounds: Bounds,
) -> Report:
    report = Report()
    workloads = workloads_from(workload_lines, report)
    matched = match_workloads(answers, workloads, report)
    by_soak: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in receipts:
        by_soak[r["soak"]].append(r)
    for rs in by_soak.values():
        rs.sort(key=lambda r: r["t_recv"])
    for a in answers:
        _check_one(
            a, by_soak.get(a.soak, []), matched.get(a.soak), node_events, bounds, report
        )
    known = {a.soak for a in answers}
    for soak in by_soak:
        if soak not in known:
            report.add("receipt-unknown", soak, "receipt for no request of this run")
    return report


def _outcome(a: Answer) -> str:
    if a.disconnected:
        return f"client disconnect ({a.plan})"
    if a.status is None:
        return f"no answer ({a.error})"
    if 200 <= a.status < 300:
        if not a.body:
            return "2xx empty" if a.complete else "2xx truncated"
        return "2xx complete" if a.complete else "2xx truncated"
    if a.markers():
        return f"{a.status} passed through"
    reason = _proxy_reason(a)
    return f"{a.status} proxy {reason[0] if reason else 'unknown'}"


def _proxy_reason(a: Answer) -> tuple[str, int] | None:
    docs = a.documents()
    if not docs or not isinstance(docs[0], dict):
        return None
    error = docs[0].get("error")
    message = str(error.get("message") if isinstance(error, dict) else error)
    for known, reason in PROXY_REASONS.items():
        # The message may go on with details, e.g. " (model 'm')".
        if message == known or message.startswith(known + " "):
            return reason
    return None


def _check_one(
    a: Answer,
    rs: list[dict[str, Any]],
    w: Workload | None,
    node_events: Sequence[dict[str, Any]],
    bounds: Bounds,
    report: Report,
) -> None:
    soak = a.soak
    outcome = _outcome(a)
    report.outcomes[outcome] += 1
    seen = " | ".join(_brief(r) for r in rs) or "no receipts"

    def violation(kind: str, why: str) -> None:
        report.add(kind, soak, f"{why}; client: {_answer_brief(a)}; receipts: {seen}")

    # A clean close (FIN) before any response byte on a reused connection
    # looks exactly like an engine's keep-alive close racing the request,
    # and the proxy sends the request once more inside the same attempt
    # (nvproxy.proxy.upstream): the engine sees it twice for one dispatch.
    resent = [
        r
        for r, nxt in itertools.pairwise(rs)
        if r["end"] == "aborted_fin"
        and nxt["node"] == r["node"]
        and nxt["t_recv"] - r["t_end"] < 0.5
    ]
    if resent:
        report.excused["resent after an engine's clean close (no dispatch)"] += len(
            resent
        )
    effective = len(rs) - len(resent)

    # -- bounds -------------------------------------------------------------
    if a.error == "timeout":
        violation("hang", f"no end within {bounds.longest + 10:.0f}s")
    elif a.duration > bounds.longest:
        violation("too-slow", f"took {a.duration:.2f}s, bound {bounds.longest:.2f}s")
    if effective > bounds.max_attempts:
        violation("too-many-dispatches", f"{effective} receipts (not counting resends)")

    # -- no dispatch after a committed body ---------------------------------
    for c in rs:
        committed_at = None
        if c["status"] is not None and 200 <= c["status"] < 300:
            committed_at = c["t_done"] if c["t_done"] is not None else c["t_first"]
            if c["t_first"] is not None:
                committed_at = min(committed_at or c["t_first"], c["t_first"])
        if committed_at is None:
            continue
        later = [r for r in rs if r["t_recv"] > committed_at]
        if not later:
            continue
        if len(_read_late(rs, w, c, committed_at)) == len(later):
            report.excused["read after the answer, dispatched before it"] += len(later)
            continue
        event = _excused(node_events, c["node"], committed_at)
        if event is not None or c["end"] == "killed":
            report.excused["redispatch after a body, node stopped/hidden"] += 1
            continue
        violation(
            "dispatch-after-commit",
            f"{len(later)} receipt(s) after {c['node']}#{c['receipt']} wrote "
            f"its 2xx body at {committed_at:.3f}",
        )

    # -- no dispatch after the client left ----------------------------------
    if a.disconnected and a.t_disconnect is not None:
        late = [r for r in rs if r["t_recv"] > a.t_disconnect + DISCONNECT_SLACK]
        if late:
            violation(
                "dispatch-after-disconnect",
                f"{len(late)} receipt(s) more than {DISCONNECT_SLACK}s after "
                f"the client left at {a.t_disconnect:.3f}",
            )

    # -- one body, from one engine ------------------------------------------
    markers = a.markers()
    if len(markers) > 1:
        violation("body-from-two-engines", f"markers {sorted(markers)}")

    # -- the workload -------------------------------------------------------
    state = None
    if w is None:
        violation("no-workload", "no workload event matched this request")
    else:
        terminals = [info for method, info in w.pairs if method in TERMINAL]
        if len(terminals) != 1:
            violation(
                "terminal-count", f"workload {w.id}: {len(terminals)} terminal events"
            )
        elif w.pairs[-1][0] not in TERMINAL:
            violation("event-after-terminal", f"workload {w.id}")
        seqs = [int(info["seq"]) for _, info in w.pairs]
        if any(b <= x for x, b in itertools.pairwise(seqs)):
            violation("seq-not-increasing", f"workload {w.id}: seq {seqs}")
        if effective > len(w.dispatches):
            violation(
                "receipt-without-dispatch",
                f"{effective} receipts, {len(w.dispatches)} dispatches "
                f"in workload {w.id}",
            )
        report.dispatches += len(w.dispatches)
        state = terminals[-1]["state"] if terminals else None
        report.states[str(state)] += 1

    dispatches = len(w.dispatches) if w is not None else None
    final_attempt = dispatches == bounds.max_attempts if w is not None else True

    # -- the answer (§5.4) and the terminal state ---------------------------
    if a.disconnected:
        if state not in (None, "cancelled"):
            committed = any(
                r["status"] is not None and r["t_first"] is not None for r in rs
            ) or (a.status is not None)
            if state == "completed" and not committed:
                violation("state-mismatch", "completed, but nothing was committed")
            report.excused[f"client left, proxy had already ended it {state}"] += 1
        return
    if a.status is None:
        last = rs[-1] if rs else None
        if last is not None and last["t_first"] is not None:
            # The engine's first body bytes were out: the proxy committed,
            # then the client got no status line at all.
            violation(
                "committed-answer-lost",
                f"client saw only {a.error} after {_brief(last)} started its body",
            )
        else:
            violation("no-answer", f"transport error {a.error}")
        return

    if 200 <= a.status < 300:
        expect_state = "completed"
        m = _one_marker(markers)
        r = _receipt(rs, m)
        if r is None:
            violation("answer-unknown-receipt", f"2xx names {m}")
        else:
            if not _last(rs, r, w):
                violation("answer-not-last-receipt", f"2xx came from {_brief(r)}")
            if r["fault"] == "silent":
                violation(
                    "silent-committed", "a silent engine's headers became the answer"
                )
            if a.complete and r["end"] != "complete":
                violation("complete-from-incomplete", f"receipt ended {r['end']}")
            if (
                a.complete
                and r["stream"]
                and r["fault"] != "empty"
                and not a.body.rstrip().endswith(b"data: [DONE]")
            ):
                violation("stream-incomplete", "stream framing complete without [DONE]")
            if not a.complete:
                if (
                    r["end"] == "complete"
                    and _excused(node_events, r["node"], r["t_end"]) is None
                ):
                    violation("truncated-unexpectedly", "engine wrote it whole")
                else:
                    report.excused["2xx truncated by the engine"] += 1
        if w is not None and state is not None and r is not None:
            started = [i for m_, i in w.pairs if m_ == "workload:started"]
            if not started or started[-1].get("scheduledOn") != r["node"]:
                violation(
                    "started-wrong-node",
                    f"workload:started on {[s.get('scheduledOn') for s in started]}, "
                    f"body from {r['node']}",
                )
            term = w.terminal or {}
            if "truncated" in term and bool(term["truncated"]) != (not a.complete):
                violation(
                    "truncation-misreported",
                    f"event truncated={term['truncated']}, "
                    f"client complete={a.complete}",
                )
    elif markers:
        expect_state = "failed"
        m = _one_marker(markers)
        r = _receipt(rs, m)
        if r is None:
            violation("answer-unknown-receipt", f"{a.status} names {m}")
        else:
            if not _last(rs, r, w):
                violation(
                    "answer-not-last-receipt", f"{a.status} came from {_brief(r)}"
                )
            if r["fault"] != f"status_{a.status}":
                violation("status-mismatch", f"receipt fault {r['fault']}")
            if not final_attempt:
                violation(
                    "retryable-status-passed-early",
                    f"{a.status} passed through after {dispatches} dispatch(es)",
                )
    else:
        expect_state = "failed"
        reason = _proxy_reason(a)
        if reason is None:
            violation("unexpected-proxy-answer", f"{a.status} not a §5.4 answer")
        else:
            name, status = reason
            if status != a.status:
                violation("proxy-status-mismatch", f"{name} answered {a.status}")
            _check_proxy_answer(
                a, name, rs, effective, dispatches, node_events, bounds, violation
            )

    if state is not None and state != expect_state:
        violation("state-mismatch", f"workload ended {state}, client saw {outcome}")


def _check_proxy_answer(
    a: Answer,
    name: str,
    rs: list[dict[str, Any]],
    effective: int,
    dispatches: int | None,
    node_events: Sequence[dict[str, Any]],
    bounds: Bounds,
    violation: Any,
) -> None:
    final = dispatches == bounds.max_attempts if dispatches is not None else True
    last = rs[-1] if rs else None
    every_dispatch_received = dispatches is not None and effective == dispatches
    if name == "no_owner_at_admission":
        if rs or dispatches:
            violation("no-owner-after-dispatch", f"{dispatches} dispatch(es)")
    elif name in ("transport_final", "target_lost_final", "no_content_final"):
        if not final:
            violation(f"{name}-early", f"after {dispatches} dispatch(es)")
        if name == "transport_final" and every_dispatch_received and last is not None:
            if (
                last["end"] == "complete"
                and _excused(node_events, last["node"], last["t_end"]) is None
            ):
                violation(
                    "final-attempt-misreported",
                    f"engine answered the final attempt ({_brief(last)}) "
                    f"but the proxy reported a transport failure",
                )
        if name == "target_lost_final" and not _node_event_during(
            node_events, a.t_send, a.t_end
        ):
            violation("target-lost-without-event", "no node stopped or hid meanwhile")
        if name == "no_content_final" and every_dispatch_received and last is not None:
            if last["fault"] != "silent":
                violation("no-content-without-silence", f"final receipt {_brief(last)}")
    elif name in ("deadline", "no_owner"):
        if a.duration < bounds.deadline - 0.05:
            violation("early-503", f"{name} after {a.duration:.2f}s")
        if final:
            violation("503-with-budget-spent", f"{dispatches} dispatches")
        if "retry-after" not in a.headers:
            violation("503-without-retry-after", name)
    else:
        violation("unexpected-proxy-answer", f"{a.status} {name}")


def _last(rs: Sequence[dict[str, Any]], r: dict[str, Any], w: Workload | None) -> bool:
    """
    Whether C{r} is the last dispatch of C{rs}: every receipt read after it
    was dispatched before it (L{_read_late}).
    """
    after = rs[rs.index(r) + 1 :]
    return len(after) == len(_read_late(rs, w, r, r["t_recv"]))


def _one_marker(markers: set[tuple[str, int]]) -> tuple[str, int] | None:
    return sorted(markers)[0] if markers else None


def _receipt(
    rs: Sequence[dict[str, Any]], marker: tuple[str, int] | None
) -> dict[str, Any] | None:
    if marker is None:
        return None
    for r in rs:
        if (r["node"], r["receipt"]) == marker:
            return r
    return None
