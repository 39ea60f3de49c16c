# -*- test-case-name: tests.test_etcd -*-
"""
From etcd-fed node records to what the rest of nvproxy reads: the peers'
records (readiness and draining, for L{nvproxy.noderecord.Fleet}), the peers
to dial (address, ports, the fingerprint to pin) and one discovery entry
per (peer, engine) with the models its record advertises — no peer is
polled.

Trust stays local by default: a record is used only if the cluster dir pins
a peer of that node id with the fingerprint the record carries.  With
C{trust = "etcd"} the record's own fingerprint is pinned instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from twisted.logger import Logger

from nvproxy.cluster import ClusterError, ClusterState, Peer
from nvproxy.discovery import Endpoint, NodeEntry
from nvproxy.noderecord import BadRecord, NodeRecord, decode

log = Logger()

Entries = dict[str, dict[str, NodeEntry]]


def etcd_document(
    record: Mapping[str, Any], address: str | None, fingerprint: str | None
) -> dict[str, Any]:
    """This node's record as put in etcd: the node record plus where peers
    dial it and the certificate they should find there."""
    document = dict(record)
    if address is not None:
        document["address"] = address
    if fingerprint is not None:
        document["fingerprint"] = fingerprint
    return document


class EtcdPeers:
    """
    @param pinned: the cluster dir's state now (its pinned peers).
    @param engines: the engines this node runs facades for.
    @ivar records: peer id -> its record (what L{nvproxy.noderecord.Fleet}
        reads).
    @ivar peers: peer id -> the peer to dial, as etcd and the pins say.
    """

    def __init__(
        self,
        node_id: str,
        trust: str,
        pinned: Callable[[], ClusterState | None],
        engines: Callable[[], Iterable[str]],
    ) -> None:
        self._node_id = node_id
        self._trust = trust
        self._pinned = pinned
        self._engines = engines
        self.records: dict[str, NodeRecord] = {}
        self.peers: dict[str, Peer] = {}
        self.entries: Entries = {}
        self._states: dict[str, str] = {}
        self._merged: tuple[ClusterState, dict[str, Peer], ClusterState] | None = None

    def apply(self, documents: Mapping[str, Mapping[str, Any]]) -> Entries:
        """Take every node's record as etcd has it; the discovery entries."""
        records: dict[str, NodeRecord] = {}
        peers: dict[str, Peer] = {}
        state = self._pinned()
        for node, document in sorted(documents.items()):
            if node == self._node_id:
                continue
            try:
                record = decode(document)
                if record.node != node:
                    raise BadRecord(f"it names node {record.node!r}")
                peer = self._peer(node, document, record, state)
            except (BadRecord, ClusterError) as e:
                self._tell(
                    node, "ignored", "etcd: record of {node} ignored: {why}", why=str(e)
                )
                continue
            if peer is None:
                continue
            self._tell(
                node,
                "ok",
                "etcd: node {node} joined at {address}",
                address=peer.address,
            )
            records[node] = record
            peers[node] = peer
        for node in [n for n in self._states if n not in documents]:
            if self._states.pop(node) == "ok":
                log.info("etcd: node {node} left", node=node)
        self.records, self.peers = records, peers
        self.entries = self._entries()
        return self.entries

    def _peer(
        self,
        node: str,
        document: Mapping[str, Any],
        record: NodeRecord,
        state: ClusterState | None,
    ) -> Peer | None:
        address = document.get("address")
        fingerprint = document.get("fingerprint")
        if not isinstance(address, str) or not address:
            raise BadRecord("no address (the node's discovery.advertise_address)")
        if state is None or not state.member:
            self._tell(
                node,
                "no-identity",
                "etcd: node {node} seen, but this node has no cluster identity"
                " to dial it with",
            )
            return None
        ports = {e: r.port for e, r in record.engines.items() if r.port}
        if self._trust == "etcd":
            if not isinstance(fingerprint, str):
                raise BadRecord('no fingerprint, and trust = "etcd" needs one')
            return Peer(node, address, fingerprint, ports)
        pin = state.peer(node)
        if pin is None:
            self._tell(
                node,
                "unpinned",
                "etcd: node {node} seen, but not pinned in the cluster dir; not dialed",
            )
            return None
        if isinstance(fingerprint, str) and fingerprint != str(pin.fingerprint):
            self._tell(
                node,
                "mismatch",
                "etcd: node {node}'s record carries another fingerprint than"
                " its pin; not dialed",
            )
            return None
        return Peer(node, address, pin.fingerprint, ports)

    def _entries(self) -> Entries:
        enabled = set(self._engines())
        entries: Entries = {}
        for node, record in self.records.items():
            peer = self.peers[node]
            host = f"[{peer.address}]" if ":" in peer.address else peer.address
            for engine_id, engine in record.engines.items():
                if engine_id not in enabled or not engine.models:
                    continue
                endpoint = Endpoint(
                    node, engine_id, "peer", f"https://{host}:{engine.port}"
                )
                entries.setdefault(engine_id, {})[node] = NodeEntry(
                    node,
                    "peer",
                    {model: endpoint for model in engine.models},
                    (endpoint,),
                )
        return entries

    def cluster_state(self, state: ClusterState) -> ClusterState:
        """
        C{state} with the peers etcd names: their address and ports from
        their records (and, with C{trust = "etcd"}, their fingerprints
        pinned); pinned peers etcd does not name stay as the dir says.
        """
        if not self.peers:
            return state
        # Asked on every request to or from a peer (which peer, which
        # pins): made again only when the dir's state or etcd's peers are
        # new objects, not for each of those requests (300 us with a
        # thousand peers).
        merged = self._merged
        if merged is not None and merged[0] is state and merged[1] is self.peers:
            return merged[2]
        kept = tuple(p for p in state.peers if p.id not in self.peers)
        made = ClusterState(state.identity, kept + tuple(self.peers.values()))
        self._merged = (state, self.peers, made)
        return made

    def _tell(self, node: str, state: str, message: str, **fields: Any) -> None:
        """Log once per node per state change."""
        if self._states.get(node) == state:
            return
        self._states[node] = state
        if state == "ok":
            log.info(message, node=node, **fields)
        else:
            log.warn(message, node=node, **fields)
