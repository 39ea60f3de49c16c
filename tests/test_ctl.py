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
            textwrap.dedent(
                """\
                ID  ENGINE  MODEL          NODE   STATE      TTFT  TOK/S  DURATION
                w1  vllm    qwen           gpu-1  completed  41ms  37.2   2.5s
                w2  ollama  llama3:latest  -      running    -     -      -"""
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
