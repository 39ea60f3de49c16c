"""
Three nvproxy nodes over pinned mTLS whose peers and readiness come from a
real etcd (opt-in: C{tox -e etcd}): routing by etcd-fed records, a readiness
change seen without polling, a node that dies, etcd restarting, and a watch
resumed past a compaction.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from attrs import evolve
from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import deferLater

from nvproxy.cluster import ClusterDir, Peer
from nvproxy.config import EtcdConfig, VllmHold, VllmServiceConfig
from nvproxy.service import NvProxy
from nvproxy.testing.fakevllm import FakeVLLM
from nvproxy.testing.harness import (
    eventually,
    facade_url,
    free_port,
    pinned_cluster,
    proxy_config,
    start_proxy,
)
from tests.integration.etcd import Etcd, skip_reason
from tests.test_e2e import _Twistd, _twistd_argv
from tests.test_forwarding import ProxyTestCase

reactor: Any = _reactor

NODES = ("node-a", "node-b", "node-c")
MODEL = "Qwen3-8B"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
TTL = 3.0


def served(fake: FakeVLLM) -> int:
    return len([p for _, _, p in fake.calls if p.startswith("/v1/chat")])


class EtcdFleetTests(ProxyTestCase):
    timeout = 90

    def setUp(self) -> Deferred[None]:  # type: ignore[override]
        super().setUp()
        reason = skip_reason()
        if reason is not None:
            self.skipTest(reason)
        self.root = os.path.abspath(self.mktemp())
        self.etcd = Etcd(reactor, os.path.join(self.root, "etcd"))
        self.addCleanup(self.etcd.stop)
        return self.etcd.start()

    async def fleet(self) -> tuple[dict[str, NvProxy], dict[str, FakeVLLM]]:
        """
        Three nodes pinned to each other in their cluster dirs, each with a
        vLLM service serving L{MODEL}; peers known only from etcd.
        """
        # the pins only (a placeholder address, no port): etcd tells where
        # each peer is
        _, self.ports = pinned_cluster(self.root, NODES, reactor, address="192.0.2.1")
        fakes: dict[str, FakeVLLM] = {}
        proxies: dict[str, NvProxy] = {}
        for node in NODES:
            fake = FakeVLLM(reactor, model=MODEL)
            fake.listen(reactor)
            self.addCleanup(fake.stop)
            fakes[node] = fake
            proxies[node] = await self.start(node, fake)
        await eventually(
            reactor,
            lambda: all(
                [self.readiness(p, n) for n in NODES] == ["awake"] * 3
                for p in proxies.values()
            ),
            attempts=500,
            what="every node to see all three awake through etcd",
        )
        for fake in fakes.values():
            del fake.calls[:]
        return proxies, fakes

    async def start(self, node: str, fake: FakeVLLM) -> NvProxy:
        config = proxy_config(
            os.path.join(self.root, node + "-state"),
            {"vllm": fake.url},
            admin=True,
            poll_interval=0.2,
        )
        engines = dict(config.engines)
        engines["vllm"] = evolve(
            engines["vllm"],
            port=self.ports[node],
            services=(VllmServiceConfig("m", fake.url, MODEL),),
            hold=VllmHold(sleeping=5.0, offloaded=5.0, restarting=5.0),
        )
        config = evolve(
            config,
            node_id=node,
            cluster_dir=os.path.join(self.root, node),
            engines=engines,
            discovery_provider="etcd",
            etcd=EtcdConfig(endpoints=(self.etcd.url,), prefix="/t/", lease_ttl=TTL),
            advertise_address="127.0.0.1",
        )
        proxy = await start_proxy(reactor, config)
        self.addCleanup(proxy.stopService)
        return proxy

    def readiness(self, at: NvProxy, node: str) -> str | None:
        entry = at.discovery.current.node("vllm", node)
        return None if entry is None else entry.readiness_of(MODEL).readiness

    async def chat(self, proxy: NvProxy) -> tuple[int, Any, bytes]:
        return await self.post(facade_url(proxy, "vllm") + "/v1/chat/completions", CHAT)

    def test_routes_by_etcd_records_without_polling(self) -> Deferred[None]:
        async def run() -> None:
            proxies, fakes = await self.fleet()
            a, b = proxies["node-a"], proxies["node-b"]
            # no peer is polled: discovery asks only this node's engine
            self.assertEqual(
                {e.kind for e in a.polling._endpoints}, {"local"}, "no peer polled"
            )
            self.assertIsNone(a.peer_records)
            assert a.vllm is not None and b.vllm is not None
            await a.vllm.sleep("m", 1)
            await eventually(
                reactor,
                lambda: self.readiness(b, "node-a") == "sleeping",
                attempts=300,
                what="b to see a asleep through etcd",
            )
            code, _, body = await self.chat(a)
            self.assertEqual(code, 200, body)
            self.assertEqual(fakes["node-a"].wake_calls, 0)
            self.assertEqual(served(fakes["node-b"]) + served(fakes["node-c"]), 1)
            status = a.ops.status()["discovery"]
            self.assertEqual(status["provider"], "etcd")
            self.assertEqual(status["state"], "live")
            self.assertEqual(status["records"], 3)

        return ensureDeferred(run())

    def test_dead_node_leaves_within_the_ttl(self) -> Deferred[None]:
        async def run() -> None:
            proxies, _ = await self.fleet()
            a, c = proxies["node-a"], proxies["node-c"]
            # c dies: its session stops without revoking its lease (as a
            # SIGKILL would), then the rest of it
            assert c.etcd is not None
            c.etcd.session._machine.stop()
            started = reactor.seconds()
            await eventually(
                reactor,
                lambda: a.discovery.current.node("vllm", "node-c") is None,
                attempts=int((TTL + 3) / 0.02),
                interval=0.02,
                what="c to leave a's snapshot",
            )
            self.assertLess(reactor.seconds() - started, TTL + 2)

        return ensureDeferred(run())

    def test_etcd_restart_keeps_serving_then_resyncs(self) -> Deferred[None]:
        async def run() -> None:
            proxies, fakes = await self.fleet()
            a, b = proxies["node-a"], proxies["node-b"]
            assert a.vllm is not None and a.etcd is not None
            await a.vllm.sleep("m", 1)
            await eventually(
                reactor, lambda: self.readiness(b, "node-a") == "sleeping", attempts=300
            )
            await self.etcd.stop()
            await eventually(
                reactor, lambda: a.etcd.session.state == "lost", attempts=300
            )
            # serving from the last snapshot: b and c still reached from a
            code, _, body = await self.chat(a)
            self.assertEqual(code, 200, body)
            self.assertEqual(fakes["node-a"].wake_calls, 0)
            # a change while etcd is down reaches the others after it returns
            await a.vllm.wake("m")
            await self.etcd.start()
            await eventually(
                reactor,
                lambda: (
                    a.etcd is not None
                    and a.etcd.session.state == "live"
                    and self.readiness(b, "node-a") == "awake"
                ),
                attempts=600,
                what="resync after etcd's restart",
            )

        return ensureDeferred(run())

    def test_compaction_past_the_revision(self) -> Deferred[None]:
        async def run() -> None:
            proxies, _ = await self.fleet()
            a, b = proxies["node-a"], proxies["node-b"]
            assert a.etcd is not None and b.vllm is not None
            session = a.etcd.session
            ranges_before = session._core.revision
            # a's watch breaks; meanwhile b changes and etcd compacts past
            # the revision a saw
            await self.etcd.stop()
            await eventually(reactor, lambda: session.state == "lost", attempts=300)
            await self.etcd.start()
            await b.vllm.sleep("m", 2)
            from nvproxy.etcd import EtcdClient

            client = EtcdClient(a.upstream.treq, reactor, [self.etcd.url])
            latest = await client.range_prefix(b"/t/")
            await client._call("/v3/kv/compaction", {"revision": str(latest.revision)})
            await eventually(
                reactor,
                lambda: (
                    session.state == "live"
                    and self.readiness(a, "node-b") == "offloaded"
                ),
                attempts=600,
                what="a to read afresh and see b offloaded",
            )
            self.assertGreater(session._core.revision, ranges_before)
            self.assertEqual(len(a.discovery.current.nodes("vllm")), 3)
            await deferLater(reactor, 0, lambda: None)

        return ensureDeferred(run())

    def test_sigkill(self) -> Deferred[None]:
        """A real nvproxy process killed with SIGKILL leaves with its lease."""

        async def run() -> None:
            proxies, fakes = await self.fleet()
            a = proxies["node-a"]
            # a fourth node, as a twistd process of its own
            d = "node-d"
            dirs = {n: ClusterDir(os.path.join(self.root, n)) for n in NODES}
            ddir = ClusterDir(os.path.join(self.root, d))
            fingerprint = ddir.init(d, reactor).fingerprint
            for node in NODES:
                dirs[node].add_peer(Peer(d, "192.0.2.1", fingerprint))
                ddir.add_peer(Peer(node, "192.0.2.1", dirs[node].fingerprint()))
            fake = FakeVLLM(reactor, model=MODEL)
            fake.listen(reactor)
            self.addCleanup(fake.stop)
            port, admin = free_port(), free_port()
            config = os.path.join(self.root, "d.toml")
            with open(config, "w") as f:
                f.write(
                    f"""
