# -*- test-case-name: tests.test_bodies -*-
"""
Finding the model in a request body without holding more of it than needed.

JSON bodies are decoded (the facade has already bounded their size).
C{multipart/form-data} bodies are scanned in blocks: only the C{model} field's
value is kept; file parts stream past and are never held in memory.
"""

from __future__ import annotations

import json
import re
from typing import IO

BLOCK = 64 * 1024
MAX_FIELD = 4096
MAX_PART_HEADERS = 16 * 1024


class BadBody(ValueError):
    """
    The body cannot be read as its content type says; the message is safe to
    show a client (it never quotes the body).
    """


def media_type(content_type: bytes | None) -> tuple[str, dict[str, str]]:
    """
    Split a C{Content-Type} into its lower-cased media type and parameters.
    """
    if not content_type:
        return "", {}
    text = content_type.decode("latin-1")
    head, _, rest = text.partition(";")
    params: dict[str, str] = {}
    for match in re.finditer(r'\s*([^=;\s]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)', rest):
        key, value = match.group(1).lower(), match.group(2).strip()
        if value.startswith('"') and value.endswith('"') and len(value) >= 2:
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        params[key] = value
    return head.strip().lower(), params


def model_from_json(content: IO[bytes]) -> str | None:
    """
    The C{model} of a JSON object body; C{None} when absent.

    @raise BadBody: not JSON, not an object, or C{model} is not a string.
    """
    content.seek(0)
    raw = content.read()
    content.seek(0)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadBody(f"request body is not valid JSON: {_reason(e)}") from None
    if not isinstance(body, dict):
        raise BadBody("request body must be a JSON object")
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str):
        raise BadBody("model must be a string")
    return model


def _reason(e: Exception) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at line {e.lineno} column {e.colno}"
    return type(e).__name__


def model_from_multipart(content: IO[bytes], boundary: str) -> str | None:
    """
    The value of the first C{model} form field of a multipart body.

    Reads C{content} in blocks of L{BLOCK} bytes; at most one block plus the
    delimiter length (and the C{model} value, capped at L{MAX_FIELD}) is held
    at any time, whatever the size of the file parts.

    @raise BadBody: the body does not follow the multipart syntax far enough
        to find the field.
    """
    if not boundary or len(boundary) > 200:
        raise BadBody("multipart body has no valid boundary")
    content.seek(0)
    try:
        return _scan(content, b"--" + boundary.encode("latin-1"))
    finally:
        content.seek(0)


def _scan(content: IO[bytes], dash_boundary: bytes) -> str | None:
    delimiter = b"\r\n" + dash_boundary
    # Treat the body as if preceded by CRLF so the first boundary matches too.
    buffer = b"\r\n"
    eof = False

    def fill() -> bool:
        nonlocal buffer, eof
        if eof:
            return False
        block = content.read(BLOCK)
        if not block:
            eof = True
            return False
        buffer += block
        return True

    # Find the first delimiter, discarding the preamble.
    while True:
        index = buffer.find(delimiter)
        if index >= 0:
            buffer = buffer[index + len(delimiter) :]
            break
        buffer = buffer[-(len(delimiter) - 1) :]
        if not fill():
            raise BadBody("multipart body has no opening boundary")
    while True:
        # After a delimiter: "--" closes the body, else CRLF and part headers.
        while len(buffer) < 2 and fill():
            pass
        if buffer.startswith(b"--"):
            return None
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            if len(buffer) > MAX_PART_HEADERS:
                raise BadBody("multipart part headers too long")
            if not fill():
                raise BadBody("multipart body ends inside part headers")
        headers = buffer[:end].decode("latin-1")
        buffer = buffer[end + 4 :]
        name, filename = _disposition(headers)
        wanted = name == "model" and filename is None
        value = b""
        while (index := buffer.find(delimiter)) < 0:
            keep = len(delimiter) - 1
            if wanted:
                value += buffer[:-keep] if len(buffer) > keep else b""
                if len(value) > MAX_FIELD:
                    raise BadBody("multipart model field too long")
            buffer = buffer[-keep:] if len(buffer) > keep else buffer
            if not fill():
                raise BadBody("multipart body ends inside a part")
        if wanted:
            value += buffer[:index]
            if len(value) > MAX_FIELD:
                raise BadBody("multipart model field too long")
            try:
                return value.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise BadBody("multipart model field is not UTF-8") from None
        buffer = buffer[index + len(delimiter) :]


def _disposition(headers: str) -> tuple[str | None, str | None]:
    for line in headers.split("\r\n"):
        key, _, value = line.partition(":")
        if key.strip().lower() == "content-disposition":
            _, params = media_type(value.encode("latin-1"))
            return params.get("name"), params.get("filename")
    return None, None
