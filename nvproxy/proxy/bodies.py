# -*- test-case-name: tests.test_bodies -*-
"""
Finding the model in a request body without holding more of it than needed.

JSON bodies are scanned in blocks, never decoded into objects: only the
top-level C{model} member's value is kept, and nesting is tracked without
recursion (and refused beyond L{MAX_DEPTH}).
C{multipart/form-data} bodies are scanned in blocks: only the C{model} field's
value is kept; file parts stream past and are never held in memory.
"""

from __future__ import annotations

import codecs
import io
import json
import re
import tempfile
from collections.abc import Iterator
from typing import IO, Final

from attrs import frozen

from nvproxy.memo import keep_short

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
    media, params = _media_type(content_type)
    return media, dict(params)  # the caller's own copy of the kept one


@keep_short(256)
def _media_type(content_type: bytes) -> tuple[str, dict[str, str]]:
    text = content_type.decode("latin-1")
    head, _, rest = text.partition(";")
    params: dict[str, str] = {}
    for match in re.finditer(r'\s*([^=;\s]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)', rest):
        key, value = match.group(1).lower(), match.group(2).strip()
        if value.startswith('"') and value.endswith('"') and len(value) >= 2:
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        params[key] = value
    return head.strip().lower(), params


# -- JSON -------------------------------------------------------------------
#
# The JSON body is scanned, never decoded into Python objects: a tokenizer
# over blocks of bytes that tracks nesting with a small stack (no recursion),
# validates the whole document as json.loads would (same grammar, including
# NaN and Infinity, and the same UTF-8/16/32 detection), keeps only the keys
# and the value of the top-level "model" member, and records where that value
# lies so a backend can rewrite it without decoding the body.

#: Deeper JSON is refused (400) rather than scanned.
MAX_DEPTH = 1000
#: Longest number token accepted (Python refuses longer integers too).
MAX_NUMBER = 4300
_MAX_KEY = 64

_WS = re.compile(rb"[ \t\n\r]*+")
_STR_BODY = (
    rb'[^"\\\x00-\x1f]*+(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*+)*+'
)
_STRING_RUN = re.compile(_STR_BODY)
_TOKEN_RUN = re.compile(rb"[-+.0-9A-Za-z]*+")
_NUMBER = rb"-?+(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?+(?:[eE][-+]?+[0-9]++)?+"
_LITERAL = rb"true|false|null|NaN|Infinity|-Infinity"
_SCALAR = re.compile(_LITERAL + b"|" + _NUMBER)
_W = rb"[ \t\n\r]*+"
_STR = rb'"' + _STR_BODY + rb'"'
#: Containers nested up to this deep are matched whole by the runs below.
_RUN_DEPTH = 4


def _nested(item: bytes) -> bytes:
    # A container of items, with no trailing comma.
    each = rb"(?:,(?=" + _W + rb"[^\]\} \t\n\r])|(?=" + _W + rb"[\]\}]))"
    array = rb"\[" + _W + rb"(?:" + item + _W + each + _W + rb")*+\]"
    member = _STR + _W + rb":" + _W + item
    obj = rb"\{" + _W + rb"(?:" + member + _W + each + _W + rb")*+\}"
    return rb"(?:" + _SCALAR_ITEM + rb"|" + array + rb"|" + obj + rb")"


_SCALAR_ITEM = rb"(?:" + _STR + rb"|" + _LITERAL + rb"|" + _NUMBER + rb")"
_ITEM = _SCALAR_ITEM
for _ in range(_RUN_DEPTH):
    _ITEM = _nested(_ITEM)
# Runs of simple members, taken in one regex call: each ends with "," or
# with the container's close, so a run never stops inside a token.
_ARRAY_RUN = re.compile(
    rb"(?:" + _W + _ITEM + _W + rb",)*+(?:" + _W + _ITEM + _W + rb"(\]))?+"
)
_MEMBER = rb'"' + _STR_BODY + rb'"' + _W + rb":" + _W + _ITEM
_OBJECT_RUN = re.compile(
    rb"(?:" + _W + _MEMBER + _W + rb",)*+(?:" + _W + _MEMBER + _W + rb"(\}))?+"
)
# At the top level only keys that cannot spell "model" are run over.
_TOP_MEMBER = rb'"(?!model")[^"\\\x00-\x1f]*+"' + _W + rb":" + _W + _ITEM
_TOP_RUN = re.compile(
    rb"(?:" + _W + _TOP_MEMBER + _W + rb",)*+(?:" + _W + _TOP_MEMBER + _W + rb"(\}))?+"
)

