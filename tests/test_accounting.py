"""
Integration tests for scheduling and accounting: burst spreading across
facades, pins, workload events with stats, metrics (spec §5 steps 2-3, §5.5,
§6).  The whole nvproxy and its fake engines run on a L{MemoryNetwork}:
simulated time, no sockets.
"""

from __future__ import annotations

import json
import os
from typing import Any

from attrs import evolve
from twisted.internet.defer import gatherResults

from nvproxy.proxy import facade
from nvproxy.testing.fakeengine import Behaviour, FakeEngine
from nvproxy.testing.harness import facade_url, proxy_config
from tests.test_forwarding import MemoryProxyTestCase


def _inference(engine: FakeEngine) -> list[str]:
    inventory = {"/api/tags", "/v1/models", "/models"}
    return [r.path for r in engine.requests if r.path not in inventory]


class BurstTests(MemoryProxyTestCase):
    def test_burst_spreads_across_facades(self) -> None:
        """
        A burst of concurrent requests on two facades spreads evenly over
        three equally loaded nodes: the reservation map is process-wide.
        """
        ollamas = []
        openais = []
        for _ in range(3):
            o = self.engine("ollama", ["m:latest"])
            o.default = Behaviour(latency=0.3, chunks=1)
            ollamas.append(o)
            a = self.engine("openai", ["m"])
            a.default = Behaviour(latency=0.3, chunks=1)
            openais.append(a)
        proxy = self.proxy(
            {"ollama": ollamas[0].url, "lmstudio": openais[0].url},
            nodes={
                "gpu-2": {"ollama": ollamas[1].url, "lmstudio": openais[1].url},
                "gpu-3": {"ollama": ollamas[2].url, "lmstudio": openais[2].url},
            },
        )
        requests = []
        for _ in range(6):
            requests.append(
                self.start_post(
                    facade_url(proxy, "ollama") + "/api/generate",
                    {"model": "m", "stream": False},
                )
            )
            requests.append(
                self.start_post(
                    facade_url(proxy, "lmstudio") + "/v1/completions",
                    {"model": "m", "prompt": "x"},
                )
            )
        answers = self.drive(gatherResults(requests, consumeErrors=True))
        self.assertEqual({code for code, _, _ in answers}, {200})
        per_node = [
            len(_inference(ollamas[i])) + len(_inference(openais[i])) for i in range(3)
        ]
        self.assertEqual(per_node, [4, 4, 4])
        # Every reservation was released when its request ended.
        self.assertEqual(set(proxy.ops.status()["reservations"].values()), {0})


class FleetTests(MemoryProxyTestCase):
    def test_targets_made_only_for_dispatches(self) -> None:
        """
        A model with forty owners: what dispatching to one takes is made
        only for the nodes dispatched to, and the request fails over as
        before.
        """
        engine = self.engine("ollama", ["m:latest"])
        engine.script(Behaviour(status=503))
        proxy = self.proxy(
            {"ollama": engine.url},
            nodes={f"gpu-{i:02d}": {"ollama": engine.url} for i in range(39)},
        )
        made: list[str] = []
        original = facade.HttpTarget

        def counting(*args: Any, **kwargs: Any) -> Any:
            target = original(*args, **kwargs)
            made.append(target.node_id)
            return target

        self.patch(facade, "HttpTarget", counting)
        code, _, _ = self.post(
            facade_url(proxy, "ollama") + "/api/generate",
            {"model": "m", "stream": False},
        )
        self.assertEqual(code, 200)
        self.assertEqual(len(_inference(engine)), 2)
        self.assertEqual(made, ["local", "gpu-00"])

    def test_round_lists_what_a_job_can_dispatch_to(self) -> None:
        """
        A model with forty owners: each round lists only as many of them
        as a job can dispatch to (C{dispatch.max_attempts}), and a job
        whose owners all fail still makes that many attempts.
        """
        engine = self.engine("ollama", ["m:latest"])
        engine.default = Behaviour(status=503)
        proxy = self.proxy(
            {"ollama": engine.url},
            nodes={f"gpu-{i:02d}": {"ollama": engine.url} for i in range(39)},
            max_attempts=3,
        )
        rounds: list[list[str]] = []
        original = facade._Candidates.resolve

        def listing(candidates: Any) -> Any:
            found = original(candidates)
            rounds.append([target.node_id for target in found])
            return found

        self.patch(facade._Candidates, "resolve", listing)
        code, _, _ = self.post(
            facade_url(proxy, "ollama") + "/api/generate",
            {"model": "m", "stream": False},
        )
        self.assertEqual(code, 503)
        self.assertEqual(len(_inference(engine)), 3)
        self.assertEqual(rounds, [["local", "gpu-00", "gpu-01"]])


