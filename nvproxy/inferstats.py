# -*- test-case-name: tests.test_inferstats -*-
"""
Inference stats measured from a response body as it streams (spec §5.5).

The body is never buffered. :meth:`StatsMeter.feed` does O(len(chunk)) work per
chunk: it keeps a bounded tail window and a few counters (first-byte time, last-byte
time, byte total, SSE ``data:`` events, newline-delimited records), and never parses
JSON. The window is the body's last ``tail_bytes``; once the body shows itself a
stream of lines (an SSE event, or an NDJSON record on its first line) it keeps only
the last :data:`TAIL_LINES` lines past 1.5 KB, which is what an open stream costs.
:meth:`StatsMeter.finish` parses only the tail window, once:

* OpenAI ``usage`` (the last SSE event carrying it, or the non-streaming body);
* Ollama's final record: ``prompt_eval_count`` / ``eval_count`` / ``eval_duration``;
* llama.cpp ``/completion``: ``tokens_evaluated`` / ``tokens_predicted`` /
  ``timings`` (llama.cpp's OpenAI routes add ``timings`` next to ``usage``, and
  put it alone on the finishing chunk of a stream without ``include_usage``).
  Its prompt count is ``prompt_n + cache_n``: ``prompt_n`` counts only the
  tokens evaluated for this request, not those taken from the prompt cache.

Every shape is recognised under every dialect (Ollama also serves OpenAI routes);
the dialect only says how a body without a usage report is framed when it is
counted. A body larger than the window that is one JSON document (a long
non-streaming answer) has its report keys read from the window's end directly.

Failing a report, completion tokens are estimated by counting stream events (SSE
``data:`` events, or NDJSON records for Ollama) minus ``[DONE]`` and report-only
events, and flagged ``estimated``. Events that carry no token are discounted too,
still without parsing every chunk: the finishing chunks (``finish_reason`` set and
no content, or llama.cpp's ``stop`` event) among the events in the tail window, and
an opening role-only chunk (``"delta": {"role": "assistant", "content": null}``),
recognised from the first :data:`HEAD_BYTES` of the body, kept for that.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from collections.abc import Iterable, Iterator
from typing import Any, Literal

from attrs import frozen
from twisted.internet.interfaces import IReactorTime

__all__ = ["Dialect", "Stats", "StatsMeter"]

Dialect = Literal["openai", "ollama", "llamacpp"]

HEAD_BYTES = 2048
"""How much of the body's start is kept to recognise a role-only first event."""

TAIL_LINES = 8
"""
How many lines a stream's window keeps at least: four SSE events or eight
NDJSON records, which hold an engine's report and the events the estimate
discounts (its last event or the one before, the finishing chunk before
them, C{[DONE]}: vLLM's finish, usage and C{[DONE]} are three).
"""

_TRIM_AT = 1536
"""A stream's window is cut back to its last L{TAIL_LINES} lines past this."""

_SSE_EVENT = b"\ndata:"
_CARRY = len(_SSE_EVENT) - 1
_DONE = b"[DONE]"
_DONE_LINE = b"data: " + _DONE
"""An SSE stream's last line, stripped, as engines write it: no record."""
_REPORT_KEYS = (
    "usage",
    "timings",
    "prompt_eval_count",
    "eval_count",
    "eval_duration",
    "tokens_predicted",
    "tokens_evaluated",
)
# The last occurrence of a report key as an object key: the opening quote is not
# escaped (so it is not inside a string value of the body).
_KEY = re.compile(r'(?<!\\)"(' + "|".join(_REPORT_KEYS) + r')"\s*:\s*')


@frozen
class Stats:
    """
    The additive ``stats`` block of a terminal workload event (§5.5).

    :ivar estimated: completion tokens were counted from stream events rather than
        reported by the engine.
    """

    promptTokens: int | None = None
    completionTokens: int | None = None
    tokensPerSecond: float | None = None
    ttftMs: int | None = None
    estimated: bool = False

    def to_json(self) -> dict[str, Any]:
        """The JSON object, ``None`` fields and a false ``estimated`` omitted."""
        out: dict[str, Any] = {}
        if self.promptTokens is not None:
            out["promptTokens"] = self.promptTokens
        if self.completionTokens is not None:
            out["completionTokens"] = self.completionTokens
        if self.tokensPerSecond is not None:
            out["tokensPerSecond"] = round(self.tokensPerSecond, 1)
        if self.ttftMs is not None:
            out["ttftMs"] = self.ttftMs
        if self.estimated:
            out["estimated"] = True
        return out


