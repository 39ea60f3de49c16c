# -*- test-case-name: tests.test_facade -*-
"""
The backend seam: "this node's engine behind this facade".

A facade is the same code for every engine; what differs between a plain
HTTP engine (Ollama, LM Studio, llama.cpp, a vLLM without registered
services) and the vLLM front door (FD §6) is asked of its L{Backend}:

* L{Backend.answer}: routes the front door answers itself (vLLM C{/health},
  C{/metrics});
* L{Backend.resolve}: the model an inference request names, as the engine
  knows it (normalization; vLLM's registry of aliases and route defaults,
  which may rewrite the body);
* L{Backend.local_inventory} and L{Backend.asks}: what this node lists
  without asking its engine (vLLM's registered services, so listing never
  wakes one), and which endpoints an inventory fan-out asks;
* L{Backend.is_awake}: whether an owner serves without waking;
* L{Backend.readiness}: how ready an owner's model is (ordering: readiness
  class, then wake estimate; a peer's from its node record);
* L{Backend.modelless_endpoint}: where a request naming no model goes on a
  node;
* L{Backend.target}: the dispatch target for an endpoint (a local vLLM
  service is woken, and held for, before forwarding);
* L{Backend.local_endpoint}: this node's own engine, for peer mode.

The engine table (L{nvproxy.engines}) says which kind serves an engine;
the composition root builds one backend per facade.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO, Any, Protocol

from attrs import frozen

from nvproxy.discovery import Discovery, Endpoint, NodeEntry
from nvproxy.dispatch import Target
from nvproxy.engines import Engine
from nvproxy.proxy.bodies import with_model
from nvproxy.proxy.client import ClientSide
from nvproxy.readiness import ModelReadiness
from nvproxy.vllm import ModelRequired, UnknownModel, VllmManager, WakingTarget

MULTIPART = "multipart/form-data"


@frozen
class Resolved:
    """
    The model an inference request is for, as the engine knows it.

    @ivar content: the body to forward instead of the client's, when the
        backend rewrote the model named in it.
    """

    model: str
    content: IO[bytes] | None = None


@frozen
class Refused:
    """A request the front door answers itself with an error."""

    status: int
    message: str
    code: str | None = None


@frozen
class Answered:
    """A request the front door answers itself with JSON."""

    body: object


class Backend(Protocol):
    """This node's engine behind one facade."""

    engine: Engine

    def answer(self, path: str | None) -> Answered | Refused | None:
        """
        The front door's own answer for the normalized C{path} (C{None}
        for an invalid path), or C{None} to proxy it.
        """

    def resolve(
        self, model: str | None, path: str, media: str, content: IO[bytes]
    ) -> Resolved | Refused:
        """
        The model of an inference request whose body names C{model} (or
        none), sent to C{path} (normalized when valid) as C{media}.
        """

    def local_inventory(self) -> object | None:
        """The model list this node gives without asking its engine."""

    def asks(self, endpoint: Endpoint) -> bool:
        """Whether an inventory fan-out asks C{endpoint}."""

    def is_awake(self, entry: NodeEntry, model: str | None) -> bool:
        """Whether C{entry} serves C{model} without a wake."""

    def readiness(self, entry: NodeEntry, model: str | None) -> ModelReadiness:
        """
        How ready C{entry}'s C{model} is: live for this node's own entry
        (kind C{local}) where the backend knows better, the snapshot's
        (C{entry.readiness_of}) for every other one, which a round's order
        takes from the snapshot without asking (L{Snapshot.ranks}).
        """

    def modelless_endpoint(self, entry: NodeEntry) -> Endpoint | None:
        """Where a request naming no model goes on C{entry}, if anywhere."""

    def target(
        self,
        target: Target,
        endpoint: Endpoint,
        client: ClientSide,
        model: str | None,
        others: bool,
    ) -> Target:
        """The dispatch target for C{endpoint}, given its plain C{target}."""

    def local_endpoint(self, model: str | None) -> Endpoint | None:
        """This node's own engine endpoint (for C{model}), for peer mode."""


