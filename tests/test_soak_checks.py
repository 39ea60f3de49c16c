"""
The chaos soak's per-request checks (C{bench.soak.checks}) on recorded data:
what counts as a dispatch after the answer, and what only looks like one.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from bench.soak.checks import Bounds, Report, check
from bench.soak.client import Answer

BOUNDS = Bounds(
    max_attempts=5, deadline=6.0, dial_timeout=1.0, header_timeout=1.5, backoff_max=0.4
)
LATE_READ = "read after the answer, dispatched before it"


def _answer() -> Answer:
    """A 2xx the client got whole from n2's receipt 7."""
    return Answer(
        soak="s1",
        index=1,
        worker=0,
        model="m",
        stream=False,
        plan=None,
        t_send=10.0,
        wall_send=1000.0,
        t_head=10.007,
        t_end=10.0071,
        wall_end=1000.0071,
        status=200,
        headers={
            "x-soak-node": "n2",
            "x-soak-receipt": "7",
            "content-type": "application/json",
        },
        body=b'{"id": "soak-n2-7"}',
        complete=True,
    )


def _receipt(node: str, number: int, t_recv: float, **fields: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "kind": "receipt",
        "soak": "s1",
        "node": node,
        "receipt": number,
        "t_recv": t_recv,
        "fault": "ok",
        "stream": False,
        "model": "m",
        "status": 200,
        "t_head": t_recv + 0.0001,
        "t_first": t_recv + 0.0001,
        "t_done": t_recv + 0.0001,
        "end": "complete",
        "t_end": t_recv + 0.0002,
    }
    values.update(fields)
    return values


ANSWERED = _receipt("n2", 7, 10.0062)
READ_LATE = _receipt(
    "n0",
    3,
    10.0093,
    fault="empty",
    t_head=None,
    t_first=None,
    t_done=None,
    end="peer_closed",
)
"""n0's engine got to the request 3 ms after n2 had answered, and found the
connection already closed by the proxy."""


def _workload(*nodes: str) -> list[dict[str, Any]]:
    """The events of one workload dispatched to C{nodes} in turn, the last
    one answering."""
    infos: list[dict[str, Any]] = []
    for node in nodes:
        infos.append({"state": "queued"})
        infos.append({"state": "queued", "scheduledOn": node})
    infos.append({"state": "running", "scheduledOn": nodes[-1]})
    infos.append({"state": "completed", "scheduledOn": nodes[-1]})
    methods = ["workload:submitted"] * (2 * len(nodes))
    methods += ["workload:started", "workload:completed"]
    return [
        {
            "method": method,
            "params": {
                "workloadInfo": {
                    "id": "1",
                    "model": "m",
                    "createdAt": 1_000_000,
                    "seq": seq,
                    **info,
                }
            },
        }
        for seq, (method, info) in enumerate(zip(methods, infos, strict=True), 1)
    ]


def _check(receipts: list[dict[str, Any]], workload: list[dict[str, Any]]) -> Report:
    return check([_answer()], receipts, [], workload, BOUNDS)


def _kinds(report: Report) -> set[str]:
    return {v.kind for v in report.violations}


class LateReadTests(SynchronousTestCase):
    def test_dispatched_before_the_answer(self) -> None:
        """
        A receipt its engine read after the answer, for a dispatch the
        workload made (and the proxy let go of) before the answering one,
        is no dispatch after the answer.
        """
        report = _check([ANSWERED, READ_LATE], _workload("n0", "n2"))
        self.assertEqual(report.violations, [])
        self.assertEqual(report.excused[LATE_READ], 1)

    def test_engine_closed_first(self) -> None:
        """
        The late engine's own fault (an abort: it closes without answering)
        may end the receipt before it sees the proxy's close: still no
        answer from it, still dispatched before the answering one.
        """
        aborted = {**READ_LATE, "fault": "abort", "status": None, "end": "aborted_fin"}
        report = _check([ANSWERED, aborted], _workload("n0", "n2"))
        self.assertEqual(report.violations, [])
        self.assertEqual(report.excused[LATE_READ], 1)

    def test_dispatched_after_the_answer(self) -> None:
        """The same receipt, but the workload went to n0 after n2: violations."""
        report = _check([ANSWERED, READ_LATE], _workload("n2", "n0"))
        self.assertLessEqual(
            {"dispatch-after-commit", "answer-not-last-receipt"}, _kinds(report)
        )
        self.assertEqual(report.excused[LATE_READ], 0)

    def test_answered_after_the_answer(self) -> None:
        """An engine that answered after the commit did get the request late."""
        answered_late = _receipt("n0", 3, 10.0093, status=503, end="complete")
        report = _check([ANSWERED, answered_late], _workload("n0", "n2"))
        self.assertIn("dispatch-after-commit", _kinds(report))

    def test_one_dispatch_explains_one_receipt(self) -> None:
        """
        A node dispatched to once before the answer explains one receipt of
        it: an earlier receipt of the same node already took that dispatch.
        """
        earlier = _receipt("n0", 2, 10.001, status=503, end="complete")
        report = _check([earlier, ANSWERED, READ_LATE], _workload("n0", "n2"))
        self.assertIn("dispatch-after-commit", _kinds(report))
        report = _check([earlier, ANSWERED, READ_LATE], _workload("n0", "n0", "n2"))
        self.assertEqual(report.violations, [])