# What the scanner expects next.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _AFTER = range(6)
_EXPECTING = {
    _VALUE: "Expecting value",
    _VALUE_OR_CLOSE: "Expecting value",
    _KEY: "Expecting property name enclosed in double quotes",
    _KEY_OR_CLOSE: "Expecting property name enclosed in double quotes",
    _COLON: "Expecting ':' delimiter",
    _AFTER: "Expecting ',' delimiter",
}


class _NotString:
    pass


NOT_STRING: Final = _NotString()


@frozen
class JsonScan:
    """
    What a scan of a JSON body found.

    @ivar is_object: the document is a JSON object.
    @ivar model: the last top-level C{model} member's value: a string,
        C{None} (absent or null) or L{NOT_STRING}.
    @ivar spans: where each top-level C{model} value lies, as byte offsets
        into the body in UTF-8 (see L{_utf8_blocks}).
    @ivar opening: offset of the top-level C{{}}.
    @ivar members: how many top-level members the object has.
    """

    is_object: bool
    model: str | _NotString | None
    spans: tuple[tuple[int, int], ...]
    opening: int
    members: int


class _Syntax(Exception):
    def __init__(self, message: str, position: int) -> None:
        self.message = message
        self.position = position


def _utf8_blocks(content: IO[bytes]) -> Iterator[bytes]:
    """
    The body in blocks of UTF-8, decoded as C{json.loads} decodes bytes
    (UTF-8 with or without a BOM, UTF-16 or UTF-32); strictly validated.

    @raise UnicodeDecodeError: from the block that is not valid.
    """
    content.seek(0)
    block = content.read(max(BLOCK, 4))
    encoding = json.detect_encoding(block)
    if encoding == "utf-8-sig":
        block, encoding = block[3:], "utf-8"
    # json.loads decodes bytes with "surrogatepass" too.
    decoder = codecs.getincrementaldecoder(encoding)("surrogatepass")
    while block:
        text = decoder.decode(block)
        yield block if encoding == "utf-8" else text.encode("utf-8", "surrogatepass")
        block = content.read(BLOCK)
    decoder.decode(b"", True)


class _Scanner:
    def __init__(self, blocks: Iterator[bytes]) -> None:
        self._blocks = blocks
        self.buf = b""
        #: Offset of C{buf[0]} in the UTF-8 body.
        self.base = 0
        self.eof = False

    def more(self, keep: int) -> bool:
        """
        Drop C{buf[:keep]} and append the next block; C{False} at the end.
        """
        if self.eof:
            return False
        block = next(self._blocks, None)
        if block is None:
            self.eof = True
            return False
        self.base += keep
        self.buf = self.buf[keep:] + block
        return True

    def string(self, i: int, limit: int) -> tuple[int, bytes | None]:
        """
        Scan the string whose quote is at C{buf[i]}: the index after it, and
        its raw content when at most C{limit} bytes long (else C{None}).
        """
        start = self.base + i
        i += 1
        raw = b""
        keep = limit >= 0
        while True:
            buf = self.buf
            end = _STRING_RUN.match(buf, i).end()  # type: ignore[union-attr]
            if keep:
                raw += buf[i:end]
                if len(raw) > limit:
                    keep, raw = False, b""
            if end < len(buf):
                c = buf[end]
                if c == 0x22:
                    return end + 1, raw if keep else None
                if c != 0x5C:
                    raise _Syntax("Invalid control character", self.base + end)
                if len(buf) - end >= 6 or not self.more(end):
                    kind = "uXXXX " if buf[end + 1 : end + 2] == b"u" else ""
                    raise _Syntax(f"Invalid \\{kind}escape", self.base + end)
                i = 0
            elif not self.more(end):
                raise _Syntax("Unterminated string starting", start)
            else:
                i = 0

    def scalar(self, i: int) -> tuple[int, int] | None:
        """
        Where the number or literal at C{buf[i]} starts and ends (C{buf} may
        have been refilled), or C{None} when there is none.
        """
        while True:
            end = _TOKEN_RUN.match(self.buf, i).end()  # type: ignore[union-attr]
            if end - i > MAX_NUMBER:
                raise _Syntax("Number too long", self.base + i)
            if end < len(self.buf) or not self.more(i):
                break
            i = 0
        found = _SCALAR.match(self.buf, i)
        return None if found is None else (i, found.end())


