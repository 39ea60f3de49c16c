# -*- test-case-name: tests.test_logs -*-
"""
Log output (spec §9).

nvproxy logs through L{twisted.logger} with structured fields.  Events carry
operational metadata only: engine, model, node, path, status, error text.
Nothing here ever sees a body, prompt, stream chunk or key material because
no call site passes one.

C{--log-format json} prints one JSON object per line (no record separator),
so the output is plain JSON Lines.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import IO, Any, Final

import twisted.logger
from twisted.logger import (
    FileLogObserver,
    ILogFilterPredicate,
    ILogObserver,
    LogEvent,
    LogLevel,
    LogLevelFilterPredicate,
    PredicateResult,
    formatEvent,
    formatEventAsClassicLogText,
    formatTime,
)
from zope.interface import implementer


def event_as_json_line(event: LogEvent) -> str:
    """
    One log event as one line of JSON: C{time} (ISO 8601, UTC), C{level},
    C{namespace}, the formatted C{message}, every structured field whose
    value is a JSON scalar (field names are stable: they are the keys), and
    C{traceback} for a logged failure.
    """
    record: dict[str, object] = {}
    when = event.get("log_time")
    if isinstance(when, (int, float)):
        record["time"] = (
            datetime.fromtimestamp(when, tz=UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z")
        )
    level = event.get("log_level")
    record["level"] = getattr(level, "name", "info")
    record["namespace"] = event.get("log_namespace", "-")
    record["message"] = _message(event)
    for key, value in event.items():
        if key.startswith("log_") or key in record:
            continue
        if value is None or isinstance(value, (str, int, float, bool)):
            record[key] = value
    failure = event.get("log_failure")
    if failure is not None:
        record["traceback"] = failure.getTraceback()
    return json.dumps(record, default=str) + "\n"


class _FileObserver(FileLogObserver):
    """
    Twisted's L{FileLogObserver}, which writes and flushes every event,
    except inside L{batched}: there a file's lines are kept and written in
    one piece at its end (the access lines of one reactor turn: one C{write}
    system call, also when the file is unbuffered, as standard output is
    under C{PYTHONUNBUFFERED}, which the unit and the image set).
    """

    def __call__(self, event: LogEvent) -> None:
        text = self.formatEvent(event)
        if text:
            out = self._outFile
            line = text if self._encoding is None else text.encode(self._encoding)
            if _batch is None:
                out.write(line)
                out.flush()
                return
            held = _batch.get(out)
            if held is None:
                _batch[out] = [line]
            else:
                held.append(line)


_batch: dict[IO[Any], list[Any]] | None = None
"""The lines written to each file inside L{batched}, to write at its end."""


@contextlib.contextmanager
def batched() -> Iterator[None]:
    """Write what the log observers write inside this at its end, per file once."""
    global _batch
    if _batch is not None:
        yield
        return
    _batch = {}
    try:
        yield
    finally:
        files, _batch = _batch, None
        for out, lines in files.items():
            try:
                out.write(lines[0][:0].join(lines))
                out.flush()
            except Exception:
                # A file that cannot be written must not keep the others'
                # lines back (nor fail the caller, as a lost line would not).
                pass


def json_observer(out: IO[str] | None = None) -> ILogObserver:
    """
    An observer writing one JSON object per line to C{out} (stdout).
    """
    stream = out if out is not None else sys.stdout
    return _FileObserver(stream, event_as_json_line)


def text_observer(out: IO[str] | None = None) -> ILogObserver:
    stream = out if out is not None else sys.stdout
    return _FileObserver(stream, event_as_text_line)


def _message(event: LogEvent) -> str:
    """
    C{formatEvent(event)}, without its cost for the common event: a plain
    C{str} format of named fields is C{str.format_map}'s job (Twisted's
    formatter is pure Python, for the call syntax C{{f()}} no caller here
    uses); anything else, or a format that fails, goes to Twisted's.
    """
    format = event.get("log_format")
    if type(format) is str and "log_flattened" not in event:
        try:
            return format.format_map(event)
        except Exception:
            pass
    return formatEvent(event)


@functools.lru_cache(maxsize=1)
def _second_text(second: int) -> str:
    return formatTime(second)


def _time_text(when: float | None) -> str:
    """Twisted's C{formatTime}, computed once per second of log output."""
    return formatTime(when) if when is None else _second_text(int(when))


