# -*- test-case-name: tests.test_cors -*-
"""
The browser policy (spec §5.8): what a facade does with CORS.

* Proxied responses carry the engine's own C{Access-Control-*} headers (or
  their absence) unchanged: nothing here touches them.
* Responses nvproxy generates itself (400, 401, 403, 404, 413, 429, 502,
  503, 504) carry no C{Access-Control-*} header, so they grant nothing.
* A preflight (C{OPTIONS} with C{Origin} and
  C{Access-Control-Request-Method}) is sent to every node that could serve
  the path, without the caller's credentials (C{Cookie}, C{Authorization},
  C{x-api-key}), and takes no reservation and creates no workload.  Nodes
  that do not answer (transport error, timeout, 502/503/504) are skipped;
  with none left the answer is a 502.  A single responder's answer is
  relayed as it is.  With several, any responder that denies (a status
  other than 2xx, or an C{Access-Control-Allow-Origin} that does not allow
  the origin) makes the answer that denial (its status and body, no CORS
  header); otherwise the answer grants the intersection (L{intersect}).
* A model inventory request carrying C{Origin} is asked of every node with
  that C{Origin} (no credentials) and needs every responder's agreement: an
  invalid inventory (not 200, or not the engine's envelope) is a 502
  without a partial list, which keeps the intersected CORS headers only when
  every responder allowed the origin; otherwise any denial is a 403 (no CORS
  header); otherwise the merged list with the intersected headers.

The intersection never grants more than any single responder would, for a
credentialed request or not (C{tests.test_cors} checks this as a property):

* origin: C{*} only if every responder says C{*}, else the request's
  origin (with C{Vary: Origin});
* credentials: only if every responder allows them for this very origin;
  the lists below are then intersected literally (C{*} is just a name for a
  credentialed request);
* methods, headers, exposed headers: the names every responder allows, a
  responder's C{*} counting as every name (except C{Authorization}, which
  a C{*} never covers in a header list); C{*} only if every responder says
  C{*};
* C{Access-Control-Max-Age}: the minimum, a responder without one counting
  as the browsers' default of 5 seconds;
* C{Access-Control-Allow-Private-Network}: only if every responder says
  C{true};
* C{Vary}: the union.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from attrs import frozen
from twisted.internet.defer import CancelledError, Deferred, gatherResults
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IResponse

from nvproxy.discovery import Endpoint
from nvproxy.engines import ModelList
from nvproxy.jsonhttp import json_bytes, write_json
from nvproxy.proxy.upstream import REQUEST_DROP, end_to_end

__all__ = [
    "CREDENTIALS",
    "Grant",
    "cors_headers",
    "grant_of",
    "intersect",
    "is_preflight",
    "origin_inventory",
    "preflight",
]

log = Logger()

CREDENTIALS: Final = frozenset(
    {b"cookie", b"authorization", b"proxy-authorization", b"x-api-key"}
)
"""What a fan-out never forwards."""

FANOUT_TIMEOUT: Final = 10.0
"""Seconds one node may take to answer a preflight or an inventory, body included."""

BODY_LIMIT: Final = 4 * 2**20
"""Bytes of one answer read; a longer one counts as invalid."""

DEFAULT_MAX_AGE: Final = 5
"""What browsers assume without C{Access-Control-Max-Age} (Fetch)."""

_UNAVAILABLE: Final = frozenset({502, 503, 504})
_DONE: Final = Failure(ResponseDone())

_ACAO = b"access-control-allow-origin"
_ACAC = b"access-control-allow-credentials"
_ACAM = b"access-control-allow-methods"
_ACAH = b"access-control-allow-headers"
_ACMA = b"access-control-max-age"
_ACEH = b"access-control-expose-headers"
_ACPN = b"access-control-allow-private-network"


def is_preflight(request: Any) -> bool:
    """Whether C{request} is a CORS preflight."""
    headers = request.requestHeaders
    return bool(
        request.method == b"OPTIONS"
        and headers.hasHeader(b"origin")
        and headers.hasHeader(b"access-control-request-method")
    )


@frozen
class Grant:
    """
    What one CORS answer allows, as its headers say.

    @ivar origin: C{Access-Control-Allow-Origin} (C{"*"}, an origin), or
        L{None} when absent.
    @ivar methods: upper-cased; C{"*"} is the wildcard.
    @ivar headers: lower-cased; C{"*"} is the wildcard.
    @ivar expose: lower-cased C{Access-Control-Expose-Headers}.
    @ivar max_age: seconds, or L{None} when absent or invalid.
    """

    origin: str | None = None
    credentials: bool = False
    methods: frozenset[str] = frozenset()
    headers: frozenset[str] = frozenset()
    expose: frozenset[str] = frozenset()
    max_age: int | None = None
    private_network: bool = False
    vary: tuple[str, ...] = ()

    def allows_origin(self, origin: str) -> bool:
        return self.origin == "*" or self.origin == origin


def _one(headers: Headers, name: bytes) -> str | None:
    values = headers.getRawHeaders(name)
    if not values:
        return None
    return values[0].decode("latin-1").strip()


def _tokens(headers: Headers, name: bytes) -> list[str]:
    return [
        token.strip()
        for value in headers.getRawHeaders(name, [])
        for token in value.decode("latin-1").split(",")
        if token.strip()
    ]


def grant_of(headers: Headers) -> Grant:
    """The L{Grant} of an answer's headers."""
    max_age: int | None = None
    text = _one(headers, _ACMA)
    if text is not None and text.isdigit():
        max_age = int(text)
    return Grant(
        origin=_one(headers, _ACAO),
        credentials=_one(headers, _ACAC) == "true",
        methods=frozenset(t.upper() for t in _tokens(headers, _ACAM)),
        headers=frozenset(t.lower() for t in _tokens(headers, _ACAH)),
        expose=frozenset(t.lower() for t in _tokens(headers, _ACEH)),
        max_age=max_age,
        private_network=_one(headers, _ACPN) == "true",
        vary=tuple(_tokens(headers, b"vary")),
    )