def scan_json(content: IO[bytes]) -> JsonScan:
    """
    Scan a JSON body without decoding it into objects.

    @raise BadBody: not JSON (as C{json.loads} would refuse it), nested deeper
        than L{MAX_DEPTH}, or with a top-level C{model} string longer than
        L{MAX_FIELD} bytes.
    """
    blocks = _utf8_blocks(content)
    try:
        try:
            return _scan_json(_Scanner(blocks))
        except _Syntax as e:
            for _ in blocks:  # json.loads decodes the whole body first
                pass
            line, column = _position(content, e.position)
            raise BadBody(
                f"request body is not valid JSON: {e.message} "
                f"at line {line} column {column}"
            ) from None
    except UnicodeDecodeError:
        raise BadBody("request body is not valid JSON: UnicodeDecodeError") from None
    finally:
        content.seek(0)


def _scan_json(s: _Scanner) -> JsonScan:
    stack = bytearray()
    state = _VALUE
    i = 0
    model: str | _NotString | None = None
    too_long = False
    spans: list[tuple[int, int]] = []
    opening = -1
    members = 0
    is_model = False  # the value about to be read is a top-level "model"
    in_model = False  # inside a container that is a top-level "model" value
    model_start = -1
    ws = _WS.match
    run_from = False  # a run of simple items may start here
    while True:
        buf = s.buf
        i = ws(buf, i).end()  # type: ignore[union-attr]
        if i == len(buf):
            if s.more(i):
                i = 0
                continue
            if state == _AFTER and not stack:
                break
            raise _Syntax(_EXPECTING[state], s.base + i)
        closed = False
        if run_from:
            run_from = False
            depth = len(stack)
            if depth + _RUN_DEPTH <= MAX_DEPTH:
                if stack[-1] == 0x5B:
                    run = _ARRAY_RUN.match(buf, i)
                else:
                    run = (_TOP_RUN if depth == 1 else _OBJECT_RUN).match(buf, i)
                assert run is not None
                if run.end() > i:
                    i = run.end()
                    if depth == 1:
                        members += 1
                    if run.group(1) is None:
                        state = _VALUE if stack[-1] == 0x5B else _KEY
                        continue
                    closed = True
        c = buf[i] if not closed else 0
        if closed:
            pass
        elif state == _AFTER:
            if not stack:
                raise _Syntax("Extra data", s.base + i)
            top = stack[-1]
            if c == 0x2C:  # ,
                i += 1
                state = _VALUE if top == 0x5B else _KEY
                run_from = True
                continue
            if (c == 0x5D and top == 0x5B) or (c == 0x7D and top == 0x7B):
                i += 1
                closed = True
            else:
                raise _Syntax("Expecting ',' delimiter", s.base + i)
        elif state == _COLON:
            if c != 0x3A:
                raise _Syntax("Expecting ':' delimiter", s.base + i)
            i += 1
            state = _VALUE
            continue
        elif state == _KEY or state == _KEY_OR_CLOSE:
            if c == 0x22:
                top_level = len(stack) == 1
                i, raw = s.string(i, _MAX_KEY if top_level else -1)
                if top_level:
                    members += 1
                    is_model = raw is not None and _decode(raw) == "model"
                state = _COLON
                continue
            if c == 0x7D and state == _KEY_OR_CLOSE:
                i += 1
                closed = True
            else:
                raise _Syntax(_EXPECTING[state], s.base + i)
        elif c == 0x5D and state == _VALUE_OR_CLOSE:
            i += 1
            closed = True
        if closed:
            del stack[-1]
            state = _AFTER
            if in_model and len(stack) == 1:
                spans.append((model_start, s.base + i))
                in_model = False
            continue
        # a value is expected
        start = s.base + i
        if is_model:
            model_start = start
        if c == 0x5B or c == 0x7B:  # [ {
            if len(stack) >= MAX_DEPTH:
                raise BadBody(f"request body nests JSON deeper than {MAX_DEPTH} levels")
            if not stack and c == 0x7B:
                opening = start
            stack.append(c)
            i += 1
            state = _VALUE_OR_CLOSE if c == 0x5B else _KEY_OR_CLOSE
            run_from = True
            if is_model:
                # the value is a container: its span ends where it closes
                model, too_long = NOT_STRING, False
                is_model, in_model = False, True
            continue
        if c == 0x22:
            if is_model:
                i, raw = s.string(i, MAX_FIELD)
                too_long = raw is None
                model = None if raw is None else _decode(raw)
            else:
                i, _ = s.string(i, -1)
        else:
            token = s.scalar(i)
            if token is None:
                raise _Syntax("Expecting value", start)
            i, end = token
            if is_model:
                model = None if s.buf[i:end] == b"null" else NOT_STRING
                too_long = False
            i = end
        state = _AFTER
        if is_model:
            spans.append((model_start, s.base + i))
            is_model = False
    if too_long and opening >= 0:
        raise BadBody(f"model is longer than {MAX_FIELD} bytes")
    return JsonScan(
        is_object=opening >= 0,
        model=model,
        spans=tuple(spans),
        opening=opening,
        members=members,
    )


