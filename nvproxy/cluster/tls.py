# -*- test-case-name: tests.test_cluster -*-
"""
Cluster mutual TLS, both ways (DESIGN §3, spec §7): L{ServerTLS} for the
listener's TLS personality, L{ClientTLS} for dialing one peer, and
L{PeerPolicyForHTTPS} choosing it per URL for an C{Agent}.

Trust is the pin alone: a certificate is accepted when its fingerprint is pinned
(and, when dialing, its DNS SAN is the expected node id), whatever its dates or
issuer. Removing a pin stops new handshakes at once (the server reads the current
pins in every handshake) and, through L{ServerTLS.peer_is_pinned} checked per
request, requests on connections already open. TLS 1.3 only; no session
resumption, so every connection is a full, pin-checked handshake.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Protocol, cast

from cryptography import x509
from OpenSSL import SSL, crypto
from service_identity import CertificateError, VerificationError
from service_identity.cryptography import verify_certificate_hostname
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator,
    IOpenSSLServerConnectionCreator,
    ISSLTransport,
)
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import BrowserLikePolicyForHTTPS
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

from nvproxy.cluster.pins import (
    ClusterState,
    Fingerprint,
    Identity,
    Peer,
    PrivateKey,
    validate_node_id,
)

__all__ = [
    "ClientTLS",
    "ClientTLSCache",
    "PeerPolicyForHTTPS",
    "PeerVerificationError",
    "ServerTLS",
    "peer_fingerprint",
]

log = Logger()


class PeerVerificationError(Exception):
    """A peer's TLS certificate is not the one pinned for the node being dialed."""


class _Context(Protocol):
    """
    The C{SSL.Context} methods used here that the installed types-pyOpenSSL stubs
    (24.1) lack or type too narrowly: pyOpenSSL 26 takes cryptography objects.
    """

    def use_certificate(self, cert: x509.Certificate) -> None: ...
    def use_privatekey(self, pkey: PrivateKey) -> None: ...
    def set_session_id(self, buf: bytes) -> None: ...


_VerifyCallback = Callable[[SSL.Connection, crypto.X509, int, int, int], bool]


def _context(identity: Identity | None, verify: _VerifyCallback) -> SSL.Context:
    """
    A TLS 1.3 context presenting C{identity}, requiring a peer certificate accepted
    by C{verify}, without session resumption (every handshake checks the pins).
    """
    context = SSL.Context(SSL.TLS_METHOD)
    context.set_min_proto_version(SSL.TLS1_3_VERSION)
    context.set_options(SSL.OP_NO_TICKET)
    context.set_session_cache_mode(SSL.SESS_CACHE_OFF)
    typed = cast(_Context, context)
    typed.set_session_id(b"nvproxy-cluster")
    if identity is not None:
        typed.use_certificate(identity.certificate)
        typed.use_privatekey(identity.key)
    context.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT, verify)
    return context


_FINGERPRINTS: weakref.WeakKeyDictionary[object, Fingerprint] = (
    weakref.WeakKeyDictionary()
)
"""Each open TLS connection's peer fingerprint, computed once."""


def peer_fingerprint(transport: object) -> Fingerprint | None:
    """
    The fingerprint of the certificate the peer presented on C{transport} (e.g. a
    twisted.web C{request.transport}), or L{None} if it is not TLS or had none.

    Computed once per connection (an encoding and a hash, per request before):
    the contexts here speak TLS 1.3 only, which has no renegotiation, so a
    connection's peer certificate never changes.  Whether that fingerprint is
    still pinned is for the caller to ask each time.
    """
    try:
        return _FINGERPRINTS[transport]
    except (KeyError, TypeError):
        pass
    if not ISSLTransport.providedBy(transport):
        return None
    certificate = transport.getPeerCertificate()
    if isinstance(certificate, crypto.X509):
        certificate = certificate.to_cryptography()
    if isinstance(certificate, x509.Certificate):
        fingerprint = Fingerprint.of(certificate)
        with contextlib.suppress(TypeError):
            _FINGERPRINTS[transport] = fingerprint
        return fingerprint
    return None