def _names(
    lists: Sequence[frozenset[str]], literal: bool, never_wild: frozenset[str]
) -> frozenset[str]:
    """
    The names every list allows: literally (credentialed), or with C{*}
    standing for every name but C{never_wild}.
    """
    if literal:
        result = lists[0]
        for names in lists[1:]:
            result = result & names
        return result
    if all("*" in names for names in lists):
        kept = {"*"}
        for name in never_wild:
            if all(name in names for names in lists):
                kept.add(name)
        return frozenset(kept)
    candidates = {name for names in lists for name in names if name != "*"}
    return frozenset(
        name
        for name in candidates
        if all(
            name in names or ("*" in names and name not in never_wild)
            for names in lists
        )
    )


def intersect(grants: Sequence[Grant], origin: str) -> Grant | None:
    """
    What every one of C{grants} allows for C{origin}, or L{None} when one of
    them does not allow the origin at all.
    """
    if not grants or not all(grant.allows_origin(origin) for grant in grants):
        return None
    credentials = all(g.credentials and g.origin == origin for g in grants)
    everyone = all(g.origin == "*" for g in grants) and not credentials
    vary: list[str] = []
    for grant in grants:
        for token in grant.vary:
            if token.lower() not in (v.lower() for v in vary):
                vary.append(token)
    ages = [g.max_age for g in grants]
    max_age = None
    if any(age is not None for age in ages):
        max_age = min(DEFAULT_MAX_AGE if age is None else age for age in ages)
    return Grant(
        origin="*" if everyone else origin,
        credentials=credentials,
        methods=_names([g.methods for g in grants], credentials, frozenset()),
        headers=_names(
            [g.headers for g in grants], credentials, frozenset({"authorization"})
        ),
        expose=_names([g.expose for g in grants], credentials, frozenset()),
        max_age=max_age,
        private_network=all(g.private_network for g in grants),
        vary=tuple(vary),
    )


