# -*- test-case-name: tests.test_admin -*-
"""
The admin API: a Klein app served only on a loopback listener (DESIGN §2).

JSON in and out.  Routes that need a part of nvproxy that is not configured
answer 404 in JSON rather than pretending.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from klein import Klein
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from nvproxy.engines import ENGINES

log = Logger()


class AdminBackend(Protocol):
    """
    What the admin API reads and drives; the service implements it.
    """

    def status(self) -> Mapping[str, Any]: ...

    def set_port(self, engine: str, port: int) -> Deferred[Mapping[str, Any]]: ...

    def select(self, engine: str, node: str | None) -> Mapping[str, Any]: ...

    def recent_workloads(self, limit: int) -> list[Any]: ...


class AdminError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _json(request: Any, status: int, body: object) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    return json.dumps(body, indent=None, sort_keys=True).encode() + b"\n"


def _body(request: Any) -> dict[str, Any]:
    raw = request.content.read()
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        raise AdminError(400, "request body is not valid JSON") from None
    if not isinstance(value, dict):
        raise AdminError(400, "request body must be a JSON object")
    return value


def _engine(name: str) -> str:
    if name not in ENGINES:
        raise AdminError(404, f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    return name


def admin_app(
    backend: AdminBackend,
    registry: CollectorRegistry,
    extra: Callable[[Klein], None] | None = None,
) -> Klein:
    """
    Build the admin app over C{backend}; C{extra} may add routes (vLLM).
    """
    app = Klein()

    @app.handle_errors(AdminError)
    def admin_error(request: Any, failure: Failure) -> bytes:
        error = failure.value
        assert isinstance(error, AdminError)
        return _json(request, error.status, {"error": error.message})

    @app.handle_errors(Exception)
    def internal(request: Any, failure: Failure) -> bytes:
        log.failure("admin request failed", failure=failure)
        return _json(request, 500, {"error": "internal error"})

    @app.route("/admin/status", methods=["GET"])
    def status(request: Any) -> bytes:
        return _json(request, 200, backend.status())

    @app.route("/admin/workloads", methods=["GET"])
    def workloads(request: Any) -> bytes:
        raw = request.args.get(b"limit", [b"50"])[0]
        try:
            limit = int(raw)
        except ValueError:
            raise AdminError(400, "limit must be an integer") from None
        if not 1 <= limit <= 10000:
            raise AdminError(400, "limit must be between 1 and 10000")
        return _json(request, 200, {"workloads": backend.recent_workloads(limit)})

    @app.route("/admin/engines/<name>/port", methods=["PUT"])
    async def set_port(request: Any, name: str) -> bytes:
        engine = _engine(name)
        port = _body(request).get("port")
        if not isinstance(port, int) or isinstance(port, bool):
            raise AdminError(400, "port must be an integer")
        if not 1 <= port <= 65535:
            raise AdminError(400, f"port must be 1..65535, got {port}")
        return _json(request, 200, await backend.set_port(engine, port))

    @app.route("/admin/engines/<name>/select", methods=["PUT"])
    def select(request: Any, name: str) -> bytes:
        engine = _engine(name)
        node = _body(request).get("node")
        if not isinstance(node, str) or not node:
            raise AdminError(400, "node must be a non-empty string")
        return _json(request, 200, backend.select(engine, node))

    @app.route("/admin/engines/<name>/select", methods=["DELETE"])
    def unselect(request: Any, name: str) -> bytes:
        return _json(request, 200, backend.select(_engine(name), None))

    @app.route("/metrics", methods=["GET"])
    def metrics(request: Any) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode())
        body: bytes = generate_latest(registry)
        return body

    @app.route("/", branch=True)
    def not_found(request: Any) -> bytes:
        return _json(request, 404, {"error": "not found"})

    if extra is not None:
        extra(app)
    return app
