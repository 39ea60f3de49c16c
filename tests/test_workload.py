# -*- test-case-name: tests.test_workload -*-
"""Tests for nvproxy.workload."""

from __future__ import annotations

import io
import json
from typing import Any

from attrs import frozen
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.internet.testing import EventLoggingObserver
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.inferstats import Stats
from nvproxy.workload import (
    JsonLinesSink,
    RingSink,
    WorkloadInfo,
    WorkloadRecorder,
    WorkloadSink,
)

TERMINAL_METHODS = ("workload:completed", "workload:errored")
NODE_A = "11111111-1111-1111-1111-111111111111"
NODE_B = "22222222-2222-2222-2222-222222222222"
STATS = Stats(12, 340, 42.3, 812)


@frozen
class FakeOutcome:
    """Shaped like the dispatcher's JobOutcome."""

    state: str
    status: int | None = None
    node_id: str | None = None
    attempts: int = 1
    reason: str | None = None


class ListSink:
    def __init__(self) -> None:
        self.events: list[tuple[str, WorkloadInfo]] = []

    def emit(self, method: str, info: WorkloadInfo) -> None:
        self.events.append((method, info))

    def summary(self) -> list[tuple[str, str, str | None, int]]:
        return [(m, i.state, i.scheduledOn, i.seq) for m, i in self.events]


class RecorderTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1716998400)
        self.sink = ListSink()
        self.recorder = WorkloadRecorder(
            self.clock, [self.sink], "3ce8a1740b62df95", originated_from=""
        )

    def test_completed(self) -> None:
        tracker = self.recorder.begin("ollama", "llama3:latest")
        tracker.admitted()
        tracker.dispatching(NODE_B, 1)
        self.clock.advance(0.812)
        tracker.committed(NODE_B, 200)
        self.clock.advance(11.188)
        tracker.finished(FakeOutcome("completed", 200, NODE_B), STATS)
        self.assertEqual(
            self.sink.summary(),
            [
                ("workload:submitted", "queued", None, 1),
                ("workload:submitted", "queued", NODE_B, 2),
                ("workload:started", "running", NODE_B, 3),
                ("workload:completed", "completed", NODE_B, 4),
            ],
        )
        final = self.sink.events[-1][1]
        self.assertEqual(
            (final.createdAt, final.startedAt, final.completedAt),
            (1716998400000, 1716998400812, 1716998412000),
        )
        self.assertEqual(final.stats, STATS)
        self.assertIsNone(final.error)
        self.assertTrue(tracker.done)
        self.assertEqual(tracker.info, final)

    def test_truncated_says_so(self) -> None:
        """
        A committed stream cut short stays completed (§1.1); its terminal
        event carries C{truncated}, which a whole answer omits.
        """
        tracker = self.recorder.begin("ollama", "llama3:latest")
        tracker.admitted()
        tracker.dispatching(NODE_B, 1)
        tracker.committed(NODE_B, 200)
        tracker.finished(FakeOutcome("completed", 200, NODE_B, 1, "truncated"), STATS)
        final = self.sink.events[-1][1]
        self.assertEqual((final.state, final.truncated), ("completed", True))
        self.assertIs(final.to_json()["truncated"], True)
        self.assertNotIn("truncated", self.sink.events[-2][1].to_json())

    def test_whole_answer_has_no_truncated_key(self) -> None:
        tracker = self.recorder.begin("ollama", "llama3:latest")
        tracker.admitted()
        tracker.committed(NODE_B, 200)
        tracker.finished(FakeOutcome("completed", 200, NODE_B, 1, "complete"), STATS)
        self.assertNotIn("truncated", self.sink.events[-1][1].to_json())

    def test_failed_after_retries(self) -> None:
        tracker = self.recorder.begin("ollama", "llama3:latest")
        tracker.admitted()
        tracker.dispatching(NODE_A, 1)
        tracker.dispatching(NODE_B, 2)
        tracker.between_attempts()
        tracker.dispatching(NODE_A, 3)
        tracker.between_attempts()
        tracker.finished(FakeOutcome("failed", 503, None, 3, "deadline passed"), STATS)
        self.assertEqual(
            self.sink.summary(),
            [
                ("workload:submitted", "queued", None, 1),
                ("workload:submitted", "queued", NODE_A, 2),
                ("workload:submitted", "queued", NODE_B, 3),
                ("workload:submitted", "queued", None, 4),
                ("workload:submitted", "queued", NODE_A, 5),
                ("workload:submitted", "queued", None, 6),
                ("workload:errored", "failed", None, 7),
            ],
        )
        final = self.sink.events[-1][1]
        self.assertEqual(final.error, "deadline passed")
        self.assertIsNone(final.stats)
        self.assertIsNone(final.startedAt)

    def test_failed_final_attempt_keeps_placement(self) -> None:
        """
        Budget exhausted on the last attempt: scheduledOn is unchanged from it, and
        with no reason the error names the status.
        """
        tracker = self.recorder.begin("llamacpp", "m")
        tracker.admitted()
        tracker.dispatching(NODE_A, 1)
        tracker.finished(FakeOutcome("failed", 502, NODE_A, 5))
        self.assertEqual(
            self.sink.summary()[-1], ("workload:errored", "failed", NODE_A, 3)
        )
        self.assertEqual(self.sink.events[-1][1].error, "upstream status 502")

    def test_committed_non_2xx(self) -> None:
        """A committed error response is failed and is never measured."""
        tracker = self.recorder.begin("ollama", "llama3:latest")
        tracker.admitted()
        tracker.dispatching(NODE_A, 1)
        tracker.committed(NODE_A, 400)
        tracker.finished(FakeOutcome("failed", 400, NODE_A), STATS)
        self.assertEqual(
            self.sink.summary(),
            [
                ("workload:submitted", "queued", None, 1),
                ("workload:submitted", "queued", NODE_A, 2),
                ("workload:started", "running", NODE_A, 3),
                ("workload:errored", "failed", NODE_A, 4),
            ],
        )
        final = self.sink.events[-1][1]
        self.assertIsNone(final.stats)
        self.assertEqual(final.error, "upstream status 400")

    def test_committed_error_names_the_status(self) -> None:
        """
        The dispatcher's reason for a committed answer is how the copy ended
        ("complete"); the error of a failed one is the engine's status.
        """
        tracker = self.recorder.begin("ollama", "m")
        tracker.admitted()
        tracker.dispatching(NODE_A, 1)
        tracker.committed(NODE_A, 429)
        tracker.finished(FakeOutcome("failed", 429, NODE_A, reason="complete"))
        self.assertEqual(self.sink.events[-1][1].error, "upstream status 429")

    def test_committed_3xx_stats_kept(self) -> None:
        tracker = self.recorder.begin("ollama", "m")
        tracker.committed(NODE_A, 302)
        tracker.finished(FakeOutcome("failed", 302, NODE_A), STATS)
        self.assertEqual(self.sink.events[-1][1].stats, STATS)

    def test_cancelled(self) -> None:
        tracker = self.recorder.begin("vllm", "qwen")
        tracker.admitted()
        tracker.dispatching(NODE_A, 1)
        tracker.finished(FakeOutcome("cancelled", None, None, 1, "client gone"))
        self.assertEqual(
            self.sink.summary(),
            [
                ("workload:submitted", "queued", None, 1),
                ("workload:submitted", "queued", NODE_A, 2),
                ("workload:errored", "cancelled", NODE_A, 3),
            ],
        )
        self.assertEqual(self.sink.events[-1][1].error, "client gone")

    def test_cancelled_after_commit_measured(self) -> None:
        tracker = self.recorder.begin("vllm", "qwen")
        tracker.committed(NODE_A, 200)
        tracker.finished(FakeOutcome("cancelled", 200, NODE_A), STATS)
        self.assertEqual(self.sink.events[-1][1].stats, STATS)

    def test_stats_need_commit(self) -> None:
        tracker = self.recorder.begin("ollama", "m")
        tracker.finished(FakeOutcome("completed", 200), STATS)
        self.assertIsNone(self.sink.events[-1][1].stats)

    def test_exactly_one_terminal(self) -> None:
        tracker = self.recorder.begin("ollama", "m")
        tracker.admitted()
        tracker.finished(FakeOutcome("cancelled"))
        tracker.finished(FakeOutcome("completed", 200))
        tracker.dispatching(NODE_A, 2)
        tracker.committed(NODE_A, 200)
        tracker.between_attempts()
        self.assertEqual(
            [m for m, _ in self.sink.events],
            ["workload:submitted", "workload:errored"],
        )

    def test_no_queued_after_commit(self) -> None:
        tracker = self.recorder.begin("ollama", "m")
        tracker.committed(NODE_A, 200)
        tracker.between_attempts()
        tracker.dispatching(NODE_B, 2)
        tracker.committed(NODE_B, 200)
        tracker.finished(FakeOutcome("completed", 200, NODE_A))
        self.assertEqual(
            self.sink.summary(),
            [
                ("workload:started", "running", NODE_A, 1),
                ("workload:completed", "completed", NODE_A, 2),
            ],
        )

    def test_seq_monotonic_across_trackers(self) -> None:
        first = self.recorder.begin("ollama", "a")
        second = self.recorder.begin("vllm", "b")
        first.admitted()
        second.admitted()
        first.dispatching(NODE_A, 1)
        second.dispatching(NODE_A, 1)
        first.finished(FakeOutcome("completed", 200))
        self.assertEqual([i.seq for _, i in self.sink.events], [1, 2, 3, 4, 5])
        self.assertEqual([i.id for _, i in self.sink.events], list("12121"))
        self.assertEqual(self.recorder.seq, 5)

    @given(
        st.lists(
            st.tuples(
                st.integers(0, 3),
                st.sampled_from(["admit", "dispatch", "between", "commit", "end"]),
            ),
            max_size=60,
        )
    )
    @settings(deadline=None)
    def test_random_hooks_invariants(self, steps: list[tuple[int, str]]) -> None:
        """
        Over any interleaving of hooks on several trackers: seq runs 1, 2, 3...
        across them, each workload has at most one terminal event and nothing after
        it, and queued events never follow a started one.
        """
        sink = ListSink()
        recorder = WorkloadRecorder(Clock(), [sink], "run")
        trackers = [recorder.begin("ollama", "m") for _ in range(4)]
        for index, hook in steps:
            t = trackers[index]
            if hook == "admit":
                t.admitted()
            elif hook == "dispatch":
                t.dispatching(NODE_A, 1)
            elif hook == "between":
                t.between_attempts()
            elif hook == "commit":
                t.committed(NODE_A, 200)
            else:
                t.finished(FakeOutcome("completed", 200))
        self.assertEqual(
            [i.seq for _, i in sink.events], list(range(1, len(sink.events) + 1))
        )
        for tracker in trackers:
            methods = [m for m, i in sink.events if i.id == tracker.info.id]
            terminal = [
                n for n, m in enumerate(methods) if m.startswith("workload:comp")
            ]
            self.assertLessEqual(len(terminal), 1)
            if terminal:
                self.assertEqual(terminal[0], len(methods) - 1)
            states = [i.state for _, i in sink.events if i.id == tracker.info.id]
            if "running" in states:
                started = states.index("running")
                self.assertNotIn("queued", states[started:])
                self.assertEqual(states.count("running"), 1)

    def test_failing_sink_isolated(self) -> None:
        class Broken:
            def emit(self, method: str, info: WorkloadInfo) -> None:
                raise OSError("disk full")

        logged = EventLoggingObserver()
        globalLogPublisher.addObserver(logged)
        self.addCleanup(globalLogPublisher.removeObserver, logged)
        broken: WorkloadSink = Broken()
        recorder = WorkloadRecorder(self.clock, [broken, self.sink], "run")
        recorder.begin("ollama", "m").admitted()
        self.assertEqual(len(self.sink.events), 1)
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)
        self.assertEqual(
            [(e["log_level"], e["method"], e["seq"]) for e in logged],
            [(LogLevel.critical, "workload:submitted", 1)],
        )


