# -*- test-case-name: tests.test_admin -*-
"""
The admin API: a Klein app served only on a loopback listener (DESIGN §2).

JSON in and out.  Routes that need a part of nvproxy that is not configured
answer 404 in JSON rather than pretending.  Each route parses its request,
calls one of L{nvproxy.ops.Operations}' methods (the same ones the broker
link calls) and renders the answer or the L{OperationError}.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from klein import Klein
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET

from nvproxy.engines import ENGINES
from nvproxy.jsonhttp import json_bytes, set_json
from nvproxy.logs import clip
from nvproxy.net import is_loopback_host
from nvproxy.ops import OperationError
from nvproxy.proxy.urlgate import TextURLGate

if TYPE_CHECKING:
    from nvproxy.statuspage import StatusPage

log = Logger()


class AdminBackend(Protocol):
    """
    What the admin API reads and drives: L{nvproxy.ops.Operations}.
    """

    def status(self) -> Mapping[str, Any]: ...

    def set_port(self, engine: str, port: int) -> Deferred[Mapping[str, Any]]: ...

    def select(self, engine: str, node: str | None) -> Mapping[str, Any]: ...

    def recent_workloads(self, limit: int) -> list[Any]: ...

    def wake(self, service: str) -> Deferred[Mapping[str, Any]]: ...

    def sleep(self, service: str, level: int) -> Deferred[Mapping[str, Any]]: ...

    def drain(self, draining: bool) -> Mapping[str, Any]: ...
    def reload(self) -> Deferred[Mapping[str, Any]]: ...


#: What a route raises to answer with an error (the operations' own error).
AdminError = OperationError


def _json(request: Any, status: int, body: object) -> bytes:
    data = json_bytes(body)
    set_json(request, status, data)
    return data


def _body(request: Any) -> dict[str, Any]:
    raw = request.content.read()
    try:
        value = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        # RecursionError: nested too deeply to decode, a client error too.
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
    *,
    vllm: bool = False,
    status_page: StatusPage | None = None,
) -> Klein:
    """
    Build the admin app over C{backend}; C{vllm} adds the wake and sleep
    routes (FD §6.5), which are not found on a node with no vLLM service;
    C{status_page} adds the page at C{/} and C{/admin/events}.
    """
    app = Klein()

    @app.handle_errors(OperationError)
    def admin_error(request: Any, failure: Failure) -> bytes:
        error = failure.value
        assert isinstance(error, OperationError)
        if error.retry_after is not None:
            request.setHeader(b"retry-after", b"%d" % error.retry_after)
        return _json(request, error.status, {**error.details, "error": error.message})

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

    @app.route("/admin/drain", methods=["POST"])
    def drain(request: Any) -> bytes:
        return _json(request, 200, backend.drain(True))

    @app.route("/admin/drain", methods=["DELETE"])
    def undrain(request: Any) -> bytes:
        return _json(request, 200, backend.drain(False))

    @app.route("/admin/reload", methods=["POST"])
    async def reload(request: Any) -> bytes:
        return _json(request, 200, await backend.reload())

    @app.route("/metrics", methods=["GET"])
    def metrics(request: Any) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode())
        body: bytes = generate_latest(registry)
        return body

    if status_page is not None:
        # Before the catch-all below, which would otherwise answer C{/}.
        status_page.install(app)

    @app.route("/", branch=True)
    def not_found(request: Any) -> bytes:
        return _json(request, 404, {"error": "not found"})

    if vllm:
        _vllm_routes(app, backend)
    return app


def _vllm_routes(app: Klein, backend: AdminBackend) -> None:
    """
    C{POST /admin/wake/<service>} and C{POST /admin/sleep/<service>
    ?level=1|2} (FD §6.5): 200 with the new state; 404 unknown service; 400
    bad level; 409 refused (active requests, busy, down); 503 not awake
    (wake failed, with C{sleep_depth}) or shutting down; 502 the service
    answered the sleep with an error.
    """

    @app.route("/admin/wake/<service>", methods=["POST"])
    async def wake(request: Any, service: str) -> bytes:
        return _json(request, 200, await backend.wake(service))

    @app.route("/admin/sleep/<service>", methods=["POST"])
    async def sleep(request: Any, service: str) -> bytes:
        raw = request.args.get(b"level", [b"1"])[0]
        if raw not in (b"1", b"2"):
            raise AdminError(400, "level must be 1 or 2")
        return _json(request, 200, await backend.sleep(service, int(raw)))


def admin_resource(app: Klein) -> IResource:
    """
    The admin app's resource behind the URL gate: a URL that is not UTF-8
    text is a 400 in the admin API's JSON and one log line, not a Klein
    traceback.
    """

    def refusal(status: int) -> Callable[[Any, str], None]:
        def refuse(request: Any, reason: str) -> None:
            log.info(
                "admin API refused {method} {path}: {reason}",
                method=request.method.decode("latin-1"),
                path=clip(request.path.decode("latin-1")),
                reason=reason,
            )
            data = json_bytes({"error": reason})
            set_json(request, status, data)
            request.write(data)
            request.finish()

        return refuse

    resource: IResource = TextURLGate(
        LoopbackOrigin(app.resource(), refusal(403)), refusal(400)
    )
    return resource


_SAFE_METHODS = frozenset({b"GET", b"HEAD", b"OPTIONS"})


def _loopback_host(host: str) -> bool:
    """C{127.x.x.x}, C{[::1]} or C{localhost}, with or without a port."""
    name = host.lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    else:
        name = name.rpartition(":")[0] if name.count(":") == 1 else name
    return name == "localhost" or is_loopback_host(name)


class LoopbackOrigin(Resource):
    """
    The admin API answers loopback callers only, and the browser is one: a
    page from anywhere can send it simple requests, and a DNS name rebound
    to 127.0.0.1 would be same-origin with such a page.  So the C{Host}
    must name a loopback address (or C{localhost}), and a request that
    changes something (not C{GET}/C{HEAD}) and carries an C{Origin} must
    come from the admin API's own origin (the status page's buttons do);
    C{nvproxyctl}, curl and scripts send no C{Origin}.  Refused: C{403}.
    """

    isLeaf = True

    def __init__(self, inner: IResource, forbid: Callable[[Any, str], None]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._inner = inner
        self._forbid = forbid

    def render(self, request: Any) -> Any:
        host = (request.getHeader(b"host") or b"").decode("latin-1")
        if not _loopback_host(host):
            self._forbid(request, "the admin API answers only to a loopback Host")
            return NOT_DONE_YET
        origin = request.getHeader(b"origin")
        if origin is not None and request.method not in _SAFE_METHODS:
            if origin.decode("latin-1").lower() != f"http://{host.lower()}":
                self._forbid(request, "cross-origin requests may not change the node")
                return NOT_DONE_YET
        return self._inner.render(request)
