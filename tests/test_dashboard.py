"""
The Grafana dashboard under deploy/ names only series nvproxy exports, and
shows every series of the model/node observability metrics.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.metrics import Metrics
from nvproxy.outliers import EjectionPolicy, OutlierTable
from nvproxy.vllm._manager import _Metrics as VllmMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana-dashboard.json"

_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
}

#: The series this dashboard exists for (model and node observability).
SHOWN = {
    "nvproxy_requests_total",
    "nvproxy_time_to_first_token_seconds_bucket",
    "nvproxy_request_duration_seconds_bucket",
    "nvproxy_prompt_tokens_total",
    "nvproxy_completion_tokens_total",
    "nvproxy_tokens_per_second_bucket",
    "nvproxy_node_inflight_requests",
    "nvproxy_reservations",
    "nvproxy_vllm_service_state",
}


def exported() -> set[str]:
    """Every sample name nvproxy's registry can expose."""
    registry = CollectorRegistry()
    Metrics(
        registry,
        reservations=lambda: {"n": 0},
        outliers=OutlierTable(Clock(), EjectionPolicy(1.0, 2.0)),
        known_model=lambda engine, model: True,
        vllm_services=lambda: [{"name": "s", "state": "awake"}],
    )
    VllmMetrics(registry)
    names = set()
    for family in registry.collect():
        for suffix in _SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def expressions(dashboard: Any) -> list[str]:
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append(target["expr"])
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            found.append(query["query"])
    return found


class DashboardTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dashboard = json.loads(DASHBOARD.read_text())
        self.names = {
            name
            for expr in expressions(self.dashboard)
            for name in re.findall(r"\bnvproxy_[a-z_]+", expr)
        }

    def test_every_expression_names_an_exported_series(self) -> None:
        self.assertTrue(self.names)
        self.assertEqual(self.names - exported(), set())

    def test_every_panel_queries_nvproxy(self) -> None:
        for panel in self.dashboard["panels"]:
            exprs = [t["expr"] for t in panel["targets"]]
            self.assertTrue(exprs, panel["title"])
            for expr in exprs:
                self.assertRegex(expr, r"\bnvproxy_", panel["title"])

    def test_shows_the_observability_series(self) -> None:
        self.assertEqual(SHOWN - self.names, set())
        self.assertLessEqual(SHOWN, exported())

    def test_variables_are_used(self) -> None:
        text = json.dumps(self.dashboard["panels"])
        for name in ("$engine", "$model", "$node", "${datasource}"):
            self.assertIn(name, text)
