# -*- test-case-name: tests.test_engines -*-
"""
Every engine-specific fact in one table (spec §10).

An engine is one entry of L{ENGINES}: its identity, its ports and persisted-port
file (spec §8), its route table, how it names models, where it lists them and in
which envelope, and how its errors look.  Nothing else in nvproxy branches on an
engine id; code asks the L{Engine} instead.

Route tables follow the engines' public HTTP APIs:

* Ollama: https://github.com/ollama/ollama/blob/main/docs/api.md and its
  OpenAI compatibility layer (``/v1/...``).
* LM Studio: the OpenAI-compatible ``/v1/*`` endpoints, the v0 REST API
  ``/api/v0/*`` and the native v1 REST API ``/api/v1/*`` (LM Studio 0.4).
* llama.cpp ``llama-server``: tools/server/README.md.
* vLLM: the OpenAI-compatible server (``vllm/entrypoints/openai``), plus its
  pooling, scoring and reranking routes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any, Literal

from attrs import frozen


class RouteKind(Enum):
    """
    How a facade treats a request (spec §5, §5.1).
    """

    INFERENCE = "inference"
    """Model-bearing: routed to an owner of the model, with the retry budget."""
    INVENTORY = "inventory"
    """A model list: fanned out to every node and merged."""
    OTHER = "other"
    """Anything else: forwarded verbatim, candidates resolved once, each tried once."""


ErrorDialect = Literal["ollama", "openai"]
StreamDialect = Literal["ollama", "openai", "llamacpp"]
BackendKind = Literal["http", "vllm"]


@frozen
class ModelList:
    """
    One inventory endpoint and its envelope.

    @ivar path: the endpoint on the engine (and on the facade).
    @ivar key: the envelope's list key (C{"models"} or C{"data"}).
    @ivar id_field: the field of each entry naming the model.
    @ivar envelope: the keys besides the list, e.g. C{{"object": "list"}}.
    """

    path: str
    key: str
    id_field: str
    envelope: tuple[tuple[str, str], ...] = ()

    def empty(self) -> dict[str, Any]:
        body: dict[str, Any] = dict(self.envelope)
        body[self.key] = []
        return body

    def ids(self, body: object) -> list[str]:
        """
        The model ids of a decoded inventory response.

        @raise ValueError: the body is not this envelope.
        """
        if not isinstance(body, dict):
            raise ValueError("inventory is not a JSON object")
        entries = body.get(self.key)
        if not isinstance(entries, list):
            raise ValueError(f"inventory has no {self.key!r} list")
        result = []
        for entry in entries:
            if isinstance(entry, dict):
                value = entry.get(self.id_field)
                if isinstance(value, str) and value:
                    result.append(value)
        return result

    def merge(self, bodies: Iterable[object]) -> dict[str, Any]:
        """
        Merge several nodes' answers into one envelope, first entry of each
        model id wins; entries without an id are dropped.
        """
        merged = self.empty()
        seen: set[str] = set()
        out: list[Any] = merged[self.key]
        for body in bodies:
            if not isinstance(body, dict):
                continue
            entries = body.get(self.key)
            if not isinstance(entries, list):
                continue
            for entry in entries:
                if not isinstance(entry, dict):
                    continue
                value = entry.get(self.id_field)
                if not isinstance(value, str) or value in seen:
                    continue
                seen.add(value)
                out.append(entry)
        return merged


OPENAI_LIST_ENVELOPE = (("object", "list"),)


@frozen
class Engine:
    """
    One engine's facts.

    @ivar inference: C{(method, path)} pairs of model-bearing routes.
    @ivar inventory: facade path -> the model list it serves (merged).
    @ivar poll: the model list discovery polls on each node's engine.
    @ivar backend: which L{nvproxy.proxy.backends} kind serves this node's
        engine: C{"http"} (a plain HTTP engine) or C{"vllm"} (the front door
        over registered services that sleep and wake, FD §6).
    """

    id: str
    name: str
    own_port: int
    relocated_port: int
    standalone_port: int
    port_file: str
    inference: frozenset[tuple[bytes, str]]
    inventory: Mapping[str, ModelList]
    poll: ModelList
    error_dialect: ErrorDialect
    stream_dialect: StreamDialect
    implicit_tag: str | None = None
    backend: BackendKind = "http"

    def classify(self, method: bytes, path: str) -> RouteKind:
        """
        Classify a request by this engine's route table.

        @param path: the request path without query, as received.
        """
        if (method, path) in self.inference:
            return RouteKind.INFERENCE
        if method in (b"GET", b"HEAD") and path in self.inventory:
            return RouteKind.INVENTORY
        return RouteKind.OTHER

    def normalize_model(self, model: str) -> str:
        """
        The canonical name of C{model} for matching against inventories.

        Ollama adds its implicit C{:latest} tag to an untagged name (the tag is
        after a C{:} in the last path segment, so a registry host's port is not
        mistaken for one); every other engine matches ids exactly.
        """
        if self.implicit_tag is None:
            return model
        last = model.rsplit("/", 1)[-1]
        if ":" in last or not model:
            return model
        return f"{model}:{self.implicit_tag}"

    def error_body(self, status: int, message: str, code: str | None = None) -> bytes:
        """
        A proxy-generated error in this engine's dialect.
        """
        if self.error_dialect == "ollama":
            return json.dumps({"error": message}).encode()
        return json.dumps(
            {
                "error": {
                    "message": message,
                    "type": _openai_error_type(status),
                    "code": code if code is not None else status,
                }
            }
        ).encode()


def _openai_error_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 413:
        return "request_too_large"
    if 400 <= status < 500:
        return "invalid_request_error"
    if status == 503:
        return "service_unavailable"
    return "server_error"


def _routes(*paths: str, method: bytes = b"POST") -> frozenset[tuple[bytes, str]]:
    return frozenset((method, p) for p in paths)


_OPENAI_MODELS = ModelList("/v1/models", "data", "id", OPENAI_LIST_ENVELOPE)

OLLAMA = Engine(
    id="ollama",
    name="Ollama",
    own_port=11434,
    relocated_port=11435,
    standalone_port=11435,
    port_file="proxy-port.json",
    inference=_routes(
        "/api/generate",
        "/api/chat",
        "/api/embed",
        "/api/embeddings",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
    ),
    inventory={
        "/api/tags": ModelList("/api/tags", "models", "name"),
        "/v1/models": _OPENAI_MODELS,
    },
    poll=ModelList("/api/tags", "models", "name"),
    error_dialect="ollama",
    stream_dialect="ollama",
    implicit_tag="latest",
)

LMSTUDIO = Engine(
    id="lmstudio",
    name="LM Studio",
    own_port=1234,
    relocated_port=1235,
    standalone_port=1234,
    port_file="lmstudio-proxy-port.json",
    inference=_routes(
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/api/v0/chat/completions",
        "/api/v0/completions",
        "/api/v0/embeddings",
        "/api/v1/chat",
    ),
    inventory={
        "/v1/models": _OPENAI_MODELS,
        "/api/v0/models": ModelList(
            "/api/v0/models", "data", "id", OPENAI_LIST_ENVELOPE
        ),
    },
    poll=_OPENAI_MODELS,
    error_dialect="openai",
    stream_dialect="openai",
)

_LLAMACPP_MODELS = ModelList("/models", "data", "id", OPENAI_LIST_ENVELOPE)

LLAMACPP = Engine(
    id="llamacpp",
    name="llama.cpp",
    own_port=8080,
    relocated_port=8081,
    standalone_port=8080,
    port_file="llamacpp-proxy-port.json",
    inference=_routes(
        "/completion",
        "/completions",
        "/v1/completions",
        "/chat/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/embedding",
        "/embeddings",
        "/v1/embeddings",
        "/infill",
        "/rerank",
        "/reranking",
        "/v1/rerank",
        "/v1/reranking",
    ),
    # spec §5: GET /models and GET /v1/models are aliases; both query every
    # candidate's GET /models and merge into an OpenAI list envelope.
    inventory={"/models": _LLAMACPP_MODELS, "/v1/models": _LLAMACPP_MODELS},
    poll=_LLAMACPP_MODELS,
    error_dialect="openai",
    stream_dialect="llamacpp",
)

VLLM = Engine(
    id="vllm",
    name="vLLM",
    own_port=8000,
    relocated_port=8001,
    standalone_port=8000,
    port_file="vllm-proxy-port.json",
    inference=_routes(
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/score",
        "/v1/rerank",
        "/v2/rerank",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/tokenize",
        "/detokenize",
    ),
    inventory={"/v1/models": _OPENAI_MODELS},
    poll=_OPENAI_MODELS,
    error_dialect="openai",
    stream_dialect="openai",
    backend="vllm",
)

ENGINES: Mapping[str, Engine] = {e.id: e for e in (OLLAMA, LMSTUDIO, LLAMACPP, VLLM)}
"""Every engine, by id, in the order of the ports table (DESIGN §2)."""


def engine(engine_id: str) -> Engine:
    """
    The engine with that id.

    @raise KeyError: with a message listing the known ids.
    """
    try:
        return ENGINES[engine_id]
    except KeyError:
        known = ", ".join(ENGINES)
        raise KeyError(f"unknown engine {engine_id!r} (known: {known})") from None
