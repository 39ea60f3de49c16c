# -*- test-case-name: tests.test_facade -*-
"""
An engine facade: a Klein app that speaks one engine's HTTP dialect.

Every request is classified by the engine's route table (L{nvproxy.engines}):

* inference: the model comes from the JSON body or a multipart C{model}
  field, is normalized, and the request is handed to the L{Dispatcher} with
  a resolver over the live discovery snapshot;
* inventory: every node answering for the engine is asked concurrently and
  the lists are merged into the engine's own envelope;
* anything else: forwarded verbatim, candidates resolved once, each tried at
  most once (spec §5.1).

Errors the proxy itself produces use the engine's error dialect.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from typing import Any

from klein import Klein
from twisted.internet.defer import CancelledError, Deferred, gatherResults
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IAgent

from nvproxy.accounting import Accounting, RequestAccounting
from nvproxy.discovery import Discovery, Endpoint, InventoryClient, NodeEntry
from nvproxy.dispatch import (
    Dispatcher,
    JobOutcome,
    RejectReason,
    Target,
)
from nvproxy.engines import Engine, RouteKind
from nvproxy.inferstats import StatsMeter
from nvproxy.proxy.attempt import HttpAttempt, UpstreamRequest
from nvproxy.proxy.bodies import (
    BadBody,
    media_type,
    model_from_json,
    model_from_multipart,
)
from nvproxy.proxy.client import ClientSide
from nvproxy.proxy.pathnorm import normalize_path
from nvproxy.vllm import ModelRequired, UnknownModel, VllmManager, WakingTarget

log = Logger()

INVENTORY_TIMEOUT = 10.0
"""Seconds a node may take to answer an inventory fan-out, body included."""


class HttpTarget:
    """
    A dispatch target reached over HTTP at C{url} (a local engine, a direct
    node's engine, or a peer's facade).
    """

    def __init__(
        self,
        *,
        node_id: str,
        url: bytes,
        agent: IAgent,
        clock: IReactorTime,
        request: UpstreamRequest,
        client: ClientSide,
        response_timeout: float,
        cooperator: Any,
        meter: StatsMeter | None = None,
        on_failure: Callable[[str], None] | None = None,
        stream_idle_timeout: float = 0.0,
    ) -> None:
        self.node_id = node_id
        self._meter = meter
        self._on_failure = on_failure
        self._idle_timeout = stream_idle_timeout
        self._url = url
        self._agent = agent
        self._clock = clock
        self._request = request
        self._client = client
        self._timeout = response_timeout
        self._cooperator = cooperator

    def start(self, final: bool) -> HttpAttempt:
        return HttpAttempt(
            agent=self._agent,
            clock=self._clock,
            node_id=self.node_id,
            url=self._url,
            request=self._request,
            client=self._client,
            final=final,
            response_timeout=self._timeout,
            cooperator=self._cooperator,
            meter=self._meter,
            on_failure=self._on_failure,
            stream_idle_timeout=self._idle_timeout,
        )


class _Sink:
    """
    L{nvproxy.dispatch.ClientSink}: turns a reject reason into the engine's
    error body.
    """

    def __init__(self, client: ClientSide, model: str | None) -> None:
        self._client = client
        self._model = model

    def reject(
        self, status: int, reason: RejectReason, retry_after: int | None
    ) -> None:
        message = reason.message
        if self._model is not None:
            message = f"{message} (model {self._model!r})"
        self._client.reject(status, message, retry_after)


class Facade:
    """
    The facade of one engine.
    """

    def __init__(
        self,
        *,
        engine: Engine,
        discovery: Discovery,
        dispatcher: Dispatcher,
        agent: IAgent,
        inventory: InventoryClient,
        clock: IReactorTime,
        response_timeout: float,
        cooperator: Any,
        accounting: Accounting,
        hidden: Callable[[bytes], bool] | None = None,
        peer_of: Callable[[Any], str | None] | None = None,
        local: Callable[[str | None], Endpoint | None] | None = None,
        vllm: VllmManager | None = None,
        stream_idle_timeout: float = 0.0,
    ) -> None:
        self.engine = engine
        self._idle_timeout = stream_idle_timeout
        self._discovery = discovery
        self._dispatcher = dispatcher
        self._agent = agent
        self._inventory_client = inventory
        self._clock = clock
        self._timeout = response_timeout
        self._cooperator = cooperator
        self._accounting = accounting
        self._hidden = hidden
        self._peer_of = peer_of
        self._local = local
        self._vllm = vllm
        app = Klein()
        # Paths reach the facade exactly as sent: no slash merging or
        # redirects, the upstream decides what a path means.
        app.url_map.merge_slashes = False
        app.url_map.strict_slashes = False
        app.route("/", branch=True)(self._handle)
        app.handle_errors(Exception)(self._internal_error)
        self.app = app

    def resource(self) -> Any:
        return self.app.resource()

    # -- entry ------------------------------------------------------------

    def _handle(self, request: Any) -> Any:
        try:
            return self._route(request)
        except Exception:
            # §3.2: a bug handling one request answers that request only.
            log.failure(
                "{engine} facade failed handling {method} {path}",
                engine=self.engine.id,
                method=request.method.decode("latin-1"),
                path=request.path.decode("latin-1")[:200],
            )
            self._answer_error(request, 500, "internal proxy error")
            return None

    def _internal_error(self, request: Any, failure: Failure) -> Any:
        if failure.check(CancelledError):
            return None
        log.failure(
            "{engine} facade failed handling {method} {path}",
            failure=failure,
            engine=self.engine.id,
            method=request.method.decode("latin-1"),
            path=request.path.decode("latin-1")[:200],
        )
        if not request.startedWriting:
            self._answer_error(request, 500, "internal proxy error")
        return None

    def _answer_error(self, request: Any, status: int, message: str) -> None:
        if request.finished or request.startedWriting:
            return
        ClientSide(request, self._error_body).reject(status, message)

    def _error_body(self, status: int, message: str, code: str | None = None) -> bytes:
        return self.engine.error_body(status, message, code)

    def _route(self, request: Any) -> Any:
        path: bytes = request.path
        if self._hidden is not None and self._hidden(path):
            self._answer_error(request, 404, "not found")
            return None
        text = path.decode("utf-8", "replace")
        kind = self.engine.classify(request.method, text)
        if request.isSecure():
            return self._for_peer(request, kind)
        if kind is RouteKind.INVENTORY:
            return self._inventory(request, text)
        if self._vllm is not None and normalize_path(path) == "/health":
            # FD §6.2: liveness of the front door plus each service's state,
            # without touching (or waking) any service.
            return self._answer_json(
                request, {"status": "ok", "services": self._vllm.status()}
            )
        if self._vllm is not None and normalize_path(path) == "/metrics":
            # Whichever service happened to be awake (or a 502 while all
            # sleep) would pass for the front door's metrics; nvproxy's own
            # are on the admin listener.
            self._answer_error(
                request,
                404,
                "not found: /metrics is not served on the vLLM front door; "
                "nvproxy's metrics are at /metrics on its admin listener",
            )
            return None
        client = ClientSide(request, self._error_body)
        prepared = self._prepare(request, kind, client, kind is RouteKind.INFERENCE)
        if prepared is None:
            return None
        model, upstream = prepared
        accounting = self._accounting.begin(self.engine, model, kind)
        # (The dispatcher resolves a non-inference request once, §5.1.)
        resolver = self._resolver(model, upstream, client, accounting)
        log.debug(
            "{engine} {kind} {method} {path} model={model}",
            engine=self.engine.id,
            kind=kind.value,
            method=request.method.decode("latin-1"),
            path=text[:200],
            model=model,
        )
        d = self._dispatcher.dispatch(
            resolver,
            _Sink(client, model),
            inference=kind is RouteKind.INFERENCE,
            observer=accounting,
            subscribe=self._subscribe,
            present=self._present(model),
        )
        return _settle(d, client)

    def _for_peer(self, request: Any, kind: RouteKind) -> Any:
        """
        Peer mode (spec §7): a pinned peer's request goes straight to this
        node's own engine, tried once and never re-routed; the peer that
        received it from its client runs the retry loop.
        """
        client = ClientSide(request, self._error_body)
        peer = self._peer_of(request) if self._peer_of is not None else None
        if peer is None:
            # The pin was removed while the connection stayed open.
            client.reject(403, "peer certificate is not pinned")
            return None
        if kind is RouteKind.INVENTORY and self._vllm is not None:
            return self._answer_json(request, self._vllm_models())
        prepared = self._prepare(request, kind, client, inference=False)
        if prepared is None:
            return None
        model, upstream = prepared
        endpoint = self._local(model) if self._local is not None else None
        if endpoint is None:
            client.reject(502, f"this node runs no {self.engine.name} engine")
            return None
        accounting = self._accounting.begin(self.engine, None, RouteKind.OTHER)
        target = self._target(endpoint, upstream, client, accounting, model=model)
        log.debug(
            "{engine} peer request from {peer} to the local engine",
            engine=self.engine.id,
            peer=peer,
        )
        d = self._dispatcher.dispatch(
            lambda: [target],
            _Sink(client, model),
            inference=False,
            observer=accounting,
        )
        return _settle(d, client)

    def _prepare(
        self, request: Any, kind: RouteKind, client: ClientSide, inference: bool
    ) -> tuple[str | None, UpstreamRequest] | None:
        """
        The model (inference routes) and what to send upstream, or C{None}
        after answering the client.  The body is taken after the model is
        read: vLLM may rewrite an alias to the served name.
        """
        model: str | None = None
        if kind is RouteKind.INFERENCE:
            model = self._inference_model(request, client)
            if model is None:
                return None
        upstream = UpstreamRequest(
            method=request.method,
            path=request.uri,
            headers=request.requestHeaders,
            content=request.content,
            inference=inference,
        )
        return model, upstream

    def _inference_model(self, request: Any, client: ClientSide) -> str | None:
        """
        The normalized model an inference request asks for, or C{None} after
        answering the client (400 bad body or no model; vLLM: 404 unknown).
        """
        try:
            model = self._model(request)
        except BadBody as e:
            client.reject(400, str(e))
            return None
        if self._vllm is not None:
            return self._vllm_model(request, client, model)
        if not model:
            client.reject(400, "model is required")
            return None
        return self.engine.normalize_model(model)

    def _vllm_model(
        self, request: Any, client: ClientSide, model: str | None
    ) -> str | None:
        """
        FD §6.2 step 1: the registry maps a model or alias (any case), or a
        route's default when the body names none, to a service's model.  A
        model the registry lacks is still served when another node
        advertises it; otherwise it is a 404 and nothing wakes.
        """
        assert self._vllm is not None
        kind, _ = media_type(request.getHeader(b"content-type"))
        path = normalize_path(request.path) or request.path.decode("latin-1")
        try:
            service = self._vllm.registry.resolve(
                model, path, kind == "multipart/form-data"
            )
        except ModelRequired:
            client.reject(400, "model is required")
            return None
        except UnknownModel:
            assert model is not None
            if self._discovery.current.owners(self.engine.id, model):
                return model
            client.reject(
                404,
                f"The model `{model}` does not exist.",
                code="model_not_found",
            )
            return None
        if model != service.model and kind != "multipart/form-data":
            # vLLM knows only its served name: an alias, another case or a
            # route default becomes that name in the forwarded JSON body.
            request.content = _with_model(request.content, service.model)
        return service.model

    def _vllm_models(self) -> dict[str, Any]:
        assert self._vllm is not None
        return {"object": "list", "data": self._vllm.registry.models()}

    def _answer_json(self, request: Any, body: object) -> None:
        data = json.dumps(body).encode()
        request.setResponseCode(200)
        request.responseHeaders.setRawHeaders(b"content-type", [b"application/json"])
        request.responseHeaders.setRawHeaders(b"content-length", [b"%d" % len(data)])
        request.write(data)
        request.finish()

    def _present(self, model: str | None) -> Callable[[str], bool]:
        """
        Whether a node still answers for this engine (and advertises
        C{model}) in the live snapshot: the target-lost check of §5.3.
        """
        engine = self.engine.id

        def present(node_id: str) -> bool:
            entry = self._discovery.current.node(engine, node_id)
            return entry is not None and (model is None or entry.advertises(model))

        return present

    def _subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        return self._discovery.subscribe(lambda _snapshot: callback())

    def _model(self, request: Any) -> str | None:
        kind, params = media_type(request.getHeader(b"content-type"))
        if kind == "multipart/form-data":
            return model_from_multipart(request.content, params.get("boundary", ""))
        return model_from_json(request.content)

    def _resolver(
        self,
        model: str | None,
        upstream: UpstreamRequest,
        client: ClientSide,
        accounting: RequestAccounting,
    ) -> Callable[[], Sequence[Target]]:
        engine = self.engine

        def resolve() -> Sequence[Target]:
            snapshot = self._discovery.current
            if model is not None:
                entries: Sequence[NodeEntry] = snapshot.owners(engine.id, model)
            else:
                entries = snapshot.nodes(engine.id)
            entries = accounting.order(entries)
            targets: list[Target] = []
            for entry in entries:
                if model is not None:
                    endpoint = entry.models[model]
                else:
                    found = self._modelless_endpoint(entry)
                    if found is None:
                        continue
                    endpoint = found
                targets.append(
                    self._target(
                        endpoint,
                        upstream,
                        client,
                        accounting,
                        others=len(entries) > 1,
                        model=model,
                    )
                )
            return targets

        return resolve

    def _target(
        self,
        endpoint: Endpoint,
        upstream: UpstreamRequest,
        client: ClientSide,
        accounting: RequestAccounting,
        others: bool = False,
        model: str | None = None,
    ) -> Target:
        """
        The dispatch target for C{endpoint}; with a C{model} (an inference
        request), a local vLLM service is woken and held for first.
        """
        url = endpoint.base_url.rstrip("/").encode("ascii") + upstream.path
        target = self._http_target(endpoint, url, upstream, client, accounting)
        if (
            self._vllm is not None
            and model is not None
            and endpoint.kind == "local"
            and endpoint.service is not None
        ):
            # A local vLLM service is woken (and held for) before forwarding.
            service = self._vllm.registry.service(endpoint.service)
            return WakingTarget(
                target,
                self._vllm,
                endpoint.service,
                client,
                service.model,
                retry_elsewhere=others,
            )
        return target

    def _modelless_endpoint(self, entry: NodeEntry) -> Endpoint | None:
        """
        Where a request naming no model goes on C{entry}.  A local vLLM
        service is used only while awake, and never woken for it (nor is it
        counted as activity): a health or metrics poller must not keep a
        model awake.
        """
        vllm = self._vllm
        if vllm is None or entry.kind != "local":
            return entry.endpoints[0]
        for endpoint in entry.endpoints:
            if endpoint.service is None or vllm.is_awake(endpoint.service):
                return endpoint
        return None

    def _http_target(
        self,
        endpoint: Endpoint,
        url: bytes,
        upstream: UpstreamRequest,
        client: ClientSide,
        accounting: RequestAccounting,
    ) -> HttpTarget:
        return HttpTarget(
            node_id=endpoint.node_id,
            url=url,
            agent=self._agent,
            clock=self._clock,
            request=upstream,
            client=client,
            response_timeout=self._timeout,
            cooperator=self._cooperator,
            meter=accounting.meter,
            on_failure=accounting.failed_attempt,
            stream_idle_timeout=self._idle_timeout,
        )

    # -- inventory --------------------------------------------------------

    def _inventory(self, request: Any, path: str) -> Deferred[None]:
        listing = self.engine.inventory[path]
        endpoints = [
            endpoint
            for entry in self._discovery.current.nodes(self.engine.id)
            for endpoint in entry.endpoints
        ]
        local: list[object] = []
        if self._vllm is not None:
            # Registered services are listed without asking (or waking) them.
            local.append(self._vllm_models())
            endpoints = [e for e in endpoints if not (e.kind == "local" and e.service)]

        async def ask(endpoint: Endpoint) -> object:
            url = endpoint.base_url.rstrip("/") + listing.path
            try:
                # The whole exchange is bounded, body included.
                return await self._inventory_client.get_json(url, INVENTORY_TIMEOUT)
            except CancelledError:
                raise
            except Exception as e:
                log.debug(
                    "{engine} inventory from {node} failed: {error}",
                    engine=self.engine.id,
                    node=endpoint.node_id,
                    error=f"{type(e).__name__}",
                )
                return None

        async def merge() -> None:
            answers = await gatherResults(
                [Deferred.fromCoroutine(ask(e)) for e in endpoints],
                consumeErrors=True,
            )
            body = json.dumps(listing.merge([*local, *answers])).encode()
            if request.finished:
                return
            request.setResponseCode(200)
            request.responseHeaders.setRawHeaders(
                b"content-type", [b"application/json"]
            )
            request.responseHeaders.setRawHeaders(
                b"content-length", [b"%d" % len(body)]
            )
            request.write(body)
            request.finish()

        return Deferred.fromCoroutine(merge())


def _with_model(content: Any, model: str) -> io.BytesIO:
    content.seek(0)
    body = json.load(content)
    body["model"] = model
    return io.BytesIO(json.dumps(body).encode())


def _settle(d: Deferred[JobOutcome], client: ClientSide) -> Deferred[object]:
    """
    What Klein waits for: the job, then (for a truncated stream, which
    closes the client connection) the close itself, so Klein does not finish
    the response first and make a cut stream look whole with a final chunk.
    """

    def settled(outcome: JobOutcome | None) -> object:
        if client.aborted and not client.gone:
            return client.closed
        return outcome

    return d.addErrback(_cancelled_is_fine).addCallback(settled)


def _cancelled_is_fine(failure: Failure) -> JobOutcome | None:
    failure.trap(CancelledError)
    return None
