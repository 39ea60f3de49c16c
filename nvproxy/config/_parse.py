# -*- test-case-name: tests.test_config -*-
"""
Reading one value: the errors, and a parser for each kind of setting
(durations, sizes, URLs, listen addresses, names, lists).

A parser takes a L{Raw} value and returns the typed value or raises a
L{ConfigError} naming C{raw.key}.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from types import MappingProxyType
from typing import Any, Final, Generic, TypeVar
from urllib.parse import urlsplit

from attrs import frozen

from nvproxy.engines import ENGINES
from nvproxy.net import ip_of, is_loopback_host

T = TypeVar("T")

NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
"""vLLM service names: usable as one URL path segment."""

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
NODE_ID_PATTERN: Final = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
"""Node ids, lower case: a DNS name (the cluster certificate's SAN)."""


class ConfigError(Exception):
    """
    The configuration is unusable.  C{str()} is one line: C{"<key>: <problem>"}.

    @ivar key: the dotted path of the offending key (C{"engines.ollama.port"}),
        the flag or environment variable it came from, or what else is at
        fault (C{"config file nvproxy.toml"}); L{None} when the caller adds it.
    @ivar problem: what is wrong, one line.
    @ivar errors: every problem, each one line: here just this one.
    """

    def __init__(self, key: str | None, problem: str) -> None:
        problem = " ".join(problem.splitlines())
        super().__init__(key, problem)
        self.key = key
        self.problem = problem
        self.errors: tuple[ConfigError, ...] = (self,)

    def __str__(self) -> str:
        if self.key is None:
            return self.problem
        return f"{self.key}: {self.problem}"


class ConfigErrors(ConfigError):
    """
    Every problem found in one configuration, in the order found.  C{str()}
    is one line per problem, joined by newlines; with a single problem it is
    that problem's line, and C{key} and C{problem} are its own.
    """

    def __init__(self, errors: Iterable[ConfigError]) -> None:
        found = tuple(one for error in errors for one in error.errors)
        if not found:
            raise ValueError("no errors")
        first = found[0]
        if len(found) == 1:
            super().__init__(first.key, first.problem)
        else:
            super().__init__(None, f"{len(found)} problems")
        self.errors = found

    def __str__(self) -> str:
        return "\n".join(ConfigError.__str__(error) for error in self.errors)


def show(value: object) -> str:
    """
    A value as it would be written in TOML, short enough for one line.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, str):
        if len(value) > 60:
            value = value[:57] + "..."
        return json.dumps(value, ensure_ascii=False)
    text = str(value)
    if isinstance(value, list | tuple):
        text = json.dumps(list(value), ensure_ascii=False, default=str)
    if len(text) > 60:
        text = text[:57] + "..."
    return text


@frozen
class Raw:
    """
    A setting's raw value and where it came from.

    @ivar key: the name to blame: the dotted TOML key, the flag or the
        environment variable.
    @ivar text: it came from a flag or the environment, so it is a string
        even where TOML would have a number.
    """

    raw: object
    key: str
    text: bool = False


def plain(value: object) -> str:
    """
    A value as an operator types it on the command line: strings bare,
    arrays as comma-separated items.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, tuple | list):
        return ", ".join(plain(item) for item in value) or "none"
    return show(value)


@frozen
class Parser(Generic[T]):
    """
    How one kind of setting is read and written back.

    @ivar read: the raw value -> the typed value, or a L{ConfigError}.
    @ivar write: a typed value as an operator would write it (the defaults
        in C{--help} and the README).
    """

    read: Callable[[Raw], T]
    write: Callable[[T], str] = plain


def join(prefix: str, name: str) -> str:
    """
    The dotted key of C{name} inside the table at C{prefix}, quoted when it
    is not a bare TOML key.
    """
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        name = json.dumps(name, ensure_ascii=False)
    return f"{prefix}.{name}" if prefix else name


def table(value: Raw) -> dict[str, object]:
    if not isinstance(value.raw, dict):
        raise ConfigError(value.key, f"must be a table, got {show(value.raw)}")
    return value.raw


def items(value: Raw) -> list[Raw]:
    """
    The items of an array, each named by its index (C{"nodes[2]"}); from a
    flag or the environment, comma-separated items (as L{plain} writes them).
    """
    if value.text and isinstance(value.raw, str):
        parts = [part.strip() for part in value.raw.split(",")]
        return [Raw(part, value.key, text=True) for part in parts if part]
    if not isinstance(value.raw, list):
        raise ConfigError(value.key, f"must be an array, got {show(value.raw)}")
    return [Raw(item, f"{value.key}[{index}]") for index, item in enumerate(value.raw)]


