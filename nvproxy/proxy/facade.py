# -*- test-case-name: tests.test_facade -*-
"""
An engine facade: Klein apps that speak one engine's HTTP dialect, the same
code for every engine (what differs is asked of its L{Backend}).

L{Facade} is the plaintext personality (local clients).  Every request is
classified by the engine's route table (L{nvproxy.engines}):

* inference: the model comes from the JSON body or a multipart C{model}
  field, is resolved by the backend, and the request is handed to the
  L{Dispatcher} with a resolver over the live discovery snapshot;
* inventory: every node answering for the engine is asked concurrently and
  the lists are merged into the engine's own envelope;
* anything else: forwarded verbatim, candidates resolved once, each tried at
  most once (spec §5.1).

L{PeerFacade} is the TLS personality (spec §7): a pinned peer's request goes
straight to this node's own engine, tried once and never re-routed.
L{personalities} puts both behind one resource.

Errors the proxy itself produces use the engine's error dialect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any

from attrs import frozen
from twisted.internet.defer import CancelledError, Deferred, gatherResults
from twisted.python.failure import Failure
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET

from nvproxy.accounting import Accounting, RequestAccounting
from nvproxy.discovery import Discovery, Endpoint, InventoryClient
from nvproxy.dispatch import Attempt, Dispatcher, JobOutcome, RejectReason, Target
from nvproxy.engines import RouteKind
from nvproxy.jsonhttp import write_json
from nvproxy.logs import Logger, clip, debug_shown
from nvproxy.proxy.access import KeyGate, KeyPolicy, caller_key
from nvproxy.proxy.accesslog import access_of
from nvproxy.proxy.attempt import AttemptSettings, HttpTarget, UpstreamRequest
from nvproxy.proxy.backends import Answered, Backend, Refused
from nvproxy.proxy.bodies import (
    BadBody,
    media_type,
    model_from_json,
    model_from_multipart,
)
from nvproxy.proxy.client import ClientSide
from nvproxy.proxy.cors import is_preflight, origin_inventory, preflight
from nvproxy.proxy.headers import CONTENT_TYPE
from nvproxy.proxy.pathnorm import is_hidden, match_key, normalize_path
from nvproxy.proxy.requestid import assign as assign_request_id
from nvproxy.proxy.requestid import request_id
from nvproxy.proxy.site import when_lost
from nvproxy.proxy.urlgate import TextURLGate

log = Logger()

INVENTORY_TIMEOUT = 10.0
"""Seconds a node may take to answer an inventory fan-out, body included."""


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


class _Candidates:
    """
    One request's nodes, for its job: the live owners of its model in
    order (C{resolve}, a L{nvproxy.dispatch.Resolver}) and whether a node
    still is one (C{present}, the target-lost check of §5.3).  One object
    with two methods, not two closures over the same five values: an open
    stream keeps them until it ends.
    """

    __slots__ = ("_accounting", "_client", "_facade", "_model", "_upstream")

    def __init__(
        self,
        facade: Facade,
        model: str | None,
        upstream: UpstreamRequest,
        client: ClientSide,
        accounting: RequestAccounting,
    ) -> None:
        self._facade = facade
        self._model = model
        self._upstream = upstream
        self._client = client
        self._accounting = accounting

    def resolve(self) -> Sequence[Target]:
        facade, model = self._facade, self._model
        engine = facade.engine
        snapshot = facade._discovery.current
        endpoints: Iterable[Endpoint]
        if model is not None:
            # A job dispatches to at most max_attempts owners: a round of a
            # fleet's hundreds lists no more than that.
            lineup = snapshot.lineup(engine.id, model)
            entries = self._accounting.first(
                lineup, facade._dispatcher.policy.max_attempts
            )
            others = len(lineup.entries) > 1
            endpoints = map(itemgetter(model), map(_MODELS, entries))
        else:
            entries = self._accounting.order(
                snapshot.nodes(engine.id), snapshot.ranks(engine.id, None)
            )
            others = len(entries) > 1
            found = map(facade.backend.modelless_endpoint, entries)
            endpoints = [endpoint for endpoint in found if endpoint is not None]
        return list(map(_Owner, repeat(self), endpoints, repeat(others)))

    def build(self, endpoint: Endpoint, others: bool) -> Target:
        """The target that dispatches to C{endpoint}."""
        return self._facade._target(
            endpoint,
            self._upstream,
            self._client,
            self._accounting,
            self._model,
            others,
        )

    def present(self, node_id: str) -> bool:
        """Whether C{node_id} still answers for this engine (and advertises
        the model) in the live snapshot."""
        model = self._model
        entry = self._facade._discovery.current.node(self._facade.engine.id, node_id)
        return entry is not None and (model is None or entry.advertises(model))


_MODELS = attrgetter("models")


class _Owner:
    """
    One owner in a round, as L{nvproxy.dispatch.Target}: what dispatching to
    it takes is made only when it is dispatched to.  A round lists up to
    C{dispatch.max_attempts} owners, and most jobs dispatch to the first.
    """

    __slots__ = ("_candidates", "_endpoint", "_others", "node_id")

    def __init__(
        self, candidates: _Candidates, endpoint: Endpoint, others: bool
    ) -> None:
        self._candidates = candidates
        self._endpoint = endpoint
        self._others = others
        self.node_id = endpoint.node_id

    def start(self, final: bool) -> Attempt:
        return self._candidates.build(self._endpoint, self._others).start(final)


@frozen
class FacadeParts:
    """
    What both personalities of one engine's facade are made of.

    @ivar hidden: whether a raw path must not reach the engine (404).
    """

    backend: Backend
    dispatcher: Dispatcher
    accounting: Accounting
    settings: AttemptSettings
    hidden: Callable[[bytes], bool] = is_hidden


class _Front:
    """
    What both personalities share: the Klein app, containment of a bug to
    its request (§3.2), hidden paths, reading what to forward, and building
    dispatch targets.
    """

    def __init__(self, parts: FacadeParts) -> None:
        self.backend = backend = parts.backend
        self.engine = backend.engine
        self._dispatcher = parts.dispatcher
        self._accounting = parts.accounting
        self._settings = parts.settings
        self._hidden = parts.hidden

    def resource(self) -> Any:
        # Paths reach the facade exactly as sent: no routing table, no slash
        # merging or redirects, the upstream decides what a path means.
        return TextURLGate(_FrontResource(self), self._refuse_url)

    def _route(self, request: Any) -> Any:
        raise NotImplementedError

    def _own(self, request: Any) -> bool:
        """Answer one of nvproxy's own routes; false: not found here."""
        return False

    # -- entry ------------------------------------------------------------

    def _handle(self, request: Any) -> Any:
        assign_request_id(request)
        access_of(request).engine = self.engine.id
        if _is_own(request.path):
            # nvproxy's own routes (the node record) exist in peer mode only.
            if self._own(request):
                return None
            self._answer_error(request, 404, "not found")
            return None
        if self._hidden(request.path):
            self._answer_error(request, 404, "not found")
            return None
        try:
            return self._route(request)
        except Exception:
            # §3.2: a bug handling one request answers that request only.
            self._log_failure(request, None)
            self._answer_error(request, 500, "internal proxy error")
            return None

    def _refuse_url(self, request: Any, reason: str) -> None:
        # An expected client error: one line, no traceback (§3.2 keeps
        # tracebacks for bugs).
        log.info(
            "{engine} facade refused {method} {path}: {reason}",
            engine=self.engine.id,
            method=request.method.decode("latin-1"),
            path=clip(request.path.decode("latin-1")),
            reason=reason,
        )
        self._answer_error(request, 400, reason)

    def _internal_error(self, request: Any, failure: Failure) -> Any:
        if failure.check(CancelledError):
            return None
        self._log_failure(request, failure)
        if not request.startedWriting:
            self._answer_error(request, 500, "internal proxy error")
        return None

    def _log_failure(self, request: Any, failure: Failure | None) -> None:
        log.failure(
            "{engine} facade failed handling {method} {path}",
            failure=failure,
            engine=self.engine.id,
            method=request.method.decode("latin-1"),
            path=clip(request.path.decode("latin-1")),
        )

    def _answer_error(
        self, request: Any, status: int, message: str, code: str | None = None
    ) -> None:
        if request.finished or request.startedWriting:
            return
        self._client(request).reject(status, message, code=code)

    def _client(self, request: Any) -> ClientSide:
        return ClientSide(request, self.engine.error_body)

    # -- what to forward --------------------------------------------------

    def _prepare(
        self,
        request: Any,
        client: ClientSide,
        kind: RouteKind,
        path: str | None,
        inference: bool,
    ) -> tuple[str | None, UpstreamRequest] | None:
        """
        The model (inference routes) and what to send upstream, or C{None}
        after answering the client.  The body is taken after the model is
        read: the backend may rewrite the model named in it.
        """
        model: str | None = None
        if kind is RouteKind.INFERENCE:
            types = request.requestHeaders._rawHeaders.get(CONTENT_TYPE)
            media, params = media_type(types[-1] if types else None)
            try:
                if media == "multipart/form-data":
                    named = model_from_multipart(
                        request.content, params.get("boundary", "")
                    )
                else:
                    named = model_from_json(request.content)
            except BadBody as e:
                client.reject(400, str(e))
                return None
            resolved = self.backend.resolve(
                named,
                path or request.path.decode("latin-1"),
                media,
                request.content,
            )
            if isinstance(resolved, Refused):
                client.reject(resolved.status, resolved.message, code=resolved.code)
                return None
            model = resolved.model
            if resolved.content is not None:
                request.content = resolved.content
        upstream = UpstreamRequest(
            method=request.method,
            path=request.uri,
            headers=request.requestHeaders,
            content=request.content,
            inference=inference,
        )
        return model, upstream

    def _target(
        self,
        endpoint: Endpoint,
        upstream: UpstreamRequest,
        client: ClientSide,
        accounting: RequestAccounting,
        model: str | None,
        others: bool = False,
    ) -> Target:
        url = endpoint.base_url.rstrip("/").encode("ascii") + upstream.path
        target = HttpTarget(
            self._settings,
            endpoint.node_id,
            url,
            upstream,
            client,
            meter=accounting.meter,
            on_failure=accounting.failed_attempt,
        )
        return self.backend.target(target, endpoint, client, model, others)


