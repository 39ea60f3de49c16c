"""
The bounded chaos soak (C{python -m bench.soak}, see C{bench/README.rst}):
about 500 requests over 3 nodes at concurrency 16 with faults, node churn and
client disconnects, every request checked against spec §5.4, then leak checks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from twisted.internet import reactor
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import TestCase

ROOT = Path(__file__).resolve().parent.parent


class BoundedSoakTests(TestCase):
    timeout = 150

    async def test_bounded_soak(self) -> None:
        """
        The soak finds no violation, no leak and no unhandled error, and it
        ran every request it was asked to.
        """
        out_json = os.path.abspath(self.mktemp())
        d = getProcessOutputAndValue(
            sys.executable,
            [
                "-m",
                "bench.soak",
                "--requests",
                "500",
                "--concurrency",
                "16",
                "--nodes",
                "3",
                "--seed",
                "9",
                "--quiet",
                "--json",
                out_json,
            ],
            env=dict(os.environ),
            path=str(ROOT),
            reactor=reactor,
        )
        out, err, code = await d
        text = (out + err).decode("utf-8", "replace")
        self.assertEqual(code, 0, text)
        result = json.loads(Path(out_json).read_text())
        self.assertEqual(result["requests"], 500, text)
        self.assertEqual(result["violations"], [], text)
        self.assertEqual(result["leaks"]["problems"], [], text)
        self.assertEqual(result["leaks"]["log_lines"], [], text)
        # The faults really happened: retries, truncations, disconnects.
        self.assertGreater(result["dispatches"], result["requests"], text)
        self.assertGreater(sum(result["faults"].values()), result["requests"], text)
