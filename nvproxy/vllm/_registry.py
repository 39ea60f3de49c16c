# -*- test-case-name: tests.test_vllm -*-
"""
The vLLM services of a node by model, alias and default route (FD §6.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nvproxy.config import VllmServiceConfig
from nvproxy.vllm._errors import ModelRequired, UnknownModel, UnknownService

MULTIPART_PREFIX = "multipart:"
"""
A C{default_for} entry C{"multipart:/v1/chat/completions"} makes a service
the default for multipart requests on that path that name no model (the
OCR-style service, FD §6.2 step 1).
"""
_EMBEDDINGS = "/v1/embeddings"


class VllmRegistry:
    """
    The vLLM services of this node by model, alias and default route.
    """

    def __init__(self, services: Sequence[VllmServiceConfig]) -> None:
        self.services = tuple(services)
        self._by_model: dict[str, VllmServiceConfig] = {}
        self._by_name: dict[str, VllmServiceConfig] = {}
        self._defaults: dict[str, VllmServiceConfig] = {}
        for service in self.services:
            self._by_name[service.name] = service
            for name in (service.model, *service.aliases):
                self._by_model.setdefault(name.casefold(), service)
            for route in service.default_for:
                self._defaults.setdefault(route, service)

    def service(self, name: str) -> VllmServiceConfig:
        """@raise UnknownService: no service C{name}."""
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownService(name) from None

    def lookup(self, model: str) -> VllmServiceConfig | None:
        return self._by_model.get(model.casefold())

    def resolve(
        self, model: str | None, path: str, multipart: bool
    ) -> VllmServiceConfig:
        """
        The service for a request to the normalized C{path} naming C{model}.

        C{/v1/embeddings} goes to its default service regardless of the body;
        otherwise a named model must be known, and a request naming none uses
        the C{multipart:}-prefixed default of the path (multipart bodies), then
        the path's plain default.

        @raise UnknownModel: C{model} is nobody's.
        @raise ModelRequired: no model and no default for C{path}.
        """
        path = path.split("?", 1)[0]
        if path == _EMBEDDINGS and _EMBEDDINGS in self._defaults:
            return self._defaults[_EMBEDDINGS]
        if model:
            service = self.lookup(model)
            if service is None:
                raise UnknownModel(model)
            return service
        if multipart and (found := self._defaults.get(MULTIPART_PREFIX + path)):
            return found
        if (found := self._defaults.get(path)) is not None:
            return found
        raise ModelRequired(path)

    def models(self, created: int = 0) -> list[dict[str, Any]]:
        """OpenAI C{/v1/models} entries for every registered model."""
        return [
            {
                "id": s.model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": s.model,
                "parent": None,
            }
            for s in self.services
        ]