class Facade(_Front):
    """
    The plaintext personality of one engine's facade.
    """

    def __init__(
        self,
        parts: FacadeParts,
        *,
        discovery: Discovery,
        inventory: InventoryClient,
        keys: KeyPolicy | None = None,
    ) -> None:
        super().__init__(parts)
        self._discovery = discovery
        self._inventory_client = inventory
        self._keys = keys

    def resource(self) -> Any:
        resource = super().resource()
        if self._keys is None:
            return resource
        # API keys (DESIGN §3a) in front of everything the caller reaches.
        return KeyGate(resource, self._keys, self.engine.error_body, self.engine.id)

    def _route(self, request: Any) -> Any:
        if is_preflight(request):
            # §5.8: every candidate's answer, intersected; no reservation,
            # no workload, no credentials forwarded.
            return self._preflight(request)
        text = request.path.decode("utf-8", "replace")
        kind = self.engine.classify(request.method, text)
        if kind is RouteKind.INVENTORY:
            return self._inventory(request, text)
        path = normalize_path(request.path)
        answer = self.backend.answer(path)
        if isinstance(answer, Answered):
            write_json(request, 200, answer.body)
            return None
        if isinstance(answer, Refused):
            self._answer_error(request, answer.status, answer.message, answer.code)
            return None
        client = self._client(request)
        inference = kind is RouteKind.INFERENCE
        prepared = self._prepare(request, client, kind, path, inference)
        if prepared is None:
            return None
        model, upstream = prepared
        access_of(request).model = model
        accounting = self._accounting.begin(
            self.engine,
            model,
            kind,
            requester=caller_key(request),
            readiness=self.backend.readiness,
            request_id=request_id(request),
        )
        # (The dispatcher resolves a non-inference request once, §5.1.)
        candidates = _Candidates(self, model, upstream, client, accounting)
        if debug_shown():
            log.debug(
                "{engine} {kind} {method} {path} model={model}",
                engine=self.engine.id,
                kind=kind.value,
                method=request.method.decode("latin-1"),
                path=clip(text),
                model=model,
            )
        d = self._dispatcher.dispatch(
            candidates.resolve,
            _Sink(client, model),
            inference=inference,
            observer=accounting,
            subscribe=self._subscribe,
            present=candidates.present,
        )
        return _settle(d, client)

    def _subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        return self._discovery.subscribe(lambda _snapshot: callback())

    def _preflight(self, request: Any) -> Deferred[None]:
        endpoints = []
        for entry in self._discovery.current.nodes(self.engine.id):
            endpoint = self.backend.modelless_endpoint(entry)
            if endpoint is not None:
                endpoints.append(endpoint)
        return preflight(
            request,
            endpoints,
            self._settings.agent,
            self._settings.clock,
            self.engine.error_body,
            self.engine.id,
        )

    # -- inventory --------------------------------------------------------

    def _inventory(self, request: Any, path: str) -> Deferred[None]:
        listing = self.engine.inventory[path]
        backend = self.backend
        endpoints = [
            endpoint
            for entry in self._discovery.current.nodes(self.engine.id)
            for endpoint in entry.endpoints
            if backend.asks(endpoint)
        ]
        own = backend.local_inventory()
        local = [] if own is None else [own]
        if request.requestHeaders.hasHeader(b"origin"):
            # §5.8: a browser's inventory needs every engine's agreement.
            return origin_inventory(
                request,
                endpoints,
                local,
                listing,
                self._settings.agent,
                self._settings.clock,
                self.engine.error_body,
                self.engine.id,
            )

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
            merged = listing.merge([*local, *answers])
            if not request.finished:
                write_json(request, 200, merged)

        return Deferred.fromCoroutine(merge())


