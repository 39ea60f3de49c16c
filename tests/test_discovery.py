"""
Tests for L{nvproxy.discovery}: snapshots and their subscribers, and
L{PollingDiscovery} over a fake inventory client on a L{Clock} (no sockets).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.discovery import (
    Discovery,
    Endpoint,
    InventoryClient,
    NodeEntry,
    PollingDiscovery,
    Snapshot,
)
from nvproxy.readiness import AWAKE, ModelReadiness

LOCAL = Endpoint("local", "ollama", "local", "http://127.0.0.1:11434")
GPU2 = Endpoint("gpu-2", "ollama", "direct", "http://10.0.0.2:11434/")
GPU2_SECOND = Endpoint("gpu-2", "ollama", "direct", "http://10.0.0.2:11500")
OPENAI = Endpoint("local", "lmstudio", "local", "http://127.0.0.1:1234")


def _tags(*names: str) -> dict[str, Any]:
    return {"models": [{"name": name} for name in names]}


class FakeInventory(InventoryClient):
    """
    Answers from a dictionary, URL -> JSON body, an exception to fail with,
    or C{None} to leave the request pending (see L{pending}).
    """

    def __init__(self) -> None:
        self.answers: dict[str, object] = {}
        self.asked: list[tuple[str, float]] = []
        self.pending: dict[str, Deferred[Any]] = {}
        self.cancelled: list[str] = []

    def get_json(self, url: str, timeout: float) -> Deferred[Any]:
        self.asked.append((url, timeout))
        answer = self.answers.get(url, ConnectionRefusedError(url))
        if answer is None:
            d: Deferred[Any] = Deferred(lambda _: self.cancelled.append(url))
            self.pending[url] = d
            return d
        if isinstance(answer, Exception):
            return fail(answer)
        return succeed(answer)

    def urls(self) -> list[str]:
        return [url for url, _ in self.asked]


def _entry(node: str, models: dict[str, Endpoint], *endpoints: Endpoint) -> NodeEntry:
    kind = endpoints[0].kind
    return NodeEntry(node, kind, models, tuple(endpoints))


class SnapshotTests(SynchronousTestCase):
    def snapshot(self) -> Snapshot:
        discovery = Discovery()
        discovery.publish(
            {
                "ollama": {
                    "gpu-3": _entry("gpu-3", {"m:latest": GPU2}, GPU2),
                    "gpu-2": _entry("gpu-2", {"x:latest": GPU2}, GPU2),
                    "local": _entry("local", {"m:latest": LOCAL}, LOCAL),
                }
            }
        )
        return discovery.current

    def test_empty(self) -> None:
        current = Discovery().current
        self.assertEqual(current.generation, 0)
        self.assertEqual(current.nodes("ollama"), ())
        self.assertEqual(current.owners("ollama", "m:latest"), ())
        self.assertIsNone(current.node("ollama", "local"))

    def test_nodes_local_first_then_by_id(self) -> None:
        nodes = [e.node_id for e in self.snapshot().nodes("ollama")]
        self.assertEqual(nodes, ["local", "gpu-2", "gpu-3"])

    def test_owners(self) -> None:
        snapshot = self.snapshot()
        owners = [e.node_id for e in snapshot.owners("ollama", "m:latest")]
        self.assertEqual(owners, ["local", "gpu-3"])
        self.assertEqual(snapshot.owners("ollama", "absent:latest"), ())
        self.assertEqual(snapshot.owners("vllm", "m:latest"), ())

    def test_answers_worked_out_once(self) -> None:
        """
        A snapshot never changes, so every request asking for a model's
        owners gets the same answer, worked out once; what is kept does not
        make two snapshots of the same inventory unequal.
        """
        snapshot = self.snapshot()
        owners = snapshot.owners("ollama", "m:latest")
        self.assertIs(snapshot.owners("ollama", "m:latest"), owners)
        self.assertIs(snapshot.nodes("ollama"), snapshot.nodes("ollama"))
        self.assertEqual(snapshot, Snapshot(snapshot.generation, snapshot.engines))

    def test_unknown_names_are_not_kept(self) -> None:
        """
        Clients name any model: only answers naming a node are kept, so
        what a snapshot keeps is bounded by what it holds.
        """
        snapshot = self.snapshot()
        for i in range(50):
            self.assertEqual(snapshot.owners("ollama", f"nobody-{i}:latest"), ())
            self.assertEqual(snapshot.owners(f"engine-{i}", "m:latest"), ())
        self.assertEqual(snapshot._owners, {})
        self.assertEqual(set(snapshot._nodes), {"ollama"})

    def test_ranks(self) -> None:
        """
        The readiness rank of each owner that is not this node, from its
        record (awake when it says nothing); for no model, of every node.
        """
        waking = ModelReadiness("waking", 3.0)
        gpu3 = NodeEntry(
            "gpu-3", "direct", {"m:latest": GPU2}, (GPU2,), {"m:latest": waking}
        )
        snapshot = Snapshot(
            1,
            {
                "ollama": {
                    "gpu-3": gpu3,
                    "gpu-2": _entry("gpu-2", {"x:latest": GPU2}, GPU2),
                    "local": _entry("local", {"m:latest": LOCAL}, LOCAL),
                }
            },
        )
        self.assertEqual(snapshot.ranks("ollama", "m:latest"), {"gpu-3": waking.rank})
        self.assertIs(
            snapshot.ranks("ollama", "m:latest"), snapshot.ranks("ollama", "m:latest")
        )
        self.assertEqual(
            snapshot.ranks("ollama", None),
            {"gpu-2": AWAKE.rank, "gpu-3": AWAKE.rank},
        )
        self.assertEqual(snapshot.ranks("ollama", "nobody:latest"), {})
        self.assertNotIn(("ollama", "nobody:latest"), snapshot._ranks)

    def test_node(self) -> None:
        snapshot = self.snapshot()
        entry = snapshot.node("ollama", "gpu-2")
        assert entry is not None
        self.assertTrue(entry.advertises("x:latest"))
        self.assertFalse(entry.advertises("m:latest"))
        self.assertIsNone(snapshot.node("lmstudio", "gpu-2"))


class DiscoveryTests(SynchronousTestCase):
    ENGINES = {"ollama": {"local": _entry("local", {"m:latest": LOCAL}, LOCAL)}}

    def test_publish_new_generation(self) -> None:
        discovery = Discovery()
        before = discovery.current
        discovery.publish(self.ENGINES)
        self.assertEqual(discovery.current.generation, 1)
        self.assertEqual(discovery.current.engines, self.ENGINES)
        # Snapshots are immutable: a reader's snapshot does not change.
        self.assertEqual(before.generation, 0)
        self.assertEqual(before.engines, {})

    def test_unchanged_publish_is_not_a_generation(self) -> None:
        discovery = Discovery()
        seen: list[Snapshot] = []
        discovery.subscribe(seen.append)
        discovery.publish(self.ENGINES)
        discovery.publish(dict(self.ENGINES))
        self.assertEqual(discovery.current.generation, 1)
        self.assertEqual([s.generation for s in seen], [1])

    def test_subscribers_see_each_change_in_order(self) -> None:
        discovery = Discovery()
        calls: list[tuple[str, int]] = []
        discovery.subscribe(lambda s: calls.append(("a", s.generation)))
        discovery.subscribe(lambda s: calls.append(("b", s.generation)))
        discovery.publish(self.ENGINES)
        discovery.publish({})
        self.assertEqual(calls, [("a", 1), ("b", 1), ("a", 2), ("b", 2)])

    def test_unsubscribe(self) -> None:
        discovery = Discovery()
        seen: list[int] = []
        unsubscribe = discovery.subscribe(lambda s: seen.append(s.generation))
        other: list[int] = []
        discovery.subscribe(lambda s: other.append(s.generation))
        discovery.publish(self.ENGINES)
        unsubscribe()
        unsubscribe()  # twice is harmless
        discovery.publish({})
        self.assertEqual(seen, [1])
        self.assertEqual(other, [1, 2])

    def test_unsubscribe_while_notifying(self) -> None:
        """A subscriber may unsubscribe itself from its own notification."""
        discovery = Discovery()
        seen: list[int] = []
        unsubscribe: list[Any] = []

        def once(snapshot: Snapshot) -> None:
            seen.append(snapshot.generation)
            unsubscribe[0]()

        unsubscribe.append(discovery.subscribe(once))
        discovery.publish(self.ENGINES)
        discovery.publish({})
        self.assertEqual(seen, [1])

    def test_failing_subscriber_does_not_stop_the_others(self) -> None:
        discovery = Discovery()
        seen: list[int] = []

        def broken(snapshot: Snapshot) -> None:
            raise RuntimeError("subscriber bug")

        discovery.subscribe(broken)
        discovery.subscribe(lambda s: seen.append(s.generation))
        discovery.publish(self.ENGINES)
        self.assertEqual(seen, [1])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class PollingTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.client = FakeInventory()
        self.discovery = Discovery()
        self.answered: list[Endpoint] = []

    def polling(
        self,
        endpoints: list[Endpoint],
        interval: float = 2.0,
        static: dict[Endpoint, list[str]] | None = None,
    ) -> PollingDiscovery:
        polling = PollingDiscovery(
            self.discovery,
            self.client,
            self.clock,
            endpoints,
            interval=interval,
            static_models=static,
            answered=self.answered.append,
        )
        self.addCleanup(lambda: polling.running and polling.stopService())
        return polling

    def advertised(self, engine: str = "ollama") -> dict[str, list[str]]:
        return {
            entry.node_id: sorted(entry.models)
            for entry in self.discovery.current.nodes(engine)
        }

    def test_polls_at_start_and_every_interval(self) -> None:
        self.client.answers[LOCAL.base_url + "/api/tags"] = _tags("m")
        polling = self.polling([LOCAL], interval=2.0)
        polling.startService()
        self.assertEqual(self.client.urls(), ["http://127.0.0.1:11434/api/tags"])
        self.assertEqual(self.advertised(), {"local": ["m:latest"]})
        self.clock.advance(1.9)
        self.assertEqual(len(self.client.asked), 1)
        self.clock.advance(0.1)
        self.assertEqual(len(self.client.asked), 2)
        self.clock.advance(2.0)
        self.assertEqual(len(self.client.asked), 3)

    def test_stop_stops_polling_and_cancels_inflight(self) -> None:
        url = LOCAL.base_url + "/api/tags"
        self.client.answers[url] = None
        polling = self.polling([LOCAL])
        polling.startService()
        polling.stopService()
        self.assertEqual(self.client.cancelled, [url])
        self.clock.advance(10)
        self.assertEqual(len(self.client.asked), 1)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_timeout_is_an_interval_at_least_a_second(self) -> None:
        self.client.answers[LOCAL.base_url + "/api/tags"] = _tags()
        self.successResultOf(self.polling([LOCAL], interval=5.0).poll())
        self.successResultOf(self.polling([LOCAL], interval=0.05).poll())
        self.assertEqual([t for _, t in self.client.asked], [5.0, 1.0])

    def test_url_from_engine_table(self) -> None:
        """The poll path is the engine's; a trailing slash is not doubled."""
        self.client.answers[OPENAI.base_url + "/v1/models"] = {
            "object": "list",
            "data": [{"id": "Qwen"}],
        }
        self.client.answers["http://10.0.0.2:11434/api/tags"] = _tags("x")
        self.successResultOf(self.polling([OPENAI, GPU2]).poll())
        self.assertEqual(
            self.client.urls(),
            ["http://127.0.0.1:1234/v1/models", "http://10.0.0.2:11434/api/tags"],
        )
        # Model ids normalized per engine (Ollama's implicit tag).
        self.assertEqual(self.advertised("lmstudio"), {"local": ["Qwen"]})
        self.assertEqual(self.advertised("ollama"), {"gpu-2": ["x:latest"]})

    def test_endpoints_of_one_node_merge(self) -> None:
        """
        Two endpoints of one node make one entry; a model both advertise is
        served by the first endpoint in configured order.
        """
        self.client.answers["http://10.0.0.2:11434/api/tags"] = _tags("a", "both")
        self.client.answers["http://10.0.0.2:11500/api/tags"] = _tags("b", "both")
        self.successResultOf(self.polling([GPU2, GPU2_SECOND]).poll())
        entry = self.discovery.current.node("ollama", "gpu-2")
        assert entry is not None
        self.assertEqual(entry.kind, "direct")
        self.assertEqual(entry.endpoints, (GPU2, GPU2_SECOND))
        self.assertEqual(
            dict(entry.models),
            {"a:latest": GPU2, "both:latest": GPU2, "b:latest": GPU2_SECOND},
        )

    def test_failure_drops_the_nodes_models_until_it_answers(self) -> None:
        url = LOCAL.base_url + "/api/tags"
        self.client.answers[url] = _tags("m")
        self.client.answers["http://10.0.0.2:11434/api/tags"] = _tags("m")
        polling = self.polling([LOCAL, GPU2])
        self.successResultOf(polling.poll())
        self.assertEqual(
            self.advertised(), {"local": ["m:latest"], "gpu-2": ["m:latest"]}
        )
        self.client.answers[url] = ConnectionRefusedError()
        self.successResultOf(polling.poll())
        self.assertEqual(self.advertised(), {"gpu-2": ["m:latest"]})
        self.assertIsNone(self.discovery.current.node("ollama", "local"))
        self.client.answers[url] = _tags("m", "n")
        self.successResultOf(polling.poll())
        self.assertEqual(
            self.advertised(),
            {"local": ["m:latest", "n:latest"], "gpu-2": ["m:latest"]},
        )

    def test_wrong_shape_drops_too(self) -> None:
        url = LOCAL.base_url + "/api/tags"
        self.client.answers[url] = _tags("m")
        polling = self.polling([LOCAL])
        self.successResultOf(polling.poll())
        self.client.answers[url] = {"data": []}  # not Ollama's envelope
        self.successResultOf(polling.poll())
        self.assertEqual(self.advertised(), {})

    def test_one_node_failing_keeps_the_other_endpoint(self) -> None:
        """An endpoint that fails takes only its own models away."""
        self.client.answers["http://10.0.0.2:11434/api/tags"] = _tags("a")
        self.client.answers["http://10.0.0.2:11500/api/tags"] = _tags("b")
        polling = self.polling([GPU2, GPU2_SECOND])
        self.successResultOf(polling.poll())
        self.client.answers["http://10.0.0.2:11434/api/tags"] = OSError("gone")
        self.successResultOf(polling.poll())
        entry = self.discovery.current.node("ollama", "gpu-2")
        assert entry is not None
        self.assertEqual(entry.endpoints, (GPU2_SECOND,))
        self.assertEqual(dict(entry.models), {"b:latest": GPU2_SECOND})

    def test_answered_hook(self) -> None:
        """
        Called for each endpoint that answered with a model list, not for
        one that failed or answered something else.
        """
        self.client.answers[LOCAL.base_url + "/api/tags"] = _tags("m")
        self.client.answers["http://10.0.0.2:11434/api/tags"] = {"nope": 1}
        polling = self.polling([LOCAL, GPU2, GPU2_SECOND])
        self.successResultOf(polling.poll())
        self.assertEqual(self.answered, [LOCAL])
        self.successResultOf(polling.poll())
        self.assertEqual(self.answered, [LOCAL, LOCAL])

    def test_static_models_are_never_asked(self) -> None:
        service = Endpoint(
            "local", "vllm", "local", "http://127.0.0.1:8001", service="text"
        )
        polling = self.polling([service], static={service: ["Qwen3"]})
        self.successResultOf(polling.poll())
        self.assertEqual(self.client.asked, [])
        self.assertEqual(self.answered, [])
        entry = self.discovery.current.node("vllm", "local")
        assert entry is not None
        self.assertEqual(dict(entry.models), {"Qwen3": service})

    def test_generation_only_on_change(self) -> None:
        url = LOCAL.base_url + "/api/tags"
        self.client.answers[url] = _tags("m")
        polling = self.polling([LOCAL], interval=1.0)
        seen: list[int] = []
        self.discovery.subscribe(lambda s: seen.append(s.generation))
        polling.startService()
        self.clock.advance(1)
        self.clock.advance(1)
        self.assertEqual(len(self.client.asked), 3)
        self.assertEqual(seen, [1])
        self.client.answers[url] = _tags("m", "n")
        self.clock.advance(1)
        self.assertEqual(seen, [1, 2])
        self.assertEqual(self.discovery.current.generation, 2)

    def test_inflight_endpoint_is_not_asked_twice(self) -> None:
        """
        A round that finds an endpoint still being polled waits for that
        answer; both rounds publish it.
        """
        url = LOCAL.base_url + "/api/tags"
        self.client.answers[url] = None
        self.client.answers["http://10.0.0.2:11434/api/tags"] = _tags("x")
        polling = self.polling([LOCAL, GPU2])
        first = polling.poll()
        second = polling.poll()
        self.assertEqual(self.client.urls().count(url), 1)
        self.assertNoResult(first)
        self.assertNoResult(second)
        self.client.pending.pop(url).callback(_tags("m"))
        self.successResultOf(first)
        self.successResultOf(second)
        self.assertEqual(
            self.advertised(), {"local": ["m:latest"], "gpu-2": ["x:latest"]}
        )
        # Settled: the next round asks again.
        self.client.answers[url] = _tags("m")
        self.successResultOf(polling.poll())
        self.assertEqual(self.client.urls().count(url), 2)

    def test_slow_answer_spans_intervals(self) -> None:
        """The loop does not stack polls behind an endpoint that hangs."""
        url = LOCAL.base_url + "/api/tags"
        self.client.answers[url] = None
        polling = self.polling([LOCAL], interval=1.0)
        polling.startService()
        self.clock.advance(5)
        self.assertEqual(self.client.urls(), [url])
        self.client.pending.pop(url).callback(_tags("m"))
        self.assertEqual(self.advertised(), {"local": ["m:latest"]})
        self.client.answers[url] = _tags("m")
        self.clock.advance(1)
        self.assertEqual(self.client.urls(), [url, url])

    def test_set_endpoints(self) -> None:
        """
        A forgotten endpoint stops advertising at once and its poll in
        flight is cancelled; a new one is polled from the next round.
        """
        self.client.answers[LOCAL.base_url + "/api/tags"] = _tags("m")
        gpu2_url = "http://10.0.0.2:11434/api/tags"
        self.client.answers[gpu2_url] = _tags("x")
        polling = self.polling([LOCAL, GPU2])
        self.successResultOf(polling.poll())
        self.client.answers[gpu2_url] = None
        round_ = polling.poll()
        generation = self.discovery.current.generation
        polling.set_endpoints([LOCAL])
        self.assertEqual(self.client.cancelled, [gpu2_url])
        self.successResultOf(round_)
        self.assertEqual(self.advertised(), {"local": ["m:latest"]})
        self.assertEqual(self.discovery.current.generation, generation + 1)
        self.client.answers[OPENAI.base_url + "/v1/models"] = {"data": [{"id": "q"}]}
        polling.set_endpoints([LOCAL, OPENAI])
        self.assertEqual(self.advertised("lmstudio"), {}, "not asked yet")
        self.successResultOf(polling.poll())
        self.assertEqual(self.advertised("lmstudio"), {"local": ["q"]})
