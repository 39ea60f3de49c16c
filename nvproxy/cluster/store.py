# -*- test-case-name: tests.test_cluster -*-
"""
The cluster directory on disk: this node's identity and the peers it trusts
(DESIGN §3, spec §7), and the L{ClusterWatcher} that follows it.

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

A L{ClusterWatcher} polls the three files' metadata (cheap ``stat`` calls) and
re-derives the L{ClusterState} when they change; if the directory turns unreadable
or invalid it keeps the last good state and logs the error.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from nvproxy.cluster.pins import (
    ClusterError,
    ClusterState,
    Fingerprint,
    Identity,
    Peer,
    _short,
    validate_node_id,
)
from nvproxy.files import atomic_write

__all__ = [
    "CERT_FILE",
    "DEFAULT_CLUSTER_DIR",
    "KEY_FILE",
    "PEERS_FILE",
    "ClusterDir",
    "ClusterWatcher",
]

log = Logger()

DEFAULT_CLUSTER_DIR = "/etc/nvproxy/cluster"
KEY_FILE = "node.key"
CERT_FILE = "node.crt"
PEERS_FILE = "peers.json"
CERT_LIFETIME = datetime.timedelta(days=3650)


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