def cors_headers(grant: Grant, *, preflight: bool) -> list[tuple[bytes, bytes]]:
    """The response headers that grant C{grant} (a preflight's, or not)."""
    out: list[tuple[bytes, bytes]] = []
    if grant.origin is None:
        return out
    out.append((_ACAO, grant.origin.encode("latin-1")))
    if grant.credentials:
        out.append((_ACAC, b"true"))
    if preflight:
        if grant.methods:
            out.append((_ACAM, ", ".join(sorted(grant.methods)).encode("latin-1")))
        if grant.headers:
            out.append((_ACAH, ", ".join(sorted(grant.headers)).encode("latin-1")))
        if grant.max_age is not None:
            out.append((_ACMA, b"%d" % grant.max_age))
        if grant.private_network:
            out.append((_ACPN, b"true"))
    elif grant.expose:
        out.append((_ACEH, ", ".join(sorted(grant.expose)).encode("latin-1")))
    vary = list(grant.vary)
    if grant.origin != "*" and "origin" not in (v.lower() for v in vary):
        vary.append("Origin")
    if vary:
        out.append((b"vary", ", ".join(vary).encode("latin-1")))
    return out


# -- asking every node ---------------------------------------------------------


@frozen
class Reply:
    """One node's whole answer."""

    node_id: str
    status: int
    phrase: bytes
    headers: Headers
    body: bytes | None  # None: longer than BODY_LIMIT


class _Collect(Protocol):
    """
    Reads one whole answer into C{done} (L{None} past L{BODY_LIMIT});
    cancelling C{done} stops reading.
    """

    def __init__(self) -> None:
        self.done: Deferred[bytes | None] = Deferred(lambda _: self._stop())
        self._done = self.done
        self._parts: list[bytes] = []
        self._size = 0

    def _stop(self) -> None:
        if self.transport is not None:
            self.transport.stopProducing()  # type: ignore[attr-defined]

    def dataReceived(self, data: bytes) -> None:
        if self._done.called:
            return
        self._size += len(data)
        if self._size > BODY_LIMIT:
            self._done.callback(None)
            self._stop()
            return
        self._parts.append(data)

    def connectionLost(self, reason: Failure = _DONE) -> None:
        if self._done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self._done.callback(b"".join(self._parts))
        else:
            self._done.errback(reason)


async def _exchange(
    agent: IAgent, method: bytes, url: bytes, headers: Headers, node_id: str
) -> Reply:
    response: IResponse = await agent.request(method, url, headers, None)
    collect = _Collect()
    response.deliverBody(collect)
    body = await collect.done
    return Reply(node_id, response.code, response.phrase, response.headers, body)


def _ask_all(
    agent: IAgent,
    clock: IReactorTime,
    method: bytes,
    path: bytes,
    headers: Headers,
    endpoints: Sequence[Endpoint],
    engine: str,
) -> Deferred[list[Reply | None]]:
    """Every endpoint's reply, L{None} for one that did not answer."""

    async def ask(endpoint: Endpoint) -> Reply | None:
        url = endpoint.base_url.rstrip("/").encode("ascii") + path
        d = Deferred.fromCoroutine(
            _exchange(agent, method, url, headers, endpoint.node_id)
        )
        d.addTimeout(FANOUT_TIMEOUT, clock)
        try:
            reply = await d
        except CancelledError:
            raise
        except Exception as e:
            log.debug(
                "{engine} CORS fan-out to {node} failed: {error}",
                engine=engine,
                node=endpoint.node_id,
                error=type(e).__name__,
            )
            return None
        if reply.status in _UNAVAILABLE:
            return None
        return reply

    results: Deferred[list[Reply | None]] = gatherResults(
        [Deferred.fromCoroutine(ask(e)) for e in endpoints], consumeErrors=True
    )
    return results


def _forwarded(request: Any) -> Headers:
    return end_to_end(request.requestHeaders, CREDENTIALS | REQUEST_DROP)


ErrorBody = Callable[[int, str, str | None], bytes]


def _reject(request: Any, error_body: ErrorBody, status: int, message: str) -> None:
    if not request.finished:
        write_json(request, status, error_body(status, message, None))


def _write(
    request: Any,
    status: int,
    phrase: bytes | None,
    headers: Iterable[tuple[bytes, Sequence[bytes]]],
    body: bytes,
) -> None:
    if request.finished:
        return
    request.setResponseCode(status, phrase or None)
    out = request.responseHeaders
    for name in (b"server", b"date", b"content-type"):
        out.removeHeader(name)
    for name, values in headers:
        out.setRawHeaders(name, list(values))
    out.setRawHeaders(b"content-length", [b"%d" % len(body)])
    if body:
        request.write(body)
    request.finish()


