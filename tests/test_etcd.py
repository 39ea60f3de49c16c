"""
The etcd session on a fake etcd and a Clock: registration under a lease,
watch-fed records, outages, compaction, and the cost of a change at 1,000
nodes.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.etcd import (
    Compacted,
    EtcdDiscovery,
    EtcdRefused,
    WatchEvent,
    encode_record,
    prefix_end,
)
from nvproxy.etcd._client import LineSplitter, parse_watch_message
from nvproxy.etcd._session import Session, SessionSettings
from nvproxy.readiness import ModelReadiness
from nvproxy.testing.fakeetcd import FakeEtcd

SETTINGS = SessionSettings(prefix="/nvproxy/", lease_ttl=9.0)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class WireTests(SynchronousTestCase):
    def test_prefix_end(self) -> None:
        self.assertEqual(prefix_end(b"/nvproxy/nodes/"), b"/nvproxy/nodes0")
        self.assertEqual(prefix_end(b"a\xff"), b"b")
        self.assertEqual(prefix_end(b"\xff\xff"), b"\0")

    def test_events(self) -> None:
        message = {
            "result": {
                "header": {"revision": "7"},
                "events": [
                    {
                        "kv": {
                            "key": _b64(b"k1"),
                            "value": _b64(b"v"),
                            "mod_revision": "6",
                        }
                    },
                    {"type": "DELETE", "kv": {"key": _b64(b"k2"), "mod_revision": "7"}},
                ],
            }
        }
        batch = parse_watch_message(message)
        assert batch is not None
        self.assertEqual(batch.revision, 7)
        self.assertEqual(
            batch.events,
            (WatchEvent(b"k1", b"v", 6), WatchEvent(b"k2", None, 7)),
        )

    def test_created_and_progress_carry_nothing(self) -> None:
        self.assertIsNone(
            parse_watch_message(
                {"result": {"header": {"revision": "2"}, "created": True}}
            )
        )
        self.assertIsNone(parse_watch_message({"result": {"header": {}}}))

    def test_compacted(self) -> None:
        message = {"result": {"canceled": True, "compact_revision": "12"}}
        with self.assertRaises(Compacted) as caught:
            parse_watch_message(message)
        self.assertEqual(caught.exception.revision, 12)

    def test_errors(self) -> None:
        for message in (
            {"error": {"grpc_code": 14, "message": "unavailable"}},
            {"result": {"canceled": True, "cancel_reason": "permission denied"}},
            [],
            {"nothing": 1},
        ):
            with self.assertRaises(EtcdRefused):
                parse_watch_message(message)

    @given(
        st.lists(st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)),
        st.lists(st.integers(min_value=1, max_value=40), max_size=20),
    )
    def test_messages_survive_any_split(
        self, messages: list[dict[str, int]], cuts: list[int]
    ) -> None:
        stream = b"".join(json.dumps(m).encode() + b"\n" for m in messages)
        seen: list[object] = []
        splitter = LineSplitter(seen.append)
        position = 0
        for cut in cuts:
            splitter.feed(stream[position : position + cut])
            position += cut
        splitter.feed(stream[position:])
        splitter.end()
        self.assertEqual(seen, messages)


class _Node:
    """One node's session on the shared fake store."""

    def __init__(
        self, store: FakeEtcd, clock: Clock, name: str, copy: bool = True
    ) -> None:
        self.name = name
        self.value = json.dumps({"node": name, "generation": 1}).encode()
        self.seen: list[Mapping[str, bytes]] = []
        self.session = Session(
            store.client(name),
            clock,
            SETTINGS,
            name,
            lambda: self.value,
            lambda records: self.seen.append(dict(records)) if copy else None,
        )

    def change(self, generation: int) -> None:
        self.value = json.dumps({"node": self.name, "generation": generation}).encode()
        self.session.record_changed()

    def timers(self, clock: Clock) -> list[object]:
        """This node's pending timers (keep-alive, backoff)."""
        mine = (self.session._core, self.session._machine)
        return [
            c for c in clock.getDelayedCalls() if getattr(c.func, "__self__", 0) in mine
        ]

    def kill(self, clock: Clock) -> None:
        """The process is killed: no timer fires again, nothing is revoked."""
        for call in self.timers(clock):
            call.cancel()  # type: ignore[attr-defined]

    @property
    def nodes(self) -> set[str]:
        return set(self.seen[-1]) if self.seen else set()


class SessionTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.store = FakeEtcd(self.clock)
        self.logged: list[dict[str, object]] = []
        globalLogPublisher.addObserver(self.logged.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.logged.append)

    def node(self, name: str) -> _Node:
        node = _Node(self.store, self.clock, name)
        node.session.start()
        return node

    def test_registers_and_sees_everyone(self) -> None:
        a, b = self.node("a"), self.node("b")
        self.assertEqual(a.session.state, "live")
        self.assertEqual(a.nodes, {"a", "b"})
        self.assertEqual(b.nodes, {"a", "b"})
        self.assertEqual(
            self.store.keys()[b"/nvproxy/nodes/a"], a.value, "record put under prefix"
        )

    def test_change_is_put_at_once_not_on_a_timer(self) -> None:
        a, b = self.node("a"), self.node("b")
        puts = self.store.calls["a", "put"]
        a.change(2)
        self.assertEqual(self.store.calls["a", "put"], puts + 1)
        self.assertEqual(json.loads(b.seen[-1]["a"])["generation"], 2)
        # nothing more is put while nothing changes
        self.clock.advance(60)
        self.assertEqual(self.store.calls["a", "put"], puts + 1)

    def test_keepalive_at_a_third_of_the_ttl(self) -> None:
        self.node("a")
        self.clock.advance(2.9)
        self.assertEqual(self.store.calls["a", "keepalive"], 0)
        self.clock.advance(0.2)
        self.assertEqual(self.store.calls["a", "keepalive"], 1)
        self.clock.pump([3.0] * 10)
        self.assertEqual(self.store.calls["a", "keepalive"], 11)
        self.assertIn(b"/nvproxy/nodes/a", self.store.keys(), "lease kept alive")

    def test_dead_node_leaves_within_the_ttl(self) -> None:
        a, b = self.node("a"), self.node("b")
        b.kill(self.clock)
        self.clock.advance(SETTINGS.lease_ttl + 0.1)
        self.assertEqual(a.nodes, {"a"})

    def test_stop_revokes_so_others_drop_it_at_once(self) -> None:
        a, b = self.node("a"), self.node("b")
        b.session.stop()
        self.assertEqual(a.nodes, {"a"})
        self.assertEqual(b.session.state, "stopped")
        self.assertEqual(b.timers(self.clock), [])

    def test_outage_keeps_the_snapshot_and_resyncs(self) -> None:
        a, b = self.node("a"), self.node("b")
        before = len(a.seen)
        self.store.stop()
        self.assertEqual(a.session.state, "lost")
        self.assertEqual(a.nodes, {"a", "b"}, "serving from the last snapshot")
        self.assertEqual(len(a.seen), before)
        self.clock.pump([1.0] * 20)
        warnings = [e for e in self.logged if e.get("log_level") == LogLevel.warn]
        self.assertEqual(
            len([e for e in warnings if "etcd" in str(e["log_format"])]), 2
        )
        # one per node, not one per retry
        self.assertEqual(a.session.status()["state"], "lost")
        self.assertGreater(a.session.status()["snapshot_age_s"], 10)
        self.store.start()
        c = self.node("c")
        b.change(5)
        self.clock.pump([1.0] * 12)
        self.assertEqual(a.session.state, "live")
        self.assertEqual(a.nodes, {"a", "b", "c"})
        self.assertEqual(c.nodes, {"a", "b", "c"})
        self.assertEqual(json.loads(a.seen[-1]["b"])["generation"], 5)
        self.assertEqual(a.session.status()["snapshot_age_s"], 0.0)

    def test_outage_longer_than_the_ttl_resyncs_deletes(self) -> None:
        a, b = self.node("a"), self.node("b")
        self.store.stop()
        # b dies during the outage; its lease expires in etcd meanwhile
        b.kill(self.clock)
        self.clock.pump([1.0] * 15)
        self.assertEqual(a.nodes, {"a", "b"})
        self.store.start()
        self.clock.pump([1.0] * 12)
        self.assertEqual(a.session.state, "live")
        self.assertEqual(a.nodes, {"a"}, "no stale node survives")
        self.assertIn(b"/nvproxy/nodes/a", self.store.keys(), "a re-registered")

    def test_compaction_past_the_revision_reads_afresh(self) -> None:
        a, b = self.node("a"), self.node("b")
        ranges = self.store.calls["a", "range"]
        self.store.stop()
        self.clock.advance(1)
        self.store.start()
        self.node("c")
        b.change(9)
        self.store.compact()
        self.clock.pump([1.0] * 12)
        self.assertEqual(a.session.state, "live")
        self.assertEqual(self.store.calls["a", "range"], ranges + 1)
        self.assertEqual(a.nodes, {"a", "b", "c"})
        self.assertEqual(json.loads(a.seen[-1]["b"])["generation"], 9)

    def test_a_broken_watch_resumes_from_the_last_revision(self) -> None:
        a, b = self.node("a"), self.node("b")
        ranges = self.store.calls["a", "range"]
        self.store.stop()
        self.clock.advance(1)
        self.store.start()
        b.change(3)
        self.clock.pump([1.0] * 5)
        self.assertEqual(self.store.calls["a", "range"], ranges, "no range read")
        self.assertEqual(json.loads(a.seen[-1]["b"])["generation"], 3)