node_id = "{d}"
state_dir = "{os.path.join(self.root, d + "-state")}"
[admin]
listen = "127.0.0.1:{admin}"
[cluster]
dir = "{os.path.join(self.root, d)}"
[discovery]
provider = "etcd"
endpoints = ["{self.etcd.url}"]
prefix = "/t/"
lease_ttl = "{TTL:g}s"
advertise_address = "127.0.0.1"
[engines.ollama]
enabled = false
[engines.lmstudio]
enabled = false
[engines.llamacpp]
enabled = false
[engines.vllm]
port = {port}
[[engines.vllm.services]]
name = "m"
url = "{fake.url}"
model = "{MODEL}"
"""
                )
            protocol = _Twistd()
            process = reactor.spawnProcess(
                protocol,
                sys.executable,
                _twistd_argv("--config", config),
                env=dict(os.environ),
            )
            self.addCleanup(lambda: protocol.ended)
            self.addCleanup(_kill, process)
            try:
                await eventually(
                    reactor,
                    lambda: a.discovery.current.node("vllm", d) is not None,
                    attempts=1000,
                    what=f"a to see {d} through etcd",
                )
            except AssertionError:
                print(protocol.output.decode())
                raise
            process.signalProcess("KILL")
            started = reactor.seconds()
            await eventually(
                reactor,
                lambda: a.discovery.current.node("vllm", d) is None,
                attempts=int((TTL + 3) / 0.02),
                interval=0.02,
                what=f"{d} to leave a's snapshot",
            )
            self.assertLess(reactor.seconds() - started, TTL + 2)
            await protocol.ended

        return ensureDeferred(run())


def _kill(process: Any) -> None:
    try:
        process.signalProcess("KILL")
    except Exception:
        pass
