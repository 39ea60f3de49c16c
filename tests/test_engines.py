"""
Tests for L{nvproxy.engines}: the engine table.
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.engines import ENGINES, LLAMACPP, LMSTUDIO, OLLAMA, VLLM, RouteKind, engine


class TableTests(SynchronousTestCase):
    def test_ids_and_order(self) -> None:
        self.assertEqual(list(ENGINES), ["ollama", "lmstudio", "llamacpp", "vllm"])

    def test_ports(self) -> None:
        """
        Ports and persisted-port files follow DESIGN §2's table.
        """
        table = {
            e.id: (e.own_port, e.relocated_port, e.standalone_port, e.port_file)
            for e in ENGINES.values()
        }
        self.assertEqual(
            table,
            {
                "ollama": (11434, 11435, 11435, "proxy-port.json"),
                "lmstudio": (1234, 1235, 1234, "lmstudio-proxy-port.json"),
                "llamacpp": (8080, 8081, 8080, "llamacpp-proxy-port.json"),
                "vllm": (8000, 8001, 8000, "vllm-proxy-port.json"),
            },
        )

    def test_unknown_engine(self) -> None:
        with self.assertRaises(KeyError) as caught:
            engine("tgi")
        self.assertIn("ollama", str(caught.exception))


class RouteTests(SynchronousTestCase):
    def assertKinds(self, e: object, kind: RouteKind, routes: list[str]) -> None:
        for route in routes:
            method, _, path = route.partition(" ")
            self.assertEqual(
                e.classify(method.encode(), path),  # type: ignore[attr-defined]
                kind,
                route,
            )

    def test_ollama(self) -> None:
        self.assertKinds(
            OLLAMA,
            RouteKind.INFERENCE,
            [
                "POST /api/generate",
                "POST /api/chat",
                "POST /api/embed",
                "POST /api/embeddings",
                "POST /v1/chat/completions",
                "POST /v1/completions",
                "POST /v1/embeddings",
            ],
        )
        self.assertKinds(
            OLLAMA, RouteKind.INVENTORY, ["GET /api/tags", "GET /v1/models"]
        )
        self.assertKinds(
            OLLAMA,
            RouteKind.OTHER,
            [
                "POST /api/pull",
                "GET /api/version",
                "GET /api/generate",
                "POST /api/tags",
            ],
        )

    def test_lmstudio(self) -> None:
        self.assertKinds(
            LMSTUDIO,
            RouteKind.INFERENCE,
            [
                "POST /v1/chat/completions",
                "POST /v1/completions",
                "POST /v1/embeddings",
                "POST /v1/responses",
                "POST /api/v0/chat/completions",
                "POST /api/v0/completions",
                "POST /api/v0/embeddings",
            ],
        )
        self.assertKinds(
            LMSTUDIO, RouteKind.INVENTORY, ["GET /v1/models", "GET /api/v0/models"]
        )
        self.assertKinds(LMSTUDIO, RouteKind.OTHER, ["GET /api/v0/models/qwen"])

    def test_llamacpp(self) -> None:
        self.assertKinds(
            LLAMACPP,
            RouteKind.INFERENCE,
            [
                "POST /completion",
                "POST /completions",
                "POST /v1/completions",
                "POST /v1/chat/completions",
                "POST /embedding",
                "POST /embeddings",
                "POST /v1/embeddings",
                "POST /infill",
                "POST /rerank",
                "POST /v1/rerank",
            ],
        )
        self.assertKinds(
            LLAMACPP, RouteKind.INVENTORY, ["GET /models", "GET /v1/models"]
        )
        self.assertKinds(LLAMACPP, RouteKind.OTHER, ["GET /health", "GET /props"])
        # The two inventory routes are aliases of one list (§5).
        self.assertIs(LLAMACPP.inventory["/models"], LLAMACPP.inventory["/v1/models"])
        self.assertEqual(LLAMACPP.inventory["/v1/models"].path, "/models")

    def test_vllm(self) -> None:
        self.assertKinds(
            VLLM,
            RouteKind.INFERENCE,
            [
                "POST /v1/chat/completions",
                "POST /v1/completions",
                "POST /v1/embeddings",
                "POST /pooling",
                "POST /score",
                "POST /rerank",
                "POST /v1/rerank",
                "POST /v1/audio/transcriptions",
            ],
        )
        self.assertKinds(VLLM, RouteKind.INVENTORY, ["GET /v1/models"])


class NormalizeTests(SynchronousTestCase):
    def test_ollama_latest(self) -> None:
        self.assertEqual(OLLAMA.normalize_model("llama3"), "llama3:latest")
        self.assertEqual(OLLAMA.normalize_model("llama3:8b"), "llama3:8b")
        self.assertEqual(
            OLLAMA.normalize_model("registry.local:5000/team/llama3"),
            "registry.local:5000/team/llama3:latest",
        )
        self.assertEqual(OLLAMA.normalize_model("hf.co/a/b:Q4_K_M"), "hf.co/a/b:Q4_K_M")

    def test_exact_elsewhere(self) -> None:
        for e in (LMSTUDIO, LLAMACPP, VLLM):
            self.assertEqual(e.normalize_model("Qwen3"), "Qwen3")

    @given(st.text(min_size=1, max_size=40))
    def test_idempotent(self, name: str) -> None:
        for e in ENGINES.values():
            once = e.normalize_model(name)
            self.assertEqual(e.normalize_model(once), once)

    @given(st.from_regex(r"[a-z0-9][a-z0-9._/-]{0,20}", fullmatch=True))
    def test_untagged_equals_latest(self, name: str) -> None:
        """
        An untagged Ollama name and the same name with C{:latest} match.
        """
        self.assertEqual(
            OLLAMA.normalize_model(name), OLLAMA.normalize_model(name + ":latest")
        )


class EnvelopeTests(SynchronousTestCase):
    def test_merge_dedupes(self) -> None:
        listing = OLLAMA.inventory["/api/tags"]
        merged = listing.merge(
            [
                {"models": [{"name": "a:latest", "size": 1}, {"name": "b:latest"}]},
                {"models": [{"name": "a:latest", "size": 2}, {"nope": 1}]},
                None,
                {"error": "x"},
            ]
        )
        self.assertEqual(
            merged, {"models": [{"name": "a:latest", "size": 1}, {"name": "b:latest"}]}
        )

    def test_openai_envelope(self) -> None:
        listing = VLLM.inventory["/v1/models"]
        self.assertEqual(listing.empty(), {"object": "list", "data": []})
        self.assertEqual(listing.ids({"object": "list", "data": [{"id": "m"}]}), ["m"])
        with self.assertRaises(ValueError):
            listing.ids([1, 2])

    def test_error_dialects(self) -> None:
        self.assertEqual(json.loads(OLLAMA.error_body(502, "boom")), {"error": "boom"})
        body = json.loads(VLLM.error_body(404, "no such model", "model_not_found"))
        self.assertEqual(
            body,
            {
                "error": {
                    "message": "no such model",
                    "type": "not_found_error",
                    "code": "model_not_found",
                }
            },
        )