@implementer(IOpenSSLServerConnectionCreator)
class ServerTLS:
    """
    Server side of cluster mTLS: present this node's certificate, accept a client
    only if its certificate's fingerprint is in the I{current} pins.

    @param state: returns the current L{ClusterState}, read on every handshake
        (e.g. C{lambda: watcher.current}).
    """

    def __init__(self, state: Callable[[], ClusterState]) -> None:
        self._state = state
        self._context: tuple[Identity | None, SSL.Context] | None = None

    def serverConnectionForTLS(self, tlsProtocol: object) -> SSL.Connection:
        identity = self._state().identity
        if self._context is None or self._context[0] != identity:
            # A context that has been used cannot change: a new identity gets a
            # new one. Without an identity every handshake fails (no certificate).
            if identity is None:
                log.warn("TLS connection but this node has no cluster identity")
            self._context = (identity, _context(identity, self._verify))
        connection = SSL.Connection(self._context[1], None)
        connection.set_app_data(tlsProtocol)
        return connection

    def _verify(
        self,
        connection: SSL.Connection,
        cert: crypto.X509,
        errno: int,
        depth: int,
        ok: int,
    ) -> bool:
        if depth > 0:
            return True  # only the leaf is pinned; intermediates do not matter
        fingerprint = Fingerprint.of(cert.to_cryptography())
        if fingerprint in self._state().pins:
            return True
        log.info(
            "refused TLS client {fingerprint}: not pinned", fingerprint=str(fingerprint)
        )
        return False

    def is_pinned(self, fingerprint: Fingerprint | None) -> bool:
        return fingerprint is not None and fingerprint in self._state().pins

    def peer_is_pinned(self, transport: object) -> bool:
        """
        Is the client on C{transport} still pinned? Check it per request so that a
        removed pin also stops connections opened before the removal.
        """
        return self.is_pinned(peer_fingerprint(transport))

    def peer(self, transport: object) -> Peer | None:
        """The pinned peer on C{transport}, if any (for logs and peer mode)."""
        fingerprint = peer_fingerprint(transport)
        if fingerprint is None:
            return None
        return self._state().peer_by_fingerprint(fingerprint)


@implementer(IOpenSSLClientConnectionCreator)
class ClientTLS:
    """
    Client side of cluster mTLS for dialing one peer: present C{identity}, accept
    the server only if its certificate has C{fingerprint} and service_identity
    finds C{node_id} among its DNS names. The handshake of a mismatching server
    fails with L{PeerVerificationError} as the reason.
    """

    def __init__(
        self, identity: Identity, node_id: str, fingerprint: Fingerprint
    ) -> None:
        self.identity = identity
        self.node_id = validate_node_id(node_id)
        self.fingerprint = fingerprint
        self._context: SSL.Context | None = None

    @classmethod
    def for_peer(cls, identity: Identity, peer: Peer) -> ClientTLS:
        return cls(identity, peer.id, peer.fingerprint)

    def clientConnectionForTLS(self, tlsProtocol: object) -> SSL.Connection:
        if self._context is None:
            self._context = _context(self.identity, self._verify)
        connection = SSL.Connection(self._context, None)
        connection.set_app_data(tlsProtocol)
        connection.set_tlsext_host_name(self.node_id.encode("ascii"))
        return connection

    def _verify(
        self,
        connection: SSL.Connection,
        cert: crypto.X509,
        errno: int,
        depth: int,
        ok: int,
    ) -> bool:
        if depth > 0:
            return True
        certificate = cert.to_cryptography()
        fingerprint = Fingerprint.of(certificate)
        problem: str | None = None
        if fingerprint != self.fingerprint:
            problem = f"has fingerprint {fingerprint}, pinned is {self.fingerprint}"
        else:
            try:
                verify_certificate_hostname(certificate, self.node_id)
            except (VerificationError, CertificateError) as e:
                problem = f"is not for node id {self.node_id} ({e})"
        if problem is None:
            return True
        error = PeerVerificationError(f"peer {self.node_id}: certificate {problem}")
        log.warn("{error}", error=str(error))
        fail = getattr(connection.get_app_data(), "failVerification", None)
        if fail is not None:
            fail(Failure(error))
        return False


class ClientTLSCache:
    """
    The L{ClientTLS} for dialing each peer, made once per identity and peer
    (and so one C{SSL.Context} each, built on first use): a new creator per
    new connection built a new context, about a quarter of a millisecond,
    before the handshake.  A changed pin or address is a different peer,
    and so a different creator; departed peers' creators are dropped when
    the cache outgrows the cluster.
    """

    def __init__(self) -> None:
        self._creators: dict[tuple[Identity, Peer], ClientTLS] = {}

    def creator(self, state: ClusterState, peer: Peer) -> ClientTLS | None:
        """The creator for dialing C{peer} as C{state}'s identity, if any."""
        identity = state.identity
        if identity is None:
            return None
        key = (identity, peer)
        creator = self._creators.get(key)
        if creator is None:
            if len(self._creators) > 4 * len(state.peers) + 16:
                self._creators.clear()  # drop contexts of departed peers
            creator = self._creators[key] = ClientTLS.for_peer(identity, peer)
        return creator


@implementer(IPolicyForHTTPS)
class PeerPolicyForHTTPS:
    """
    For C{twisted.web.client.Agent(reactor, contextFactory=...)}: an https URL
    whose host and port belong to a pinned peer is dialed with that peer's
    L{ClientTLS}; any other goes to C{fallback} (default: web PKI verification).
    """

    def __init__(
        self,
        state: Callable[[], ClusterState],
        fallback: IPolicyForHTTPS | None = None,
    ) -> None:
        self._state = state
        self._fallback: IPolicyForHTTPS = (
            fallback if fallback is not None else BrowserLikePolicyForHTTPS()
        )
        self._creators = ClientTLSCache()

    def creatorForNetloc(
        self, hostname: bytes, port: int
    ) -> IOpenSSLClientConnectionCreator:
        state = self._state()
        peer = state.peer_at(hostname.decode("ascii", "replace"), port)
        creator = None if peer is None else self._creators.creator(state, peer)
        if creator is None:
            return self._fallback.creatorForNetloc(hostname, port)
        return creator
