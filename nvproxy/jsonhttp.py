# -*- test-case-name: tests.test_facade -*-
"""
The one way nvproxy writes a JSON answer of its own (facades, the admin
API, the vLLM admin routes).
"""

from __future__ import annotations

import json
from typing import Any


def json_bytes(body: object) -> bytes:
    """C{body} as the bytes of a JSON answer: sorted keys, one line."""
    return json.dumps(body, sort_keys=True).encode() + b"\n"


def set_json(request: Any, status: int, data: bytes) -> None:
    """The status and headers of a JSON answer of C{data} (not written)."""
    request.setResponseCode(status)
    headers = request.responseHeaders
    headers.setRawHeaders(b"content-type", [b"application/json"])
    headers.setRawHeaders(b"content-length", [b"%d" % len(data)])


def write_json(
    request: Any, status: int, body: object | bytes, retry_after: int | None = None
) -> None:
    """
    Answer C{request} with C{body} (an object to encode, or JSON bytes such
    as an engine-dialect error body) and finish it.
    """
    data = body if isinstance(body, bytes) else json_bytes(body)
    set_json(request, status, data)
    if retry_after is not None:
        request.responseHeaders.setRawHeaders(
            b"retry-after", [str(retry_after).encode()]
        )
    request.write(data)
    request.finish()
