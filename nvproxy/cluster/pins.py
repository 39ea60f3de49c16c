# -*- test-case-name: tests.test_cluster -*-
"""
What the cluster trusts, as values: certificate fingerprints, the pinned peers,
this node's identity, and the L{ClusterState} derived from them (its pins).

Trust is the pin alone: a certificate is accepted when its fingerprint is pinned
(and, when dialing, its DNS SAN is the expected node id), whatever its dates or
issuer.  L{nvproxy.cluster.store} reads these values from the cluster dir and
L{nvproxy.cluster.tls} checks handshakes against them.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from functools import lru_cache

from attrs import field, frozen
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from nvproxy.config import NODE_ID_PATTERN, node_id_problem
from nvproxy.engines import ENGINES

__all__ = [
    "ENGINE_IDS",
    "ClusterError",
    "ClusterState",
    "Fingerprint",
    "Identity",
    "Peer",
    "PrivateKey",
    "validate_node_id",
]

#: The engines a peer's C{ports} may name: the engine table's.
ENGINE_IDS = frozenset(ENGINES)

PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey


class ClusterError(Exception):
    """The cluster dir, or an argument about it, is unusable; C{str()} says why."""


_HEX64 = re.compile(r"[0-9a-f]{64}")
_PAIR = re.compile(r"[0-9a-f]{2}")
_FINGERPRINT_PREFIXES = ("sha256 fingerprint=", "sha256:", "sha256=")


@frozen
class Fingerprint:
    """The SHA-256 digest of a certificate's DER encoding."""

    digest: bytes = field()

    @digest.validator
    def _check(self, attribute: object, value: bytes) -> None:
        if len(value) != 32:
            raise ClusterError("a SHA-256 fingerprint is 32 bytes")

    @classmethod
    def of(cls, certificate: x509.Certificate) -> Fingerprint:
        return cls(certificate.fingerprint(hashes.SHA256()))

    @classmethod
    def parse(cls, text: str) -> Fingerprint:
        """
        Parse C{sha256:HEX}, bare HEX, or colon-separated hex pairs (optionally
        prefixed C{sha256:} or C{SHA256 Fingerprint=}), in any case.
        """
        s = text.strip().lower()
        for prefix in _FINGERPRINT_PREFIXES:
            if s.startswith(prefix):
                s = s[len(prefix) :]
                break
        if ":" in s:
            pairs = s.split(":")
            if len(pairs) == 32 and all(_PAIR.fullmatch(p) for p in pairs):
                return cls(bytes.fromhex("".join(pairs)))
        elif _HEX64.fullmatch(s):
            return cls(bytes.fromhex(s))
        raise ClusterError(
            f"{_short(text)} is not a SHA-256 fingerprint "
            "(expected sha256:<64 hex digits> or 32 colon-separated hex pairs)"
        )

    @property
    def colon_hex(self) -> str:
        """The OpenSSL rendering: upper-case hex pairs joined by colons."""
        return ":".join(f"{b:02X}" for b in self.digest)

    def __str__(self) -> str:
        return "sha256:" + self.digest.hex()


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def validate_node_id(text: str) -> str:
    """
    Return C{text} lower-cased if it is a usable node id: a DNS name (it goes in the
    certificate's DNS SAN) whose last label is not all digits (so it can never be
    read as an IP address); the same rule as the configuration's.
    """
    node_id = text.strip().lower()
    if node_id_problem(node_id) is not None:
        raise ClusterError(
            f"{_short(text)} is not a valid node id "
            "(use a DNS name: letters, digits, '-' and '.', not an IP address)"
        )
    return node_id


@lru_cache(maxsize=1024)
def _dialed_host(host: str) -> str:
    """
    A host as a URL names it, in the form peer addresses are kept in: asked
    for on every request forwarded to a peer, of the few hosts a fleet has
    (the parse of an IP address was most of what finding the peer cost).
    """
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return host.lower().rstrip(".")


def _validate_address(text: str) -> str:
    host = text.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host.lower().rstrip(".")
    if not NODE_ID_PATTERN.fullmatch(name) or len(name) > 253:
        raise ClusterError(
            f"address {_short(text)} is not a host name or IP address "
            "(give the host alone: no scheme, no port)"
        )
    return name


