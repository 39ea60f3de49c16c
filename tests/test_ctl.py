"""
Tests for L{nvproxy.ctl._format}: what nvproxyctl shows people.
"""

from __future__ import annotations

import textwrap

from twisted.trial.unittest import SynchronousTestCase

from nvproxy.ctl._format import FORMATTERS, refusal, table


class FormatTests(SynchronousTestCase):
    def test_table(self) -> None:
        self.assertEqual(
            table(["A", "LONGER"], [["x", None], ["yyyy", [1, 2]], ["z", True]]),
            "A     LONGER\nx     -\nyyyy  1, 2\nz     yes",
        )

    def test_workloads(self) -> None:
        answer = {
            "workloads": [
                {
                    "workloadInfo": {
                        "id": "w1",
                        "engine": "vllm",
                        "model": "qwen",
                        "scheduledOn": "gpu-1",
                        "state": "completed",
                        "createdAt": 1000,
                        "completedAt": 3500,
                        "stats": {"ttftMs": 41, "tokensPerSecond": 37.25},
                        "requestId": "req-1",
                    }
                },
                {
                    "workloadInfo": {
                        "id": "w2",
                        "engine": "ollama",
                        "model": "llama3:latest",
                        "state": "running",
                        "createdAt": 4000,
                        "completedAt": None,
                    }
                },
            ]
        }
        self.assertEqual(
            FORMATTERS["workloads"](answer),
            "\n".join(
                [
                    "ID  ENGINE  MODEL          NODE   STATE      TTFT  TOK/S  DURATION"
                    "  REQUEST ID",
                    "w1  vllm    qwen           gpu-1  completed  41ms  37.2   2.5s    "
                    "  req-1",
                    "w2  ollama  llama3:latest  -      running    -     -      -       "
                    "  -",
                ]
            ),
        )
        self.assertEqual(FORMATTERS["workloads"]({"workloads": []}), "no workloads yet")

    def test_status_vllm(self) -> None:
        answer = {
            "node_id": "n",
            "inflight": 1,
            "facades": [],
            "nodes": {},
            "reservations": {},
            "vllm": [
                {
                    "name": "text",
                    "state": "asleep",
                    "sleep_depth": "sleeping",
                    "active_requests": 0,
                    "last_activity": "2026-01-01T00:00:00Z",
                    "wake_estimate_s": 12.5,
                }
            ],
        }
        self.assertIn(
            textwrap.dedent(
                """\
                vLLM services:
                SERVICE  STATE   DEPTH     ACTIVE  LAST ACTIVITY         WAKE EST.
                text     asleep  sleeping  0       2026-01-01T00:00:00Z  12.5s"""
            ),
            FORMATTERS["status"](answer),
        )

    def test_sentences(self) -> None:
        self.assertEqual(
            FORMATTERS["reload"](
                {"changed": ["limits"], "restart_required": ["state_dir"]}
            ),
            "configuration reloaded: changed limits\n"
            "state_dir changed: it takes effect at the next restart",
        )
        self.assertEqual(
            FORMATTERS["select"]({"engine": "ollama", "selected": None}),
            "ollama: no node selected",
        )
        self.assertEqual(
            FORMATTERS["set-port"]({"engine": "vllm", "port": 8001}),
            "vllm facade now listens on port 8001",
        )

    def test_refusal(self) -> None:
        self.assertEqual(
            refusal({"error": "configuration refused", "errors": ["a: bad"]}, b""),
            ["configuration refused", "a: bad"],
        )
        self.assertEqual(refusal(None, b"oops\n"), ["oops"])


class FleetFormatTests(SynchronousTestCase):
    """Discovery, readiness and drain as nvproxyctl shows them."""

    def test_status_fleet(self) -> None:
        answer = {
            "node_id": "a",
            "inflight": 0,
            "draining": True,
            "discovery": {
                "provider": "etcd",
                "endpoint": "http://10.0.0.9:2379",
                "state": "live",
                "revision": 42,
                "records": 3,
                "snapshot_age_s": 0.0,
                "error": None,
            },
            "facades": [],
            "nodes": {},
            "reservations": {},
            "records": [
                {
                    "node": "a",
                    "draining": True,
                    "engines": {
                        "vllm": {
                            "models": {
                                "q": {"readiness": "sleeping", "wake_estimate_s": 6.0}
                            }
                        }
                    },
                },
                {
                    "node": "b",
                    "draining": False,
                    "engines": {
                        "vllm": {
                            "models": {
                                "q": {"readiness": "awake", "wake_estimate_s": 0.0}
                            }
                        }
                    },
                },
            ],
        }
        text = FORMATTERS["status"](answer)
        lines = text.splitlines()
        self.assertEqual(
            lines[:2],
            [
                "node a: 0 in flight, draining (no new dispatches while others own"
                " its models)",
                "discovery: etcd http://10.0.0.9:2379 live, revision 42, 3 record(s),"
                " snapshot age 0.0s",
            ],
        )
        start = lines.index("readiness:")
        self.assertEqual(
            lines[start + 1 : start + 4],
            [
                "NODE  ENGINE  MODEL  READINESS  WAKE EST.  DRAINING",
                "a     vllm    q      sleeping   6.0s       yes",
                "b     vllm    q      awake      -          no",
            ],
        )

    def test_drain(self) -> None:
        self.assertEqual(
            FORMATTERS["drain"]({"node_id": "b", "draining": False}),
            "b is back in rotation",
        )
        self.assertIn(
            "b is draining", FORMATTERS["drain"]({"node_id": "b", "draining": True})
        )
