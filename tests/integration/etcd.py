"""
A real single-member etcd on loopback for the opt-in etcd suite
(C{tox -e etcd}): Debian's C{etcd-server} package, or the binary named by
C{NVPROXY_ETCD}; its data dir in the test's temp folder.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IProcessTransport

from nvproxy.testing.harness import NotHealthy, free_port, wait_healthy
from tests.integration.llamacpp import _ServerProcess


def find_etcd() -> str | None:
    """The etcd binary, or None."""
    return os.environ.get("NVPROXY_ETCD") or shutil.which("etcd")


def skip_reason() -> str | None:
    if os.environ.get("NVPROXY_ETCD_TESTS") != "1":
        return "the etcd suite is opt-in: tox -e etcd (sets NVPROXY_ETCD_TESTS=1)"
    if find_etcd() is None:
        return "no etcd binary (apt-get install etcd-server, or set NVPROXY_ETCD)"
    return None


class Etcd:
    """
    One etcd process; L{stop} and L{start} again keep its data and ports,
    as an operator's restart would.
    """

    def __init__(
        self, reactor: Any, data_dir: str, tls: tuple[str, str, str] | None = None
    ) -> None:
        """
        @param tls: (server certificate, its key, client CA) PEM files: etcd
            then serves https and requires a client certificate.
        """
        self._reactor = reactor
        self._data_dir = data_dir
        self._tls = tls
        self.client_port = free_port()
        self.peer_port = free_port()
        self.metrics_port = free_port()
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.client_port}"
        self._process: _ServerProcess | None = None
        self._transport: IProcessTransport | None = None

    @property
    def output(self) -> str:
        if self._process is None:
            return ""
        return self._process.output.decode("utf-8", "replace")

    async def _start(self) -> None:
        binary = find_etcd()
        assert binary is not None
        argv = [
            binary,
            "--name",
            "test",
            "--data-dir",
            self._data_dir,
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            "--listen-peer-urls",
            f"http://127.0.0.1:{self.peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{self.peer_port}",
            "--initial-cluster",
            f"test=http://127.0.0.1:{self.peer_port}",
            "--log-level",
            "warn",
        ]
        health = self.url + "/health"
        if self._tls is not None:
            cert, key, ca = self._tls
            argv += [
                "--cert-file",
                cert,
                "--key-file",
                key,
                "--trusted-ca-file",
                ca,
                "--client-cert-auth",
                # health on a plain metrics listener: the test's own probe
                # has no client certificate
                "--listen-metrics-urls",
                f"http://127.0.0.1:{self.metrics_port}",
            ]
            health = f"http://127.0.0.1:{self.metrics_port}/health"
        process = self._process = _ServerProcess()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "ETCD_UNSUPPORTED_ARCH": "",
        }
        self._transport = self._reactor.spawnProcess(process, binary, argv, env=env)
        try:
            await wait_healthy(
                self._reactor,
                health,
                within=20.0,
                interval=0.05,
                alive=lambda: not process.exited,
            )
        except NotHealthy:
            await self._stop("KILL")
            raise RuntimeError(f"etcd did not start:\n{self.output}") from None

    def start(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._start())

    async def _stop(self, signal: str) -> None:
        process, transport = self._process, self._transport
        if process is None or transport is None or process.exited:
            return
        try:
            transport.signalProcess(signal)
        except ProcessExitedAlready:
            pass
        killer = self._reactor.callLater(10, self._kill, transport)
        try:
            await process.ended()
        finally:
            if killer.active():
                killer.cancel()

    def _kill(self, transport: IProcessTransport) -> None:
        try:
            transport.signalProcess("KILL")
        except ProcessExitedAlready:
            pass

    def stop(self, signal: str = "TERM") -> Deferred[None]:
        return Deferred.fromCoroutine(self._stop(signal))


def make_tls(directory: str) -> dict[str, str]:
    """
    A CA, a server certificate for 127.0.0.1 and a client certificate, as
    PEM files in C{directory}: keys C{ca}, C{server}, C{server_key},
    C{client}, C{client_key}.
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    os.makedirs(directory, exist_ok=True)
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    def write(file: str, data: bytes) -> str:
        path = os.path.join(directory, file)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("test etcd CA"))
        .issuer_name(name("test etcd CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": write("ca.pem", ca.public_bytes(serialization.Encoding.PEM))}
    # etcd's JSON gateway dials etcd's own gRPC with the server certificate,
    # so with client certificates required that one must be a client too
    for who, usage in (
        ("server", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
        ("client", [ExtendedKeyUsageOID.CLIENT_AUTH]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(f"test etcd {who}"))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        )
        cert = builder.sign(ca_key, hashes.SHA256())
        paths[who] = write(f"{who}.pem", cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{who}_key"] = write(f"{who}.key", key_pem(key))
    return paths