class ClaimTests(MemoryProxyTestCase):
    def test_discovery_change_keeps_the_claim(self) -> None:
        """
        An inventory change while an attempt is in flight neither moves the
        reservation off the node doing the work nor takes another (§6).
        """
        a = self.engine("ollama", ["m:latest"])
        b = self.engine("ollama", ["m:latest"])
        a.default = Behaviour(latency=0.5)
        proxy = self.proxy({"ollama": a.url}, nodes={"gpu-2": {"ollama": b.url}})
        request = self.start_post(
            facade_url(proxy, "ollama") + "/api/generate",
            {"model": "m", "stream": False},
        )
        self.net.advance(0.1)
        self.assertNoResult(request)
        self.assertEqual(proxy.ops.status()["reservations"], {"gpu-2": 0, "local": 1})
        for model in ("x:latest", "y:latest"):
            b.models.append(model)
            self.drive(proxy.polling.poll())
            self.assertEqual(
                proxy.ops.status()["reservations"], {"gpu-2": 0, "local": 1}
            )
        self.assertNoResult(request)
        code, _, _ = self.drive(request)
        self.assertEqual(code, 200)
        self.assertEqual(proxy.ops.status()["reservations"], {"gpu-2": 0, "local": 0})


class PinTests(MemoryProxyTestCase):
    def test_pin_routes_first_and_ineligible_pin_ignored(self) -> None:
        local = self.engine("ollama", ["m:latest"])
        other = self.engine("ollama", ["m:latest"])
        third = self.engine("ollama", ["x:latest"])
        proxy = self.proxy(
            {"ollama": local.url},
            nodes={"gpu-2": {"ollama": other.url}, "gpu-3": {"ollama": third.url}},
        )
        url = facade_url(proxy, "ollama") + "/api/generate"
        proxy.ops.select("ollama", "gpu-2")
        for _ in range(3):
            code, _, _ = self.post(url, {"model": "m", "stream": False})
            self.assertEqual(code, 200)
        self.assertEqual(len(_inference(other)), 3)
        self.assertEqual(_inference(local), [])
        # gpu-3 does not advertise m: pinning it never sends m there.
        proxy.ops.select("ollama", "gpu-3")
        code, _, _ = self.post(url, {"model": "m", "stream": False})
        self.assertEqual(code, 200)
        self.assertEqual(_inference(third), [])


class SingleOwnerTests(MemoryProxyTestCase):
    def test_only_owner_reserved_unless_pinned(self) -> None:
        """
        The one owner of a model is reserved while its request runs and
        released after (the shortcut past ordering keeps §6), except when it
        is pinned: a pinned round reserves nothing.
        """
        engine = self.engine("ollama", ["m:latest"])
        engine.default = Behaviour(latency=0.5, chunks=1)
        proxy = self.proxy({"ollama": engine.url})
        url = facade_url(proxy, "ollama") + "/api/generate"
        for pinned, held in ((False, 1), (True, 0)):
            if pinned:
                proxy.ops.select("ollama", "local")
            d = self.start_post(url, {"model": "m", "stream": False})
            self.net.advance(0.2)
            self.assertEqual(proxy.ops.status()["reservations"], {"local": held})
            code, _, _ = self.drive(d)
            self.assertEqual(code, 200)
            self.assertEqual(set(proxy.ops.status()["reservations"].values()), {0})