class PeerFacade(_Front):
    """
    The TLS personality of one engine's facade (spec §7): a pinned peer's
    request goes straight to this node's own engine, tried once and never
    re-routed; the peer that received it from its client runs the retry
    loop.

    @param peer_of: the pinned peer a request comes from, checked per
        request so a removed pin stops an open keep-alive connection.
    """

    def __init__(
        self,
        parts: FacadeParts,
        *,
        peer_of: Callable[[Any], str | None],
        node_record: Callable[[], object] | None = None,
    ) -> None:
        super().__init__(parts)
        self._peer_of = peer_of
        self._node_record = node_record

    def _own(self, request: Any) -> bool:
        """C{GET /_nvproxy/node}: this node's record, to pinned peers only."""
        if self._node_record is None or match_key(request.path) != _NODE_KEY:
            return False
        if self._peer_of(request) is None:
            self._client(request).reject(403, "peer certificate is not pinned")
            return True
        if request.method not in (b"GET", b"HEAD"):
            request.setHeader(b"allow", b"GET, HEAD")
            self._answer_error(request, 405, "method not allowed")
            return True
        write_json(request, 200, self._node_record())
        return True

    def _route(self, request: Any) -> Any:
        client = self._client(request)
        peer = self._peer_of(request)
        if peer is None:
            # The pin was removed while the connection stayed open.
            client.reject(403, "peer certificate is not pinned")
            return None
        text = request.path.decode("utf-8", "replace")
        kind = self.engine.classify(request.method, text)
        if kind is RouteKind.INVENTORY:
            own = self.backend.local_inventory()
            if own is not None:
                write_json(request, 200, own)
                return None
        path = normalize_path(request.path)
        prepared = self._prepare(request, client, kind, path, inference=False)
        if prepared is None:
            return None
        model, upstream = prepared
        endpoint = self.backend.local_endpoint(model)
        if endpoint is None:
            client.reject(502, f"this node runs no {self.engine.name} engine")
            return None
        accounting = self._accounting.begin(self.engine, None, RouteKind.OTHER)
        target = self._target(endpoint, upstream, client, accounting, model)
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