def preflight(
    request: Any,
    endpoints: Sequence[Endpoint],
    agent: IAgent,
    clock: IReactorTime,
    error_body: ErrorBody,
    engine: str,
) -> Deferred[None]:
    """Answer the preflight C{request} from every one of C{endpoints}."""
    origin = request.requestHeaders.getRawHeaders(b"origin")[0].decode("latin-1")
    asked = _ask_all(
        agent, clock, b"OPTIONS", request.uri, _forwarded(request), endpoints, engine
    )

    def answer(replies: list[Reply | None]) -> None:
        responders = [reply for reply in replies if reply is not None]
        if not responders:
            _reject(request, error_body, 502, "no engine answered the CORS preflight")
            return
        if len(responders) == 1:
            # One engine: its answer, exactly.
            only = responders[0]
            relayed = end_to_end(only.headers, frozenset({b"content-length"}))
            _write(
                request,
                only.status,
                only.phrase,
                relayed.getAllRawHeaders(),
                only.body or b"",
            )
            return
        for reply in responders:
            if not (200 <= reply.status < 300) or not grant_of(
                reply.headers
            ).allows_origin(origin):
                # A denial, as that engine gave it, with no CORS header.
                kept = [
                    (name, list(values))
                    for name, values in reply.headers.getAllRawHeaders()
                    if name.lower() == b"content-type"
                ]
                _write(request, reply.status, reply.phrase, kept, reply.body or b"")
                return
        grant = intersect([grant_of(r.headers) for r in responders], origin)
        assert grant is not None
        statuses = {r.status for r in responders}
        status = statuses.pop() if len(statuses) == 1 else 204
        pairs = [(name, [value]) for name, value in cors_headers(grant, preflight=True)]
        _write(request, status, None, pairs, b"")

    return asked.addCallback(answer)


def origin_inventory(
    request: Any,
    endpoints: Sequence[Endpoint],
    local: Sequence[object],
    listing: ModelList,
    agent: IAgent,
    clock: IReactorTime,
    error_body: ErrorBody,
    engine: str,
) -> Deferred[None]:
    """
    Answer an inventory C{request} carrying C{Origin}: every responder must
    allow the origin and give a valid list.
    """
    origin = request.requestHeaders.getRawHeaders(b"origin")[0].decode("latin-1")
    headers = Headers(
        {b"origin": [origin.encode("latin-1")], b"accept": [b"application/json"]}
    )
    path = listing.path.encode("ascii")
    asked = _ask_all(agent, clock, b"GET", path, headers, endpoints, engine)

    def answer(replies: list[Reply | None]) -> None:
        responders = [reply for reply in replies if reply is not None]
        grants = [grant_of(reply.headers) for reply in responders]
        grant = intersect(grants, origin) if grants else None
        approved = bool(grants) and grant is not None
        bodies: list[object] = []
        invalid: str | None = None
        for reply in responders:
            try:
                if reply.status != 200 or reply.body is None:
                    raise ValueError(f"HTTP {reply.status}")
                body = json.loads(reply.body)
                listing.ids(body)
            except ValueError as e:
                invalid = f"node {reply.node_id}: {e}"
                break
            bodies.append(body)
        if invalid is not None:
            log.info(
                "{engine} inventory for a browser origin refused: invalid {why}",
                engine=engine,
                why=invalid,
            )
            pairs = cors_headers(grant, preflight=False) if approved and grant else []
            data = error_body(502, "a node answered an invalid model list", None)
            _write(
                request,
                502,
                None,
                [(b"content-type", [b"application/json"])]
                + [(name, [value]) for name, value in pairs],
                data,
            )
            return
        if grants and not approved:
            _reject(request, error_body, 403, "origin not allowed by every engine")
            return
        merged = json_bytes(listing.merge([*local, *bodies]))
        pairs = cors_headers(grant, preflight=False) if grant is not None else []
        _write(
            request,
            200,
            None,
            [(b"content-type", [b"application/json"])]
            + [(name, [value]) for name, value in pairs],
            merged,
        )

    return asked.addCallback(answer)