class JsonShapeTests(SynchronousTestCase):
    def test_spec_example(self) -> None:
        """The terminal event is byte-for-byte the spec's example (§5.5)."""
        clock = Clock()
        clock.advance(1716998400)
        out = io.StringIO()
        recorder = WorkloadRecorder(clock, [JsonLinesSink(out)], "3ce8a1740b62df95")
        for _ in range(16):
            recorder.begin("ollama", "other")
        tracker = recorder.begin("ollama", "llama3:latest")
        tracker.admitted()
        tracker.dispatching(NODE_B, 1)
        tracker.committed(NODE_B, 200)
        clock.advance(12)
        tracker.finished(FakeOutcome("completed", 200, NODE_B), STATS)
        lines = out.getvalue().splitlines()
        self.assertEqual(len(lines), 4)
        self.assertEqual(
            lines[-1],
            '{"jsonrpc":"2.0","method":"workload:completed","params":{"workloadInfo":'
            '{"id":"17","model":"llama3:latest","engine":"ollama",'
            '"runId":"3ce8a1740b62df95","state":"completed","originatedFrom":"",'
            '"scheduledOn":"22222222-2222-2222-2222-222222222222",'
            '"createdAt":1716998400000,"startedAt":1716998400000,'
            '"completedAt":1716998412000,"error":null,"requesterId":null,"seq":4,'
            '"stats":{"promptTokens":12,"completionTokens":340,'
            '"tokensPerSecond":42.3,"ttftMs":812}}}}',
        )
        first = json.loads(lines[0])
        self.assertNotIn("scheduledOn", first["params"]["workloadInfo"])
        self.assertNotIn("stats", first["params"]["workloadInfo"])


