# -*- test-case-name: tests.test_brokerdiscovery -*-
"""
Discovery fed and watched over the broker link (spec §4).

* C{ENGINE:discovery:nodes} (in): a full inventory snapshot for one engine,
  C{{"nodes": [{"nodeId", "url" | "peer", "models": [...]}, ...]}}.  It
  replaces polled discovery for that engine until the link closes: a node
  given by C{url} is reached directly at its engine (this node's own id
  makes it local), one given by C{peer} through that pinned peer's facade.
* C{ENGINE:discovery:subscribe} (in): from then on nvproxy sends
  C{ENGINE:discovery:nodes} notifications (out) with its own view of that
  engine, at once and whenever it changes.
* C{discovery:node-activity} (out, process-scoped): per-node in-flight
  counts (live reservations), whenever they change, at most once per
  reactor turn, once the broker subscribed to any engine's discovery.

L{BrokerDiscovery} sits between the polling provider, which publishes into
C{polled}, and the L{Discovery} the request path reads: it republishes the
polled snapshot with every broker-fed engine replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from nvproxy.discovery import Discovery, Endpoint, NodeEntry, NodeKind, Snapshot
from nvproxy.engines import ENGINES

__all__ = ["BrokerDiscovery", "SnapshotError"]

log = Logger()


class SnapshotError(ValueError):
    """A C{discovery:nodes} snapshot that cannot be used (the message says why)."""


class BrokerDiscovery:
    """
    @param polled: where polled discovery publishes.
    @param discovery: what the request path reads.
    @param peer_url: the facade URL of a pinned peer for an engine, or
        C{None} when no such peer is pinned.
    @param notify: sends a notification on the broker link.
    """

    def __init__(
        self,
        polled: Discovery,
        discovery: Discovery,
        node_id: str,
        peer_url: Callable[[str, str], str | None],
        clock: IReactorTime,
    ) -> None:
        self._polled = polled
        self._discovery = discovery
        self._node_id = node_id
        self._peer_url = peer_url
        self._clock = clock
        self._fed: dict[str, dict[str, NodeEntry]] = {}
        self._subscribed: dict[str, object] = {}
        self._notify: Callable[[str, Mapping[str, Any]], None] | None = None
        self._activity: Callable[[], Mapping[str, int]] | None = None
        self._last_activity: Mapping[str, int] | None = None
        self._pending: IDelayedCall | None = None
        polled.subscribe(lambda _snapshot: self._merge())
        discovery.subscribe(self._changed)

    def attach(
        self,
        notify: Callable[[str, Mapping[str, Any]], None],
        activity: Callable[[], Mapping[str, int]],
    ) -> None:
        """Send notifications with C{notify}; report C{activity()} on change."""
        self._notify = notify
        self._activity = activity

    def detach(self) -> None:
        """The link closed: polled discovery again, nothing more sent."""
        self._notify = None
        self._subscribed.clear()
        if self._pending is not None and self._pending.active():
            self._pending.cancel()
        self._pending = None
        if self._fed:
            self._fed.clear()
            self._merge()

    # -- in ---------------------------------------------------------------

    def feed(self, engine: str, params: Mapping[str, Any]) -> Mapping[str, Any]:
        """
        C{ENGINE:discovery:nodes}: the broker's inventory of C{engine}.

        @raise SnapshotError: it is malformed; nothing changes.
        """
        nodes = params.get("nodes")
        if not isinstance(nodes, list):
            raise SnapshotError("nodes must be a list")
        table = ENGINES[engine]
        entries: dict[str, NodeEntry] = {}
        for index, node in enumerate(nodes):
            where = f"nodes[{index}]"
            if not isinstance(node, dict):
                raise SnapshotError(f"{where} must be an object")
            node_id = node.get("nodeId")
            if not isinstance(node_id, str) or not node_id:
                raise SnapshotError(f"{where}.nodeId must be a non-empty string")
            if node_id in entries:
                raise SnapshotError(f"{where}.nodeId {node_id!r} is repeated")
            models = node.get("models", [])
            if not isinstance(models, list) or not all(
                isinstance(m, str) for m in models
            ):
                raise SnapshotError(f"{where}.models must be a list of strings")
            url, peer = node.get("url"), node.get("peer")
            kind: NodeKind
            if isinstance(url, str) and url.startswith(("http://", "https://")):
                kind = "local" if node_id == self._node_id else "direct"
                base = url
            elif isinstance(peer, str):
                found = self._peer_url(engine, peer)
                if found is None:
                    raise SnapshotError(f"{where}.peer {peer!r} is not a pinned peer")
                kind, base = "peer", found
            else:
                raise SnapshotError(f"{where} needs a url (http or https) or a peer")
            endpoint = Endpoint(node_id, engine, kind, base)
            entries[node_id] = NodeEntry(
                node_id,
                kind,
                {table.normalize_model(m): endpoint for m in models},
                (endpoint,),
            )
        self._fed[engine] = entries
        log.info(
            "{engine}: discovery fed by the broker: {count} node(s)",
            engine=engine,
            count=len(entries),
        )
        self._merge()
        return {"engine": engine, "nodes": len(entries)}

    def subscribe(self, engine: str) -> Mapping[str, Any]:
        """C{ENGINE:discovery:subscribe}: send this engine's view from now on."""
        self._subscribed[engine] = None
        self._send_view(engine, self._discovery.current)
        return {"engine": engine, "subscribed": True}

    # -- out --------------------------------------------------------------

    def _merge(self) -> None:
        engines = dict(self._polled.current.engines)
        engines.update(self._fed)
        self._discovery.publish(engines)

    def _changed(self, snapshot: Snapshot) -> None:
        for engine in list(self._subscribed):
            self._send_view(engine, snapshot)

    def _send_view(self, engine: str, snapshot: Snapshot) -> None:
        view = view_of(snapshot, engine)
        # The generation moves with every engine's change: compare the nodes.
        if self._subscribed.get(engine) == view["nodes"] or self._notify is None:
            return
        self._subscribed[engine] = view["nodes"]
        self._notify(f"{engine}:discovery:nodes", view)

    def activity_changed(self) -> None:
        """In-flight counts may have changed: report them this turn."""
        if self._notify is None or self._pending is not None or not self._subscribed:
            return
        self._pending = self._clock.callLater(0, self._send_activity)

    def _send_activity(self) -> None:
        self._pending = None
        if self._notify is None or self._activity is None:
            return
        counts = dict(self._activity())
        if counts == self._last_activity:
            return
        self._last_activity = counts
        self._notify("discovery:node-activity", {"nodes": counts})


def view_of(snapshot: Snapshot, engine: str) -> dict[str, Any]:
    """The C{ENGINE:discovery:nodes} params for C{engine} in C{snapshot}."""
    nodes = []
    for entry in snapshot.nodes(engine):
        urls = sorted({e.base_url for e in entry.endpoints})
        node: dict[str, Any] = {
            "nodeId": entry.node_id,
            "kind": entry.kind,
            "models": sorted(entry.models),
        }
        if entry.kind == "peer":
            node["peer"] = entry.node_id
        node["url"] = urls[0] if urls else None
        nodes.append(node)
    return {"generation": snapshot.generation, "nodes": nodes}
