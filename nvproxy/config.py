# -*- test-case-name: tests.test_config -*-
"""
nvproxy's configuration: a TOML file, C{NVPROXY_*} environment variables and
command-line flags, validated into frozen attrs values (DESIGN §2).

Precedence, highest first: command-line flags, environment variables, the TOML
file, built-in defaults.  Every key of the file is checked: an unknown key, a
value of the wrong type or out of range stops the load with a L{ConfigError}
whose text is one line naming the key and the problem, e.g.::

    dispatch.max_attempts: must be an integer >= 1, got "x"
    engines.ollama.prot: unknown key
    --deadline: must be greater than 0, got "0s"
    config file nvproxy.toml: line 3: invalid TOML: Invalid value (column 12)

A value that came from a flag or an environment variable is named by the flag
(C{--max-attempts}) or the variable (C{NVPROXY_MAX_ATTEMPTS}).

Durations are written C{"250ms"}, C{"10s"}, C{"15m"}, C{"3h"}, C{"1h30m"} or as a
bare number of seconds; sizes as C{"64MiB"} (B, KB/KiB, MB/MiB, GB/GiB) or a bare
number of bytes.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Collection, Mapping
from decimal import Decimal
from types import MappingProxyType
from typing import Final, Literal, cast
from urllib.parse import urlsplit

import attrs
from attrs import field, frozen
from twisted.logger import Logger
from twisted.python import usage

from nvproxy.engines import ENGINES
from nvproxy.logs import LEVELS
from nvproxy.ports import atomic_write

log = Logger()

LogFormat = Literal["text", "json"]
LogLevelName = Literal["debug", "info", "warn", "error", "critical"]
Control = Literal["stdio"]

SYSTEM_STATE_DIR: Final = "/var/lib/nvproxy"
NODE_ID_FILE: Final = "node-id"
NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
"""vLLM service names: usable as one URL path segment."""

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
NODE_ID_PATTERN: Final = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
"""Node ids, lower case: a DNS name (the cluster certificate's SAN)."""


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


FLAG_NAMES: Final = (
    "config",
    "response-header-timeout",
    "dial-timeout",
    "max-attempts",
    "deadline",
    "cluster-dir",
    "state-dir",
    "admin",
    "log-format",
    "log-level",
    "node-id",
    "control",
    "listen-interface",
    "eject-base",
    "eject-max",
)
"""Long names of the command-line flags; each also reads C{NVPROXY_<NAME>}."""


def env_name(flag: str) -> str:
    """
    The environment variable of a flag: C{"dial-timeout"} ->
    C{"NVPROXY_DIAL_TIMEOUT"}.
    """
    return "NVPROXY_" + flag.upper().replace("-", "_")


class ConfigError(Exception):
    """
    The configuration is unusable.  C{str()} is one line: C{"<key>: <problem>"}.

    @ivar key: the dotted path of the offending key (C{"engines.ollama.port"}),
        the flag or environment variable it came from, or what else is at
        fault (C{"config file nvproxy.toml"}); L{None} when the caller adds it.
    @ivar problem: what is wrong, one line.
    """

    def __init__(self, key: str | None, problem: str) -> None:
        problem = " ".join(problem.splitlines())
        super().__init__(key, problem)
        self.key = key
        self.problem = problem

    def __str__(self) -> str:
        if self.key is None:
            return self.problem
        return f"{self.key}: {self.problem}"


def _show(value: object) -> str:
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
    if isinstance(value, list):
        text = json.dumps(value, ensure_ascii=False, default=str)
    if len(text) > 60:
        text = text[:57] + "..."
    return text


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
        raise ConfigError(None, f"{_DURATION_EXPECTED}, got {_show(value)}")
    if not isinstance(value, str):
        if not math.isfinite(value):
            raise ConfigError(None, f"{_DURATION_EXPECTED}, got {_show(value)}")
        if value < 0:
            raise ConfigError(None, f"must not be negative, got {_show(value)}")
        return float(value)
    text = value.strip()
    if text.startswith("-") and (
        _NUMBER.fullmatch(text[1:]) or _DURATION.fullmatch(text[1:])
    ):
        raise ConfigError(None, f"must not be negative, got {_show(value)}")
    if _NUMBER.fullmatch(text):
        return float(Decimal(text))
    if not _DURATION.fullmatch(text):
        raise ConfigError(None, f"{_DURATION_EXPECTED}, got {_show(value)}")
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
        raise ConfigError(None, f"{_SIZE_EXPECTED}, got {_show(value)}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(None, f"must not be negative, got {_show(value)}")
        return value
    match = _SIZE.fullmatch(value.strip())
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(None, f"{_SIZE_EXPECTED}, got {_show(value)}")
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


# The configuration


@frozen
class DispatchConfig:
    """
    Retry bounds of spec §5.1.

    @ivar response_header_timeout: the wait for response headers and, once
        they arrived, for the first body byte; C{0} disables both.
    @ivar backoff: waits between resolution rounds; the last repeats.
    @ivar stream_idle_timeout: after commit, the longest silence between two
        chunks from the upstream before the stream is cut (with the
        dialect's error frame); C{0} (the default) never cuts.
    @ivar eject_base: how long a node's engine is ordered last after a
        transport failure (L{nvproxy.outliers}); C{0} disables ejection.
    @ivar eject_max: the longest ejection; each one in a row doubles the
        previous up to it.
    """

    max_attempts: int = 5
    deadline: float = 600.0
    dial_timeout: float = 10.0
    response_header_timeout: float = 1800.0
    backoff: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    stream_idle_timeout: float = 0.0
    eject_base: float = 1.0
    eject_max: float = 30.0


@frozen
class LimitsConfig:
    """
    Per-facade client limits.
    """

    max_body: int = 64 * 2**20
    max_connections: int = 4096
    header_timeout: float = 30.0


@frozen
class VllmHold:
    """
    How long a request waits for a waking vLLM service, by sleep depth
    (FD §6.2.1).
    """

    sleeping: float = 30.0
    offloaded: float = 180.0
    restarting: float = 300.0


@frozen
class VllmServiceConfig:
    """
    One vLLM service (FD §6.1).

    @ivar aliases: other names of C{model}; matching is case-insensitive.
    @ivar default_for: request paths that use this service when the request
        names no model.
    @ivar idle_sleep: idle time before level-1 sleep; C{0} never.
    @ivar idle_offload: idle time before level-2 sleep; C{0} never.
    """

    name: str
    url: str
    model: str
    aliases: tuple[str, ...] = ()
    default_for: tuple[str, ...] = ()
    idle_sleep: float = 900.0
    idle_offload: float = 10800.0


def default_backend(engine_id: str, facade_port: int) -> str:
    """
    Where this node's engine is when the config does not say: its own port,
    or its relocated port when the facade occupies the own port (DESIGN §2).
    """
    engine = ENGINES[engine_id]
    port = engine.own_port
    if facade_port == engine.own_port:
        port = engine.relocated_port
    return f"http://127.0.0.1:{port}"


@frozen
class EngineConfig:
    """
    One engine's facade on this node.

    @ivar port: the configured facade port; C{0} is the engine's standalone
        default (spec §8).  A persisted port may override it: see
        L{nvproxy.ports.effective_port}.
    @ivar backend: the base URL of this node's engine.
    @ivar backend_configured: C{backend} was given explicitly; when false it is
        L{default_backend} of the configured port, and a caller that moves the
        facade (a persisted port) should recompute it.
    @ivar aliases: extra loopback-only listen addresses (spec §7).
    @ivar services: vLLM services (vLLM only).
    @ivar hold: vLLM wake hold deadlines (vLLM only).
    @ivar state_ttl: how long the last look at a vLLM service that found it
        awake is trusted while its state polls fail (vLLM only).
    """

    id: str
    backend: str
    enabled: bool = True
    port: int = 0
    backend_configured: bool = False
    aliases: tuple[tuple[str, int], ...] = ()
    services: tuple[VllmServiceConfig, ...] = ()
    hold: VllmHold = VllmHold()
    state_ttl: float = 10.0

    @property
    def facade_port(self) -> int:
        """
        The configured facade port with C{0} resolved to the standalone
        default.
        """
        return self.port or ENGINES[self.id].standalone_port


@frozen
class NodeConfig:
    """
    Another node reached directly at its engines (no nvproxy there).

    @ivar engines: engine id -> base URL, in the engine table's order.
    """

    id: str
    engines: Mapping[str, str]


@frozen
class Config:
    """
    Everything nvproxy is configured with.

    @ivar node_id: L{None} means derive it: see L{resolve_node_id}.
    @ivar engines: every engine of L{ENGINES}, in its order, enabled or not.
    @ivar control: C{"stdio"} attaches the broker link (spec §3, §4).
    @ivar listen_interface: the address facades listen on.
    @ivar config_path: the TOML file read, if any.
    """

    state_dir: str
    engines: Mapping[str, EngineConfig]
    node_id: str | None = None
    log_format: LogFormat = "text"
    log_level: LogLevelName = "info"
    admin_listen: tuple[str, int] = ("127.0.0.1", 8010)
    admin_enabled: bool = True
    dispatch: DispatchConfig = DispatchConfig()
    discovery_poll_interval: float = 2.0
    limits: LimitsConfig = LimitsConfig()
    cluster_dir: str | None = None
    nodes: tuple[NodeConfig, ...] = ()
    control: Control | None = None
    listen_interface: str = "127.0.0.1"
    workload_log: str | None = None
    config_path: str | None = field(default=None, eq=False)


# Field validators.  Each takes the raw value and the name to blame.


@frozen
class _Value:
    """
    A setting's raw value and where it came from.

    @ivar text: it came from a flag or the environment, so it is a string
        even where TOML would have a number.
    """

    raw: object
    key: str
    text: bool = False


def _join(prefix: str, name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        name = json.dumps(name, ensure_ascii=False)
    return f"{prefix}.{name}" if prefix else name


def _table(value: object, key: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise ConfigError(key, f"must be a table, got {_show(value)}")
    return value


def _known(table: Mapping[str, object], prefix: str, allowed: Collection[str]) -> None:
    for name in table:
        if name not in allowed:
            raise ConfigError(_join(prefix, name), "unknown key")


def _get(table: Mapping[str, object], prefix: str, name: str) -> _Value | None:
    if name in table:
        return _Value(table[name], _join(prefix, name))
    return None


def _string(value: _Value) -> str:
    if not isinstance(value.raw, str):
        raise ConfigError(value.key, f"must be a string, got {_show(value.raw)}")
    if not value.raw.strip():
        raise ConfigError(value.key, "must not be empty")
    return value.raw.strip()


def _bool(value: _Value) -> bool:
    if not isinstance(value.raw, bool):
        raise ConfigError(value.key, f"must be true or false, got {_show(value.raw)}")
    return value.raw


def _integer(value: _Value, minimum: int) -> int:
    raw = value.raw
    if value.text and isinstance(raw, str) and re.fullmatch(r"[+-]?\d+", raw.strip()):
        raw = int(raw.strip())
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < minimum:
        raise ConfigError(
            value.key, f"must be an integer >= {minimum}, got {_show(value.raw)}"
        )
    return raw


def _duration(value: _Value, *, zero: bool) -> float:
    """
    @param zero: C{0} is meaningful ("disabled", "never").
    """
    try:
        seconds = parse_duration(value.raw)  # type: ignore[arg-type]
    except ConfigError as e:
        raise ConfigError(value.key, e.problem) from None
    if seconds == 0 and not zero:
        raise ConfigError(value.key, f"must be greater than 0, got {_show(value.raw)}")
    return seconds


def _size(value: _Value) -> int:
    try:
        size = parse_size(value.raw)  # type: ignore[arg-type]
    except ConfigError as e:
        raise ConfigError(value.key, e.problem) from None
    if size < 1:
        raise ConfigError(value.key, f"must be at least 1 byte, got {_show(value.raw)}")
    return size


def _url(value: _Value) -> str:
    """
    An C{http} or C{https} base URL with a host; no query, fragment or user
    information.  Trailing C{/} are dropped.
    """
    text = _string(value)
    problem = f"must be an http:// or https:// URL with a host, got {_show(value.raw)}"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ConfigError(value.key, problem) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(value.key, problem)
    if parts.query or parts.fragment or "#" in text or "?" in text:
        raise ConfigError(
            value.key, f"must not have a query or fragment, got {_show(value.raw)}"
        )
    if parts.username is not None or parts.password is not None:
        raise ConfigError(value.key, "must not contain user information")
    if port == 0:
        raise ConfigError(value.key, f"must not use port 0, got {_show(value.raw)}")
    return text.rstrip("/")


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if text == "localhost":
        text = "127.0.0.1"
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def is_loopback(host: str) -> bool:
    """
    Whether C{host} (an IP literal or C{localhost}) is a loopback address;
    IPv4-mapped IPv6 addresses count by their IPv4 address.
    """
    address = _ip(host)
    return address is not None and address.is_loopback


def _host_port(value: _Value) -> tuple[str, int]:
    """
    C{"127.0.0.1:8010"}, C{"[::1]:8010"} or C{"localhost:8010"}; the host
    must be an IP literal (C{localhost} becomes C{127.0.0.1}).
    """
    text = _string(value)
    problem = f"must be HOST:PORT with an IP address, got {_show(value.raw)}"
    match = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", text)
    if match is None:
        raise ConfigError(value.key, problem)
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    address = _ip(host)
    if address is None or (match.group(1) is not None and ":" not in host):
        raise ConfigError(value.key, problem)
    if not 1 <= port <= 65535:
        raise ConfigError(value.key, f"port must be 1..65535, got {_show(value.raw)}")
    return str(address), port


def _loopback_host_port(value: _Value) -> tuple[str, int]:
    host, port = _host_port(value)
    if not is_loopback(host):
        raise ConfigError(value.key, "must be a loopback address")
    return host, port


def _interface(value: _Value) -> str:
    text = _string(value)
    address = _ip(text)
    if address is None:
        raise ConfigError(
            value.key, f"must be an IP address to listen on, got {_show(value.raw)}"
        )
    return str(address)


def _node_id(value: _Value) -> str:
    text = _string(value).strip().lower()
    problem = node_id_problem(text)
    if problem is not None:
        raise ConfigError(value.key, f"{problem}, got {_show(value.raw)}")
    return text


def _identifier(value: _Value) -> str:
    text = _string(value)
    if not NAME_PATTERN.fullmatch(text):
        raise ConfigError(
            value.key,
            "must be 1 to 63 letters, digits, '.', '_' or '-', starting with a"
            f" letter or digit, got {_show(value.raw)}",
        )
    return text


def _choice(value: _Value, choices: tuple[str, ...]) -> str:
    if not isinstance(value.raw, str) or value.raw.strip() not in choices:
        listed = " or ".join(json.dumps(c) for c in choices)
        raise ConfigError(value.key, f"must be {listed}, got {_show(value.raw)}")
    return value.raw.strip()


def _array(value: _Value) -> list[object]:
    if not isinstance(value.raw, list):
        raise ConfigError(value.key, f"must be an array, got {_show(value.raw)}")
    return value.raw


def _items(value: _Value) -> list[_Value]:
    return [
        _Value(item, f"{value.key}[{index}]")
        for index, item in enumerate(_array(value))
    ]


def _path(value: _Value) -> str:
    return os.path.expanduser(_string(value))


def _port(value: _Value) -> int:
    raw = value.raw
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= 65535:
        raise ConfigError(
            value.key,
            f"must be 0 (standalone default) or 1..65535, got {_show(raw)}",
        )
    return raw


_KNOWN_ENGINES = ", ".join(ENGINES)


# Sections


_TOP_KEYS: Final = (
    "workloads",
    "node_id",
    "state_dir",
    "log_format",
    "log_level",
    "listen_interface",
    "admin",
    "dispatch",
    "discovery",
    "limits",
    "cluster",
    "engines",
    "nodes",
)
_ENGINE_KEYS: Final = ("enabled", "port", "backend", "aliases")
_VLLM_KEYS: Final = ("hold", "services", "state_ttl")
_SERVICE_KEYS: Final = (
    "name",
    "url",
    "model",
    "aliases",
    "default_for",
    "idle_sleep",
    "idle_offload",
)


def _section(document: Mapping[str, object], name: str) -> dict[str, object]:
    if name not in document:
        return {}
    return _table(document[name], name)


class _Overrides:
    """
    Flag and environment values, flags first; an empty variable is unset.
    """

    def __init__(self, flags: Mapping[str, str | None], env: Mapping[str, str]):
        self._flags = flags
        self._env = env

    def get(self, flag: str) -> _Value | None:
        value = self._flags.get(flag)
        if value is not None:
            return _Value(value, f"--{flag}", text=True)
        variable = env_name(flag)
        text = self._env.get(variable)
        if text:
            return _Value(text, variable, text=True)
        return None


def _pick(
    overrides: _Overrides,
    flag: str,
    table: Mapping[str, object],
    prefix: str,
    name: str,
) -> _Value | None:
    return overrides.get(flag) or _get(table, prefix, name)


def _dispatch(table: dict[str, object], overrides: _Overrides) -> DispatchConfig:
    _known(
        table,
        "dispatch",
        (
            "max_attempts",
            "deadline",
            "dial_timeout",
            "response_header_timeout",
            "backoff",
            "stream_idle_timeout",
            "eject_base",
            "eject_max",
        ),
    )
    result = DispatchConfig()
    if value := _pick(overrides, "max-attempts", table, "dispatch", "max_attempts"):
        result = attrs.evolve(result, max_attempts=_integer(value, 1))
    if value := _pick(overrides, "deadline", table, "dispatch", "deadline"):
        result = attrs.evolve(result, deadline=_duration(value, zero=False))
    if value := _pick(overrides, "dial-timeout", table, "dispatch", "dial_timeout"):
        result = attrs.evolve(result, dial_timeout=_duration(value, zero=False))
    if value := _pick(
        overrides,
        "response-header-timeout",
        table,
        "dispatch",
        "response_header_timeout",
    ):
        result = attrs.evolve(
            result, response_header_timeout=_duration(value, zero=True)
        )
    if value := _get(table, "dispatch", "stream_idle_timeout"):
        result = attrs.evolve(result, stream_idle_timeout=_duration(value, zero=True))
    if value := _get(table, "dispatch", "backoff"):
        steps = tuple(_duration(item, zero=True) for item in _items(value))
        if not steps:
            raise ConfigError(value.key, "must list at least one duration")
        if steps[-1] <= 0:
            # The last step repeats while waiting for an owner: 0 would spin.
            raise ConfigError(value.key, "the last duration must be above 0")
        result = attrs.evolve(result, backoff=steps)
    base = _pick(overrides, "eject-base", table, "dispatch", "eject_base")
    if base:
        result = attrs.evolve(result, eject_base=_duration(base, zero=True))
    if value := _pick(overrides, "eject-max", table, "dispatch", "eject_max"):
        result = attrs.evolve(result, eject_max=_duration(value, zero=False))
        if result.eject_base > result.eject_max:
            raise ConfigError(
                value.key,
                f"must not be below dispatch.eject_base, got {_show(value.raw)}",
            )
    elif base and result.eject_base > result.eject_max:
        raise ConfigError(
            base.key, f"must not be above dispatch.eject_max, got {_show(base.raw)}"
        )
    return result


def _limits(table: dict[str, object]) -> LimitsConfig:
    _known(table, "limits", ("max_body", "max_connections", "header_timeout"))
    result = LimitsConfig()
    if value := _get(table, "limits", "max_body"):
        result = attrs.evolve(result, max_body=_size(value))
    if value := _get(table, "limits", "max_connections"):
        result = attrs.evolve(result, max_connections=_integer(value, 1))
    if value := _get(table, "limits", "header_timeout"):
        result = attrs.evolve(result, header_timeout=_duration(value, zero=False))
    return result


def _hold(value: _Value) -> VllmHold:
    table = _table(value.raw, value.key)
    _known(table, value.key, ("sleeping", "offloaded", "restarting"))
    defaults = VllmHold()

    def hold(name: str, default: float) -> float:
        item = _get(table, value.key, name)
        return default if item is None else _duration(item, zero=False)

    return VllmHold(
        sleeping=hold("sleeping", defaults.sleeping),
        offloaded=hold("offloaded", defaults.offloaded),
        restarting=hold("restarting", defaults.restarting),
    )


def _required(table: Mapping[str, object], prefix: str, name: str) -> _Value:
    item = _get(table, prefix, name)
    if item is None:
        raise ConfigError(_join(prefix, name), "is required")
    return item


def _service(value: _Value) -> VllmServiceConfig:
    table = _table(value.raw, value.key)
    _known(table, value.key, _SERVICE_KEYS)
    service = VllmServiceConfig(
        name=_identifier(_required(table, value.key, "name")),
        url=_url(_required(table, value.key, "url")),
        model=_string(_required(table, value.key, "model")),
    )
    if item := _get(table, value.key, "aliases"):
        aliases = tuple(_string(alias) for alias in _items(item))
        service = attrs.evolve(service, aliases=aliases)
    if item := _get(table, value.key, "default_for"):
        paths = []
        for entry in _items(item):
            path = _string(entry)
            # "multipart:/v1/chat/completions" names the default for a
            # multipart request on that path (the OCR-style service, FD §6.2).
            bare = path.removeprefix("multipart:")
            if not bare.startswith("/"):
                raise ConfigError(
                    entry.key,
                    'must be a path starting with "/" (optionally prefixed '
                    f'"multipart:"), got {_show(path)}',
                )
            paths.append(path)
        service = attrs.evolve(service, default_for=tuple(paths))
    if item := _get(table, value.key, "idle_sleep"):
        service = attrs.evolve(service, idle_sleep=_duration(item, zero=True))
    if item := _get(table, value.key, "idle_offload"):
        service = attrs.evolve(service, idle_offload=_duration(item, zero=True))
    return service


def _services(value: _Value) -> tuple[VllmServiceConfig, ...]:
    services: list[VllmServiceConfig] = []
    names: dict[str, str] = {}
    routes: dict[str, str] = {}
    for item in _items(value):
        service = _service(item)
        if service.name in {s.name for s in services}:
            raise ConfigError(
                _join(item.key, "name"),
                f"duplicate service name {_show(service.name)}",
            )
        owner = names.get(service.model.casefold())
        if owner is not None:
            raise ConfigError(
                _join(item.key, "model"),
                f"{_show(service.model)} already names a model of service"
                f" {_show(owner)}",
            )
        for index, alias in enumerate(service.aliases):
            owner = names.get(alias.casefold())
            if owner is not None:
                raise ConfigError(
                    f"{_join(item.key, 'aliases')}[{index}]",
                    f"{_show(alias)} already names a model of service {_show(owner)}",
                )
        for index, route in enumerate(service.default_for):
            owner = routes.get(route)
            if owner is not None:
                raise ConfigError(
                    f"{_join(item.key, 'default_for')}[{index}]",
                    f"{_show(route)} is already the default of service {_show(owner)}",
                )
            routes[route] = service.name
        for name in (service.model, *service.aliases):
            names[name.casefold()] = service.name
        services.append(service)
    return tuple(services)


def _engine(engine_id: str, table: dict[str, object]) -> EngineConfig:
    prefix = _join("engines", engine_id)
    allowed = _ENGINE_KEYS + (_VLLM_KEYS if engine_id == "vllm" else ())
    for name in table:
        if name in _VLLM_KEYS and engine_id != "vllm":
            raise ConfigError(_join(prefix, name), "only valid for vllm")
    _known(table, prefix, allowed)
    port = 0
    if value := _get(table, prefix, "port"):
        port = _port(value)
    facade_port = port or ENGINES[engine_id].standalone_port
    result = EngineConfig(engine_id, default_backend(engine_id, facade_port), port=port)
    if value := _get(table, prefix, "enabled"):
        result = attrs.evolve(result, enabled=_bool(value))
    if value := _get(table, prefix, "backend"):
        backend = _url(value)
        _not_self(value.key, backend, facade_port)
        result = attrs.evolve(result, backend=backend, backend_configured=True)
    if value := _get(table, prefix, "aliases"):
        aliases: list[tuple[str, int]] = []
        for item in _items(value):
            alias = _loopback_host_port(item)
            if alias in aliases:
                raise ConfigError(item.key, f"duplicate alias {_show(item.raw)}")
            aliases.append(alias)
        result = attrs.evolve(result, aliases=tuple(aliases))
    if value := _get(table, prefix, "hold"):
        result = attrs.evolve(result, hold=_hold(value))
    if value := _get(table, prefix, "state_ttl"):
        result = attrs.evolve(result, state_ttl=_duration(value, zero=True))
    if value := _get(table, prefix, "services"):
        services = _services(value)
        for index, service in enumerate(services):
            _not_self(f"{value.key}[{index}].url", service.url, facade_port)
        result = attrs.evolve(result, services=services)
    return result


def _not_self(key: str, url: str, facade_port: int) -> None:
    """
    Refuse a backend that is the facade itself: every request would loop.
    """
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if parts.hostname and is_loopback(parts.hostname) and port == facade_port:
        raise ConfigError(key, f"points at this facade's own port {facade_port}")


def _engines(document: Mapping[str, object]) -> dict[str, EngineConfig]:
    section = _section(document, "engines")
    for name in section:
        if name not in ENGINES:
            raise ConfigError(
                _join("engines", name),
                f"unknown engine; known engines are {_KNOWN_ENGINES}",
            )
    engines = {}
    for engine_id in ENGINES:
        table = {}
        if engine_id in section:
            table = _table(section[engine_id], _join("engines", engine_id))
        engines[engine_id] = _engine(engine_id, table)
    ports: dict[int, str] = {}
    for engine_id, engine in engines.items():
        if not engine.enabled:
            continue
        other = ports.get(engine.facade_port)
        if other is not None:
            raise ConfigError(
                _join(_join("engines", engine_id), "port"),
                f"{engine.facade_port} is also the facade port of {other}",
            )
        ports[engine.facade_port] = engine_id
    return engines


def _nodes(
    document: Mapping[str, object], own_id: str | None
) -> tuple[NodeConfig, ...]:
    if "nodes" not in document:
        return ()
    nodes: list[NodeConfig] = []
    for item in _items(_Value(document["nodes"], "nodes")):
        table = _table(item.raw, item.key)
        _known(table, item.key, ("id", "engines"))
        id_value = _get(table, item.key, "id")
        if id_value is None:
            raise ConfigError(_join(item.key, "id"), "is required")
        node_id = _node_id(id_value)
        if node_id in {node.id for node in nodes}:
            raise ConfigError(id_value.key, f"duplicate node id {_show(node_id)}")
        if node_id == own_id:
            raise ConfigError(id_value.key, f"{_show(node_id)} is this node's own id")
        engines_value = _get(table, item.key, "engines")
        if engines_value is None:
            raise ConfigError(_join(item.key, "engines"), "is required")
        urls = _table(engines_value.raw, engines_value.key)
        if not urls:
            raise ConfigError(
                engines_value.key, "must map at least one engine to a URL"
            )
        for name in urls:
            if name not in ENGINES:
                raise ConfigError(
                    _join(engines_value.key, name),
                    f"unknown engine; known engines are {_KNOWN_ENGINES}",
                )
        mapping = {
            engine_id: _url(
                _Value(urls[engine_id], _join(engines_value.key, engine_id))
            )
            for engine_id in ENGINES
            if engine_id in urls
        }
        nodes.append(NodeConfig(node_id, MappingProxyType(mapping)))
    return tuple(nodes)


# Loading


def _writable(path: str) -> bool:
    existing = path
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            return False
        existing = parent
    return os.access(existing, os.W_OK)


def default_state_dir(
    env: Mapping[str, str],
    *,
    euid: int | None = None,
    writable: Callable[[str], bool] = _writable,
) -> str:
    """
    C{/var/lib/nvproxy} for root when it can be written, else
    C{$XDG_STATE_HOME/nvproxy}, else C{~/.local/state/nvproxy}.
    """
    if euid is None:
        euid = os.geteuid()
    if euid == 0 and writable(SYSTEM_STATE_DIR):
        return SYSTEM_STATE_DIR
    xdg = env.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):
        return os.path.join(xdg, "nvproxy")
    home = env.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".local", "state", "nvproxy")


def _read_document(path: str) -> dict[str, object]:
    where = f"config file {path}"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(where, f"cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(where, f"not UTF-8 text at byte {e.start}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        message = str(e)
        match = re.fullmatch(r"(.*) \(at line (\d+), column (\d+)\)", message)
        if match is None:
            raise ConfigError(where, f"invalid TOML: {message}") from None
        raise ConfigError(
            f"{where}: line {match.group(2)}",
            f"invalid TOML: {match.group(1)} (column {match.group(3)})",
        ) from None


def load_config(
    path: str | None,
    flags: Mapping[str, str | None],
    env: Mapping[str, str],
) -> Config:
    """
    Build the configuration from a TOML file, environment variables and
    command-line flags, in increasing order of precedence.

    @param path: the TOML file; L{None} falls back to C{flags["config"]}, then
        C{NVPROXY_CONFIG}, then no file (defaults only).
    @param flags: flag long name (see L{FLAG_NAMES}) -> value, L{None} when
        not given.
    @param env: the process environment.
    @raise ConfigError: anything is wrong; the first problem found.
    """
    unknown = set(flags) - set(FLAG_NAMES)
    if unknown:
        raise ValueError(f"unknown flags {sorted(unknown)}")
    overrides = _Overrides(flags, env)
    if path is None and (value := overrides.get("config")):
        path = _string(value)
    document: dict[str, object] = {}
    if path is not None:
        document = _read_document(path)
    _known(document, "", _TOP_KEYS)

    node_id = None
    if value := _pick(overrides, "node-id", document, "", "node_id"):
        node_id = _node_id(value)

    if value := _pick(overrides, "state-dir", document, "", "state_dir"):
        state_dir = _path(value)
    else:
        state_dir = default_state_dir(env)

    log_format: LogFormat = "text"
    if value := _pick(overrides, "log-format", document, "", "log_format"):
        log_format = "json" if _choice(value, ("text", "json")) == "json" else "text"

    log_level: LogLevelName = "info"
    if value := _pick(overrides, "log-level", document, "", "log_level"):
        if isinstance(value.raw, str):  # any case: NVPROXY_LOG_LEVEL=DEBUG
            value = attrs.evolve(value, raw=value.raw.lower())
        log_level = cast(LogLevelName, _choice(value, LEVELS))

    listen_interface = "127.0.0.1"
    if value := _pick(overrides, "listen-interface", document, "", "listen_interface"):
        listen_interface = _interface(value)

    control: Control | None = None
    if value := overrides.get("control"):
        _choice(value, ("stdio",))
        control = "stdio"

    admin = _section(document, "admin")
    _known(admin, "admin", ("listen", "enabled"))
    admin_listen = ("127.0.0.1", 8010)
    admin_enabled = True
    admin_key = "admin.listen"
    if value := _get(admin, "admin", "enabled"):
        admin_enabled = _bool(value)
    if value := _get(admin, "admin", "listen"):
        admin_listen = _loopback_host_port(value)
    if value := overrides.get("admin"):
        admin_key = value.key
        if isinstance(value.raw, str) and value.raw.strip().lower() == "off":
            admin_enabled = False
        else:
            admin_listen = _loopback_host_port(value)
            admin_enabled = True

    dispatch = _dispatch(_section(document, "dispatch"), overrides)

    discovery = _section(document, "discovery")
    _known(discovery, "discovery", ("poll_interval",))
    poll_interval = 2.0
    if value := _get(discovery, "discovery", "poll_interval"):
        poll_interval = _duration(value, zero=False)

    limits = _limits(_section(document, "limits"))

    cluster = _section(document, "cluster")
    _known(cluster, "cluster", ("dir",))
    cluster_dir = None
    if value := _pick(overrides, "cluster-dir", cluster, "cluster", "dir"):
        cluster_dir = _path(value)

    workloads = _section(document, "workloads")
    _known(workloads, "workloads", ("log",))
    workload_log = None
    if value := _get(workloads, "workloads", "log"):
        workload_log = _path(value)

    engines = _engines(document)
    if admin_enabled:
        for engine in engines.values():
            if engine.enabled and engine.facade_port == admin_listen[1]:
                raise ConfigError(
                    admin_key,
                    f"port {admin_listen[1]} is also the facade port of {engine.id}",
                )
    nodes = _nodes(document, node_id)

    return Config(
        node_id=node_id,
        state_dir=state_dir,
        log_format=log_format,
        log_level=log_level,
        admin_listen=admin_listen,
        admin_enabled=admin_enabled,
        dispatch=dispatch,
        discovery_poll_interval=poll_interval,
        limits=limits,
        cluster_dir=cluster_dir,
        engines=MappingProxyType(engines),
        nodes=nodes,
        control=control,
        listen_interface=listen_interface,
        workload_log=workload_log,
        config_path=path,
    )


# Node identity


def node_id_from_hostname(hostname: str) -> str:
    """
    A valid node id (see L{node_id_problem}) made from a host name: lower
    case, other characters become C{-}, each label trimmed of C{-} and cut
    to 63 characters, empty labels dropped; C{"node"} when nothing usable is
    left (or only an all-digit last label).
    """
    labels = []
    for label in hostname.strip().lower().split("."):
        label = re.sub(r"[^a-z0-9-]+", "-", label).strip("-")[:63].strip("-")
        if label:
            labels.append(label)
    candidate = ".".join(labels)[:253].strip(".-")
    if not candidate or node_id_problem(candidate) is not None:
        return "node"
    return candidate


def resolve_node_id(config: Config, hostname: str) -> str:
    """
    This node's id: the configured one; else the one persisted in
    C{<state_dir>/node-id}; else derived from C{hostname} and persisted (a
    failure to persist is logged, not fatal).

    @raise ConfigError: the persisted file cannot be read or holds an invalid
        id (the id names this node's certificate, so it is not replaced
        silently).
    """
    if config.node_id is not None:
        return config.node_id
    path = os.path.join(config.state_dir, NODE_ID_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as e:
        raise ConfigError(path, f"cannot read: {e.strerror or e}") from None
    else:
        text = data.decode("utf-8", "replace").strip()
        if node_id_problem(text) is not None:
            raise ConfigError(
                path,
                f"not a valid node id: {_show(text)}; fix or delete the file",
            )
        return text
    node_id = node_id_from_hostname(hostname)
    try:
        atomic_write(path, node_id.encode("ascii") + b"\n")
    except OSError as e:
        log.warn(
            "cannot persist node id {node_id} to {path}: {error}",
            node_id=node_id,
            path=path,
            error=e.strerror or str(e),
        )
    return node_id


# twistd


class Options(usage.Options):
    """
    Command-line options of C{twistd nvproxy}.  After parsing, C{self.config}
    holds the loaded L{Config}; a configuration problem is a
    L{usage.UsageError} whose text is the one-line L{ConfigError}.
    """

    synopsis = "[options]"
    longdesc = (
        "Reverse-proxy LLM inference for Ollama, LM Studio, llama.cpp and vLLM. "
        "Every option also reads NVPROXY_<OPTION> from the environment "
        "(e.g. NVPROXY_RESPONSE_HEADER_TIMEOUT); options win over the "
        "environment, which wins over the config file."
    )
    optParameters = [
        ["config", "c", None, "TOML configuration file."],
        [
            "response-header-timeout",
            None,
            None,
            'Wait for response headers and first body byte, e.g. "30m"; 0 disables.',
        ],
        ["dial-timeout", None, None, 'Upstream connect timeout, e.g. "10s".'],
        ["max-attempts", None, None, "Dispatches an inference request may fail."],
        ["deadline", None, None, 'No new attempts after this, e.g. "10m".'],
        [
            "eject-base",
            None,
            None,
            'Order a node last for this long after a transport failure, e.g. "1s";'
            " 0 disables.",
        ],
        ["eject-max", None, None, 'The longest such ejection, e.g. "30s".'],
        ["cluster-dir", None, None, "Cluster identity and pinned peers (mTLS)."],
        ["state-dir", None, None, "Persisted ports, node id, vLLM wake intent."],
        [
            "admin",
            None,
            None,
            'Admin API listen address (loopback HOST:PORT) or "off".',
        ],
        ["log-format", None, None, 'Log format: "text" or "json".'],
        [
            "log-level",
            None,
            None,
            'Log level: "debug", "info" (default), "warn", "error" or "critical".',
        ],
        ["node-id", None, None, "This node's id (default: from the host name)."],
        ["control", None, None, 'Attach the broker link: "stdio".'],
        ["listen-interface", None, None, "Address the facades listen on."],
    ]

    config: Config

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._env: Mapping[str, str] = os.environ if env is None else env

    def postOptions(self) -> None:
        flags: dict[str, str | None] = {name: self[name] for name in FLAG_NAMES}
        try:
            self.config = load_config(self["config"], flags, self._env)
        except ConfigError as e:
            raise usage.UsageError(str(e)) from None
