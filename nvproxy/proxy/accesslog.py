# -*- test-case-name: tests.test_operations -*-
"""
The access log: one line per facade request, at C{info}, in the
C{nvproxy.access} namespace, once the response is finished or the client
went away::

    POST /v1/chat/completions 200 engine=vllm model=qwen node=gpu-1
    attempts=1 ttfb_ms=41 duration_ms=1730 bytes=5120 outcome=finished
    request_id=4eab8da2d623a1f65d5ebb6f234651ba

C{status} is C{None} when nothing was sent; C{outcome} is C{finished} or
C{client_gone}.

Only metadata (§9): the path without its query string, never a body,
prompt, header or key.  The fields are L{ACCESS_FIELDS}, in that order: a
field added there (e.g. a request id) appears in text and JSON output alike.

The facade notes what it learns on the request's L{AccessRecord}
(L{access_of}); L{nvproxy.proxy.site.FacadeRequest} times it and L{emit}s
it.  C{log.access = false} switches the lines off.
"""

from __future__ import annotations

from typing import Any, Final

from attrs import define

from nvproxy.logs import Logger, clip
from nvproxy.proxy.requestid import request_id

__all__ = ["ACCESS_FIELDS", "AccessLine", "AccessRecord", "access_of", "emit"]

log = Logger(namespace="nvproxy.access")

ACCESS_FIELDS: Final = (
    "method",
    "path",
    "status",
    "engine",
    "model",
    "node",
    "attempts",
    "ttfb_ms",
    "duration_ms",
    "bytes",
    "outcome",
    "request_id",
)
"""The access line's fields, in order; the one place to add one."""

_FORMAT: Final = "{method} {path} {status} " + " ".join(
    f"{name}={{{name}}}" for name in ACCESS_FIELDS[3:]
)


@define
class AccessRecord:
    """What the facade learned about one request (all optional)."""

    engine: str | None = None
    model: str | None = None
    node: str | None = None
    attempts: int = 0


def access_of(request: Any) -> AccessRecord:
    """The record of C{request}, made on first use."""
    record = getattr(request, "access", None)
    if not isinstance(record, AccessRecord):
        record = AccessRecord()
        request.access = record
    return record


AccessLine = tuple[Any, float, float | None, float, bool]
"""L{emit}'s arguments for one request, kept until the line is written."""


def _ms(start: float | None, end: float | None) -> int | None:
    if start is None or end is None:
        return None
    return max(0, round((end - start) * 1000))


def emit(
    request: Any,
    received_at: float,
    first_byte_at: float | None,
    ended_at: float,
    completed: bool,
) -> None:
    """
    Log C{request}'s access line.

    @param completed: the response was finished (else the client went away
        and the status is what had been sent, if anything).
    """
    record = access_of(request)
    status = request.code if request.startedWriting else None
    log.info(
        _FORMAT,
        method=request.method.decode("latin-1"),
        path=clip(request.path.decode("latin-1")),
        status=status,
        engine=record.engine,
        model=record.model,
        node=record.node,
        attempts=record.attempts,
        ttfb_ms=_ms(received_at, first_byte_at),
        duration_ms=_ms(received_at, ended_at),
        bytes=request.sentLength,
        outcome="finished" if completed else "client_gone",
        request_id=request_id(request),
    )