class _FrontResource(Resource):
    """
    A facade's one route, as a bare leaf: C{_handle} answers, errors are
    contained to their request (§3.2), and a client that leaves cancels
    the answer in progress.  (What Klein did here, without its per-request
    routing and closures, which left reference cycles behind every request
    for the cyclic collector; docs/performance.rst.)
    """

    isLeaf = True

    def __init__(self, front: _Front) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._front = front

    def render(self, request: Any) -> Any:
        front = self._front
        try:
            result = front._handle(request)
        except Exception:
            front._internal_error(request, Failure())
            result = None
        if not isinstance(result, Deferred):
            _respond(result, request)
            return NOT_DONE_YET
        # the client left: cancel what is in progress (the job sees it)
        when_lost(request, partial(_cancel, result))
        # (Functions with arguments, not closures: an open stream keeps
        # these until it ends, and a closure and its cells cost more.)
        result.addCallbacks(
            _respond,
            _failed,
            callbackArgs=(request,),
            errbackArgs=(front, request),
        )
        return NOT_DONE_YET


def _cancel(result: Deferred[Any], reason: object) -> None:
    result.cancel()


def _respond(result: object, request: Any) -> None:
    if request.finished or request._disconnected:
        return
    if isinstance(result, bytes):
        request.write(result)
    request.finish()


