# -*- test-case-name: tests.test_statuspage -*-
"""
A fake status source for the status page: a fleet of many nodes and models
(node records with readiness and wake estimates, vLLM services, workloads
with stats), deterministic for a seed and driven by an injected clock.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from twisted.internet.interfaces import IReactorTime

__all__ = ["FleetStatus"]

_FAMILIES = [
    "Qwen3-8B",
    "Qwen3-32B",
    "Qwen3.6-35B-A3B-FP8",
    "llama3.1:8b",
    "llama3.3:70b",
    "mistral-small-24b",
    "gemma-3-27b-it",
    "phi-4",
    "deepseek-r1-distill-32b",
    "granite-3.3-8b",
]
_ENGINES = ("vllm", "ollama", "llamacpp", "lmstudio")


class FleetStatus:
    """
    L{nvproxy.statuspage.StatusSource} for a fleet of C{nodes} nodes serving
    C{models} models.  L{step} moves it on: a workload finishes, a model
    wakes or falls asleep.
    """

    def __init__(
        self, clock: IReactorTime, nodes: int = 20, models: int = 50, seed: int = 1
    ) -> None:
        self._clock = clock
        self._random = random.Random(seed)
        self.node_ids = [f"gpu-{n + 1:02d}" for n in range(nodes)]
        self.models: list[tuple[str, str]] = []
        for n in range(models):
            family = _FAMILIES[n % len(_FAMILIES)]
            suffix = "" if n < len(_FAMILIES) else f"-ft{n // len(_FAMILIES)}"
            self.models.append((family + suffix, _ENGINES[n % len(_ENGINES)]))
        rnd = self._random
        # model index -> {node: [readiness, estimate]}
        self._placement: dict[int, dict[str, list[Any]]] = {}
        for index, (_model, engine) in enumerate(self.models):
            owners = rnd.sample(self.node_ids, rnd.randint(1, min(4, nodes)))
            self._placement[index] = {
                node: [self._readiness(engine), round(rnd.uniform(3, 60), 1)]
                for node in owners
            }
        # This node runs a few vLLM services.
        for index, (_model, engine) in enumerate(self.models[:12]):
            if engine == "vllm":
                self._placement[index].setdefault(self.node_ids[0], ["awake", 8.0])
        self._workloads: list[dict[str, Any]] = []
        self._ids = 0
        self.draining = {self.node_ids[-1]} if nodes > 2 else set()
        for _ in range(40):
            self.step(back=rnd.uniform(0, 540))

    def _readiness(self, engine: str) -> str:
        if engine != "vllm":
            return "awake"
        return self._random.choice(
            ["awake", "awake", "awake", "sleeping", "offloaded", "waking", "restarting"]
        )

    def _ms(self, back: float = 0.0) -> int:
        return round((self._clock.seconds() - back) * 1000)

    def step(self, back: float = 0.0) -> None:
        """One more finished workload; sometimes a readiness change."""
        rnd = self._random
        index = rnd.randrange(len(self.models))
        model, engine = self.models[index]
        node = rnd.choice(sorted(self._placement[index]))
        self._ids += 1
        ttft = rnd.uniform(40, 900)
        duration = ttft + rnd.uniform(300, 8000)
        tps = rnd.uniform(15, 140)
        end = self._ms(back)
        state = "completed" if rnd.random() > 0.08 else "failed"
        info: dict[str, Any] = {
            "id": str(self._ids),
            "requestId": f"{rnd.getrandbits(128):032x}",
            "model": model,
            "engine": engine,
            "state": state,
            "scheduledOn": node,
            "createdAt": end - round(duration),
            "completedAt": end,
            "error": None if state == "completed" else "upstream status 500",
        }
        if state == "completed":
            info["stats"] = {
                "ttftMs": round(ttft),
                "tokensPerSecond": round(tps, 1),
                "completionTokens": round(tps * (duration - ttft) / 1000),
            }
        self._workloads.append({"workloadInfo": info, "events": []})
        self._workloads.sort(key=lambda w: w["workloadInfo"]["createdAt"])
        del self._workloads[:-200]
        if rnd.random() < 0.3:
            placement = self._placement[rnd.randrange(len(self.models))]
            chosen = placement[rnd.choice(sorted(placement))]
            chosen[0] = rnd.choice(["awake", "waking", "sleeping", "offloaded"])

    def status(self) -> Mapping[str, Any]:
        records: dict[str, dict[str, Any]] = {
            node: {
                "version": 1,
                "node": node,
                "generation": 1,
                "draining": node in self.draining,
                "engines": {},
            }
            for node in self.node_ids
        }
        for index, (model, engine) in enumerate(self.models):
            for node, (readiness, estimate) in self._placement[index].items():
                engines = records[node]["engines"]
                slot = engines.setdefault(
                    engine, {"port": 8000, "in_flight": 0, "models": {}}
                )
                slot["models"][model] = {
                    "readiness": readiness,
                    "wake_estimate_s": 0.0 if readiness == "awake" else estimate,
                }
                slot["in_flight"] = (self._ids + index) % 3
        own = self.node_ids[0]
        vllm = [
            {
                "name": f"svc-{n}",
                "model": model,
                "state": "awake" if n % 3 else "asleep",
                "sleep_depth": None if n % 3 else "sleeping",
                "active_requests": n % 3,
                "held_requests": 0,
                "last_activity": self._clock.seconds() - 30 * n,
            }
            for n, (model, engine) in enumerate(self.models)
            if engine == "vllm"
            and own in self._placement[self.models.index((model, engine))]
        ]
        return {
            "node_id": own,
            "records": [records[node] for node in self.node_ids],
            "nodes": {},
            "vllm": vllm,
            "inflight": sum(
                e["in_flight"] for r in records.values() for e in r["engines"].values()
            ),
            "reservations": {node: 0 for node in self.node_ids},
            "facades": [
                {"engine": e, "port": 8000, "listening": True} for e in _ENGINES
            ],
        }

    def recent_workloads(self, limit: int) -> list[Any]:
        return list(reversed(self._workloads))[:limit]


def serve(reactor: Any, port: int, nodes: int = 20, models: int = 50) -> Any:
    """
    Serve the status page over a L{FleetStatus} on C{127.0.0.1:port} (the
    admin app's own routes, with the fleet as their source), moving the
    fleet on every two seconds.  Returns the listening port; its
    C{stopListening} also stops the fleet.
    """
    from twisted.internet.task import LoopingCall
    from twisted.web.server import Site

    from nvproxy.admin import admin_app, admin_resource
    from nvproxy.statuspage import StatusPage

    fleet = FleetStatus(reactor, nodes=nodes, models=models)
    page = StatusPage(fleet, reactor)
    app = admin_app(fleet, _registry(), status_page=page)  # type: ignore[arg-type]
    loop = LoopingCall(fleet.step)
    loop.clock = reactor
    loop.start(2.0, now=False)
    listening = reactor.listenTCP(
        port, Site(admin_resource(app)), interface="127.0.0.1"
    )
    stop_listening = listening.stopListening

    def stop() -> Any:
        if loop.running:
            loop.stop()
        page.feed.close()
        return stop_listening()

    listening.stopListening = stop
    return listening


def _registry() -> Any:
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()


if __name__ == "__main__":  # python -m nvproxy.testing.fleetstatus [PORT]
    import sys

    from twisted.internet import reactor as _reactor

    serve(_reactor, int(sys.argv[1]) if len(sys.argv) > 1 else 8099)
    _reactor.run()
