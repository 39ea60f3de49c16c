# -*- test-case-name: tests.test_cluster -*-
"""
The cluster directory: this node's identity, the peers it trusts, and the mutual-TLS
contexts built from them (DESIGN §3, spec §7).

Layout (``[cluster] dir``, ``--cluster-dir``; ``nvproxyctl cluster init`` creates it)::

    <dir>/              mode 0700 when created by init
      node.key          this node's private key: EC P-256, PEM (PKCS#8), mode 0600
      node.crt          self-signed certificate, PEM: CN = DNS SAN = node id,
                        valid 10 years, for TLS server and client authentication
      peers.json        the pinned peers; absent means none

``peers.json``::

    {
      "version": 1,
      "peers": [
        {
          "id": "gpu-2",
          "address": "10.0.0.2",
          "ports": {"ollama": 11435, "vllm": 8000},
          "fingerprint": "sha256:3b1f...e9"
        }
      ]
    }

* ``id``: the peer's node id, a lower-case DNS name (letters, digits, ``-``, ``.``);
  the dialing side checks it against the DNS SAN of the peer's certificate.
* ``address``: host name or IP address of the peer (no scheme, no port).
* ``ports``: facade port per engine (``ollama``, ``lmstudio``, ``llamacpp``,
  ``vllm``); optional, an engine left out is at its standalone port.
* ``fingerprint``: SHA-256 of the peer's certificate (DER). Accepted as
  ``sha256:<64 hex>``, bare 64 hex digits, or 32 colon-separated hex pairs (what
  ``openssl x509 -noout -fingerprint -sha256`` prints, its ``sha256 Fingerprint=``
  prefix included), in any case; always written as ``sha256:<64 lower-case hex>``.

An entry whose ``id`` is this node's own id is skipped, so one ``peers.json`` can be
copied to every node. Ids and fingerprints are unique. Tools write every file
atomically (temporary file, fsync, rename); hand edits should do the same.

Trust is the pin alone: a certificate is accepted when its fingerprint is pinned
(and, when dialing, its DNS SAN is the expected node id), whatever its dates or
issuer. Removing a pin stops new handshakes at once (the server reads the current
pins in every handshake) and, through L{ServerTLS.peer_is_pinned} checked per
request, requests on connections already open. TLS 1.3 only; no session
resumption, so every connection is a full, pin-checked handshake.

A L{ClusterWatcher} polls the three files' metadata (cheap ``stat`` calls) and
re-derives the L{ClusterState} when they change; if the directory turns unreadable
or invalid it keeps the last good state and logs the error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn, Protocol, TextIO, cast

from attrs import field, frozen
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from OpenSSL import SSL, crypto
from service_identity import CertificateError, VerificationError
from service_identity.cryptography import verify_certificate_hostname
from twisted.application.service import Service
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator,
    IOpenSSLServerConnectionCreator,
    IReactorTime,
    ISSLTransport,
)
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import BrowserLikePolicyForHTTPS
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

from nvproxy.config import NODE_ID_PATTERN, node_id_problem
from nvproxy.files import atomic_write

__all__ = [
    "DEFAULT_CLUSTER_DIR",
    "ENGINE_IDS",
    "ClientTLS",
    "ClusterDir",
    "ClusterError",
    "ClusterState",
    "ClusterWatcher",
    "Fingerprint",
    "Identity",
    "Peer",
    "PeerPolicyForHTTPS",
    "PeerVerificationError",
    "ServerTLS",
    "cluster_command",
    "peer_fingerprint",
    "validate_node_id",
]

log = Logger()

DEFAULT_CLUSTER_DIR = "/etc/nvproxy/cluster"
ENGINE_IDS = frozenset({"ollama", "lmstudio", "llamacpp", "vllm"})
KEY_FILE = "node.key"
CERT_FILE = "node.crt"
PEERS_FILE = "peers.json"
CERT_LIFETIME = datetime.timedelta(days=3650)

PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey


class ClusterError(Exception):
    """The cluster dir, or an argument about it, is unusable; C{str()} says why."""


class PeerVerificationError(Exception):
    """A peer's TLS certificate is not the one pinned for the node being dialed."""


