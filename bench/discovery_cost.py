"""
What one readiness change costs with each discovery provider, measured on
fakes (no processes, a Clock), for fleets of several sizes.

    python -m bench.discovery_cost [--nodes 10,100,1000]

* mesh: one node's real L{PollingDiscovery} and L{PeerRecords} polling
  N-1 peers (one engine each) through a counting in-memory client, over
  one poll interval: every node pays this every interval whether anything
  changed or not, and a change is seen at the next poll (half an interval
  on average, a whole one at worst).
* etcd: N real L{Session}s on a L{FakeEtcd}; one node's record changes:
  the requests it costs (a put) and the watch events each node receives.
  Keep-alives cost every node one request per TTL/3 whatever changes.
  And the CPU one node spends applying such a change (L{applied}): every
  node receives it and takes it into its peers and discovery snapshot.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from nvproxy.discovery import Discovery, Endpoint, InventoryClient, PollingDiscovery
from nvproxy.etcd import EtcdPeers, Session, SessionSettings
from nvproxy.noderecord import Fleet, LocalRecord, PeerRecords
from nvproxy.readiness import AWAKE
from nvproxy.testing.fakeetcd import FakeEtcd

INTERVAL = 2.0
TTL = 10.0


class _Counting(InventoryClient):
    def __init__(self) -> None:
        self.calls = 0

    def get_json(self, url: str, timeout: float) -> Deferred[Any]:
        self.calls += 1
        if url.endswith("/_nvproxy/node"):
            node = url.split("//")[1].split(".")[0]
            return succeed(
                {
                    "version": 1,
                    "node": node,
                    "generation": 1,
                    "engines": {"ollama": {"port": 11435, "models": {}}},
                }
            )
        return succeed({"models": [{"name": "m:latest"}]})


def mesh(nodes: int) -> dict[str, float]:
    clock = Clock()
    client = _Counting()
    peers = {f"n{i}": f"https://n{i}.example:11435" for i in range(1, nodes)}
    endpoints = [Endpoint(peer, "ollama", "peer", url) for peer, url in peers.items()]
    polling = PollingDiscovery(Discovery(), client, clock, endpoints, INTERVAL)
    records = PeerRecords(client, clock, INTERVAL, changed=lambda: None)
    records.set_peers(peers)
    started = time.process_time()
    polling.poll()
    records.poll()
    cpu = time.process_time() - started
    return {
        "requests_per_node_per_interval": client.calls,
        "fleet_requests_per_interval": client.calls * nodes,
        "cpu_ms_per_node_per_interval": cpu * 1000,
        "seen_after_s_mean": INTERVAL / 2,
        "seen_after_s_max": INTERVAL,
    }


def etcd(nodes: int) -> dict[str, float]:
    clock = Clock()
    store = FakeEtcd(clock)
    values = {f"n{i}": b'{"generation":1}' for i in range(nodes)}
    sessions = {
        name: Session(
            store.client(name),
            clock,
            SessionSettings(lease_ttl=TTL),
            name,
            lambda name=name: values[name],  # type: ignore[misc]
            lambda records: None,
        )
        for name in values
    }
    for session in sessions.values():
        session.start()
    calls = sum(store.calls.values())
    delivered = sum(store.delivered.values())
    started = time.process_time()
    values["n0"] = b'{"generation":2}'
    sessions["n0"].record_changed()
    cpu = time.process_time() - started
    return {
        "cpu_ms_per_node_per_change_applied": applied(nodes),
        "fleet_requests_per_change": sum(store.calls.values()) - calls,
        "events_per_node_per_change": (sum(store.delivered.values()) - delivered)
        / nodes,
        "cpu_ms_per_change_fleet_wide": cpu * 1000,
        "keepalives_per_node_per_interval": INTERVAL / (TTL / 3),
        "seen_after_s": 0.0,
    }


class _Member:
    """The cluster state as C{trust = "etcd"} reads it: this node has an
    identity (a real one needs a cluster dir and its certificate)."""

    member = True

    def peer(self, node: str) -> None:
        return None


def _document(i: int, generation: int, readiness: str) -> dict[str, Any]:
    """Node C{n<i>}'s record as etcd holds it: one vLLM model."""
    return {
        "version": 1,
        "node": f"n{i}",
        "generation": generation,
        "address": f"10.0.{i // 250}.{i % 250 + 1}",
        "fingerprint": "sha256:" + hashlib.sha256(b"%d" % i).hexdigest(),
        "engines": {
            "vllm": {
                "port": 8000,
                "in_flight": 0,
                "models": {"m": {"readiness": readiness, "wake_estimate_s": 5.0}},
            }
        },
    }


def applied(nodes: int, changes: int = 5) -> float:
    """
    The CPU (ms, median of C{changes}) one node spends taking a change of
    one other node's record: the real L{EtcdPeers} (trust etcd), readiness
    annotation and discovery, handed every record as the provider hands
    them on (the same objects for the records that did not change).
    """
    member = _Member()
    peers = EtcdPeers("n0", "etcd", lambda: member, lambda: ["vllm"])  # type: ignore[arg-type,return-value]
    discovery = Discovery()
    local = LocalRecord(
        "n0",
        discovery,
        ports=lambda: {},
        readiness=lambda engine, model: AWAKE,
        in_flight=lambda engine: 0,
        draining=lambda: False,
    )
    annotate = Fleet(local, peers).annotate
    polling = PollingDiscovery(
        discovery, _Counting(), Clock(), [], INTERVAL, annotate=annotate
    )
    documents = {f"n{i}": _document(i, 1, "awake") for i in range(1, nodes)}
    polling.set_fed(peers.apply(documents))
    times = []
    for change in range(changes):
        i = 1 + change % (nodes - 1)
        documents = dict(documents)
        documents[f"n{i}"] = _document(i, 2 + change, ("sleeping", "awake")[change % 2])
        started = time.process_time()
        polling.set_fed(peers.apply(documents))
        times.append(time.process_time() - started)
    return sorted(times)[len(times) // 2] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", default="10,100,1000")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for n in (int(x) for x in args.nodes.split(",")):
        rows.append({"nodes": n, "mesh": mesh(n), "etcd": etcd(n)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"{'nodes':>6}  {'mesh req/node/interval':>22}  {'mesh fleet req/interval':>23}"
        f"  {'etcd req/change':>15}  {'etcd events/node/change':>23}"
        f"  {'etcd ms/node/change':>19}"
    )
    for row in rows:
        m, e = row["mesh"], row["etcd"]
        print(
            f"{row['nodes']:>6}  {m['requests_per_node_per_interval']:>22.0f}"
            f"  {m['fleet_requests_per_interval']:>23.0f}"
            f"  {e['fleet_requests_per_change']:>15.0f}"
            f"  {e['events_per_node_per_change']:>23.2f}"
            f"  {e['cpu_ms_per_node_per_change_applied']:>19.2f}"
        )


if __name__ == "__main__":
    main()