class WorkloadTests(MemoryProxyTestCase):
    def test_events_and_stats(self) -> None:
        """
        A served streaming request leaves submitted/started/completed events
        with seq and stats measured from the stream; a request nobody can
        serve leaves an errored workload without stats.
        """
        fake = self.engine("ollama", ["m:latest"])
        fake.default = Behaviour(chunks=12)
        proxy = self.proxy({"ollama": fake.url}, admin=True)
        url = facade_url(proxy, "ollama")
        code, _, _ = self.post(url + "/api/chat", {"model": "m", "messages": []})
        self.assertEqual(code, 200)
        code, _, _ = self.post(url + "/api/chat", {"model": "absent"})
        self.assertEqual(code, 502)

        admin = f"http://127.0.0.1:{proxy.admin.bound_port()}"
        code, _, body = self.get(admin + "/admin/workloads?limit=10")
        self.assertEqual(code, 200)
        workloads = json.loads(body)["workloads"]
        self.assertEqual(len(workloads), 2)
        failed, served = workloads
        events = [
            (
                e["method"],
                e["workloadInfo"]["state"],
                e["workloadInfo"].get("scheduledOn"),
            )
            for e in served["events"]
        ]
        self.assertEqual(
            events,
            [
                ("workload:submitted", "queued", None),
                ("workload:submitted", "queued", "local"),
                ("workload:started", "running", "local"),
                ("workload:completed", "completed", "local"),
            ],
        )
        seqs = [e["workloadInfo"]["seq"] for e in served["events"]]
        self.assertEqual(seqs, sorted(seqs))
        final = served["workloadInfo"]
        self.assertEqual(final["model"], "m:latest")
        self.assertEqual(final["engine"], "ollama")
        self.assertEqual(final["stats"]["completionTokens"], 12)
        self.assertIn("promptTokens", final["stats"])
        self.assertIn("ttftMs", final["stats"])
        self.assertEqual(failed["workloadInfo"]["state"], "failed")
        self.assertNotIn("stats", failed["workloadInfo"])

    def test_json_lines_log(self) -> None:
        """
        With C{[workloads] log}, every event is also one JSON-RPC line.
        """
        fake = self.engine("openai", ["m"])
        path = os.path.abspath(self.mktemp())
        config = evolve(
            proxy_config(
                self.mktemp(), {"lmstudio": fake.url}, port=self.net.free_port
            ),
            workload_log=path,
        )
        proxy = self.start(config)
        self.post(facade_url(proxy, "lmstudio") + "/v1/completions", {"model": "m"})
        with open(path) as f:
            lines = [json.loads(line) for line in f]
        self.assertEqual(
            [line["method"] for line in lines],
            [
                "workload:submitted",
                "workload:submitted",
                "workload:started",
                "workload:completed",
            ],
        )
        self.assertEqual({line["jsonrpc"] for line in lines}, {"2.0"})
        info = lines[-1]["params"]["workloadInfo"]
        self.assertEqual((info["engine"], info["model"]), ("lmstudio", "m"))

    def test_metrics(self) -> None:
        fake = self.engine("openai", ["m"])
        proxy = self.proxy({"vllm": fake.url}, admin=True)
        self.post(facade_url(proxy, "vllm") + "/v1/chat/completions", {"model": "m"})
        admin = f"http://127.0.0.1:{proxy.admin.bound_port()}"
        code, headers, body = self.get(admin + "/metrics")
        self.assertEqual(code, 200)
        text = body.decode()
        requests = (
            'nvproxy_requests_total{engine="vllm",key="",model="m",node="local",'
            'outcome="completed",route="inference"} 1.0'
        )
        self.assertIn(requests, text)
        self.assertIn('nvproxy_dispatch_attempts_total{engine="vllm"} 1.0', text)
        self.assertIn('nvproxy_reservations{node="local"} 0.0', text)
        self.assertIn("nvproxy_time_to_first_byte_seconds_bucket", text)