def _decode(raw: bytes) -> str:
    decoded = json.loads(b'"' + raw + b'"')
    assert isinstance(decoded, str)
    return decoded


def _position(content: IO[bytes], position: int) -> tuple[int, int]:
    """
    Line and column (in characters, from 1) of a byte offset in the UTF-8
    body, as C{json} reports them.
    """
    line, column = 1, 1
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    seen = 0
    for block in _utf8_blocks(content):
        block = block[: position - seen]
        seen += len(block)
        text = decoder.decode(block)
        newlines = text.count("\n")
        if newlines:
            line += newlines
            column = len(text) - text.rfind("\n")
        else:
            column += len(text)
        if seen >= position:
            break
    return line, column


#: In-memory bodies up to this size are decoded by C{json.loads} first.
FAST_LIMIT = 256 * 1024
_LONG_NUMBER = re.compile(rb"[-+.0-9eE]{%d,}" % (MAX_NUMBER + 1)).search
_SLOW = object()


def _fast_model(content: IO[bytes]) -> object:
    """
    L{model_from_json}'s answer from C{json.loads} (C speed, a few times
    cheaper than the scan for a typical chat body), or L{_SLOW} when the
    scan must decide: a body that is large, not in memory, not JSON (the
    scan words the error), or near a limit the scan enforces and
    C{json.loads} does not (nesting, number length, model length).
    """
    if not isinstance(content, io.BytesIO):
        return _SLOW
    data = content.getvalue()
    if (
        len(data) > FAST_LIMIT
        or data.count(b"[") + data.count(b"{") > MAX_DEPTH
        or (len(data) > MAX_NUMBER and _LONG_NUMBER(data) is not None)
    ):
        return _SLOW
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return _SLOW
    if not isinstance(document, dict):
        raise BadBody("request body must be a JSON object")
    model = document.get("model")
    if model is None:
        return None
    if not isinstance(model, str):
        raise BadBody("model must be a string")
    # the scan's limit is on the encoded JSON string, escapes included
    return model if len(model) * 6 <= MAX_FIELD else _SLOW


def model_from_json(content: IO[bytes]) -> str | None:
    """
    The C{model} of a JSON object body; C{None} when absent or null.

    A small body in memory is decoded by C{json.loads}; any other is
    scanned in blocks (L{scan_json}), never decoded whole.  Both give the
    same answers and refusals (a property test checks).

    @raise BadBody: not JSON, not an object, or C{model} is not a string.
    """
    fast = _fast_model(content)
    if fast is not _SLOW:
        assert fast is None or isinstance(fast, str)
        return fast
    found = scan_json(content)
    if not found.is_object:
        raise BadBody("request body must be a JSON object")
    if isinstance(found.model, _NotString):
        raise BadBody("model must be a string")
    return found.model


def with_model(content: IO[bytes], model: str) -> IO[bytes]:
    """
    A copy of a JSON object body whose top-level C{model} is C{model}: each
    top-level C{model} value is replaced (or the member added first), the
    rest copied byte for byte.  The copy is in memory when C{content} is, else
    a temporary file, like twisted.web's own buffer of the body.

    @raise BadBody: as L{model_from_json}.
    """
    found = scan_json(content)
    if not found.is_object:
        raise BadBody("request body must be a JSON object")
    value = json.dumps(model).encode()
    if found.spans:
        edits = [(start, end, value) for start, end in found.spans]
    else:
        at = found.opening + 1
        comma = b", " if found.members else b""
        edits = [(at, at, b'"model": ' + value + comma)]
    out: IO[bytes] = (
        io.BytesIO() if isinstance(content, io.BytesIO) else tempfile.TemporaryFile()
    )
    offset = skip = 0
    try:
        for block in _utf8_blocks(content):
            end = offset + len(block)
            at = offset
            while at < end:
                if skip > at:
                    at = min(end, skip)
                elif edits and edits[0][0] < end:
                    start, stop, replacement = edits.pop(0)
                    out.write(block[at - offset : start - offset])
                    out.write(replacement)
                    at, skip = start, stop
                else:
                    out.write(block[at - offset :])
                    at = end
            offset = end
    finally:
        content.seek(0)
    out.seek(0)
    return out


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
