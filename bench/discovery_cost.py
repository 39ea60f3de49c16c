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
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from nvproxy.discovery import Discovery, Endpoint, InventoryClient, PollingDiscovery
from nvproxy.etcd import Session, SessionSettings
from nvproxy.noderecord import PeerRecords
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
        "fleet_requests_per_change": sum(store.calls.values()) - calls,
        "events_per_node_per_change": (sum(store.delivered.values()) - delivered)
        / nodes,
        "cpu_ms_per_change_fleet_wide": cpu * 1000,
        "keepalives_per_node_per_interval": INTERVAL / (TTL / 3),
        "seen_after_s": 0.0,
    }


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
    )
    for row in rows:
        m, e = row["mesh"], row["etcd"]
        print(
            f"{row['nodes']:>6}  {m['requests_per_node_per_interval']:>22.0f}"
            f"  {m['fleet_requests_per_interval']:>23.0f}"
            f"  {e['fleet_requests_per_change']:>15.0f}"
            f"  {e['events_per_node_per_change']:>23.2f}"
        )


if __name__ == "__main__":
    main()
