# -*- test-case-name: tests.test_requestid -*-
"""
Request ids (C{X-Request-Id}).

Every facade request gets one as it arrives: the client's own if it is 1 to
128 printable ASCII characters (one header value), else a fresh random one.
The id is set on the request headers (so it goes upstream with the rest),
on the response headers (also after the upstream's headers are copied) and
is kept on the request object, where L{request_id} reads it back (workload
events, log lines).  W3C C{traceparent} / C{tracestate} are end-to-end
headers and pass through untouched like any other.
"""

from __future__ import annotations

import os
import re
from typing import Any

from nvproxy.proxy.headers import canonical

__all__ = ["HEADER", "HEADER_KEY", "assign", "request_id", "valid"]

HEADER = b"x-request-id"
HEADER_KEY = canonical(HEADER)
"""L{HEADER} as L{twisted.web.http_headers.Headers} keeps it."""

_ATTRIBUTE = "_nvproxy_request_id"
_VALID = re.compile(rb"[\x20-\x7e]{1,128}")


def valid(value: bytes) -> bool:
    """Whether C{value} is an id worth keeping: 1-128 printable ASCII."""
    return _VALID.fullmatch(value) is not None


_POOL_IDS = 256
_pool: list[bytes] = []


def new_id() -> str:
    """
    A fresh id: 32 hex digits of randomness (no clock, no node).  The
    operating system's randomness is drawn for L{_POOL_IDS} ids at a time:
    one system call each was a noticeable part of a request's cost.
    """
    if not _pool:
        block = os.urandom(16 * _POOL_IDS)
        _pool.extend(block[i : i + 16] for i in range(0, len(block), 16))
    return _pool.pop().hex()


def assign(request: Any) -> str:
    """
    Give C{request} its id (once; a second call returns the same one) and
    set it on the request and response headers.
    """
    existing = request_id(request)
    if existing is not None:
        return existing
    # The tables directly (nvproxy.proxy.headers): the id is printable ASCII.
    given = request.requestHeaders._rawHeaders
    values = given.get(HEADER_KEY) or []
    if len(values) == 1 and valid(values[0].strip()):
        rid = bytes(values[0]).strip().decode("ascii")
    else:
        rid = new_id()
    raw = rid.encode("ascii")
    given[HEADER_KEY] = [raw]
    request.responseHeaders._rawHeaders[HEADER_KEY] = [raw]
    setattr(request, _ATTRIBUTE, rid)
    return rid


def request_id(request: Any) -> str | None:
    """The id L{assign} gave C{request}, or C{None}."""
    rid = getattr(request, _ATTRIBUTE, None)
    return rid if isinstance(rid, str) else None