class RingSinkTests(SynchronousTestCase):
    def run_workloads(self, ring: RingSink, count: int) -> WorkloadRecorder:
        clock = Clock()
        recorder = WorkloadRecorder(clock, [ring], "run")
        for _ in range(count):
            clock.advance(1)
            tracker = recorder.begin("ollama", "m")
            tracker.admitted()
            tracker.dispatching(NODE_A, 1)
            tracker.committed(NODE_A, 200)
            tracker.finished(FakeOutcome("completed", 200, NODE_A), STATS)
        return recorder

    def test_recent_with_events(self) -> None:
        ring = RingSink()
        self.run_workloads(ring, 2)
        recent = ring.recent(10)
        self.assertEqual([w["workloadInfo"]["id"] for w in recent], ["2", "1"])
        self.assertEqual(
            [e["method"] for e in recent[0]["events"]],
            [
                "workload:submitted",
                "workload:submitted",
                "workload:started",
                "workload:completed",
            ],
        )
        self.assertEqual(recent[0]["workloadInfo"]["state"], "completed")
        self.assertEqual(recent[0]["workloadInfo"]["stats"], STATS.to_json())

    def test_ring_limit(self) -> None:
        ring = RingSink(maxlen=3)
        recorder = self.run_workloads(ring, 5)
        running = recorder.begin("ollama", "m")
        running.admitted()
        recent = ring.recent()
        self.assertEqual(
            [w["workloadInfo"]["id"] for w in recent], ["6", "5", "4", "3"]
        )
        self.assertEqual(recent[0]["workloadInfo"]["state"], "queued")
        self.assertEqual(len(ring.recent(2)), 2)
        self.assertEqual(ring.recent(0), [])

    def test_active_not_evicted(self) -> None:
        """An unfinished workload survives any number of finished ones."""
        ring = RingSink(maxlen=2)
        clock = Clock()
        recorder = WorkloadRecorder(clock, [ring], "run")
        long = recorder.begin("ollama", "m")
        long.admitted()
        for _ in range(5):
            t = recorder.begin("ollama", "m")
            t.admitted()
            t.finished(FakeOutcome("completed", 200))
        long.finished(FakeOutcome("cancelled"))
        ids = [w["workloadInfo"]["id"] for w in ring.recent()]
        self.assertEqual(ids, ["6", "1"])
        self.assertEqual(len(ring.recent()[1]["events"]), 2)

    def test_bad_maxlen(self) -> None:
        self.assertRaises(ValueError, RingSink, 0)

    def test_fields_partitioned(self) -> None:
        """Every field is stored once: constant per workload or per event."""
        import attrs

        from nvproxy.workload import _CONSTANT, _VARYING

        self.assertEqual(
            sorted([*_CONSTANT, *_VARYING]), sorted(attrs.fields_dict(WorkloadInfo))
        )
        self.assertFalse(set(_CONSTANT) & set(_VARYING))

    @settings(max_examples=60)
    @given(
        st.lists(
            st.lists(
                st.one_of(
                    st.just(("admitted",)),
                    st.tuples(
                        st.just("dispatching"), st.sampled_from([NODE_A, NODE_B])
                    ),
                    st.just(("between",)),
                    st.tuples(
                        st.just("committed"),
                        st.sampled_from([NODE_A, NODE_B]),
                        st.sampled_from([200, 404, 503]),
                    ),
                    st.tuples(
                        st.just("finished"),
                        st.sampled_from(["completed", "failed", "cancelled"]),
                        st.sampled_from([None, 200, 502]),
                        st.sampled_from([None, "truncated", "client went away"]),
                        st.booleans(),
                    ),
                    st.tuples(st.just("tick"), st.integers(0, 3000)),
                ),
                max_size=8,
            ),
            min_size=1,
            max_size=6,
        ),
        st.integers(1, 4),
    )
    def test_same_json_as_each_event(
        self, scripts: list[list[tuple[Any, ...]]], maxlen: int
    ) -> None:
        """
        What the ring reports is, event for event, the JSON of the record each
        event carried: its compact storage loses and invents nothing.
        """
        ring = RingSink(maxlen=maxlen)
        oracle = ListSink()
        clock = Clock()
        clock.advance(1716998400)
        recorder = WorkloadRecorder(clock, [ring, oracle], "run", "origin")
        trackers = [
            recorder.begin(
                "ollama",
                f"m{n}",
                requester_id=None if n % 2 else f"key{n}",
                request_id=None if n % 3 else f"req{n}",
            )
            for n in range(len(scripts))
        ]
        # Interleave the workloads' hooks, one step of each in turn.
        for step in range(max(map(len, scripts))):
            for tracker, script in zip(trackers, scripts, strict=True):
                if step >= len(script):
                    continue
                hook = script[step]
                if hook[0] == "admitted":
                    tracker.admitted()
                elif hook[0] == "dispatching":
                    tracker.dispatching(hook[1], 1)
                elif hook[0] == "between":
                    tracker.between_attempts()
                elif hook[0] == "committed":
                    tracker.committed(hook[1], hook[2])
                elif hook[0] == "finished":
                    stats = STATS if hook[4] else None
                    tracker.finished(
                        FakeOutcome(hook[1], hook[2], reason=hook[3]), stats
                    )
                else:
                    clock.advance(hook[1] / 1000)
        by_id: dict[str, list[tuple[str, WorkloadInfo]]] = {}
        for method, info in oracle.events:
            by_id.setdefault(info.id, []).append((method, info))
        finished = sorted(
            (i for i, events in by_id.items() if events[-1][0] in TERMINAL_METHODS),
            key=lambda i: by_id[i][-1][1].seq,
        )
        kept = {i for i in by_id if i not in finished} | set(finished[-maxlen:])
        expected = sorted(
            (by_id[i] for i in kept),
            key=lambda events: (events[0][1].createdAt, events[0][1].seq),
            reverse=True,
        )
        self.assertEqual(
            ring.recent(),
            [
                {
                    "workloadInfo": events[-1][1].to_json(),
                    "events": [
                        {"method": m, "workloadInfo": i.to_json()} for m, i in events
                    ],
                }
                for events in expected
            ],
        )

    def test_finished_entry_small(self) -> None:
        """
        A finished workload of four events holds under 1 KB in the ring (a
        record per event was about 1.9 KB): the ring keeps a thousand.
        Measured with tracemalloc, which counts allocations, not time.
        """
        import gc
        import tracemalloc

        ring = RingSink(maxlen=200)
        self.run_workloads(ring, 10)  # warm: interned names, the deque's blocks
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            recorder = self.run_workloads(ring, 200)
            del recorder
            gc.collect()
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        self.assertLess((after - before) / 190, 1024)