# -- values -----------------------------------------------------------------------

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


def _fingerprint_of(identity: Identity) -> Fingerprint:
    return Fingerprint.of(identity.certificate)


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

    @pins.default
    def _pins(self) -> frozenset[Fingerprint]:
        return frozenset(peer.fingerprint for peer in self.peers)

    @property
    def member(self) -> bool:
        return self.identity is not None

    def peer(self, peer_id: str) -> Peer | None:
        return next((p for p in self.peers if p.id == peer_id), None)

    def peer_by_fingerprint(self, fingerprint: Fingerprint) -> Peer | None:
        return next((p for p in self.peers if p.fingerprint == fingerprint), None)

    def peer_at(self, host: str, port: int) -> Peer | None:
        """
        The peer dialed at C{host}:C{port}: the one with that address and port, or
        else the only peer at that address.
        """
        try:
            host = str(ipaddress.ip_address(host.strip("[]")))
        except ValueError:
            host = host.lower().rstrip(".")
        at_host = [p for p in self.peers if p.address == host]
        exact = [p for p in at_host if port in dict(p.ports).values()]
        if len(exact) == 1:
            return exact[0]
        return at_host[0] if len(at_host) == 1 and not exact else None


# -- the directory ---------------------------------------------------------------


def _make_identity(node_id: str, now: datetime.datetime) -> Identity:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # An hour back, so a peer whose clock is a little behind still agrees.
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + CERT_LIFETIME)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(node_id)]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            False,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False
        )
        .sign(key, hashes.SHA256())
    )
    return Identity(node_id, certificate, key)


def _spki(key: object) -> bytes:
    assert isinstance(
        key, ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey | rsa.RSAPublicKey
    )
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