class ScaleTests(SynchronousTestCase):
    """
    One change costs every node one watch event and no request, whatever the
    fleet's size (a polling mesh costs every node N-1 requests per interval).
    """

    def test_thousand_nodes_constant_work_per_change(self) -> None:
        clock = Clock()
        store = FakeEtcd(clock)
        nodes = [_Node(store, clock, f"n{i:04}", copy=False) for i in range(1000)]
        for node in nodes:
            node.session.start()
        self.assertEqual(len(nodes[0].session.records), 1000)
        calls = sum(store.calls.values())
        delivered = dict(store.delivered)
        nodes[500].change(2)
        self.assertEqual(sum(store.calls.values()) - calls, 1, "one put, in all")
        per_node = {
            n: store.delivered[n] - delivered.get(n, 0) for n in store.delivered
        }
        self.assertEqual(set(per_node.values()), {1})
        self.assertEqual(len(per_node), 1000)
        self.assertEqual(json.loads(nodes[0].session.records["n0500"])["generation"], 2)


class ProviderTests(SynchronousTestCase):
    """L{EtcdDiscovery}: decoded records, handed on once per turn."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.store = FakeEtcd(self.clock)
        self.registry = CollectorRegistry()
        self.applied: list[dict[str, object]] = []
        self.record: dict[str, object] = {"version": 1, "node": "a", "generation": 1}
        self.subscribers: list[Callable[[], None]] = []
        self.provider = EtcdDiscovery(
            self.store.client("a"),
            self.clock,
            SETTINGS,
            "a",
            lambda: self.record,
            self._subscribe,
            lambda records: self.applied.append(dict(records)),
            registry=self.registry,
        )
        self.logged: list[dict[str, object]] = []
        globalLogPublisher.addObserver(self.logged.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.logged.append)

    def _subscribe(self, changed: Callable[[], None]) -> Callable[[], None]:
        self.subscribers.append(changed)
        return lambda: self.subscribers.remove(changed)

    def put(self, node: str, value: bytes) -> None:
        self.store.client("op").put(b"/nvproxy/nodes/" + node.encode(), value, 0)

    def test_other_nodes_decoded_and_coalesced(self) -> None:
        self.provider.startService()
        self.put("b", encode_record({"node": "b", "generation": 1}))
        self.put("c", encode_record({"node": "c", "generation": 1}))
        self.assertEqual(self.applied, [])
        self.clock.advance(0)
        self.assertEqual(
            self.applied,
            [
                {
                    "b": {"node": "b", "generation": 1},
                    "c": {"node": "c", "generation": 1},
                }
            ],
        )

    def test_record_change_is_put(self) -> None:
        self.provider.startService()
        self.record = {"version": 1, "node": "a", "generation": 2}
        for changed in self.subscribers:
            changed()
        self.assertEqual(
            json.loads(self.store.keys()[b"/nvproxy/nodes/a"])["generation"], 2
        )

    def test_malformed_logged_once_per_change(self) -> None:
        self.provider.startService()
        self.put("b", b"{not json")
        self.put("b", b"[1]")
        self.clock.advance(0)
        self.put("b", encode_record({"node": "b"}))
        self.put("b", b"nope")
        self.clock.advance(0)
        warned = [e for e in self.logged if e.get("log_level") == LogLevel.warn]
        self.assertEqual(len(warned), 2)
        self.assertEqual(self.applied[-1], {})

    def test_stop_revokes_and_unsubscribes(self) -> None:
        self.provider.startService()
        self.successResultOf(self.provider.stopService())
        self.assertEqual(self.subscribers, [])
        self.assertNotIn(b"/nvproxy/nodes/a", self.store.keys())
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_metrics(self) -> None:
        self.provider.startService()
        self.store.stop()
        self.clock.advance(5)
        self.store.start()
        self.clock.pump([1.0] * 12)
        families = {
            m.name: m
            for m in text_string_to_metric_families(
                generate_latest(self.registry).decode()
            )
        }
        self.assertEqual(families["nvproxy_etcd_watch_connects"].samples[0].value, 2)
        self.assertEqual(families["nvproxy_etcd_records"].samples[0].value, 1)
        self.assertEqual(
            families["nvproxy_discovery_snapshot_age_seconds"].samples[0].value, 0
        )
        self.assertIn("nvproxy_etcd_keepalive_failures", families)


class ChangeDuringCallTests(SynchronousTestCase):
    """A record change is never lost while a call is in flight."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.store = FakeEtcd(self.clock)
        self.node = _Node(self.store, self.clock, "a")
        self.held: list[Any] = []

    def hold(self, method: str) -> None:
        """Make the next C{method} call wait for L{release}."""
        client = self.node.session._core.api
        original = getattr(client, method)

        def held(*args: Any) -> Deferred[Any]:
            setattr(client, method, original)
            d: Deferred[Any] = Deferred()
            self.held.append((d, original, args))
            return d

        setattr(client, method, held)

    def release(self) -> None:
        d, original, args = self.held.pop(0)
        original(*args).chainDeferred(d)

    def stored(self) -> int:
        return int(json.loads(self.store.keys()[b"/nvproxy/nodes/a"])["generation"])

    def test_change_during_keepalive(self) -> None:
        self.node.session.start()
        self.hold("keepalive")
        self.clock.advance(SETTINGS.lease_ttl / 3)
        self.node.change(2)
        self.assertEqual(self.stored(), 1, "not put while the keep-alive runs")
        self.release()
        self.assertEqual(self.stored(), 2)

    def test_change_during_connect(self) -> None:
        self.hold("range_prefix")
        self.node.session.start()
        self.assertEqual(self.node.session.state, "connecting")
        self.node.change(2)
        self.release()
        self.assertEqual(self.node.session.state, "live")
        self.assertEqual(self.stored(), 2)


