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

from attrs import frozen
from twisted.logger import Logger

from nvproxy.cluster import ClusterError, ClusterState, Peer
from nvproxy.discovery import Endpoint, NodeEntry
from nvproxy.noderecord import BadRecord, NodeRecord, decode
from nvproxy.readiness import AWAKE

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


@frozen
class _Made:
    """What one node's document made: its record, the peer to dial and
    its discovery entries (engine, entry)."""

    document: Mapping[str, Any]
    record: NodeRecord
    peer: Peer
    entries: tuple[tuple[str, NodeEntry], ...]


def _entries_of(
    node: str, record: NodeRecord, peer: Peer, enabled: frozenset[str]
) -> tuple[tuple[str, NodeEntry], ...]:
    """
    A peer's discovery entry for each enabled engine its record advertises
    models for, with the readiness and draining the record gives (what
    L{nvproxy.noderecord.Fleet.annotate} would add).
    """
    host = f"[{peer.address}]" if ":" in peer.address else peer.address
    entries = []
    for engine_id, engine in record.engines.items():
        if engine_id not in enabled or not engine.models:
            continue
        endpoint = Endpoint(node, engine_id, "peer", f"https://{host}:{engine.port}")
        entries.append(
            (
                engine_id,
                NodeEntry(
                    node,
                    "peer",
                    {model: endpoint for model in engine.models},
                    (endpoint,),
                    readiness={m: r for m, r in engine.models.items() if r != AWAKE},
                    draining=record.draining,
                ),
            )
        )
    return tuple(entries)


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
        # node -> (its document, record, peer and entries) as the last apply
        # made them from the same objects (see apply)
        self._made: dict[str, _Made] = {}
        self._made_with: tuple[ClusterState | None, frozenset[str]] | None = None

    def apply(self, documents: Mapping[str, Mapping[str, Any]]) -> Entries:
        """
        Take every node's record as etcd has it; the discovery entries.

        Each change of one node's record hands on every node's: a document
        that is the same object as the last apply's (the provider keeps
        the decoded JSON of a record whose bytes did not change), with the
        same pins and engines, keeps what was made from it, so a change
        costs what the changed records do, not the whole fleet (20 ms with
        a thousand nodes).  The peers stay the same mapping while none of
        them changes, so what depends on them is not made again either.
        """
        state = self._pinned()
        made_with = (state, frozenset(self._engines()))
        known = self._made if made_with == self._made_with else {}
        made: dict[str, _Made] = {}
        for node, document in sorted(documents.items()):
            if node == self._node_id:
                continue
            seen = known.get(node)
            if seen is not None and seen.document is document:
                made[node] = seen
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
            made[node] = _Made(
                document, record, peer, _entries_of(node, record, peer, made_with[1])
            )
        for node in [n for n in self._states if n not in documents]:
            if self._states.pop(node) == "ok":
                log.info("etcd: node {node} left", node=node)
        self._made, self._made_with = made, made_with
        self.records = {node: each.record for node, each in made.items()}
        peers = {node: each.peer for node, each in made.items()}
        if peers != self.peers:
            self.peers = peers
        entries: Entries = {}
        for node, each in made.items():
            for engine_id, entry in each.entries:
                entries.setdefault(engine_id, {})[node] = entry
        self.entries = entries
        return entries

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
