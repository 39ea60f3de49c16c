"""
A three-node cluster of nvproxy instances on 127.0.0.1 with distinct ports,
pinned mutual TLS between them, each with its own fake engine (spec §7,
DESIGN §3).
"""

from __future__ import annotations

import json
import os

from attrs import evolve
from twisted.internet import reactor
from twisted.web.client import Agent, HTTPConnectionPool

from nvproxy.cluster import ClusterDir, Peer, PeerPolicyForHTTPS
from nvproxy.proxy.upstream import BytesProducer
from nvproxy.service import NvProxy
from nvproxy.testing.fakeengine import FakeEngine
from nvproxy.testing.harness import (
    facade_url,
    free_port,
    pinned_cluster,
    proxy_config,
    start_proxy,
)
from tests.test_accounting import _inference
from tests.test_forwarding import ProxyTestCase

NODES = ("node-a", "node-b", "node-c")


async def start_node(
    case: ProxyTestCase, root: str, node: str, port: int
) -> tuple[FakeEngine, NvProxy]:
    """
    Node C{node}: a fake Ollama engine serving C{node:latest}, and nvproxy
    with its Ollama facade on C{port} and the cluster dir C{root/node}.
    """
    fake = await case.engine("ollama", [f"{node}:latest"])
    config = proxy_config(os.path.join(root, node + "-state"), {"ollama": fake.url})
    engines = dict(config.engines)
    engines["ollama"] = evolve(engines["ollama"], port=port)
    config = evolve(
        config, node_id=node, cluster_dir=os.path.join(root, node), engines=engines
    )
    proxy = await start_proxy(reactor, config)
    case.addCleanup(proxy.stopService)
    return fake, proxy


class ClusterTests(ProxyTestCase):
    async def cluster(self) -> tuple[dict[str, NvProxy], dict[str, FakeEngine]]:
        """
        Three nodes; node X's engine serves model C{X:latest} only.
        """
        root = os.path.abspath(self.mktemp())
        dirs, ports = pinned_cluster(root, NODES, reactor, engine="ollama")
        self.dirs = dirs
        fakes = {}
        proxies = {}
        for node in NODES:
            fakes[node], proxies[node] = await start_node(self, root, node, ports[node])
        # Every node polls its peers once the others are listening.
        for proxy in proxies.values():
            await proxy.polling.poll()
        return proxies, fakes

    async def test_routes_to_the_only_owner_over_mtls(self) -> None:
        """
        Node A routes a model only node C advertises to C over pinned mTLS;
        C serves it from its own engine.
        """
        proxies, fakes = await self.cluster()
        a = proxies["node-a"]
        owners = a.discovery.current.owners("ollama", "node-c:latest")
        self.assertEqual([(e.node_id, e.kind) for e in owners], [("node-c", "peer")])
        code, _, body = await self.post(
            facade_url(a, "ollama") + "/api/generate",
            {"model": "node-c", "stream": False},
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(len(_inference(fakes["node-c"])), 1)
        self.assertEqual(_inference(fakes["node-a"]), [])
        self.assertEqual(_inference(fakes["node-b"]), [])
        # The peer's engine saw the request through C, not from A directly.
        served = [r for r in fakes["node-c"].requests if r.path == "/api/generate"]
        self.assertEqual(json.loads(served[0].body)["model"], "node-c")

    async def test_inventory_spans_the_cluster(self) -> None:
        proxies, _ = await self.cluster()
        code, _, body = await self.client.request(
            "GET", facade_url(proxies["node-b"], "ollama") + "/api/tags"
        )
        self.assertEqual(code, 200)
        names = sorted(m["name"] for m in json.loads(body)["models"])
        self.assertEqual(names, ["node-a:latest", "node-b:latest", "node-c:latest"])

    async def test_peer_never_reroutes(self) -> None:
        """
        A request arriving from a pinned peer is served by the local engine
        (here: its 404 for a model it lacks), never forwarded onward.
        """
        proxies, fakes = await self.cluster()
        state_a = proxies["node-a"].cluster.current  # type: ignore[union-attr]
        pool = HTTPConnectionPool(reactor, persistent=False)
        agent = Agent(
            reactor, contextFactory=PeerPolicyForHTTPS(lambda: state_a), pool=pool
        )
        port = proxies["node-c"].listeners["ollama"].bound_port()
        import treq
        from twisted.web.http_headers import Headers

        response = await agent.request(
            b"POST",
            b"https://127.0.0.1:%d/api/generate" % port,
            Headers({b"content-type": [b"application/json"]}),
            BytesProducer(b'{"model": "node-b", "stream": false}'),
        )
        body = await treq.content(response)
        self.assertEqual(response.code, 404, body)
        self.assertEqual(len(_inference(fakes["node-c"])), 1)
        self.assertEqual(_inference(fakes["node-b"]), [])

    async def test_unpinned_peer_stops_advertising(self) -> None:
        """
        Removing a peer from a node's cluster dir takes effect without a
        restart: its models leave that node's inventory.
        """
        proxies, _ = await self.cluster()
        a = proxies["node-a"]
        self.dirs["node-a"].remove_peer("node-c")
        assert a.cluster is not None
        a.cluster.reload()
        await a.polling.poll()
        self.assertEqual(a.discovery.current.owners("ollama", "node-c:latest"), ())
        code, _, _ = await self.post(
            facade_url(a, "ollama") + "/api/generate", {"model": "node-c"}
        )
        self.assertEqual(code, 502)


class JoinTests(ProxyTestCase):
    async def test_join_without_restart(self) -> None:
        """
        A node started with an empty cluster dir joins once its identity and
        peers appear: no restart for either side (§7).
        """
        root = os.path.abspath(self.mktemp())
        dirs = {n: ClusterDir(os.path.join(root, n)) for n in ("node-a", "node-b")}
        os.makedirs(dirs["node-a"].path)
        fingerprint_b = dirs["node-b"].init("node-b", reactor).fingerprint
        ports = {n: free_port() for n in dirs}
        proxies = {}
        fakes = {}
        for node in dirs:
            fakes[node], proxies[node] = await start_node(self, root, node, ports[node])
        fingerprint_a = dirs["node-a"].init("node-a", reactor).fingerprint
        dirs["node-a"].add_peer(
            Peer("node-b", "127.0.0.1", fingerprint_b, {"ollama": ports["node-b"]})
        )
        dirs["node-b"].add_peer(
            Peer("node-a", "127.0.0.1", fingerprint_a, {"ollama": ports["node-a"]})
        )
        for proxy in proxies.values():
            assert proxy.cluster is not None
            proxy.cluster.reload()
        for proxy in proxies.values():
            await proxy.polling.poll()
        code, _, body = await self.post(
            facade_url(proxies["node-b"], "ollama") + "/api/generate",
            {"model": "node-a", "stream": False},
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(len(_inference(fakes["node-a"])), 1)