# Durations and sizes


_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_DURATION = re.compile(r"(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ms|h|m|s))+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|h|m|s)")
_UNIT_SECONDS: Final = {
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
}
_DURATION_EXPECTED = (
    'must be a duration such as "250ms", "10s", "15m", "3h" or a number of seconds'
)


def parse_duration(value: str | int | float) -> float:
    """
    Seconds from C{"250ms"}, C{"10s"}, C{"15m"}, C{"3h"}, C{"1h30m"} or a bare
    number of seconds (C{"0"}, C{2}, C{1.5}).

    @raise ConfigError: (without a key) on anything else, or a negative value.
    """
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(None, f"{_DURATION_EXPECTED}, got {show(value)}")
    if not isinstance(value, str):
        if not math.isfinite(value):
            raise ConfigError(None, f"{_DURATION_EXPECTED}, got {show(value)}")
        if value < 0:
            raise ConfigError(None, f"must not be negative, got {show(value)}")
        return float(value)
    text = value.strip()
    if text.startswith("-") and (
        _NUMBER.fullmatch(text[1:]) or _DURATION.fullmatch(text[1:])
    ):
        raise ConfigError(None, f"must not be negative, got {show(value)}")
    if _NUMBER.fullmatch(text):
        return float(Decimal(text))
    if not _DURATION.fullmatch(text):
        raise ConfigError(None, f"{_DURATION_EXPECTED}, got {show(value)}")
    total = sum(
        (
            Decimal(number) * _UNIT_SECONDS[unit]
            for number, unit in _DURATION_PART.findall(text)
        ),
        Decimal(0),
    )
    return float(total)


def format_duration(seconds: float) -> str:
    """
    The shortest form L{parse_duration} reads back exactly: C{"1h30m"},
    C{"250ms"}, C{"0s"}; C{"0.0001s"} below a millisecond.

    @raise ValueError: C{seconds} is negative or not finite.
    """
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"not a duration: {seconds!r}")
    exact = Decimal(repr(float(seconds)))
    millis = exact * 1000
    if millis != millis.to_integral_value():
        return format(exact, "f") + "s"
    remaining = int(millis)
    if remaining == 0:
        return "0s"
    parts = []
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        count, remaining = divmod(remaining, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


_SIZE = re.compile(r"(\d+)\s*([A-Za-z]*)")
_SIZE_UNITS: Final = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "kib": 1024,
    "mb": 1000**2,
    "mib": 1024**2,
    "gb": 1000**3,
    "gib": 1024**3,
}
_SIZE_EXPECTED = 'must be a size such as "64MiB" or a number of bytes'