def _failed(failure: Failure, front: _Front, request: Any) -> None:
    if request.finished or request._disconnected:
        if not failure.check(CancelledError):
            front._log_failure(request, failure)
        return
    _respond(front._internal_error(request, failure), request)


class _Personalities(Resource):
    """
    One facade port's two personalities: TLS requests (peers, already
    pinned in the handshake) go to C{peer}, plaintext to C{plain}.  Both
    are leaves that answer in C{render}.
    """

    isLeaf = True

    def __init__(self, plain: IResource, peer: IResource) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._plain = plain
        self._peer = peer

    def render(self, request: Any) -> Any:
        chosen = self._peer if request.isSecure() else self._plain
        return chosen.render(request)


def personalities(plain: Facade, peer: PeerFacade | None) -> IResource:
    """The resource of one facade port: plaintext only, or both."""
    resource: IResource = plain.resource()
    if peer is None:
        return resource
    return _Personalities(resource, peer.resource())


_NODE_KEY = "/_nvproxy/node"
_OWN_PREFIX = "/_nvproxy"


def _is_own(raw_path: bytes) -> bool:
    """Whether a raw path is under nvproxy's own C{/_nvproxy} (normalized)."""
    key = match_key(raw_path)
    return key is not None and (key == _OWN_PREFIX or key.startswith(_OWN_PREFIX + "/"))


def _settle(d: Deferred[JobOutcome], client: ClientSide) -> Deferred[object]:
    """
    What Klein waits for: the job, then (for a truncated stream, which
    closes the client connection) the close itself, so Klein does not finish
    the response first and make a cut stream look whole with a final chunk.
    """

    return d.addErrback(_cancelled_is_fine).addCallback(_settled, client)


def _settled(outcome: JobOutcome | None, client: ClientSide) -> object:
    if outcome is not None:
        record = access_of(client.request)
        record.node, record.attempts = outcome.node_id, outcome.attempts
    if client.aborted and not client.gone:
        return client.closed
    return outcome


def _cancelled_is_fine(failure: Failure) -> JobOutcome | None:
    failure.trap(CancelledError)
    return None