def event_as_text_line(event: LogEvent) -> str | None:
    """
    One log event as Twisted's classic text line
    (C{formatEventAsClassicLogText}: C{TIME [NAMESPACE#LEVEL] MESSAGE}),
    made faster for the event that has no traceback (see L{_message}).
    """
    if "log_failure" in event or type(event.get("log_format")) is not str:
        return formatEventAsClassicLogText(event, formatTime=_time_text)
    text = _message(event)
    if not text:
        return None
    system = event.get("log_system")
    if system is None:
        level = event.get("log_level")
        system = f"{event.get('log_namespace', '-')}#{getattr(level, 'name', '-')}"
    line = f"{_time_text(event.get('log_time'))} [{system}] {text}"
    return line.replace("\n", "\n\t") + "\n"


LEVELS: Final = ("debug", "info", "warn", "error", "critical")
"""The level names C{--log-level} and C{log/set-level} accept."""

_level = LogLevelFilterPredicate(defaultLogLevel=LogLevel.info)
_debug_shown = False
_shown: frozenset[LogLevel] = frozenset(
    level for level in LogLevel.iterconstants() if level >= LogLevel.info
)
"""The levels the output shows (L{set_level}): one set lookup per event."""


class Logger(twisted.logger.Logger):
    """
    Twisted's L{twisted.logger.Logger}, except that C{debug} builds no event
    while the output is filtered above debug (L{set_level}): the per-request
    routing detail is debug (spec §9), and an event nobody shows still cost
    a dict, a level check and a pass through every observer, several times
    per request.  Hot paths log through this one.
    """

    def debug(self, format: str | None = None, **kwargs: object) -> None:
        if _debug_shown:
            self._emit_event(LogLevel.debug, format, kwargs)

    def info(self, format: str | None = None, **kwargs: object) -> None:
        # Twisted's passes **kwargs on to emit, which packs them into a dict
        # again: the event is the dict of this call (an access line's twelve
        # fields, once per request).
        self._emit_event(LogLevel.info, format, kwargs)

    def emit(
        self, level: LogLevel, format: str | None = None, **kwargs: object
    ) -> None:
        """
        Twisted's C{emit}, with its level check against a set: Twisted's
        walks the level constants (a generator) on every event.
        """
        if level not in _LOG_LEVELS:
            super().emit(level, format, **kwargs)  # Twisted's own complaint
            return
        self._emit_event(level, format, kwargs)

    def _emit_event(
        self, level: LogLevel, format: str | None, event: dict[str, object]
    ) -> None:
        """C{emit} with the event's fields in C{event}, which it completes."""
        event.update(
            log_logger=self,
            log_level=level,
            log_namespace=self.namespace,
            log_source=self.source,
            log_format=format,
            log_time=time.time(),
        )
        trace = event.get("log_trace")
        if trace is not None:
            trace.append((self, self.observer))  # type: ignore[attr-defined]
        self.observer(event)


_LOG_LEVELS: Final = frozenset(LogLevel.iterconstants())


