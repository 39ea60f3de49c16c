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

    def __init__(self, reactor: Any, data_dir: str) -> None:
        self._reactor = reactor
        self._data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
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
        process = self._process = _ServerProcess()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "ETCD_UNSUPPORTED_ARCH": "",
        }
        self._transport = self._reactor.spawnProcess(process, binary, argv, env=env)
        try:
            await wait_healthy(
                self._reactor,
                self.url + "/health",
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
