# -*- test-case-name: tests.test_control -*-
"""
The broker link (spec §3, §4): JSON-RPC 2.0, one JSON object per line, on
standard input and output (C{--control stdio}).

With the link attached the process starts with no facade; the broker enables
each with C{facade/enable}.  Facade-scoped methods carry the engine as their
address, C{ENGINE:METHOD} (C{ollama:node/select}); only a known engine id
counts as an address, so an unaddressed C{errors:report} stays itself.
Messages:

==========================  ===========  ===========================================
method                      direction    params / result
==========================  ===========  ===========================================
C{facade/enable}            in           C{{engine, port, aliases?,
                                         ignorePersistedPort?}} -> C{{engine, port}}
C{facade/disable}           in           C{{engine}}
C{E:node/select}            in           C{{nodeId}} (C{null} clears the pin)
C{E:set-port}               in           C{{port}} -> C{{engine, port, persisted}}
C{node/set-priority}        in           C{{generation, priority, pending?,
                                         gpuPressure?}} -> C{{applied}}
C{log/set-level}            in           C{{level}}
C{E:discovery:nodes}        in           C{{nodes: [{nodeId, url | peer, models}]}}
                                         -> C{{engine, nodes}}
C{E:discovery:subscribe}    in           -> C{{engine, subscribed}}
C{[E:]errors:report}        in           C{{kind?, message?}}: logged -> C{{logged}}
C{E:discovery:nodes}        out          C{{generation, nodes: [{nodeId, kind, url,
                                         peer?, models}]}} after a subscribe, on change
C{discovery:node-activity}  out          C{{nodes: {NODE: in-flight}}} on change
C{E:ready}                  out          C{{port}} once a facade listens
C{E:error}                  out          C{{kind, message}} (e.g. a lost bind race)
C{workload:*}               out          C{{workloadInfo}} (spec §5.5)
==========================  ===========  ===========================================

When the broker closes the link, facades stop serving and the process exits
(spec §11); nothing the broker sends closes it.  A line longer than
C{max_line} bytes gets an invalid-request error (id C{null}) naming the limit
and is discarded up to its newline; JSON that is not valid (C{NaN} and
C{Infinity} included) is a parse error; a message nested deeper than
L{MAX_DEPTH} levels, or with an id that is not a string, a finite number or
C{null}, is an invalid request.  Logs never go to standard output while the
link is attached.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from twisted.internet import protocol
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from nvproxy.brokerdiscovery import BrokerDiscovery, SnapshotError
from nvproxy.config import format_size
from nvproxy.engines import ENGINES
from nvproxy.logs import LEVELS, clip
from nvproxy.ops import OperationError
from nvproxy.scheduler import SchedulerSnapshot
from nvproxy.workload import WorkloadInfo, notification

log = Logger()

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
SERVER_ERROR = -32000

MAX_LINE = 1 << 20
"""The default longest line, in bytes, without its newline."""

MAX_DEPTH = 64
"""The deepest nesting of arrays and objects a message may have."""


class ControlError(Exception):
    """
    A request the broker sent cannot be carried out; answered as a JSON-RPC
    error with C{code}.
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ControlTarget(Protocol):
    """
    What the broker drives: L{nvproxy.ops.Operations}, the same methods the
    admin API calls where the operation is the same.
    """

    def enable_facade(
        self,
        engine: str,
        port: int,
        aliases: Sequence[tuple[str, int]],
        ignore_persisted: bool,
    ) -> Deferred[int]: ...

    def disable_facade(self, engine: str) -> Deferred[None]: ...

    def select(self, engine: str, node: str | None) -> Mapping[str, Any]: ...

    def set_port(self, engine: str, port: int) -> Deferred[Mapping[str, Any]]: ...

    def apply_priority(self, snapshot: SchedulerSnapshot) -> bool: ...

    def set_log_level(self, level: str) -> None: ...

    def reservation_counts(self) -> Mapping[str, int]: ...