def set_level(level: str) -> None:
    """
    Change the level of the log output, also while it runs
    (C{log/set-level}): every observer made by L{level_filtered} follows.

    @raise ValueError: not one of L{LEVELS}.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}")
    new = LogLevel.levelWithName(level)
    # The predicate reads its per-namespace table, which copies
    # defaultLogLevel only when it is built (or cleared): set both.
    _level.defaultLogLevel = new
    _level.setLogLevelForNamespace("", new)
    global _debug_shown, _shown
    _debug_shown = new is LogLevel.debug
    _shown = frozenset(level for level in LogLevel.iterconstants() if level >= new)


def debug_shown() -> bool:
    """
    Whether debug events are shown (L{set_level}).  A hot path asks before
    a debug call whose fields cost something to compute: L{Logger.debug}
    drops the event, but the call's arguments are evaluated first.
    """
    return _debug_shown


def current_level() -> str:
    """The name of the level the log output is filtered at."""
    name: str = _level.logLevelForNamespace("").name
    return name


_PORT_CHATTER = re.compile(r"\S+ starting on \d+|\((TCP|UDP|UNIX) Port \S+ Closed\)")


@implementer(ILogFilterPredicate)
class _QuietPorts:
    """
    Drops twisted.internet's own "<Factory> starting on N" and "(TCP Port N
    Closed)" lines: each listener logs its start and stop itself, by name.
    """

    def __call__(self, event: LogEvent) -> PredicateResult:
        text = event.get("log_text")
        result: PredicateResult = PredicateResult.maybe
        if (
            event.get("log_namespace") == "log_legacy"
            and isinstance(text, str)
            and _PORT_CHATTER.fullmatch(text)
        ):
            result = PredicateResult.no
        return result


_quiet_ports = _QuietPorts()


@implementer(ILogObserver)
class _LevelFiltered:
    """
    Twisted's C{FilteringLogObserver} with C{[_level, _quiet_ports]}, in one
    call: an event without a level or a namespace, or below the level of
    the output, is dropped (as L{LogLevelFilterPredicate} drops it; nvproxy
    sets one level for every namespace), and so is the port chatter.
    """

    def __init__(self, observer: ILogObserver) -> None:
        self._observer = observer

    def __call__(self, event: LogEvent) -> None:
        namespace = event.get("log_namespace")
        if event.get("log_level") not in _shown or not namespace:
            return
        # (the port chatter is Twisted's legacy log: nvproxy's events skip
        # the predicate's call)
        if namespace == "log_legacy" and _quiet_ports(event) is PredicateResult.no:
            return
        trace = event.get("log_trace")
        if trace is not None:
            trace.append((self, self._observer))
        self._observer(event)


def level_filtered(observer: ILogObserver) -> ILogObserver:
    """
    C{observer} behind the process-wide level filter that L{set_level}
    changes.
    """
    return _LevelFiltered(observer)


class ReopenableFile:
    """
    A log file that L{reopen_logs} closes and opens again by name (after
    logrotate moved it: SIGUSR1).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] = open(path, "a", encoding="utf-8")
        _reopenable.append(self)

    def write(self, text: str) -> int:
        return self._file.write(text)

    def flush(self) -> None:
        self._file.flush()

    def reopen(self) -> None:
        old, self._file = self._file, open(self.path, "a", encoding="utf-8")
        old.close()


_reopenable: list[ReopenableFile] = []


def reopen_logs() -> None:
    """Reopen every log file by name (SIGUSR1)."""
    for log_file in _reopenable:
        log_file.reopen()


_twistd_settings: dict[str, object] = {
    "format": "text",
    "level": "info",
    "logfile": None,
    "nodaemon": True,
    "stderr": False,
}


def configure_twistd(
    log_format: str,
    level: str,
    logfile: str | None,
    nodaemon: bool,
    stderr: bool = False,
) -> str:
    """
    Remember how twistd should log and return the dotted name of the
    observer factory to give twistd's C{--logger} (twistd imports it by name
    when it starts logging, after options are parsed).
    """
    _twistd_settings.update(
        format=log_format,
        level=level,
        logfile=logfile,
        nodaemon=nodaemon,
        stderr=stderr,
    )
    return f"{__name__}.twistd_observer"


def twistd_observer() -> ILogObserver:
    """
    The observer twistd logs to: our format, at our level (default info:
    per-request routing detail is debug, spec §9; C{--log-level debug} or
    C{NVPROXY_LOG_LEVEL=debug} shows it, C{log/set-level} changes it while
    running), where twistd would put it: stdout with C{-n} or
    C{--logfile -}, else the log file (default C{twistd.log}).
    """
    settings = _twistd_settings
    logfile = settings["logfile"]
    assert logfile is None or isinstance(logfile, str)
    if settings["stderr"] and logfile in (None, "-"):
        # Standard output carries the broker link.
        out: IO[str] = sys.stderr
    elif logfile == "-" or (logfile is None and settings["nodaemon"]):
        out = sys.stdout
    else:
        out = ReopenableFile(logfile or "twistd.log")  # type: ignore[assignment]
    inner = json_observer(out) if settings["format"] == "json" else text_observer(out)
    set_level(str(settings["level"]))
    return level_filtered(inner)


def clip(text: str, limit: int = 200) -> str:
    """A log field's text, cut to C{limit} characters (paths, error texts)."""
    return text[:limit]


def describe(error: object) -> str:
    """An exception (or a L{Failure}'s) as a short log field: type, text."""
    value = getattr(error, "value", error)
    return clip(f"{type(value).__name__}: {value}")
