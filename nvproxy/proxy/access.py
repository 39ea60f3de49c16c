# -*- test-case-name: tests.test_access -*-
"""
Who may call a facade (DESIGN §3a): the network gate the listener applies
before a byte of HTTP is read, and the API-key gate in front of the
plaintext personality.

* L{NetworkGate}: a plaintext connection is accepted only from a source in
  C{plaintext_from} (default: loopback).  An IPv4-mapped IPv6 source (a
  dual-stack listener's view of an IPv4 client) is matched as IPv4.  TLS
  (pinned peers) is not its business.
* L{KeyGate}: with an API keys file, a caller from outside loopback (and
  with C{require_key_on_loopback}, every caller) must present a key as
  C{Authorization: Bearer KEY} or C{x-api-key: KEY}; without one the
  answer is a 401 in the engine's dialect with C{WWW-Authenticate: Bearer}
  and nothing goes upstream.  A CORS preflight is exempt (browsers never
  send credentials on one; it is forwarded without any, spec §5.8).  A key
  nvproxy accepted is removed from the request before it is forwarded, and
  its name becomes the request's L{Caller} (the workload's C{requesterId},
  the C{key} label of C{nvproxy_requests_total}).  With
  C{max_concurrent_per_key}, a key with that many requests in flight gets
  an immediate 429 with C{Retry-After: 1}.

Keys, digests and C{Authorization} values never reach a log line, an event,
a metric or an error body.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from attrs import frozen
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.interfaces import IAddress
from twisted.logger import Logger
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET
from zope.interface import Attribute, Interface, implementer

from nvproxy.config import AccessConfig, IPNetwork
from nvproxy.jsonhttp import write_json
from nvproxy.keyring import KeyRing
from nvproxy.net import ip_of, is_loopback, is_loopback_host
from nvproxy.proxy.cors import is_preflight

__all__ = [
    "Caller",
    "ICaller",
    "KeyGate",
    "KeyPolicy",
    "NetworkGate",
    "access_warnings",
    "caller_key",
]

log = Logger()


class NetworkGate:
    """
    Whether a connection's source may speak plaintext HTTP.

    @param networks: the allowed source networks.
    """

    def __init__(self, networks: Sequence[IPNetwork]) -> None:
        self.networks = tuple(networks)

    def __call__(self, address: IAddress) -> bool:
        if not isinstance(address, IPv4Address | IPv6Address):
            return False
        if address.host == "localhost":
            return False
        ip = ip_of(address.host)
        if ip is None:
            return False
        return any(ip.version == net.version and ip in net for net in self.networks)


class ICaller(Interface):
    """Who a request comes from, as the key gate established it."""

    key = Attribute("The name of the API key presented, or None.")


@implementer(ICaller)
@frozen
class Caller:
    key: str | None


def caller_key(request: Any) -> str | None:
    """The name of the key C{request} was admitted with, or L{None}."""
    get = getattr(request, "getComponent", None)
    if get is None:
        return None
    caller = get(ICaller)
    return None if caller is None else caller.key


@frozen
class KeyPolicy:
    """
    One facade's key rules.

    @ivar max_concurrent: requests one key may have in flight; 0 unlimited.
    """

    keys: KeyRing
    require_on_loopback: bool = False
    max_concurrent: int = 0


def _presented(request: Any) -> list[tuple[bytes, str]]:
    """Each (header, key) the request presents, C{Authorization} first."""
    found: list[tuple[bytes, str]] = []
    headers = request.requestHeaders
    for value in headers.getRawHeaders(b"authorization", [])[:1]:
        scheme, _, credentials = value.strip().partition(b" ")
        if scheme.lower() == b"bearer" and credentials.strip():
            found.append((b"authorization", credentials.strip().decode("latin-1")))
    for value in headers.getRawHeaders(b"x-api-key", [])[:1]:
        if value.strip():
            found.append((b"x-api-key", value.strip().decode("latin-1")))
    return found


class KeyGate(Resource):
    """
    The key check in front of a facade's plaintext personality C{inner}.

    @param error_body: the engine's error dialect.
    """

    isLeaf = True

    def __init__(
        self,
        inner: IResource,
        policy: KeyPolicy,
        error_body: Callable[[int, str, str | None], bytes],
        engine: str,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._inner = inner
        self._policy = policy
        self._error_body = error_body
        self._engine = engine
        self.in_flight: dict[str, int] = {}

    def render(self, request: Any) -> Any:
        if is_preflight(request):
            return self._inner.render(request)
        policy = self._policy
        name: str | None = None
        for header, key in _presented(request):
            name = policy.keys.match(key)
            if name is not None:
                # Consumed: the key is nvproxy's, never the engine's.
                request.requestHeaders.removeHeader(header)
                break
        if name is None:
            if policy.require_on_loopback or not is_loopback(
                request.getClientAddress()
            ):
                return self._unauthorized(request)
            return self._inner.render(request)
        limit = policy.max_concurrent
        count = self.in_flight.get(name, 0)
        if limit and count >= limit:
            log.info(
                "{engine} facade: key {key} has {limit} requests in flight: 429",
                engine=self._engine,
                key=name,
                limit=limit,
            )
            body = self._error_body(
                429,
                f"too many concurrent requests for this API key (limit {limit})",
                "rate_limit_exceeded",
            )
            write_json(request, 429, body, retry_after=1)
            return NOT_DONE_YET
        self.in_flight[name] = count + 1
        request.notifyFinish().addBoth(lambda _: self._done(name))
        request.setComponent(ICaller, Caller(name))
        return self._inner.render(request)

    def _done(self, name: str) -> None:
        left = self.in_flight.get(name, 1) - 1
        if left > 0:
            self.in_flight[name] = left
        else:
            self.in_flight.pop(name, None)

    def _unauthorized(self, request: Any) -> Any:
        log.info(
            "{engine} facade refused {method} from {peer}: no valid API key",
            engine=self._engine,
            method=request.method.decode("latin-1"),
            peer=str(request.getClientAddress()),
        )
        request.responseHeaders.setRawHeaders(b"www-authenticate", [b"Bearer"])
        body = self._error_body(
            401,
            "a valid API key is required (Authorization: Bearer KEY)",
            "invalid_api_key",
        )
        write_json(request, 401, body)
        return NOT_DONE_YET


def access_warnings(access: AccessConfig, interface: str) -> list[str]:
    """
    What an operator should hear about a facade's access rules at start:
    networks that cannot reach a loopback listener, and a network opened
    without keys.
    """
    outside = [str(net) for net in access.plaintext_from if not _loopback(net)]
    if not outside:
        return []
    if is_loopback_host(interface):
        return [
            f"plaintext_from allows {', '.join(outside)} but the facade listens"
            f" on {interface}: only loopback callers can reach it"
        ]
    if access.api_keys_file is None:
        return [f"plaintext HTTP from {', '.join(outside)} without API keys"]
    return []


def _loopback(network: IPNetwork) -> bool:
    return network.network_address.is_loopback and network.broadcast_address.is_loopback