class ChangedTests(SynchronousTestCase):
    def test_begin_record_complete(self) -> None:
        """
        begin sets every field as the frozen __init__ would: the same
        record, hashable, frozen, and evolve works on it.
        """
        import attrs

        recorder = WorkloadRecorder(Clock(), [], "run", "origin")
        info = recorder.begin("ollama", "m", requester_id="k", request_id="q").info
        self.assertEqual(sorted(info.__dict__), sorted(attrs.fields_dict(WorkloadInfo)))
        self.assertEqual(info, WorkloadInfo(**info.__dict__))
        self.assertEqual(hash(info), hash(WorkloadInfo(**info.__dict__)))
        self.assertEqual(attrs.evolve(info, seq=3).seq, 3)
        with self.assertRaises(attrs.exceptions.FrozenInstanceError):
            info.state = "running"  # type: ignore[misc]

    @given(
        st.dictionaries(
            st.sampled_from(
                ["state", "scheduledOn", "startedAt", "completedAt", "error", "seq"]
            ),
            st.one_of(st.none(), st.integers(0, 10**6), st.text(max_size=5)),
        )
    )
    def test_same_as_evolve(self, changes: dict[str, Any]) -> None:
        """The fast copy equals attrs.evolve, hashes alike, and stays frozen."""
        import attrs

        from nvproxy.workload import WorkloadInfo, _changed

        info = WorkloadInfo(
            id="1",
            model="m",
            engine="e",
            runId="r",
            state="queued",
            originatedFrom="",
            scheduledOn=None,
            createdAt=1,
            startedAt=None,
            completedAt=None,
            error=None,
            requesterId=None,
            seq=0,
        )
        fast = _changed(info, dict(changes))
        slow = attrs.evolve(info, **changes)
        self.assertEqual(fast, slow)
        self.assertEqual(hash(fast), hash(slow))
        self.assertEqual(fast.to_json(), slow.to_json())
        self.assertEqual(info.state, "queued")  # the original is untouched
        with self.assertRaises(attrs.exceptions.FrozenInstanceError):
            fast.state = "running"  # type: ignore[misc]
