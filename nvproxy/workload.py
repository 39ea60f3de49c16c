# -*- test-case-name: tests.test_workload -*-
"""
Workload lifecycle events (spec §5.5).

One :class:`WorkloadRecorder` per process is the event producer: it owns ``seq``
(from 1, across every workload) and hands each request a :class:`WorkloadTracker`
whose methods are the dispatcher's ``JobObserver`` hooks::

    hook                         event                 state      scheduledOn
    admitted()                   workload:submitted    queued     absent
    dispatching(node, attempt)   workload:submitted    queued     node
    between_attempts()           workload:submitted    queued     absent
    committed(node, status)      workload:started      running    node
    finished(outcome, stats)     workload:completed    completed  unchanged
                                 workload:errored      failed     unchanged
                                 workload:errored      cancelled  unchanged

Exactly one terminal event per workload; hooks after it are ignored, and so are
pre-commit hooks after the commit (the state rank never goes back). ``stats`` is
attached only to the terminal event of a committed response whose status is below
400.

Sinks receive ``(method, WorkloadInfo)``: :class:`RingSink` keeps recent workloads
for ``GET /admin/workloads``; :class:`JsonLinesSink` writes JSON-RPC notifications,
one per line.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from operator import itemgetter
from typing import IO, Any, Literal, Protocol

from attrs import frozen
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from nvproxy.inferstats import Stats

__all__ = [
    "JsonLinesSink",
    "Outcome",
    "RingSink",
    "WorkloadInfo",
    "WorkloadRecorder",
    "WorkloadSink",
    "WorkloadState",
    "WorkloadTracker",
]

log = Logger()

WorkloadState = Literal["queued", "running", "completed", "failed", "cancelled"]

SUBMITTED = "workload:submitted"
STARTED = "workload:started"
COMPLETED = "workload:completed"
TRUNCATED = "truncated"
"""The outcome reason of a committed stream cut short (C{StreamEnd.TRUNCATED})."""
ERRORED = "workload:errored"
TERMINAL = frozenset({COMPLETED, ERRORED})


@frozen(slots=False)
class WorkloadInfo:
    """
    The ``workloadInfo`` of one event, named exactly as on the wire. Times are
    milliseconds since the epoch (from the injected clock).

    Not slotted: each event's record is a copy of the last with a few fields
    changed (:func:`_changed`), and a dict copies at C speed, three times
    faster than ``attrs.evolve`` through the frozen ``__init__``.
    """

    id: str
    model: str
    engine: str
    runId: str
    state: WorkloadState
    originatedFrom: str
    scheduledOn: str | None
    createdAt: int
    startedAt: int | None
    completedAt: int | None
    error: str | None
    requesterId: str | None
    seq: int
    stats: Stats | None = None
    truncated: bool = False
    requestId: str | None = None

    def to_json(self) -> dict[str, Any]:
        """
        The JSON object. An unplaced workload has no ``scheduledOn`` key (§5.5:
        absent means "not placed"); ``stats`` is absent unless measured;
        ``truncated`` is present (``true``) only on the terminal event of a
        committed answer whose upstream ended before the response was
        complete (the state stays ``completed``, §1.1).
        """
        out: dict[str, Any] = {
            "id": self.id,
            "model": self.model,
            "engine": self.engine,
            "runId": self.runId,
            "state": self.state,
            "originatedFrom": self.originatedFrom,
        }
        if self.scheduledOn is not None:
            out["scheduledOn"] = self.scheduledOn
        out.update(
            createdAt=self.createdAt,
            startedAt=self.startedAt,
            completedAt=self.completedAt,
            error=self.error,
            requesterId=self.requesterId,
            seq=self.seq,
        )
        if self.requestId is not None:
            out["requestId"] = self.requestId
        if self.truncated:
            out["truncated"] = True
        if self.stats is not None:
            stats = self.stats.to_json()
            if stats:
                out["stats"] = stats
        return out


def _changed(info: WorkloadInfo, changes: dict[str, Any]) -> WorkloadInfo:
    """``attrs.evolve(info, **changes)`` for the fields of :class:`WorkloadInfo`."""
    new: WorkloadInfo = object.__new__(WorkloadInfo)
    state = new.__dict__
    state.update(info.__dict__)
    state.update(changes)
    return new


def notification(method: str, info: WorkloadInfo) -> dict[str, Any]:
    """The JSON-RPC 2.0 notification carrying one event."""
    return {
        "jsonrpc": "2.0",
        "method": method,
        "params": {"workloadInfo": info.to_json()},
    }


class WorkloadSink(Protocol):
    """Where workload events go."""

    def emit(self, method: str, info: WorkloadInfo) -> None: ...


class Outcome(Protocol):
    """
    What :meth:`WorkloadTracker.finished` reads from the dispatcher's
    ``JobOutcome``.
    """

    @property
    def state(self) -> str: ...  # "completed" | "failed" | "cancelled"

    @property
    def status(self) -> int | None: ...

    @property
    def reason(self) -> str | None: ...


class WorkloadRecorder:
    """
    The process-wide producer of workload events.

    :param clock: timestamps (``createdAt``, ``startedAt``, ``completedAt``).
    :param sinks: every event goes to each, in order; a failing sink is logged
        and does not affect the request or the other sinks.
    :param run_id: this process run's id, carried as ``runId``.
    :param originated_from: default ``originatedFrom`` (this node's id, or ``""``).
    """

    def __init__(
        self,
        clock: IReactorTime,
        sinks: Iterable[WorkloadSink],
        run_id: str,
        originated_from: str = "",
    ) -> None:
        self._clock = clock
        self._sinks = list(sinks)
        self._run_id = run_id
        self._origin = originated_from
        self._seq = 0
        self._ids = 0

    @property
    def seq(self) -> int:
        """The ``seq`` of the last event produced (0 before the first)."""
        return self._seq

    def now_ms(self) -> int:
        return round(self._clock.seconds() * 1000)

    def begin(
        self,
        engine: str,
        model: str,
        *,
        requester_id: str | None = None,
        originated_from: str | None = None,
        request_id: str | None = None,
    ) -> WorkloadTracker:
        """Start tracking one request; emits nothing until :meth:`admitted`."""
        self._ids += 1
        # WorkloadInfo's fields, set as _changed sets them: the frozen
        # __init__ (sixteen arguments) is most of a request's begin.  Not a
        # copy of a blank record made by that __init__ either: its dict shares
        # the class's keys, and every later _changed copy of it was a third
        # slower.
        info: WorkloadInfo = object.__new__(WorkloadInfo)
        info.__dict__.update(
            id=str(self._ids),
            model=model,
            engine=engine,
            runId=self._run_id,
            state="queued",
            originatedFrom=self._origin if originated_from is None else originated_from,
            scheduledOn=None,
            createdAt=self.now_ms(),
            startedAt=None,
            completedAt=None,
            error=None,
            requesterId=requester_id,
            seq=0,
            stats=None,
            truncated=False,
            requestId=request_id,
        )
        return WorkloadTracker(self, info)

    def _emit(
        self, method: str, info: WorkloadInfo, changes: dict[str, Any]
    ) -> WorkloadInfo:
        """
        Send C{info} with C{changes} (taken over: it gains C{seq}) and the
        next C{seq} to every sink.
        """
        self._seq += 1
        changes["seq"] = self._seq
        info = _changed(info, changes)
        for sink in self._sinks:
            try:
                sink.emit(method, info)
            except Exception:
                log.failure(
                    "workload sink {sink!r} failed on {method} seq {seq}",
                    sink=sink,
                    method=method,
                    seq=info.seq,
                )
        return info


class WorkloadTracker:
    """
    One workload's events; its methods are the ``JobObserver`` hooks. Obtain from
    :meth:`WorkloadRecorder.begin`.
    """

    def __init__(self, recorder: WorkloadRecorder, info: WorkloadInfo) -> None:
        self._recorder = recorder
        self._info = info
        self._committed_status: int | None = None
        self._done = False

    @property
    def info(self) -> WorkloadInfo:
        """The workload as of its last event (``seq`` 0 before the first)."""
        return self._info

    @property
    def done(self) -> bool:
        return self._done

    def admitted(self) -> None:
        self._queued(None)

    def dispatching(self, node_id: str, attempt: int) -> None:
        self._queued(node_id)

    def between_attempts(self) -> None:
        self._queued(None)

    def committed(self, node_id: str, status: int) -> None:
        if self._done or self._committed_status is not None:
            return
        self._committed_status = status
        self._emit(
            STARTED,
            {
                "state": "running",
                "scheduledOn": node_id,
                "startedAt": self._recorder.now_ms(),
            },
        )

    def finished(self, outcome: Outcome, stats: Stats | None = None) -> None:
        """
        Emit the one terminal event.

        ``stats`` is kept only if the response was committed with a status below
        400: the proxy's own error bodies and an engine's error body are never
        measured. A ``failed`` outcome carries ``outcome.reason`` (or the status)
        as ``error``.
        """
        if self._done:
            return
        status = self._committed_status
        if status is None or status >= 400:
            stats = None
        now = self._recorder.now_ms()
        if outcome.state == "completed":
            self._emit(
                COMPLETED,
                {
                    "state": "completed",
                    "completedAt": now,
                    "stats": stats,
                    "truncated": outcome.reason == TRUNCATED,
                },
            )
        elif outcome.state == "cancelled":
            # §5.5 has two terminal methods; a cancel is its own *state*
            # (§5.4), reported through workload:errored.
            self._emit(
                ERRORED,
                {
                    "state": "cancelled",
                    "completedAt": now,
                    "error": outcome.reason,
                    "stats": stats,
                },
            )
        else:
            if status is not None:
                # A committed answer that failed: the engine's status, not
                # how the copy ended.
                error = f"upstream status {status}"
            else:
                code = outcome.status
                error = outcome.reason or (
                    f"upstream status {code}" if code is not None else "failed"
                )
            self._emit(
                ERRORED,
                {
                    "state": "failed",
                    "completedAt": now,
                    "error": error,
                    "stats": stats,
                    "truncated": outcome.reason == TRUNCATED,
                },
            )
        self._done = True

    def _queued(self, node_id: str | None) -> None:
        # The broker's store rejects a lower state rank (§5.5): once running, a
        # workload never reads queued again.
        if self._committed_status is None:
            self._emit(SUBMITTED, {"state": "queued", "scheduledOn": node_id})

    def _emit(self, method: str, changes: dict[str, Any]) -> None:
        # One dict from the hook to the record (_changed): no keyword
        # arguments packed again at each of the two calls.
        if self._done:
            return
        self._info = self._recorder._emit(method, self._info, changes)


_CONSTANT = (
    "id",
    "model",
    "engine",
    "runId",
    "originatedFrom",
    "createdAt",
    "requesterId",
    "requestId",
)
"""The fields of :class:`WorkloadInfo` that no event changes."""
_VARYING = (
    "state",
    "scheduledOn",
    "startedAt",
    "completedAt",
    "error",
    "seq",
    "stats",
    "truncated",
)
"""The rest: what one event can change."""
_CREATED_AT = _CONSTANT.index("createdAt")
_constant_of = itemgetter(*_CONSTANT)
_varying_of = itemgetter(*_VARYING)


_STEP = 1 + len(_VARYING)
_FIRST_SEQ = len(_CONSTANT) + 1 + _VARYING.index("seq")


def _record(info: WorkloadInfo) -> list[Any]:
    """
    A new workload's entry in a :class:`RingSink`: one flat list of its
    constant fields, then per event its method and the fields an event can
    change (:func:`_add`).

    Compact because the ring keeps a thousand finished workloads: a
    :class:`WorkloadInfo` per event is a 16-key dict each, about 1.9 KB per
    finished workload where this takes about 0.8 KB, and a running one no
    longer holds its earlier events' records.
    """
    return list(_constant_of(info.__dict__))


def _add(record: list[Any], method: str, info: WorkloadInfo) -> None:
    record.append(method)
    record.extend(_varying_of(info.__dict__))


def _order(record: list[Any]) -> tuple[int, int]:
    """Creation time, then the first event's ``seq``."""
    return (record[_CREATED_AT], record[_FIRST_SEQ])


def _record_json(record: list[Any]) -> dict[str, Any]:
    """The entry of ``GET /admin/workloads``: the last event's record and all."""
    width = len(_CONSTANT)
    constant = dict(zip(_CONSTANT, record[:width], strict=True))
    listed = []
    for at in range(width, len(record), _STEP):
        # As _changed builds an event's record: no frozen __init__ per event.
        info: WorkloadInfo = object.__new__(WorkloadInfo)
        fields = info.__dict__
        fields.update(constant)
        fields.update(zip(_VARYING, record[at + 1 : at + _STEP], strict=True))
        listed.append({"method": record[at], "workloadInfo": info.to_json()})
    return {"workloadInfo": dict(listed[-1]["workloadInfo"]), "events": listed}


class RingSink:
    """
    The most recent workloads, each with its event list, for
    ``GET /admin/workloads?limit=N``.

    Unfinished workloads are kept until their terminal event (their number is
    bounded by the requests in flight); finished ones go to a ring of ``maxlen``,
    the oldest dropped first.
    """

    def __init__(self, maxlen: int = 1000) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen!r}")
        self._active: dict[str, list[Any]] = {}
        self._finished: deque[list[Any]] = deque(maxlen=maxlen)

    def emit(self, method: str, info: WorkloadInfo) -> None:
        record = self._active.get(info.id)
        if record is None:
            record = self._active[info.id] = _record(info)
        _add(record, method, info)
        if method in TERMINAL:
            del self._active[info.id]
            self._finished.append(record)

    def recent(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Up to ``limit`` workloads, the most recently created first."""
        entries = sorted(
            [*self._active.values(), *self._finished],
            key=_order,
            reverse=True,
        )
        if limit is not None:
            entries = entries[: max(0, limit)]
        return [_record_json(e) for e in entries]


class JsonLinesSink:
    """
    Writes each event as one JSON-RPC 2.0 notification per line, flushed, e.g.
    to the broker link's stdout or an audit file.
    """

    def __init__(self, file: IO[str]) -> None:
        self._file = file

    def emit(self, method: str, info: WorkloadInfo) -> None:
        line = json.dumps(notification(method, info), separators=(",", ":"))
        self._file.write(line + "\n")
        self._file.flush()
