"""
End to end across a real (namespaced) network: a plaintext request from a
non-loopback address is refused before any HTTP is read (spec §7).

Needs root and C{ip netns}; the test makes its own network namespace and
veth pair with addresses that exist only inside them, and removes both.
Elsewhere the demux unit tests (L{tests.test_listener}) cover the gate.
"""

from __future__ import annotations

import os
import sys
import textwrap

from attrs import evolve
from twisted.internet import reactor
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import SkipTest

from nvproxy.testing.fakeengine import FakeEngine
from nvproxy.testing.harness import free_port, proxy_config, start_proxy
from tests.test_forwarding import ProxyTestCase

HOST_ADDRESS = "10.213.7.1"
PEER_ADDRESS = "10.213.7.2"


async def _run(*argv: str) -> tuple[bytes, bytes, int]:
    d = getProcessOutputAndValue(argv[0], argv[1:], env=dict(os.environ))
    d.addTimeout(30, reactor)
    return await d


class NetnsTests(ProxyTestCase):
    async def namespace(self) -> str:
        if os.geteuid() != 0:
            raise SkipTest("needs root to create a network namespace")
        name = f"nvp{os.getpid() % 100000}"
        out, err, code = await _run("/usr/sbin/ip", "netns", "add", name)
        if code != 0:
            raise SkipTest(f"ip netns unavailable: {err.decode().strip()}")
        self.addCleanup(_run, "/usr/sbin/ip", "netns", "del", name)
        host, inner = f"{name}h", f"{name}n"
        for argv in (
            ["link", "add", host, "type", "veth", "peer", "name", inner],
            ["link", "set", inner, "netns", name],
            ["addr", "add", f"{HOST_ADDRESS}/24", "dev", host],
            ["link", "set", host, "up"],
            [
                "netns",
                "exec",
                name,
                "ip",
                "addr",
                "add",
                f"{PEER_ADDRESS}/24",
                "dev",
                inner,
            ],
            ["netns", "exec", name, "ip", "link", "set", inner, "up"],
        ):
            out, err, code = await _run("/usr/sbin/ip", *argv)
            self.assertEqual(code, 0, err.decode())
        self.addCleanup(_run, "/usr/sbin/ip", "link", "del", host)
        return name

    async def test_plaintext_from_lan_refused(self) -> None:
        namespace = await self.namespace()
        fake = FakeEngine("ollama", ["m:latest"], reactor)
        await fake.listen(reactor)
        self.addCleanup(fake.stop)
        config = proxy_config(self.mktemp(), {"ollama": fake.url})
        config = evolve(config, listen_interface="0.0.0.0")
        engines = dict(config.engines)
        port = free_port()
        engines["ollama"] = evolve(engines["ollama"], port=port)
        proxy = await start_proxy(reactor, evolve(config, engines=engines))
        self.addCleanup(proxy.stopService)
        probe = textwrap.dedent(
            f"""
            import socket
            s = socket.create_connection(("{HOST_ADDRESS}", {port}), timeout=10)
            s.sendall(b"GET /api/tags HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            print(repr(data))
            """
        )
        out, err, code = await _run(
            "/usr/sbin/ip", "netns", "exec", namespace, sys.executable, "-c", probe
        )
        self.assertEqual(code, 0, err.decode())
        self.assertEqual(out.strip(), b"b''")
        # The same port still serves loopback clients.
        code, _, body = await self.client.request(
            "GET", f"http://127.0.0.1:{port}/api/tags"
        )
        self.assertEqual(code, 200)
