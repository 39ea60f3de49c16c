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
C{E:ready}                  out          C{{port}} once a facade listens
C{E:error}                  out          C{{kind, message}} (e.g. a lost bind race)
C{workload:*}               out          C{{workloadInfo}} (spec §5.5)
==========================  ===========  ===========================================

When the broker closes the link, facades stop serving and the process exits
(spec §11).  Logs never go to standard output while the link is attached.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.logger import Logger
from twisted.protocols.basic import LineOnlyReceiver
from twisted.python.failure import Failure

from nvproxy.engines import ENGINES
from nvproxy.logs import LEVELS
from nvproxy.ops import OperationError
from nvproxy.scheduler import SchedulerSnapshot
from nvproxy.workload import WorkloadInfo, notification

log = Logger()

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
SERVER_ERROR = -32000


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


def split_address(method: str) -> tuple[str | None, str]:
    """
    C{"ollama:node/select"} -> C{("ollama", "node/select")}; a prefix that
    is not an engine id is part of the method (spec §4).
    """
    head, sep, rest = method.partition(":")
    if sep and head in ENGINES:
        return head, rest
    return None, method


_FACADE_SCOPED = frozenset({"node/select", "set-port", "ready", "error"})


class ControlLink(LineOnlyReceiver):
    """
    The JSON-RPC endpoint on the broker's pipe.
    """

    delimiter = b"\n"
    MAX_LENGTH = 1 << 20

    def __init__(self, target: ControlTarget, on_close: Callable[[], None]) -> None:
        self._target = target
        self._on_close = on_close
        self.open = False

    def connectionMade(self) -> None:
        self.open = True
        log.info("broker link attached")

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.open = False
        log.info("broker link closed; stopping")
        self._on_close()

    # -- out --------------------------------------------------------------

    def _send(self, message: Mapping[str, Any]) -> None:
        if self.open and self.transport is not None:
            line = json.dumps(message, separators=(",", ":")).encode()
            self.sendLine(line)  # type: ignore[no-untyped-call]

    def notify(self, method: str, params: Mapping[str, Any]) -> None:
        self._send({"jsonrpc": "2.0", "method": method, "params": dict(params)})

    def emit(self, method: str, info: WorkloadInfo) -> None:
        """L{nvproxy.workload.WorkloadSink}: workload events to the broker."""
        self._send(notification(method, info))

    # -- in ---------------------------------------------------------------

    def lineReceived(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            message = json.loads(line)
        except ValueError:
            self._error(None, PARSE_ERROR, "parse error")
            return
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            self._error(None, INVALID_REQUEST, "not a JSON-RPC 2.0 message")
            return
        method = message.get("method")
        ident = message.get("id")
        if not isinstance(method, str):
            # A response to something we sent; we send only notifications.
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
        if name == "log/set-level":
            level = params.get("level")
            if level not in LEVELS:
                raise ControlError(INVALID_PARAMS, f"unknown log level {level!r}")
            self._target.set_log_level(level)
            return {"level": level}
        raise ControlError(METHOD_NOT_FOUND, f"unknown method {method!r}")

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
        if sep and port.isdigit() and 1 <= int(port) <= 65535:
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
    except (TypeError, ValueError) as e:
        raise ControlError(INVALID_PARAMS, f"bad snapshot: {e}") from None
