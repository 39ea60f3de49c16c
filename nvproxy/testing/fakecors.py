# -*- test-case-name: tests.test_cors -*-
"""
A CORS policy for the fake engines, answering as Starlette's
C{CORSMiddleware} does (what vLLM and many OpenAI-style servers run):
a preflight from an allowed origin is a C{200} with the grants, one from
any other origin a C{400} "Disallowed CORS origin" without CORS headers; a
simple response to an allowed origin carries C{Access-Control-Allow-Origin}
(and C{-Credentials}, C{-Expose-Headers}).
"""

from __future__ import annotations

from attrs import frozen

__all__ = ["CorsPolicy"]


@frozen
class CorsPolicy:
    """
    @ivar origins: allowed origins; C{"*"} allows every origin.
    @ivar methods: allowed methods; C{"*"} every method.
    @ivar headers: allowed request headers; C{"*"} echoes the requested ones.
    @ivar max_age: C{Access-Control-Max-Age}, or L{None} for none.
    """

    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("GET", "POST", "OPTIONS")
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False
    max_age: int | None = 600
    expose: tuple[str, ...] = ()

    def allows(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    def _origin(self, origin: str) -> str:
        if "*" in self.origins and not self.credentials:
            return "*"
        return origin

    def _vary(self) -> list[tuple[str, str]]:
        return [] if self._origin("x") == "*" else [("Vary", "Origin")]

    def preflight(
        self, origin: str, requested_headers: str | None
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        """The answer to a preflight from C{origin}: status, headers, body."""
        if not self.allows(origin):
            return 400, [("Content-Type", "text/plain")], b"Disallowed CORS origin"
        headers = [("Access-Control-Allow-Origin", self._origin(origin))]
        if self.credentials:
            headers.append(("Access-Control-Allow-Credentials", "true"))
        headers.append(("Access-Control-Allow-Methods", ", ".join(self.methods)))
        allowed = list(self.headers)
        if "*" in allowed and requested_headers:
            allowed = [requested_headers]
        if allowed:
            headers.append(("Access-Control-Allow-Headers", ", ".join(allowed)))
        if self.max_age is not None:
            headers.append(("Access-Control-Max-Age", str(self.max_age)))
        headers.extend(self._vary())
        headers.append(("Content-Type", "text/plain"))
        return 200, headers, b"OK"

    def simple(self, origin: str) -> list[tuple[str, str]]:
        """The headers a simple response to C{origin} carries."""
        if not self.allows(origin):
            return []
        headers = [("Access-Control-Allow-Origin", self._origin(origin))]
        if self.credentials:
            headers.append(("Access-Control-Allow-Credentials", "true"))
        if self.expose:
            headers.append(("Access-Control-Expose-Headers", ", ".join(self.expose)))
        return headers + self._vary()