class TrustTests(SynchronousTestCase):
    """Which etcd-fed records are used: pinned by the cluster dir, or by etcd."""

    def setUp(self) -> None:
        from nvproxy.cluster import ClusterDir

        root = self.mktemp()
        self.dirs = {n: ClusterDir(f"{root}/{n}") for n in ("a", "b", "c")}
        self.fp = {n: d.init(n, Clock()).fingerprint for n, d in self.dirs.items()}
        # a pins b (placeholder address), not c
        from nvproxy.cluster import Peer

        self.dirs["a"].add_peer(Peer("b", "192.0.2.1", self.fp["b"]))

    def document(self, node: str, fingerprint: object = None) -> dict[str, Any]:
        return {
            "version": 1,
            "node": node,
            "generation": 1,
            "address": "10.0.0.7",
            "fingerprint": str(fingerprint or self.fp[node]),
            "engines": {
                "vllm": {"port": 8000, "models": {"m": {"readiness": "awake"}}},
                "ollama": {"port": 11435, "models": {}},
            },
        }

    def peers(self, trust: str) -> Any:
        from nvproxy.etcd import EtcdPeers

        state = self.dirs["a"].load()
        return EtcdPeers("a", trust, lambda: state, lambda: ["vllm", "ollama"])

    def test_pinned(self) -> None:
        peers = self.peers("pinned")
        entries = peers.apply(
            {
                "a": self.document("a"),
                "b": self.document("b"),
                "c": self.document("c"),
            }
        )
        self.assertEqual(set(peers.records), {"b"}, "c is not pinned; a is us")
        self.assertEqual(
            [e.base_url for e in entries["vllm"]["b"].endpoints],
            ["https://10.0.0.7:8000"],
        )
        self.assertNotIn("ollama", entries, "no models, no entry")
        state = peers.cluster_state(self.dirs["a"].load())
        dialed = state.peer_at("10.0.0.7", 8000)
        assert dialed is not None
        self.assertEqual((dialed.id, dialed.fingerprint), ("b", self.fp["b"]))

    def test_fingerprint_must_match_the_pin(self) -> None:
        peers = self.peers("pinned")
        peers.apply({"b": self.document("b", fingerprint=self.fp["c"])})
        self.assertEqual(peers.records, {})

    def test_trust_etcd_pins_the_record(self) -> None:
        peers = self.peers("etcd")
        peers.apply({"c": self.document("c")})
        self.assertEqual(set(peers.records), {"c"})
        state = peers.cluster_state(self.dirs["a"].load())
        self.assertIn(self.fp["c"], state.pins)

    def test_merged_state_made_once_per_change(self) -> None:
        """
        Every request to or from a peer asks for the merged state: it is
        the same object until the dir's state or etcd's peers change, so a
        request does not rebuild a fleet's pins; after a change it says
        what the change says.
        """
        peers = self.peers("etcd")
        dir_state = self.dirs["a"].load()
        peers.apply({"c": self.document("c")})
        state = peers.cluster_state(dir_state)
        self.assertIs(peers.cluster_state(dir_state), state)
        self.assertEqual(state.peer_at("10.0.0.7", 8000), peers.peers["c"])
        moved = dict(self.document("c"), address="10.0.0.8")
        peers.apply({"c": moved})
        after = peers.cluster_state(dir_state)
        self.assertIsNot(after, state)
        self.assertIsNone(after.peer_at("10.0.0.7", 8000))
        self.assertEqual(after.peer_at("10.0.0.8", 8000), peers.peers["c"])
        reloaded = self.dirs["a"].load()  # the dir watcher's new state
        self.assertIsNot(peers.cluster_state(reloaded), after)
        self.assertEqual(peers.cluster_state(reloaded), after)

    def test_unchanged_records_keep_what_they_made(self) -> None:
        """
        One node's record changing hands on every node's: what the others'
        unchanged documents made (records, peers, entries) is kept, the
        peers are the same mapping while none of them changes, and the
        entries carry the readiness and draining their records give.
        """
        peers = self.peers("etcd")
        documents = {"b": self.document("b"), "c": self.document("c")}
        first = peers.apply(documents)
        known, record_b = peers.peers, peers.records["b"]
        sleeping = self.document("c")
        sleeping["draining"] = True
        sleeping["engines"]["vllm"]["models"]["m"] = {
            "readiness": "sleeping",
            "wake_estimate_s": 5.0,
        }
        second = peers.apply(dict(documents, c=sleeping))
        self.assertIs(second["vllm"]["b"], first["vllm"]["b"])
        self.assertIs(peers.records["b"], record_b)
        changed = second["vllm"]["c"]
        self.assertIsNot(changed, first["vllm"]["c"])
        self.assertTrue(changed.draining)
        self.assertEqual(changed.readiness_of("m"), ModelReadiness("sleeping", 5.0))
        self.assertIs(peers.peers, known, "no peer moved")
        moved = dict(sleeping, address="10.0.0.8")
        peers.apply(dict(documents, c=moved))
        self.assertIsNot(peers.peers, known)
        self.assertEqual(peers.peers["c"].address, "10.0.0.8")
        # equal documents that are new objects are read again, alike
        again = peers.apply({node: dict(doc) for node, doc in documents.items()})
        self.assertEqual(again, first)

    def test_engines_changed_remakes(self) -> None:
        """The same documents under other enabled engines (a reload) make
        the entries again."""
        from nvproxy.etcd import EtcdPeers

        state = self.dirs["a"].load()
        engines = ["vllm"]
        peers = EtcdPeers("a", "etcd", lambda: state, lambda: engines)
        documents = {"b": self.document("b")}
        peers.apply(documents)
        engines.remove("vllm")
        self.assertEqual(peers.apply(documents), {})

    def test_malformed_and_wrong_node_ignored(self) -> None:
        peers = self.peers("pinned")
        wrong = dict(self.document("b"), node="c")
        peers.apply({"b": wrong})
        self.assertEqual(peers.records, {})
        peers.apply({"b": {"version": 2, "node": "b"}})
        self.assertEqual(peers.records, {})
        peers.apply({"b": self.document("b")})
        self.assertEqual(set(peers.records), {"b"})
