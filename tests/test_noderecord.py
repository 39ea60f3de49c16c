"""
The node record (L{nvproxy.noderecord}): schema, validation, this node's
record and its generation, peers' records, annotation of discovery entries
and the readiness gauge.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.discovery import Discovery, Endpoint, InventoryClient, NodeEntry
from nvproxy.noderecord import (
    BadRecord,
    EngineRecord,
    Fleet,
    FutureRecord,
    LocalRecord,
    NodeRecord,
    PeerRecords,
    ReadinessCollector,
    decode,
    encode,
)
from nvproxy.readiness import AWAKE, ModelReadiness

EXAMPLE = {
    "version": 1,
    "node": "node-a",
    "generation": 17,
    "draining": False,
    "engines": {
        "vllm": {
            "port": 8000,
            "in_flight": 2,
            "models": {"Qwen3-8B": {"readiness": "sleeping", "wake_estimate_s": 12.5}},
        },
        "ollama": {
            "port": 11435,
            "in_flight": 0,
            "models": {"llama3:8b": {"readiness": "awake", "wake_estimate_s": 0.0}},
        },
    },
}


def _docs_example() -> Any:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(here, "docs", "node-record.rst")) as f:
        text = f.read()
    block = text.split(".. code-block:: json", 1)[1].split("\n\n", 2)[1]
    return json.loads(block)


class SchemaTests(SynchronousTestCase):
    def test_round_trip(self) -> None:
        record = decode(EXAMPLE)
        self.assertEqual(record.node, "node-a")
        self.assertEqual(record.generation, 17)
        self.assertEqual(
            record.engines["vllm"].models["Qwen3-8B"],
            ModelReadiness("sleeping", 12.5),
        )
        self.assertEqual(encode(record), EXAMPLE)

    def test_documented_example(self) -> None:
        self.assertEqual(_docs_example(), EXAMPLE)
        decode(_docs_example())

    def test_unknown_fields_ignored(self) -> None:
        doc = json.loads(json.dumps(EXAMPLE))
        doc["zone"] = "eu"
        doc["engines"]["vllm"]["gpu"] = "A100"
        doc["engines"]["vllm"]["models"]["Qwen3-8B"]["since"] = 3
        self.assertEqual(encode(decode(doc)), EXAMPLE)

    def test_future_version(self) -> None:
        self.assertRaises(FutureRecord, decode, {**EXAMPLE, "version": 2})

    def test_malformed(self) -> None:
        def with_(path: list[str], value: object) -> Any:
            doc = json.loads(json.dumps(EXAMPLE))
            at = doc
            for key in path[:-1]:
                at = at[key]
            at[path[-1]] = value
            return doc

        model = ["engines", "vllm", "models", "Qwen3-8B"]
        for doc in [
            [],
            "x",
            {},
            with_(["version"], "1"),
            with_(["version"], 0),
            with_(["node"], ""),
            with_(["generation"], -1),
            with_(["generation"], True),
            with_(["draining"], "no"),
            with_(["engines"], []),
            with_(["engines", "vllm", "port"], 70000),
            with_(["engines", "vllm", "in_flight"], -2),
            with_(["engines", "vllm", "models"], None),
            with_([*model, "readiness"], "asleep"),
            with_([*model, "wake_estimate_s"], -1),
            with_([*model, "wake_estimate_s"], "12"),
            with_([*model, "wake_estimate_s"], 10**400),
        ]:
            with self.subTest(doc=doc):
                self.assertRaises(BadRecord, decode, doc)


def _entry(node: str, kind: Any, *models: str, service: str | None = None) -> NodeEntry:
    endpoint = Endpoint(node, "vllm", kind, f"http://{node}", service)
    return NodeEntry(node, kind, {m: endpoint for m in models}, (endpoint,))


class LocalRecordTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.discovery = Discovery()
        self.discovery.publish({"vllm": {"a": _entry("a", "local", "M", service="m")}})
        self.state = {"M": ModelReadiness("sleeping", 6.0)}
        self.inflight = {"vllm": 0}
        self.draining = False
        self.record = LocalRecord(
            "a",
            self.discovery,
            ports=lambda: {"vllm": 8000},
            readiness=lambda engine, model: self.state[model],
            in_flight=lambda engine: self.inflight[engine],
            draining=lambda: self.draining,
        )
        self.seen: list[int] = []
        self.record.subscribe(lambda r: self.seen.append(r.generation))

    def test_built_from_local_state(self) -> None:
        record = self.record.current()
        self.assertEqual(
            record,
            NodeRecord(
                "a",
                1,
                False,
                {"vllm": EngineRecord(8000, 0, {"M": ModelReadiness("sleeping", 6.0)})},
            ),
        )

    def test_generation_bumps_on_every_change(self) -> None:
        self.assertEqual(self.record.current().generation, 1)
        self.assertEqual(self.record.current().generation, 1)
        self.state["M"] = AWAKE
        self.record.refresh()
        self.assertEqual(self.seen, [1, 2])
        self.draining = True
        self.assertEqual(self.record.current().generation, 3)
        self.inflight["vllm"] = 2
        self.assertEqual(self.record.current().engines["vllm"].in_flight, 2)
        self.assertEqual(self.seen, [1, 2, 3, 4])
        self.record.refresh()
        self.assertEqual(self.seen, [1, 2, 3, 4])


class _Records(InventoryClient):
    def __init__(self) -> None:
        self.answers: dict[str, Any] = {}
        self.asked: list[str] = []

    def get_json(self, url: str, timeout: float) -> Deferred[Any]:
        self.asked.append(url)
        answer = self.answers.get(url)
        if isinstance(answer, Exception):
            return fail(answer)
        return succeed(answer)


class PeerRecordsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.client = _Records()
        self.changes: list[None] = []
        self.peers = PeerRecords(
            self.client, self.clock, 2.0, changed=lambda: self.changes.append(None)
        )
        self.peers.set_peers({"node-a": "https://a:1", "node-b": "https://b:1"})
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def warnings(self, peer: str) -> list[str]:
        return [
            e["kind"]
            for e in self.events
            if e.get("peer") == peer and e.get("log_level").name == "warn"
        ]

    def test_valid_malformed_future(self) -> None:
        self.client.answers["https://a:1/_nvproxy/node"] = EXAMPLE
        self.client.answers["https://b:1/_nvproxy/node"] = {"version": 1}
        self.peers.startService()
        self.addCleanup(self.peers.stopService)
        self.assertEqual(set(self.peers.records), {"node-a"})
        self.assertEqual(self.changes, [None])
        for _ in range(3):
            self.clock.advance(2)
        self.assertEqual(self.warnings("node-b"), ["malformed"])
        self.client.answers["https://b:1/_nvproxy/node"] = {
            **EXAMPLE,
            "node": "node-b",
            "version": 9,
        }
        for _ in range(3):
            self.clock.advance(2)
        self.assertEqual(self.warnings("node-b"), ["malformed", "future"])
        self.assertEqual(set(self.peers.records), {"node-a"})
        # the record of node-a served by node-b is not node-b's
        self.client.answers["https://b:1/_nvproxy/node"] = EXAMPLE
        self.clock.advance(2)
        self.assertEqual(self.warnings("node-b"), ["malformed", "future", "malformed"])
        self.assertEqual(len(self.changes), 1)

    def test_unanswered_forgets(self) -> None:
        self.client.answers["https://a:1/_nvproxy/node"] = EXAMPLE
        self.peers.poll()
        self.assertIn("node-a", self.peers.records)
        self.client.answers["https://a:1/_nvproxy/node"] = ValueError("HTTP 404")
        self.peers.poll()
        self.peers.poll()
        self.assertEqual(self.peers.records, {})
        self.assertEqual(self.warnings("node-a"), ["unanswered"])
        self.assertEqual(len(self.changes), 2)
        self.peers.set_peers({})
        self.assertEqual(self.peers.records, {})


class FleetTests(SynchronousTestCase):
    def test_annotate(self) -> None:
        discovery = Discovery()
        local = LocalRecord(
            "a",
            discovery,
            ports=lambda: {},
            readiness=lambda engine, model: ModelReadiness("offloaded", 45),
            in_flight=lambda engine: 0,
            draining=lambda: True,
        )
        peers = PeerRecords(_Records(), Clock(), 2.0, changed=lambda: None)
        peers.records["node-a"] = decode(EXAMPLE)
        fleet = Fleet(local, peers)
        mine = fleet.annotate("vllm", _entry("a", "local", "M"))
        self.assertEqual(mine.readiness_of("M"), ModelReadiness("offloaded", 45))
        self.assertTrue(mine.draining)
        peer = fleet.annotate("vllm", _entry("node-a", "peer", "Qwen3-8B", "other"))
        self.assertEqual(peer.readiness_of("Qwen3-8B").readiness, "sleeping")
        self.assertEqual(peer.readiness_of("other"), AWAKE)
        self.assertFalse(peer.draining)
        unknown = _entry("node-z", "peer", "Qwen3-8B")
        self.assertEqual(fleet.annotate("vllm", unknown), unknown)
        direct = _entry("gpu", "direct", "Qwen3-8B")
        self.assertEqual(fleet.annotate("vllm", direct), direct)
        records = fleet.records()
        self.assertEqual([r["node"] for r in records], ["a", "node-a"])
        # an entry that already says what the record says is handed back
        # as it is (a publish then compares it by identity)
        self.assertIs(fleet.annotate("vllm", peer), peer)

    def test_readiness_gauge(self) -> None:
        discovery = Discovery()
        entry = _entry("a", "local", "M", "N")
        from attrs import evolve

        discovery.publish(
            {"vllm": {"a": evolve(entry, readiness={"M": ModelReadiness("waking")})}}
        )
        registry = CollectorRegistry()
        registry.register(ReadinessCollector(discovery))
        text = generate_latest(registry).decode()
        ones = re.findall(r"nvproxy_model_readiness\{(.*)\} 1\.0", text)
        self.assertEqual(
            sorted(ones),
            [
                'engine="vllm",model="M",node="a",readiness="waking"',
                'engine="vllm",model="N",node="a",readiness="awake"',
            ],
        )
        self.assertEqual(text.count("nvproxy_model_readiness{"), 10)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats(allow_nan=True)
    | st.sampled_from(["", "awake", "sleeping", "vllm", "node-a"]),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "version",
                    "node",
                    "generation",
                    "draining",
                    "engines",
                    "vllm",
                    "port",
                    "in_flight",
                    "models",
                    "M",
                    "readiness",
                    "wake_estimate_s",
                ]
            ),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)


def _mutations() -> Any:
    """The example with one value replaced somewhere by random JSON."""
    paths = [
        ["version"],
        ["generation"],
        ["engines"],
        ["engines", "vllm"],
        ["engines", "vllm", "port"],
        ["engines", "vllm", "in_flight"],
        ["engines", "vllm", "models"],
        ["engines", "vllm", "models", "Qwen3-8B"],
        ["engines", "vllm", "models", "Qwen3-8B", "wake_estimate_s"],
    ]
    return st.tuples(st.sampled_from(paths), _json)


class DecodeNeverCrashesTests(SynchronousTestCase):
    @given(_json)
    def test_random_json(self, doc: Any) -> None:
        try:
            decode(doc)
        except BadRecord:
            pass

    @given(_mutations())
    def test_mutated_example(self, mutation: Any) -> None:
        path, value = mutation
        doc = json.loads(json.dumps(EXAMPLE))
        at = doc
        for key in path[:-1]:
            at = at[key]
        at[path[-1]] = value
        try:
            record = decode(doc)
        except BadRecord:
            return
        self.assertEqual(decode(encode(record)), record)