def parse_size(value: str | int) -> int:
    """
    Bytes from C{"64MiB"}, C{"10KB"}, C{"512B"} or a bare number of bytes.

    @raise ConfigError: (without a key) on anything else.
    """
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ConfigError(None, f"{_SIZE_EXPECTED}, got {show(value)}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(None, f"must not be negative, got {show(value)}")
        return value
    match = _SIZE.fullmatch(value.strip())
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(None, f"{_SIZE_EXPECTED}, got {show(value)}")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


def format_size(size: int) -> str:
    """
    A size as L{parse_size} reads it: the largest binary unit that divides it.
    """
    if size < 0:
        raise ValueError(f"not a size: {size!r}")
    for unit in ("GiB", "MiB", "KiB"):
        scale = _SIZE_UNITS[unit.lower()]
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


# Addresses and names


is_loopback = is_loopback_host


def node_id_problem(text: str) -> str | None:
    """
    Why C{text} (already lower-cased) cannot be a node id, or C{None}: it
    must be a DNS name whose last label is not all digits (so it can never
    be read as an IP address).
    """
    if (
        not NODE_ID_PATTERN.fullmatch(text)
        or len(text) > 253
        or text.rsplit(".", 1)[-1].isdigit()
    ):
        return "must be a DNS name: letters, digits, '-' and '.', not an IP address"
    return None


def host_port_text(address: tuple[str, int]) -> str:
    """C{("::1", 8010)} -> C{"[::1]:8010"}."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# The readers: Raw -> value, or ConfigError(raw.key, ...)


def read_string(value: Raw) -> str:
    if not isinstance(value.raw, str):
        raise ConfigError(value.key, f"must be a string, got {show(value.raw)}")
    if not value.raw.strip():
        raise ConfigError(value.key, "must not be empty")
    return value.raw.strip()


def _bool(value: Raw) -> bool:
    if not isinstance(value.raw, bool):
        raise ConfigError(value.key, f"must be true or false, got {show(value.raw)}")
    return value.raw


def _path(value: Raw) -> str:
    return os.path.expanduser(read_string(value))


def _url(value: Raw) -> str:
    """
    An C{http} or C{https} base URL with a host; no query, fragment or user
    information.  Trailing C{/} are dropped.
    """
    text = read_string(value)
    problem = f"must be an http:// or https:// URL with a host, got {show(value.raw)}"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ConfigError(value.key, problem) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(value.key, problem)
    if parts.query or parts.fragment or "#" in text or "?" in text:
        raise ConfigError(
            value.key, f"must not have a query or fragment, got {show(value.raw)}"
        )
    if parts.username is not None or parts.password is not None:
        raise ConfigError(value.key, "must not contain user information")
    if port == 0:
        raise ConfigError(value.key, f"must not use port 0, got {show(value.raw)}")
    return text.rstrip("/")


def _host_port(value: Raw) -> tuple[str, int]:
    """
    C{"127.0.0.1:8010"}, C{"[::1]:8010"} or C{"localhost:8010"}; the host
    must be an IP literal (C{localhost} becomes C{127.0.0.1}).
    """
    text = read_string(value)
    problem = f"must be HOST:PORT with an IP address, got {show(value.raw)}"
    match = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", text)
    if match is None:
        raise ConfigError(value.key, problem)
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    address = ip_of(host)
    if address is None or (match.group(1) is not None and ":" not in host):
        raise ConfigError(value.key, problem)
    if not 1 <= port <= 65535:
        raise ConfigError(value.key, f"port must be 1..65535, got {show(value.raw)}")
    return str(address), port


def _loopback(value: Raw) -> tuple[str, int]:
    host, port = _host_port(value)
    if not is_loopback(host):
        raise ConfigError(value.key, "must be a loopback address")
    return host, port


def _loopback_or_off(value: Raw) -> tuple[str, int] | None:
    """A loopback HOST:PORT, or L{None} for C{"off"} (any case)."""
    if isinstance(value.raw, str) and value.raw.strip().lower() == "off":
        return None
    return _loopback(value)


def _interface(value: Raw) -> str:
    text = read_string(value)
    address = ip_of(text)
    if address is None:
        raise ConfigError(
            value.key, f"must be an IP address to listen on, got {show(value.raw)}"
        )
    return str(address)


def _node_id(value: Raw) -> str:
    text = read_string(value).strip().lower()
    problem = node_id_problem(text)
    if problem is not None:
        raise ConfigError(value.key, f"{problem}, got {show(value.raw)}")
    return text


def _identifier(value: Raw) -> str:
    text = read_string(value)
    if not NAME_PATTERN.fullmatch(text):
        raise ConfigError(
            value.key,
            "must be 1 to 63 letters, digits, '.', '_' or '-', starting with a"
            f" letter or digit, got {show(value.raw)}",
        )
    return text


def _port(value: Raw) -> int:
    raw = value.raw
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= 65535:
        raise ConfigError(
            value.key,
            f"must be 0 (standalone default) or 1..65535, got {show(raw)}",
        )
    return raw


def _route(value: Raw) -> str:
    path = read_string(value)
    # "multipart:/v1/chat/completions" names the default for a multipart
    # request on that path (the OCR-style service, FD §6.2).
    if not path.removeprefix("multipart:").startswith("/"):
        raise ConfigError(
            value.key,
            'must be a path starting with "/" (optionally prefixed '
            f'"multipart:"), got {show(path)}',
        )
    return path


def _backoff(value: Raw) -> tuple[float, ...]:
    steps = tuple(duration(zero=True).read(item) for item in items(value))
    if not steps:
        raise ConfigError(value.key, "must list at least one duration")
    if steps[-1] <= 0:
        # The last step repeats while waiting for an owner: 0 would spin.
        raise ConfigError(value.key, "the last duration must be above 0")
    return steps


# The parsers the settings table uses


STRING: Final = Parser(read_string)


def _etcd_prefix(value: Raw) -> str:
    """A key prefix: starts and ends with C{/}."""
    text = read_string(value)
    if not (text.startswith("/") and text.endswith("/")):
        raise ConfigError(
            value.key, f"must start and end with /, got {show(value.raw)}"
        )
    return text


ETCD_PREFIX: Final = Parser(_etcd_prefix)
PATH: Final = Parser(_path)
BOOL: Final = Parser(_bool)
URL: Final = Parser(_url)
LOOPBACK: Final = Parser(_loopback, host_port_text)
LOOPBACK_OR_OFF: Final = Parser(
    _loopback_or_off, lambda v: "off" if v is None else host_port_text(v)
)
INTERFACE: Final = Parser(_interface)
NODE_ID: Final = Parser(_node_id)
IDENTIFIER: Final = Parser(_identifier)
PORT: Final = Parser(_port)
ROUTE: Final = Parser(_route)
BACKOFF: Final = Parser(
    _backoff, lambda steps: ", ".join(format_duration(step) for step in steps)
)


def integer(minimum: int) -> Parser[int]:
    """
    An integer C{>= minimum}; from a flag or the environment, its decimal
    text.
    """

    def read(value: Raw) -> int:
        raw = value.raw
        text = value.text and isinstance(raw, str)
        if text and re.fullmatch(r"[+-]?\d+", str(raw).strip()):
            raw = int(str(raw).strip())
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < minimum:
            raise ConfigError(
                value.key, f"must be an integer >= {minimum}, got {show(value.raw)}"
            )
        return raw

    return Parser(read)


def duration(*, zero: bool) -> Parser[float]:
    """
    A duration (L{parse_duration}).

    @param zero: C{0} is meaningful ("disabled", "never"); otherwise refused.
    """

    def read(value: Raw) -> float:
        try:
            seconds = parse_duration(value.raw)  # type: ignore[arg-type]
        except ConfigError as e:
            raise ConfigError(value.key, e.problem) from None
        if seconds == 0 and not zero:
            raise ConfigError(
                value.key, f"must be greater than 0, got {show(value.raw)}"
            )
        return seconds

    return Parser(read, format_duration)


def _size(value: Raw) -> int:
    try:
        size = parse_size(value.raw)  # type: ignore[arg-type]
    except ConfigError as e:
        raise ConfigError(value.key, e.problem) from None
    if size < 1:
        raise ConfigError(value.key, f"must be at least 1 byte, got {show(value.raw)}")
    return size


SIZE: Final = Parser(_size, format_size)


def choice(*choices: str, fold_case: bool = False) -> Parser[Any]:
    """
    One of C{choices}; with C{fold_case}, in any case (C{DEBUG}).
    """

    def read(value: Raw) -> str:
        raw = value.raw
        if fold_case and isinstance(raw, str):
            raw = raw.lower()
        if not isinstance(raw, str) or raw.strip() not in choices:
            listed = " or ".join(json.dumps(c) for c in choices)
            raise ConfigError(value.key, f"must be {listed}, got {show(raw)}")
        return raw.strip()

    return Parser(read)


def array(item: Parser[T], *, unique: str | None = None) -> Parser[tuple[T, ...]]:
    """
    An array of C{item}s.

    @param unique: refuse a repeated item, as a "duplicate C{unique}".
    """

    def read(value: Raw) -> tuple[T, ...]:
        result: list[T] = []
        for entry in items(value):
            parsed = item.read(entry)
            if unique is not None and parsed in result:
                raise ConfigError(entry.key, f"duplicate {unique} {show(entry.raw)}")
            result.append(parsed)
        return tuple(result)

    return Parser(read, lambda values: ", ".join(map(item.write, values)) or "none")


_KNOWN_ENGINES: Final = ", ".join(ENGINES)


def unknown_engine(key: str) -> ConfigError:
    return ConfigError(key, f"unknown engine; known engines are {_KNOWN_ENGINES}")


def _engine_urls(value: Raw) -> Mapping[str, str]:
    """
    A table of engine id -> base URL, in the engine table's order.
    """
    urls = table(value)
    if not urls:
        raise ConfigError(value.key, "must map at least one engine to a URL")
    for name in urls:
        if name not in ENGINES:
            raise unknown_engine(join(value.key, name))
    return MappingProxyType(
        {
            engine_id: _url(Raw(urls[engine_id], join(value.key, engine_id)))
            for engine_id in ENGINES
            if engine_id in urls
        }
    )


ENGINE_URLS: Final = Parser(
    _engine_urls, lambda urls: ", ".join(f"{k} = {v}" for k, v in urls.items())
)