def split_address(method: str) -> tuple[str | None, str]:
    """
    C{"ollama:node/select"} -> C{("ollama", "node/select")}; a prefix that
    is not an engine id is part of the method (spec §4).
    """
    head, sep, rest = method.partition(":")
    if sep and head in ENGINES:
        return head, rest
    return None, method


_FACADE_SCOPED = frozenset(
    {
        "node/select",
        "set-port",
        "ready",
        "error",
        "discovery:nodes",
        "discovery:subscribe",
    }
)


class ControlLink(protocol.Protocol):
    """
    The JSON-RPC endpoint on the broker's pipe.

    @ivar max_line: the longest line, in bytes without its newline; a longer
        one is answered with an error and discarded up to its newline.
    """

    delimiter = b"\n"

    def __init__(
        self,
        target: ControlTarget,
        on_close: Callable[[], None],
        max_line: int = MAX_LINE,
        discovery: BrokerDiscovery | None = None,
    ) -> None:
        self._target = target
        self._discovery = discovery
        self._on_close = on_close
        self.max_line = max_line
        self.open = False
        self._buffer = b""
        self._discarding = False

    def connectionMade(self) -> None:
        self.open = True
        log.info("broker link attached")
        if self._discovery is not None:
            self._discovery.attach(self.notify, self._target.reservation_counts)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.open = False
        if self._discovery is not None:
            self._discovery.detach()
        why = reason.getErrorMessage() if reason is not None else "closed"
        log.info("broker link closed: {why}", why=why)
        self._on_close()

    # -- out --------------------------------------------------------------

    def _send(self, message: Mapping[str, Any]) -> None:
        if self.open and self.transport is not None:
            line = json.dumps(message, separators=(",", ":")).encode()
            self.transport.write(line + self.delimiter)

    def notify(self, method: str, params: Mapping[str, Any]) -> None:
        self._send({"jsonrpc": "2.0", "method": method, "params": dict(params)})

    def emit(self, method: str, info: WorkloadInfo) -> None:
        """L{nvproxy.workload.WorkloadSink}: workload events to the broker."""
        self._send(notification(method, info))

    # -- in ---------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        """
        Split lines; a line over L{max_line} is refused as soon as it is
        known to be too long, and its bytes are dropped up to its newline.
        """
        if self._discarding:
            end = data.find(self.delimiter)
            if end < 0:
                return
            self._discarding = False
            data = data[end + 1 :]
        buffer = self._buffer + data
        self._buffer = b""
        start = 0
        while self.open:
            end = buffer.find(self.delimiter, start)
            if end < 0:
                break
            if end - start > self.max_line:
                self._too_long()
            else:
                self._line(buffer[start:end])
            start = end + 1
        rest = buffer[start:]
        if len(rest) > self.max_line:
            self._too_long()
            self._discarding = True
        elif self.open:
            self._buffer = rest

    def _too_long(self) -> None:
        limit = format_size(self.max_line)
        log.warn(
            "broker link: discarded a line longer than {limit}",
            limit=limit,
        )
        self._error(
            None,
            INVALID_REQUEST,
            f"line longer than {limit} ({self.max_line} bytes); discarded",
        )

    def _line(self, line: bytes) -> None:
        try:
            self.lineReceived(line)
        except Exception:
            # A bug, not the broker's doing: logged with its stack; the link
            # stays up.
            log.failure("broker line handling failed")
            self._error(None, INTERNAL_ERROR, "internal error")

    def lineReceived(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            message = json.loads(line, parse_constant=_no_constant)
        except ValueError:
            self._error(None, PARSE_ERROR, "parse error")
            return
        except RecursionError:
            self._error(None, INVALID_REQUEST, _TOO_DEEP)
            return
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            self._error(None, INVALID_REQUEST, "not a JSON-RPC 2.0 message")
            return
        ident = message.get("id")
        if not _valid_id(ident):
            self._error(None, INVALID_REQUEST, "id must be a string, number or null")
            return
        if _deeper_than(message, MAX_DEPTH):
            self._error(ident, INVALID_REQUEST, _TOO_DEEP)
            return
        if "method" not in message and ("result" in message or "error" in message):
            # A response to something we sent; we send only notifications.
            return
        method = message.get("method")
        if not isinstance(method, str):
            self._error(ident, INVALID_REQUEST, "method must be a string")
            return
        params = message.get("params", {})
        if not isinstance(params, dict):
            self._error(ident, INVALID_PARAMS, "params must be an object")
            return
        d = maybeDeferred(self._dispatch, method, params)

        def answered(result: object) -> None:
            if ident is not None:
                self._send({"jsonrpc": "2.0", "id": ident, "result": result})

        def failed(failure: Failure) -> None:
            if failure.check(ControlError):
                error = failure.value
                assert isinstance(error, ControlError)
                code, text = error.code, error.message
            elif failure.check(OperationError):
                # The same refusals the admin API gives (engine not enabled,
                # port taken): the broker's mistake or a busy port, not a bug.
                refused = failure.value
                assert isinstance(refused, OperationError)
                code = INVALID_PARAMS if refused.status < 409 else SERVER_ERROR
                text = refused.message
            else:
                log.failure("broker request {method} failed", failure, method=method)
                code, text = SERVER_ERROR, "internal error"
            if ident is not None:
                self._error(ident, code, text)

        d.addCallbacks(answered, failed)

    def _error(self, ident: object, code: int, message: str) -> None:
        self._send(
            {"jsonrpc": "2.0", "id": ident, "error": {"code": code, "message": message}}
        )

    def _dispatch(self, method: str, params: dict[str, Any]) -> Any:
        engine, name = split_address(method)
        if name in _FACADE_SCOPED and engine is None:
            # §4: never fall back to "the only facade".
            raise ControlError(INVALID_PARAMS, f"{name} needs an engine address")
        if name == "facade/enable":
            return self._enable(params)
        if name == "facade/disable":
            return self._target.disable_facade(_engine_param(params))
        if name == "node/select":
            assert engine is not None
            node = params.get("nodeId", params.get("node"))
            if node is not None and not isinstance(node, str):
                raise ControlError(INVALID_PARAMS, "nodeId must be a string or null")
            return dict(self._target.select(engine, node or None))
        if name == "set-port":
            assert engine is not None
            return self._target.set_port(engine, _port_param(params, "port"))
        if name == "node/set-priority":
            return {"applied": self._target.apply_priority(_snapshot(params))}
        if name in ("discovery:nodes", "discovery:subscribe"):
            assert engine is not None
            return self._discovery_call(engine, name, params)
        if name == "errors:report":
            return _report(engine, params)
        if name == "log/set-level":
            level = params.get("level")
            if level not in LEVELS:
                raise ControlError(INVALID_PARAMS, f"unknown log level {level!r}")
            self._target.set_log_level(level)
            return {"level": level}
        raise ControlError(METHOD_NOT_FOUND, f"unknown method {method!r}")

    def _discovery_call(
        self, engine: str, name: str, params: dict[str, Any]
    ) -> dict[str, Any]:
        if self._discovery is None:
            raise ControlError(METHOD_NOT_FOUND, f"{name} is not available")
        if name == "discovery:subscribe":
            return dict(self._discovery.subscribe(engine))
        try:
            return dict(self._discovery.feed(engine, params))
        except SnapshotError as e:
            raise ControlError(INVALID_PARAMS, f"discovery:nodes: {e}") from None

    def _enable(self, params: dict[str, Any]) -> Deferred[dict[str, Any]]:
        engine = _engine_param(params)
        port = _port_param(params, "port", allow_zero=True)
        raw_aliases = params.get("aliases", [])
        if not isinstance(raw_aliases, list):
            raise ControlError(INVALID_PARAMS, "aliases must be a list")
        aliases = [_alias(a) for a in raw_aliases]
        ignore = bool(params.get("ignorePersistedPort", False))

        async def enable() -> dict[str, Any]:
            try:
                bound = await self._target.enable_facade(engine, port, aliases, ignore)
            except ControlError:
                raise
            except Exception as e:
                # §3.2: a lost bind race is that engine's alone, reported so
                # the broker can retry elsewhere.
                self.notify(f"{engine}:error", {"kind": "bind", "message": str(e)})
                raise ControlError(SERVER_ERROR, f"cannot listen: {e}") from None
            self.notify(f"{engine}:ready", {"port": bound})
            return {"engine": engine, "port": bound}

        return Deferred.fromCoroutine(enable())


_TOO_DEEP = f"nested deeper than {MAX_DEPTH} levels"


def _report(engine: str | None, params: Mapping[str, Any]) -> dict[str, Any]:
    """C{errors:report}: logged (its string fields only, each clipped)."""
    fields = {
        key: clip(value)
        for key, value in sorted(params.items())
        if isinstance(key, str) and isinstance(value, str)
    }
    log.warn(
        "broker reported an error{about}: {kind}: {text}",
        about=f" for {engine}" if engine else "",
        kind=fields.get("kind", "error"),
        text=fields.get("message", ""),
        report=json.dumps(fields, sort_keys=True),
    )
    return {"logged": True}


def _no_constant(name: str) -> object:
    """C{NaN}, C{Infinity}, C{-Infinity} are not JSON."""
    raise ValueError(f"{name} is not JSON")


def _valid_id(ident: object) -> bool:
    """JSON-RPC 2.0: an id is a string, a number or null."""
    if ident is None or isinstance(ident, str):
        return True
    if isinstance(ident, bool):
        return False
    if isinstance(ident, int):
        return True
    return isinstance(ident, float) and math.isfinite(ident)


def _deeper_than(value: object, limit: int) -> bool:
    """
    Whether C{value} nests arrays and objects more than C{limit} deep;
    without recursion, so any depth json accepted is measured safely.
    """
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Any
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend(
            (child, depth + 1) for child in children if isinstance(child, dict | list)
        )
    return False


def _engine_param(params: Mapping[str, Any]) -> str:
    engine = params.get("engine")
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ControlError(
            INVALID_PARAMS, f"engine must be one of {', '.join(ENGINES)}"
        )
    return engine


def _port_param(params: Mapping[str, Any], key: str, allow_zero: bool = False) -> int:
    port = params.get(key, 0 if allow_zero else None)
    low = 0 if allow_zero else 1
    if not isinstance(port, int) or isinstance(port, bool) or not low <= port <= 65535:
        raise ControlError(
            INVALID_PARAMS,
            f"{key} must be an integer {low}..65535"
            + (" (0: the standalone default)" if allow_zero else ""),
        )
    return port


def _alias(value: object) -> tuple[str, int]:
    if isinstance(value, str):
        host, sep, port = value.rpartition(":")
        # ASCII digits only: str.isdigit() admits superscripts int() refuses.
        if sep and re.fullmatch(r"[0-9]{1,5}", port) and 1 <= int(port) <= 65535:
            return host.strip("[]"), int(port)
    raise ControlError(INVALID_PARAMS, f"alias must be HOST:PORT, got {value!r}")


def _snapshot(params: Mapping[str, Any]) -> SchedulerSnapshot:
    generation = params.get("generation")
    priority = params.get("priority", [])
    pending = params.get("pending", {})
    pressure = params.get("gpuPressure", {})
    if not isinstance(generation, int) or isinstance(generation, bool):
        raise ControlError(INVALID_PARAMS, "generation must be an integer")
    if not isinstance(priority, list) or not all(isinstance(p, str) for p in priority):
        raise ControlError(INVALID_PARAMS, "priority must be a list of node ids")
    if not isinstance(pending, dict) or not isinstance(pressure, dict):
        raise ControlError(INVALID_PARAMS, "pending and gpuPressure must be objects")
    try:
        return SchedulerSnapshot(
            generation,
            tuple(priority),
            {str(k): int(v) for k, v in pending.items()},
            {str(k): float(v) for k, v in pressure.items()},
        )
    except (TypeError, ValueError, OverflowError) as e:
        # OverflowError: int() of an infinite float (JSON 1e400).
        raise ControlError(INVALID_PARAMS, f"bad snapshot: {e}") from None