class ClusterDir:
    """Reads and writes one cluster directory (format: module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.key_path = self.path / KEY_FILE
        self.cert_path = self.path / CERT_FILE
        self.peers_path = self.path / PEERS_FILE

    def __repr__(self) -> str:
        return f"ClusterDir({str(self.path)!r})"

    # identity

    def init(self, node_id: str, clock: IReactorTime) -> Identity:
        """
        Create this node's key and self-signed certificate for C{node_id}, valid
        from C{clock}'s now. Refuses to overwrite an existing identity.
        """
        node_id = validate_node_id(node_id)
        for existing in (self.key_path, self.cert_path):
            if existing.exists():
                raise ClusterError(
                    f"{existing} already exists; refusing to overwrite this "
                    "node's identity"
                )
        now = datetime.datetime.fromtimestamp(clock.seconds(), datetime.UTC)
        identity = _make_identity(node_id, now)
        key_pem = identity.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        cert_pem = identity.certificate.public_bytes(serialization.Encoding.PEM)
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write(self.key_path, key_pem, mode=0o600, exclusive=True)
            atomic_write(self.cert_path, cert_pem, mode=0o644, exclusive=True)
        except FileExistsError as e:
            raise ClusterError(
                f"{e.filename2 or e.filename} appeared while initializing; "
                "refusing to overwrite it"
            ) from e
        except OSError as e:
            raise ClusterError(f"cannot write {self.path}: {e.strerror}") from e
        return identity

    def identity(self) -> Identity | None:
        """This node's identity, or L{None} if the dir holds none."""
        key_exists, cert_exists = self.key_path.exists(), self.cert_path.exists()
        if not key_exists and not cert_exists:
            return None
        if not key_exists or not cert_exists:
            present, missing = (
                (self.cert_path, self.key_path)
                if cert_exists
                else (self.key_path, self.cert_path)
            )
            raise ClusterError(f"{present} exists but {missing} is missing")
        cert_pem, key_pem = self._read(self.cert_path), self._read(self.key_path)
        try:
            certificate = x509.load_pem_x509_certificate(cert_pem)
        except ValueError as e:
            raise ClusterError(f"{self.cert_path}: not a PEM certificate") from e
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError) as e:
            raise ClusterError(
                f"{self.key_path}: not an unencrypted PEM private key"
            ) from e
        if not isinstance(
            key,
            ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey,
        ):
            raise ClusterError(f"{self.key_path}: unsupported key type")
        if _spki(key.public_key()) != _spki(certificate.public_key()):
            raise ClusterError(f"{self.key_path} does not match {self.cert_path}")
        try:
            san = certificate.extensions.get_extension_for_class(
                x509.SubjectAlternativeName
            ).value
            names = san.get_values_for_type(x509.DNSName)
        except x509.ExtensionNotFound:
            names = []
        if len(names) != 1:
            raise ClusterError(
                f"{self.cert_path}: expected exactly one DNS name (the node id) in "
                f"the subject alternative names, found {len(names)}"
            )
        try:
            node_id = validate_node_id(names[0])
        except ClusterError as e:
            raise ClusterError(f"{self.cert_path}: {e}") from e
        mode = self.key_path.stat().st_mode
        if mode & 0o077:
            log.warn(
                "{path} is accessible to other users (mode {mode}); chmod 600 it",
                path=str(self.key_path),
                mode=oct(stat.S_IMODE(mode)),
            )
        return Identity(node_id, certificate, key)

    def fingerprint(self) -> Fingerprint:
        """This node's certificate fingerprint, for the other nodes' peers.json."""
        identity = self.identity()
        if identity is None:
            raise ClusterError(
                f"{self.path} holds no node identity; run 'nvproxyctl cluster init'"
            )
        return identity.fingerprint

    # peers

    def peers(self) -> tuple[Peer, ...]:
        """Every entry in peers.json, in file order (this node's own included)."""
        if not self.peers_path.exists():
            return ()
        return _parse_peers(self._read(self.peers_path), self.peers_path)

    def add_peer(self, peer: Peer, *, replace: bool = False) -> None:
        """
        Pin C{peer}. An existing entry with its id is an error unless C{replace};
        its fingerprint must not belong to another peer or to this node.
        """
        identity = self.identity()
        if identity is not None:
            if peer.id == identity.node_id:
                raise ClusterError(f"{peer.id} is this node's own id")
            if peer.fingerprint == identity.fingerprint:
                raise ClusterError(f"{peer.fingerprint} is this node's own certificate")
        peers = list(self.peers())
        if any(p.id == peer.id for p in peers):
            if not replace:
                raise ClusterError(
                    f"peer {peer.id} already exists (remove it first, or replace it)"
                )
            peers = [p for p in peers if p.id != peer.id]
        clash = next((p for p in peers if p.fingerprint == peer.fingerprint), None)
        if clash is not None:
            raise ClusterError(f"{peer.fingerprint} is already pinned for {clash.id}")
        self._write_peers([*peers, peer])

    def remove_peer(self, peer_id: str) -> Peer:
        """Unpin the peer C{peer_id} and return its entry."""
        peers = list(self.peers())
        found = next((p for p in peers if p.id == peer_id.strip().lower()), None)
        if found is None:
            raise ClusterError(f"no peer {_short(peer_id)} in {self.peers_path}")
        self._write_peers([p for p in peers if p is not found])
        return found

    def _write_peers(self, peers: Iterable[Peer]) -> None:
        document = {
            "version": 1,
            "peers": [p.to_json() for p in sorted(peers, key=lambda p: p.id)],
        }
        data = (json.dumps(document, indent=2) + "\n").encode("utf-8")
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write(self.peers_path, data, mode=0o644)
        except OSError as e:
            raise ClusterError(f"cannot write {self.peers_path}: {e.strerror}") from e

    # the whole

    def load(self) -> ClusterState:
        """Read the directory into a L{ClusterState}; a missing dir is no cluster."""
        identity = self.identity()
        peers = self.peers()
        if identity is not None:
            own = [p for p in peers if p.id == identity.node_id]
            if own and own[0].fingerprint != identity.fingerprint:
                log.warn(
                    "{path} lists this node ({node_id}) with another fingerprint",
                    path=str(self.peers_path),
                    node_id=identity.node_id,
                )
            peers = tuple(p for p in peers if p.id != identity.node_id)
            if any(p.fingerprint == identity.fingerprint for p in peers):
                raise ClusterError(
                    f"{self.peers_path}: this node's fingerprint is pinned for "
                    "another peer"
                )
        return ClusterState(identity, peers)

    def signature(self) -> tuple[tuple[int, ...] | None, ...]:
        """What changes whenever any of the three files changes (a cheap stat)."""
        result: list[tuple[int, ...] | None] = []
        for path in (self.key_path, self.cert_path, self.peers_path):
            try:
                s = path.stat()
            except OSError:
                result.append(None)
            else:
                result.append(
                    (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)
                )
        return tuple(result)

    def _read(self, path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError as e:
            raise ClusterError(f"cannot read {path}: {e.strerror}") from e


_PEER_KEYS = frozenset({"id", "address", "ports", "fingerprint"})


def _parse_peers(data: bytes, path: Path) -> tuple[Peer, ...]:
    try:
        document = json.loads(data)
    except ValueError as e:  # includes UnicodeDecodeError and JSONDecodeError
        raise ClusterError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(document, dict):
        raise ClusterError(
            f'{path}: expected an object {{"version": 1, "peers": [...]}}'
        )
    unknown = sorted(set(document) - {"version", "peers"})
    if unknown:
        raise ClusterError(f"{path}: unknown key {unknown[0]!r}")
    if document.get("version", 1) != 1:
        raise ClusterError(f"{path}: unsupported version {document['version']!r}")
    entries = document.get("peers", [])
    if not isinstance(entries, list):
        raise ClusterError(f'{path}: "peers" must be a list')
    peers: list[Peer] = []
    for number, entry in enumerate(entries, 1):
        where = f"{path}: peer #{number}"
        if not isinstance(entry, dict):
            raise ClusterError(f"{where}: expected an object")
        if isinstance(entry.get("id"), str):
            where = f"{path}: peer {entry['id']!r}"
        missing = sorted({"id", "address", "fingerprint"} - set(entry))
        if missing:
            raise ClusterError(f"{where}: missing {missing[0]!r}")
        unknown = sorted(set(entry) - _PEER_KEYS)
        if unknown:
            raise ClusterError(f"{where}: unknown key {unknown[0]!r}")
        ports = entry.get("ports", {})
        if not isinstance(ports, dict):
            raise ClusterError(f'{where}: "ports" must be an object')
        for key in ("id", "address", "fingerprint"):
            if not isinstance(entry[key], str):
                raise ClusterError(f"{where}: {key!r} must be a string")
        try:
            peer = Peer(entry["id"], entry["address"], entry["fingerprint"], ports)
        except ClusterError as e:
            raise ClusterError(f"{where}: {e}") from e
        for other in peers:
            if other.id == peer.id:
                raise ClusterError(f"{where}: id listed twice")
            if other.fingerprint == peer.fingerprint:
                raise ClusterError(f"{where}: same fingerprint as {other.id}")
        peers.append(peer)
    return tuple(peers)


# -- watching ------------------------------------------------------------------------


class ClusterWatcher(Service):
    """
    The current L{ClusterState}, re-derived when the cluster dir changes.

    Construction loads the dir once (a L{ClusterError} then means the daemon cannot
    start); while running it polls every C{interval} seconds on C{clock}. A later
    invalid dir keeps the last good state (and sets L{error}).
    """

    def __init__(
        self, cluster_dir: ClusterDir, clock: IReactorTime, interval: float = 2.0
    ) -> None:
        self._dir = cluster_dir
        self._clock = clock
        self._interval = interval
        self._signature = cluster_dir.signature()
        self._current = cluster_dir.load()
        self._subscribers: list[Callable[[ClusterState], object]] = []
        self._loop: LoopingCall | None = None
        self.error: ClusterError | None = None

    @property
    def current(self) -> ClusterState:
        return self._current

    def subscribe(
        self, callback: Callable[[ClusterState], object]
    ) -> Callable[[], None]:
        """Call C{callback(state)} on every change; returns the unsubscriber."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    def check(self) -> ClusterState:
        """Reload if the files changed since the last look; return the state."""
        if self._dir.signature() != self._signature:
            return self.reload()
        return self._current

    def reload(self) -> ClusterState:
        """Load the dir now, notify subscribers if the state changed."""
        self._signature = self._dir.signature()
        try:
            state = self._dir.load()
        except (ClusterError, OSError) as problem:
            e = problem if isinstance(problem, ClusterError) else ClusterError(problem)
            if self.error is None or str(e) != str(self.error):
                log.error(
                    "cluster dir unusable, keeping the previous state: {error}",
                    error=str(e),
                )
            self.error = e
            return self._current
        self.error = None
        if state != self._current:
            self._current = state
            log.info(
                "cluster changed: node {node_id}, peers {peers}",
                node_id=state.node_id,
                peers=[p.id for p in state.peers],
            )
            for callback in list(self._subscribers):
                try:
                    callback(state)
                except Exception:
                    log.failure(
                        "cluster subscriber {callback!r} failed", callback=callback
                    )
        return state

    def _poll(self) -> None:
        try:
            self.check()
        except Exception:
            log.failure("polling the cluster dir failed")

    def startService(self) -> None:
        Service.startService(self)
        loop = self._loop = LoopingCall(self._poll)
        loop.clock = self._clock
        loop.start(self._interval, now=True).addErrback(
            lambda f: log.failure("cluster watch stopped", f)
        )

    def stopService(self) -> None:
        Service.stopService(self)
        loop, self._loop = self._loop, None
        if loop is not None and loop.running:
            loop.stop()


# -- TLS ---------------------------------------------------------------------------


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


def peer_fingerprint(transport: object) -> Fingerprint | None:
    """
    The fingerprint of the certificate the peer presented on C{transport} (e.g. a
    twisted.web C{request.transport}), or L{None} if it is not TLS or had none.
    """
    if not ISSLTransport.providedBy(transport):
        return None
    certificate = transport.getPeerCertificate()
    if isinstance(certificate, crypto.X509):
        certificate = certificate.to_cryptography()
    if isinstance(certificate, x509.Certificate):
        return Fingerprint.of(certificate)
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
        self._creators: dict[tuple[Identity, Peer], ClientTLS] = {}

    def creatorForNetloc(
        self, hostname: bytes, port: int
    ) -> IOpenSSLClientConnectionCreator:
        state = self._state()
        peer = state.peer_at(hostname.decode("ascii", "replace"), port)
        if peer is None or state.identity is None:
            return self._fallback.creatorForNetloc(hostname, port)
        key = (state.identity, peer)
        creator = self._creators.get(key)
        if creator is None:
            if len(self._creators) > 4 * len(state.peers) + 16:
                self._creators.clear()  # drop contexts of departed peers
            creator = self._creators[key] = ClientTLS.for_peer(state.identity, peer)
        return creator


# -- command line -----------------------------------------------------------------


class _Usage(Exception):
    pass


class _Exit(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


class _Parser(argparse.ArgumentParser):
    """argparse writing to our streams and raising instead of exiting."""

    def __init__(self, *args: Any, out: TextIO, **kwargs: Any) -> None:
        self.out = out
        super().__init__(*args, **kwargs)

    def _print_message(self, message: str, file: Any = None) -> None:
        if message:
            self.out.write(message)

    def error(self, message: str) -> NoReturn:
        raise _Usage(f"{self.prog}: error: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            self.out.write(message)
        raise _Exit(status)


def _engine_port(text: str) -> tuple[str, int]:
    engine, sep, port = text.partition("=")
    if not sep or not port.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not ENGINE=PORT")
    return engine.strip().lower(), int(port)


def _parser(out: TextIO) -> _Parser:
    common = _Parser(add_help=False, out=out)
    common.add_argument(
        "--dir",
        metavar="D",
        help=f"cluster dir (default: $NVPROXY_CLUSTER_DIR or {DEFAULT_CLUSTER_DIR})",
    )
    parser = _Parser(prog="nvproxyctl cluster", out=out)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> _Parser:
        parser: _Parser = commands.add_parser(
            name, help=help, parents=[common], out=out
        )
        return parser

    init = command("init", "create this node's key and certificate")
    init.add_argument("node_id", metavar="NODE_ID")
    command("fingerprint", "print this node's certificate fingerprint")
    add = command("add-peer", "pin a peer")
    add.add_argument("peer_id", metavar="ID")
    add.add_argument("address", metavar="ADDRESS")
    add.add_argument("fingerprint", metavar="FINGERPRINT")
    add.add_argument(
        "--port",
        action="append",
        type=_engine_port,
        default=[],
        metavar="ENGINE=PORT",
        help="the peer's facade port for an engine (repeatable)",
    )
    add.add_argument("--replace", action="store_true", help="replace an existing entry")
    remove = command("remove-peer", "unpin a peer")
    remove.add_argument("peer_id", metavar="ID")
    command("list", "list the pinned peers")
    return parser


def cluster_command(
    argv: list[str],
    out: TextIO,
    *,
    err: TextIO | None = None,
    clock: IReactorTime | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """
    C{nvproxyctl cluster ARGV}: C{init NODE_ID}, C{fingerprint},
    C{add-peer ID ADDRESS FINGERPRINT [--port ENGINE=PORT ...] [--replace]},
    C{remove-peer ID}, C{list}; each takes C{--dir D}.

    @return: 0 on success, 1 when the operation fails, 2 on a usage error.
    """
    err = out if err is None else err
    environ = os.environ if environ is None else environ
    try:
        args = _parser(out).parse_args(argv)
    except _Usage as e:
        err.write(f"{e}\n")
        return 2
    except _Exit as e:
        return e.status
    directory = ClusterDir(
        args.dir or environ.get("NVPROXY_CLUSTER_DIR") or DEFAULT_CLUSTER_DIR
    )
    try:
        if args.command == "init":
            if clock is None:
                from twisted.internet import reactor

                clock = cast(IReactorTime, reactor)
            identity = directory.init(args.node_id, clock)
            out.write(
                f"initialized node {identity.node_id} in {directory.path}\n"
                f"fingerprint {identity.fingerprint}\n"
            )
        elif args.command == "fingerprint":
            out.write(f"{directory.fingerprint()}\n")
        elif args.command == "add-peer":
            peer = Peer(args.peer_id, args.address, args.fingerprint, args.port)
            directory.add_peer(peer, replace=args.replace)
            out.write(f"added peer {peer.id} at {peer.address} ({peer.fingerprint})\n")
        elif args.command == "remove-peer":
            removed = directory.remove_peer(args.peer_id)
            out.write(f"removed peer {removed.id}\n")
        else:
            for p in directory.peers():
                ports = ",".join(f"{e}={n}" for e, n in p.ports) or "-"
                out.write(f"{p.id}\t{p.address}\t{ports}\t{p.fingerprint}\n")
    except (ClusterError, OSError) as e:
        err.write(f"nvproxyctl cluster {args.command}: {e}\n")
        return 1
    return 0