def _to_fingerprint(value: Fingerprint | str) -> Fingerprint:
    return value if isinstance(value, Fingerprint) else Fingerprint.parse(value)


def _to_ports(
    value: Mapping[str, int] | Iterable[tuple[str, int]],
) -> tuple[tuple[str, int], ...]:
    items = list(value.items() if isinstance(value, Mapping) else value)
    ports: dict[str, int] = {}
    for engine, port in items:
        if engine not in ENGINE_IDS:
            raise ClusterError(
                f"unknown engine {_short(str(engine))} "
                f"(known: {', '.join(sorted(ENGINE_IDS))})"
            )
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ClusterError(f"port for {engine} must be 1-65535, not {port!r}")
        if engine in ports:
            raise ClusterError(f"port for {engine} given twice")
        ports[engine] = port
    return tuple(sorted(ports.items()))


@frozen
class Peer:
    """A pinned peer node: where its facades listen and which certificate it has."""

    id: str = field(converter=validate_node_id)
    address: str = field(converter=_validate_address)
    fingerprint: Fingerprint = field(converter=_to_fingerprint)
    ports: tuple[tuple[str, int], ...] = field(default=(), converter=_to_ports)

    def port(self, engine: str) -> int | None:
        """The peer's facade port for C{engine}, if peers.json names one."""
        return dict(self.ports).get(engine)

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "address": self.address,
            "ports": dict(self.ports),
            "fingerprint": str(self.fingerprint),
        }


@frozen
class Identity:
    """This node's certificate and key. Equal when the certificates are."""

    node_id: str
    certificate: x509.Certificate = field(eq=False, repr=False)
    key: PrivateKey = field(eq=False, repr=False)
    fingerprint: Fingerprint = field(init=False)

    @fingerprint.default
    def _fingerprint(self) -> Fingerprint:
        return Fingerprint.of(self.certificate)


@frozen
class ClusterState:
    """
    Everything derived from the cluster dir at one moment. C{identity} is L{None}
    when this node is not a cluster member (no TLS personality then).
    """

    identity: Identity | None = None
    peers: tuple[Peer, ...] = ()
    node_id: str | None = field(init=False)
    pins: frozenset[Fingerprint] = field(init=False)

    @node_id.default
    def _node_id(self) -> str | None:
        return None if self.identity is None else self.identity.node_id

    # Every request from a peer asks which peer its fingerprint is, and a
    # fleet pins hundreds: looked up, not searched (the first peer listed
    # wins, as a search from the start would find it).
    _by_fingerprint: dict[Fingerprint, Peer] = field(init=False, eq=False, repr=False)
    _by_id: dict[str, Peer] = field(init=False, eq=False, repr=False)
    _by_address: dict[str, list[Peer]] = field(init=False, eq=False, repr=False)

    @pins.default
    def _pins(self) -> frozenset[Fingerprint]:
        return frozenset(peer.fingerprint for peer in self.peers)

    @_by_fingerprint.default
    def _index_fingerprints(self) -> dict[Fingerprint, Peer]:
        return {peer.fingerprint: peer for peer in reversed(self.peers)}

    @_by_id.default
    def _index_ids(self) -> dict[str, Peer]:
        return {peer.id: peer for peer in reversed(self.peers)}

    @_by_address.default
    def _index_addresses(self) -> dict[str, list[Peer]]:
        at: dict[str, list[Peer]] = {}
        for peer in self.peers:
            at.setdefault(peer.address, []).append(peer)
        return at

    @property
    def member(self) -> bool:
        return self.identity is not None

    def peer(self, peer_id: str) -> Peer | None:
        return self._by_id.get(peer_id)

    def peer_by_fingerprint(self, fingerprint: Fingerprint) -> Peer | None:
        return self._by_fingerprint.get(fingerprint)

    def peer_at(self, host: str, port: int) -> Peer | None:
        """
        The peer dialed at C{host}:C{port}: the one with that address and port, or
        else the only peer at that address.
        """
        at_host = self._by_address.get(_dialed_host(host), ())
        exact = [p for p in at_host if port in dict(p.ports).values()]
        if len(exact) == 1:
            return exact[0]
        return at_host[0] if len(at_host) == 1 and not exact else None