@frozen
class _Report:
    prompt: int | None
    completion: int | None
    tps: float | None


class StatsMeter:
    """
    Measures one response body.

    :param clock: timestamps for time to first token and throughput.
    :param dialect: the engine dialect, used to frame an unreported body.
    :param tail_bytes: how much of the body's end is kept for :meth:`finish`.
    """

    def __init__(
        self, clock: IReactorTime, dialect: Dialect, tail_bytes: int = 8192
    ) -> None:
        if tail_bytes < 64:
            raise ValueError(f"tail_bytes must be >= 64, got {tail_bytes!r}")
        self._clock = clock
        self._dialect = dialect
        self._limit = tail_bytes
        # Until the body is known to be a stream of lines (SSE events or
        # NDJSON records), its window is its last tail_bytes; a stream's
        # window keeps only its last TAIL_LINES lines once past _TRIM_AT,
        # what an open stream holds.
        self._trim_at = tail_bytes
        self._lined = False
        self._tail = bytearray()
        self._head: bytearray | None = bytearray()
        self._role_opening = False
        self._total = 0
        self._events = 0
        self._newlines = 0
        # The last bytes of the stream, so a "\ndata:" split across chunks is still
        # counted; the stream start counts as a line start.
        self._carry = b"\n"
        self._started: float | None = None
        self._first: float | None = None
        self._last: float | None = None
        self._result: Stats | None = None
        self._finished = False

    @property
    def window(self) -> int:
        """The number of body bytes currently held (at most ``tail_bytes``)."""
        return len(self._tail)

    @property
    def total_bytes(self) -> int:
        return self._total

    @property
    def at_line_start(self) -> bool:
        """Whether the body so far ends with a newline (or is empty)."""
        return self._carry.endswith(b"\n")

    def started(self) -> None:
        """
        Mark the reference time for time to first token.  nvproxy calls it
        at admission, so C{ttftMs} is what the client waited, failed
        attempts and backoff included.
        """
        self._started = self._clock.seconds()

    def feed(self, chunk: bytes) -> None:
        """Account for one chunk of the body, in order."""
        if not chunk or self._finished:
            return
        now = self._clock.seconds()
        if self._first is None:
            self._first = now
        self._last = now
        head = self._head
        if head is not None and len(head) < HEAD_BYTES:
            head += chunk[: HEAD_BYTES - len(head)]
            if chunk.find(b"\n") >= 0:  # not "in", which tries an int first
                self._decide_opening(head)
        self._total += len(chunk)
        # Each count is a pass over the chunk, so only what can still matter
        # is counted: events unless the body is NDJSON (lined without an
        # event: a record holds no raw newline), then lines while the body
        # has shown no SSE event, and only for Ollama's dialect (they count
        # an Ollama NDJSON body's records, never an SSE body's).  A whole
        # SSE answer often comes as one piece: its events found first, its
        # newlines are not counted at all.
        events = self._events
        if events or not self._lined:
            # A match spanning the boundary starts in the carry and ends in the
            # chunk; neither 5-byte half can hold a whole 6-byte match on its own.
            events += chunk.count(_SSE_EVENT)
            events += (self._carry + chunk[:_CARRY]).count(_SSE_EVENT)
            self._events = events
        if not events and self._dialect == "ollama":
            self._newlines += chunk.count(b"\n")
        if len(chunk) >= _CARRY:
            self._carry = chunk[-_CARRY:]
        else:
            self._carry = (self._carry + chunk)[-_CARRY:]
        if self._events and not self._lined:
            self._lines_found()
        tail = self._tail
        if len(chunk) >= self._limit:
            tail[:] = chunk[-self._limit :]
        else:
            tail += chunk
            excess = len(tail) - self._limit
            if excess > 0:
                del tail[:excess]  # advances the buffer start; no copy
        if len(tail) > self._trim_at:
            cut = _lines_cut(tail)
            if cut:
                # A new window, not a deletion: a bytearray keeps the
                # allocation it grew to, and an open stream would hold its
                # peak, not its lines (a copy of them, every few chunks).
                self._tail = tail = tail[cut:]
            # long lines: not cut again at every chunk
            self._trim_at = min(self._limit, max(_TRIM_AT, len(tail) + _TRIM_AT // 2))

    def _lines_found(self) -> None:
        self._lined = True
        self._trim_at = min(self._limit, _TRIM_AT)

    def finish(self) -> Stats | None:
        """
        Parse the tail once and return the stats, or ``None`` when nothing could
        be measured. Later calls return the same result; later feeds are ignored.
        """
        if self._finished:
            return self._result
        self._finished = True
        if self._lined:
            # The window as if cut after the last chunk, whatever the split.
            del self._tail[: _lines_cut(self._tail)]
        self._result = self._measure()
        self._tail = bytearray()
        self._head = None
        return self._result

    def _decide_opening(self, head: bytearray) -> None:
        """
        Settle the first event as soon as its line is complete, and let the
        head go: a long stream then holds only its tail (a stream's memory).
        """
        found, record = _first_complete_event(head)
        if found:
            self._role_opening = _role_only(record)
            self._head = None
            first = head[: head.find(b"\n")].strip()
            if first.startswith(b"{") and first.endswith(b"}"):
                self._lines_found()  # NDJSON: a whole record on its first line

    def _measure(self) -> Stats | None:
        ttft: int | None = None
        if self._started is not None and self._first is not None:
            ttft = max(0, round((self._first - self._started) * 1000))
        window = bytes(self._tail)
        whole = self._total <= len(window)
        sse = self._events > 0
        win = _Window(window, whole)
        report = _last_report(win)
        if report is not None and report.completion is not None:
            # The engine reported its counts: nothing to estimate, so the
            # rest of the window need not be decoded.
            return self._stats(report, ttft, sse, estimated=False)
        if report is None and not whole:
            # One document larger than the window (a long non-streaming answer, or
            # llama.cpp's final event carrying the prompt): read the report keys
            # from its end.
            if any(win.found(name) for name in _KEY_NAMES):
                report = _report(_scan_keys(window))
        estimated = False
        if report is None or report.completion is None:
            counted = self._count(_tally(win, last_done=not sse), sse)
            if counted is not None:
                estimated = True
                report = _Report(
                    report.prompt if report is not None else None, counted, None
                )
        if report is None:
            return None if ttft is None else Stats(ttftMs=ttft)
        return self._stats(report, ttft, sse, estimated)

    def _stats(
        self, report: _Report, ttft: int | None, sse: bool, estimated: bool
    ) -> Stats:
        tps = report.tps
        if tps is None and report.completion and sse:
            tps = self._decode_rate(report.completion)
        if tps is not None and not (math.isfinite(tps) and tps >= 0):
            tps = None
        return Stats(
            promptTokens=report.prompt,
            completionTokens=report.completion,
            tokensPerSecond=tps,
            ttftMs=ttft,
            estimated=estimated,
        )

    def _count(self, tally: _Tally, sse: bool) -> int | None:
        if sse:
            tokenless = tally.tokenless
            head = self._head
            if (
                self._role_opening
                if head is None
                else _role_only(_first_event(bytes(head), self._total))
            ):
                tokenless += 1
            return max(0, self._events - tally.done - tally.report_only - tokenless)
        if self._dialect != "ollama" or self._newlines == 0:
            # One unreported JSON document (a non-streaming answer) has no
            # events to count.
            return None
        lines = self._newlines
        if not self._tail.endswith(b"\n"):
            lines += 1  # an unterminated last record
        if tally.last_done:
            lines -= 1  # the final record carries no token
        return max(0, lines)

    def _decode_rate(self, tokens: int) -> float | None:
        if self._first is None or self._last is None:
            return None
        span = self._last - self._first
        return tokens / span if span > 0 else None


def _record(line: bytes) -> object:
    """One non-blank line of the window decoded (C{None}: not a record)."""
    if line.startswith(b"data:"):
        line = line[5:].strip()
        if line == _DONE:
            return None
    elif line.startswith((b"event:", b"id:", b"retry:", b":")):
        return None
    return _loads(line)


# What the window is searched for, each once: where a line can matter, a
# search finds one of these in it.  Each is led by a literal that is rare in
# an engine's JSON (re finds a pattern's literal prefix at C speed, but one
# alternation of them all is tried at every byte), and together they are a
# superset of what the line checks below look for.
_ESCAPE = re.compile(rb"\\u")
_USAGE = re.compile(rb"usage")
_KEY_NAMES = (
    _USAGE,
    *(re.compile(needle) for needle in (rb"timings", rb"eval_", rb"tokens_")),
)
"""The report keys' names (C{eval_} and C{tokens_} stand for two and three)."""
_MAY_REPORT = (_ESCAPE, *_KEY_NAMES)
"""In a line that can carry a report: a report key's name, or an escape
(which could spell one)."""
_REASON = re.compile(rb'_reason"(?!:null)')
_MAY_TALLY = (
    re.compile(rb"\[DONE\]"),
    _ESCAPE,
    _USAGE,
    re.compile(rb'stop"'),
    _REASON,
)
"""In a line that can change a L{_Tally}: a C{[DONE]}, or what
L{_may_count} looks for (an escape, a usage, a C{"stop"}, a C{finish_reason}
that is not literally null)."""

_NEEDLES = {
    pattern: pattern.pattern.replace(b"\\", b"")
    for pattern in (*_MAY_REPORT, *_MAY_TALLY)
    if pattern is not _REASON
}
_NEEDLES[_ESCAPE] = b"\\"
_NEEDLES[_REASON] = b'_reason"'
"""A literal every match of each searched pattern holds: a window without
it (one C{find}, a fast scan) has no match, and no iterator and list are
made for it (most of a stream's windows lack most of the patterns)."""

_Span = tuple[int, int]


class _Window:
    """
    The tail window, its lines found and decoded only where a search of the
    whole window says one can matter: an OpenAI stream's window holds a
    hundred events, of which the report and the tally need two or three.

    A line is a span C{(start, end)} of the window between newlines; blank
    lines are skipped, and so is the first line of a trimmed window (it may
    be partial).
    """

    def __init__(self, window: bytes, whole: bool) -> None:
        self.window = window
        self.document: object = _loads(window) if whole and window else None
        first = window.find(b"\n")
        self._start = 0 if whole else (len(window) if first < 0 else first + 1)
        self._values: dict[int, object] = {}
        self._found: dict[re.Pattern[bytes], list[int]] = {}

    def line(self, span: _Span) -> bytes:
        """The line at C{span}, stripped."""
        return self.window[span[0] : span[1]].strip()

    def value(self, span: _Span) -> object:
        """The line at C{span} decoded (L{_record}), at most once."""
        start = span[0]
        if start not in self._values:
            self._values[start] = _record(self.line(span))
        return self._values[start]

    def found(self, pattern: re.Pattern[bytes]) -> list[int]:
        """Where C{pattern} matches in the whole window (searched once)."""
        where = self._found.get(pattern)
        if where is None:
            if self.window.find(_NEEDLES.get(pattern, b"")) < 0:
                where = []  # one fast scan, where the search is a slow one
            else:
                where = [match.start() for match in pattern.finditer(self.window)]
            self._found[pattern] = where
        return where

    def matching(self, patterns: tuple[re.Pattern[bytes], ...]) -> list[_Span]:
        """The lines with a match of any of C{patterns} in them, in order."""
        window, start = self.window, self._start
        found = sorted(at for pattern in patterns for at in self.found(pattern))
        spans: list[_Span] = []
        end = start
        for at in found:
            if at < start or (spans and at < end):
                continue  # in the partial first line, or a line already taken
            begin = window.rfind(b"\n", start, at) + 1 or start
            end = window.find(b"\n", at)
            if end < 0:
                end = len(window)
            spans.append((begin, end))
        return spans

    def backwards(self) -> Iterator[_Span]:
        """Every non-blank line, from the last."""
        window, start = self.window, self._start
        end = len(window)
        while end >= start:
            newline = window.rfind(b"\n", start, end)
            begin = newline + 1 if newline >= 0 else start
            if window[begin:end].strip():
                yield begin, end
            if newline < 0:
                return
            end = newline


def _last_report(win: _Window) -> _Report | None:
    """
    The report of the last record carrying one: the last line is looked at
    first (an Ollama or llama.cpp report is the last record), then the rest
    of the window is searched for lines that could carry one; only those
    are decoded.  An SSE stream's usage event, before its C{[DONE]}, is
    found by the search.  A window with no such line at all (an OpenAI
    client that did not ask for usage) is told by the search alone, and
    its lines are not walked; its last line, C{[DONE]}, is not searched.
    """
    if isinstance(win.document, dict):
        return _report(win.document)
    lines = win.backwards()
    last = next(lines, None)
    if last is None:
        return None
    line = win.line(last)
    if line != _DONE_LINE and any(pattern.search(line) for pattern in _MAY_REPORT):
        report = _line_report(win, last)
        if report is not None:
            return report
    if not any([win.found(pattern) for pattern in _MAY_REPORT]):
        return None  # no line can carry one (an OpenAI stream without usage)
    if next(lines, None) is None:
        return None  # the only line was looked at
    for span in reversed(win.matching(_MAY_REPORT)):
        if span[0] < last[0]:
            report = _line_report(win, span)
            if report is not None:
                return report
    return None


def _line_report(win: _Window, span: _Span) -> _Report | None:
    value = win.value(span)
    return _report(value) if isinstance(value, dict) else None


@frozen
class _Tally:
    """What an estimate needs from the window's records."""

    done: int  # [DONE] markers
    report_only: int  # report-only events (choices: [] and a usage)
    tokenless: int  # finishing events with no output (L{_finishing})
    last_done: bool  # the last record has "done": true (Ollama's final)


def _may_count(line: bytes) -> bool:
    """
    Whether the decoded line could be a report-only or finishing event:
    only with a usage, a C{"stop"}, or a C{finish_reason} that is not
    literally null (or an escape).  An OpenAI stream's events in between
    are none of these, and are not decoded.
    """
    return (
        line.find(b"\\u") >= 0
        or line.find(b'"usage"') >= 0
        or line.find(b'"stop"') >= 0
        or line.count(b'"finish_reason"') != line.count(b'"finish_reason":null')
    )


def _counted(value: dict[str, Any]) -> tuple[int, int]:
    """(report-only, tokenless) of one record."""
    report_only = value.get("choices") == [] and value.get("usage") is not None
    return int(report_only), int(_finishing(value))


def _tally(win: _Window, last_done: bool = True) -> _Tally:
    """
    The window's L{_Tally}, decoding only lines that can change it; without
    C{last_done} (an SSE body's estimate does not use it) its C{last_done}
    is C{False} and the last record is not looked for.
    """
    if isinstance(win.document, dict):
        report_only, tokenless = _counted(win.document)
        final = last_done and win.document.get("done") is True
        return _Tally(0, report_only, tokenless, final)
    done = report_only = tokenless = 0
    for span in win.matching(_MAY_TALLY):
        line = win.line(span)
        if line.startswith(b"data:") and line[5:].strip() == _DONE:
            done += 1
        elif _may_count(line):
            value = win.value(span)
            if isinstance(value, dict):
                only, finishing = _counted(value)
                report_only += only
                tokenless += finishing
    last_value = None
    for span in win.backwards() if last_done else ():
        value = win.value(span)
        if isinstance(value, dict):
            last_value = value
            break
    return _Tally(
        done,
        report_only,
        tokenless,
        isinstance(last_value, dict) and last_value.get("done") is True,
    )


def _lines_cut(tail: bytearray) -> int:
    """
    Where a stream's window starts when it keeps its last L{TAIL_LINES}
    lines: at the newline before them (a trimmed window's first line is
    not read, L{_Window}), or 0 when it holds no more.
    """
    at = len(tail)
    for _ in range(TAIL_LINES + 1):
        at = tail.rfind(b"\n", 0, at)
        if at <= 0:
            return 0
    return at


def _first_event(head: bytes, total: int) -> object:
    """
    The first SSE ``data:`` payload of a body whose first bytes are ``head``,
    decoded; ``None`` when it is not complete within ``head`` or not JSON.
    """
    lines = head.split(b"\n")
    if len(head) < total:
        lines = lines[:-1]  # the last line may go on past the head
    return _opening(lines)[1]


def _first_complete_event(head: bytes | bytearray) -> tuple[bool, object]:
    """
    Whether the body's first event line (as L{_first_event} finds it) is
    complete in C{head}, and if so what L{_first_event} makes of it: more
    bytes cannot change the answer.
    """
    return _opening(_complete_lines(head))


def _complete_lines(head: bytes | bytearray) -> Iterator[bytes | bytearray]:
    """The newline-terminated lines of C{head}, found as they are asked for:
    the first event is usually the first line of a 2 KB head."""
    start = 0
    while (end := head.find(b"\n", start)) >= 0:
        yield head[start:end]
        start = end + 1


def _opening(lines: Iterable[bytes | bytearray]) -> tuple[bool, object]:
    """
    Among C{lines}, the first that settles the opening event: a C{data:}
    line (its payload decoded) or any other line that is not an SSE field or
    comment (C{None}); whether one did.
    """
    for line in lines:
        stripped = line.strip()
        if stripped.startswith(b"data:"):
            return True, _loads(bytes(stripped[5:].strip()))
        if stripped and not stripped.startswith((b"event:", b"id:", b"retry:", b":")):
            return True, None
    return False, None


def _carries_token(choice: dict[str, Any]) -> bool:
    """Whether one streamed choice holds generated output."""
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return any(value for key, value in delta.items() if key != "role")
    return False


def _tokenless(record: object) -> list[dict[str, Any]] | None:
    """The choices of an OpenAI stream chunk none of which carries output."""
    if not isinstance(record, dict):
        return None
    choices = record.get("choices")
    if not isinstance(choices, list) or not choices:
        return None
    if not all(isinstance(c, dict) and not _carries_token(c) for c in choices):
        return None
    return choices


def _role_only(record: object) -> bool:
    """An opening chunk with no output and no ``finish_reason`` (the role)."""
    choices = _tokenless(record)
    return choices is not None and all(c.get("finish_reason") is None for c in choices)


def _finishing(record: dict[str, Any]) -> bool:
    """
    A closing event with no output: an OpenAI chunk whose ``finish_reason`` is
    set, or llama.cpp's ``/completion`` ``stop`` event.
    """
    if record.get("stop") is True and not record.get("content"):
        return True
    choices = _tokenless(record)
    return choices is not None and any(
        c.get("finish_reason") is not None for c in choices
    )


_DECODER = json.JSONDecoder()


def _loads(data: bytes) -> object:
    """
    C{json.loads(data)}, or C{None} when it fails.  An engine's JSON is
    UTF-8, decoded here as such: C{json.loads} of bytes first works out
    their encoding in Python (C{json.detect_encoding}), which is a third of
    its time for a short record.  Bytes it would not read as UTF-8 (a byte
    order mark, a NUL in the first two: UTF-16 or -32) and bytes that are
    not strict UTF-8 (it allows encoded surrogates) go to C{json.loads}, so
    the result is always its, and a record that is not JSON is parsed once.
    """
    if not data.startswith(codecs.BOM_UTF8) and b"\x00" not in data[:2]:
        try:
            text = data.decode()
        except UnicodeDecodeError:
            pass
        else:
            try:
                return _DECODER.decode(text)
            except ValueError:
                return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def _scan_keys(window: bytes) -> dict[str, Any]:
    """
    The report keys found in the tail of one large JSON document, each the last
    occurrence whose value decodes.  The caller looks for the keys' names
    first (L{_KEY_NAMES}), which is far cheaper when there are none.
    """
    text = window.decode("utf-8", "replace")
    decoder = json.JSONDecoder()
    found: dict[str, Any] = {}
    for match in _KEY.finditer(text):
        try:
            value, _ = decoder.raw_decode(text, match.end())
        except ValueError:
            continue
        found[match.group(1)] = value
    return found


def _int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value) if value >= 0 else None


def _float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _timings_rate(timings: object) -> float | None:
    if not isinstance(timings, dict):
        return None
    rate = _float(timings.get("predicted_per_second"))
    if rate is not None:
        return rate
    predicted = _float(timings.get("predicted_n"))
    millis = _float(timings.get("predicted_ms"))
    if predicted is not None and millis:
        return predicted * 1000 / millis
    return None


def _report(record: dict[str, Any]) -> _Report | None:
    """Token counts from one record of any known shape, or ``None``."""
    usage = record.get("usage")
    if isinstance(usage, dict):
        completion = _int(usage.get("completion_tokens"))
        prompt = _int(usage.get("prompt_tokens"))
        if completion is not None or prompt is not None:
            return _Report(prompt, completion, _timings_rate(record.get("timings")))
    if "eval_count" in record or "prompt_eval_count" in record:
        completion = _int(record.get("eval_count"))
        prompt = _int(record.get("prompt_eval_count"))
        duration = _float(record.get("eval_duration"))  # nanoseconds
        tps = None
        if completion is not None and duration:
            tps = completion / (duration / 1e9)
        if completion is not None or prompt is not None:
            return _Report(prompt, completion, tps)
    if "tokens_predicted" in record or "tokens_evaluated" in record:
        completion = _int(record.get("tokens_predicted"))
        prompt = _int(record.get("tokens_evaluated"))
        if completion is not None or prompt is not None:
            return _Report(prompt, completion, _timings_rate(record.get("timings")))
    timings = record.get("timings")
    if isinstance(timings, dict):
        completion = _int(timings.get("predicted_n"))
        prompt = _int(timings.get("prompt_n"))
        cached = _int(timings.get("cache_n"))
        if prompt is not None and cached is not None:
            # prompt_n counts only the tokens evaluated for this request; the
            # rest of the prompt came from llama.cpp's prompt cache.
            prompt += cached
        if completion is not None or prompt is not None:
            return _Report(prompt, completion, _timings_rate(timings))
    return None