class HttpBackend:
    """
    A plain HTTP engine: models are normalized by the engine table, every
    node is awake, inventory is asked of every endpoint.

    @param local: this node's endpoints for the engine, as configured (the
        peer-mode fallback while discovery has not seen them answer).
    """

    def __init__(
        self,
        engine: Engine,
        discovery: Discovery,
        node_id: str,
        local: Sequence[Endpoint],
    ) -> None:
        self.engine = engine
        self._discovery = discovery
        self._node_id = node_id
        self._local = tuple(local)

    def answer(self, path: str | None) -> Answered | Refused | None:
        return None

    def resolve(
        self, model: str | None, path: str, media: str, content: IO[bytes]
    ) -> Resolved | Refused:
        if not model:
            return Refused(400, "model is required")
        return Resolved(self.engine.normalize_model(model))

    def local_inventory(self) -> object | None:
        return None

    def asks(self, endpoint: Endpoint) -> bool:
        return True

    def is_awake(self, entry: NodeEntry, model: str | None) -> bool:
        return self.readiness(entry, model).readiness == "awake"

    def readiness(self, entry: NodeEntry, model: str | None) -> ModelReadiness:
        # A peer's comes from its node record; direct nodes are awake.
        return entry.readiness_of(model)

    def modelless_endpoint(self, entry: NodeEntry) -> Endpoint | None:
        return entry.endpoints[0]

    def target(
        self,
        target: Target,
        endpoint: Endpoint,
        client: ClientSide,
        model: str | None,
        others: bool,
    ) -> Target:
        return target

    def local_endpoint(self, model: str | None) -> Endpoint | None:
        entry = self._discovery.current.node(self.engine.id, self._node_id)
        if entry is not None and model is not None and model in entry.models:
            return entry.models[model]
        return self._local[0] if self._local else None


class VllmBackend(HttpBackend):
    """
    The vLLM front door (FD §6): a registry of services that sleep and wake.
    """

    def __init__(
        self,
        engine: Engine,
        discovery: Discovery,
        node_id: str,
        local: Sequence[Endpoint],
        manager: VllmManager,
    ) -> None:
        super().__init__(engine, discovery, node_id, local)
        self._manager = manager

    def answer(self, path: str | None) -> Answered | Refused | None:
        if path == "/health":
            # FD §6.2: liveness of the front door plus each service's state,
            # without touching (or waking) any service.
            return Answered({"status": "ok", "services": self._manager.status()})
        if path == "/metrics":
            # Whichever service happened to be awake (or a 502 while all
            # sleep) would pass for the front door's metrics; nvproxy's own
            # are on the admin listener.
            return Refused(
                404,
                "not found: /metrics is not served on the vLLM front door; "
                "nvproxy's metrics are at /metrics on its admin listener",
            )
        return None

    def resolve(
        self, model: str | None, path: str, media: str, content: IO[bytes]
    ) -> Resolved | Refused:
        """
        FD §6.2 step 1: the registry maps a model or alias (any case), or a
        route's default when the body names none, to a service's model.  A
        model the registry lacks is still served when another node
        advertises it; otherwise it is a 404 and nothing wakes.
        """
        multipart = media == MULTIPART
        try:
            service = self._manager.registry.resolve(model, path, multipart)
        except ModelRequired:
            return Refused(400, "model is required")
        except UnknownModel:
            assert model is not None
            if self._discovery.current.owners(self.engine.id, model):
                return Resolved(model)
            return Refused(
                404, f"The model `{model}` does not exist.", code="model_not_found"
            )
        if model != service.model and not multipart:
            # vLLM knows only its served name: an alias, another case or a
            # route default becomes that name in the forwarded JSON body.
            return Resolved(service.model, _with_model(content, service.model))
        return Resolved(service.model)

    def local_inventory(self) -> object | None:
        # Registered services are listed without asking (or waking) them.
        return {"object": "list", "data": self._manager.registry.models()}

    def asks(self, endpoint: Endpoint) -> bool:
        return not (endpoint.kind == "local" and endpoint.service)

    def readiness(self, entry: NodeEntry, model: str | None) -> ModelReadiness:
        """
        This node's registered services: live from their machines; a peer's
        model: from its node record (DESIGN §3: awake owners first across
        the fleet).
        """
        if entry.kind != "local" or model is None:
            return entry.readiness_of(model)
        endpoint = entry.models.get(model)
        if endpoint is None or endpoint.service is None:
            return entry.readiness_of(model)
        return self._manager.readiness(endpoint.service)

    def modelless_endpoint(self, entry: NodeEntry) -> Endpoint | None:
        """
        A local service is used only while awake, and never woken for a
        request naming no model (nor is it counted as activity): a health or
        metrics poller must not keep a model awake.
        """
        if entry.kind != "local":
            return entry.endpoints[0]
        for endpoint in entry.endpoints:
            if endpoint.service is None or self._manager.is_awake(endpoint.service):
                return endpoint
        return None

    def target(
        self,
        target: Target,
        endpoint: Endpoint,
        client: ClientSide,
        model: str | None,
        others: bool,
    ) -> Target:
        """
        With a C{model} (an inference request), a local service is woken
        and held for before forwarding.
        """
        if model is None or endpoint.kind != "local" or endpoint.service is None:
            return target
        service = self._manager.registry.service(endpoint.service)
        return WakingTarget(
            target,
            self._manager,
            endpoint.service,
            client,
            service.model,
            retry_elsewhere=others,
        )


def _with_model(content: Any, model: str) -> IO[bytes]:
    # A spliced copy (no decode of the body, no recursion): in memory when
    # the body is, else a temporary file streamed to the engine per attempt.
    return with_model(content, model)
