# -*- test-case-name: tests.test_statuspage -*-
"""
The live status page on the admin listener: C{GET /} (one HTML page, its
stylesheet and script shipped in this package, no build step and nothing
from elsewhere) and the event stream it reads, C{GET /admin/events}.

L{install} adds the routes to the admin app; the page is as loopback-only
as the rest of the admin API because it is served by the same listener.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from klein import Klein
from twisted.internet.interfaces import IReactorTime

from nvproxy.jsonhttp import json_bytes, set_json
from nvproxy.statuspage._feed import StatusFeed, StatusSource
from nvproxy.statuspage._view import READINESS, SECTIONS, view

__all__ = [
    "ASSETS",
    "CSP",
    "READINESS",
    "SECTIONS",
    "StatusFeed",
    "StatusPage",
    "StatusSource",
    "view",
]

CSP = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self';"
    b" connect-src 'self'; base-uri 'none'; form-action 'none';"
    b" frame-ancestors 'none'"
)
"""The page's Content-Security-Policy: its own script and style only."""

ASSETS = {
    "/": ("index.html", b"text/html; charset=utf-8"),
    "/static/status.css": ("status.css", b"text/css; charset=utf-8"),
    "/static/status.js": ("status.js", b"text/javascript; charset=utf-8"),
}
"""Route -> (file in C{static/}, content type)."""


def _asset(name: str) -> bytes:
    return files(__package__).joinpath("static", name).read_bytes()


class StatusPage:
    """
    The page's routes over C{source} (L{nvproxy.ops.Operations}).
    """

    def __init__(self, source: StatusSource, clock: IReactorTime, **feed: Any) -> None:
        self.feed = StatusFeed(source, clock, **feed)
        # Read once: the files do not change while the process runs.
        self._assets = {
            route: (_asset(name), kind) for route, (name, kind) in ASSETS.items()
        }

    def install(self, app: Klein) -> None:
        """Add C{GET /}, the page's assets and C{GET /admin/events} to C{app}."""
        for route in self._assets:
            app.route(route, methods=["GET", "HEAD"], endpoint=f"status:{route}")(
                self._serve(route)
            )
        app.route("/admin/events", methods=["GET"])(self._events)

    def _serve(self, route: str) -> Any:
        body, kind = self._assets[route]

        def serve(request: Any) -> bytes:
            headers = request.responseHeaders
            headers.setRawHeaders(b"content-type", [kind])
            headers.setRawHeaders(b"content-security-policy", [CSP])
            headers.setRawHeaders(b"x-content-type-options", [b"nosniff"])
            headers.setRawHeaders(b"referrer-policy", [b"no-referrer"])
            headers.setRawHeaders(b"x-frame-options", [b"DENY"])
            headers.setRawHeaders(b"cache-control", [b"no-cache"])
            return body

        return serve

    def _events(self, request: Any) -> Any:
        if self.feed.clients >= self.feed.max_clients:
            data = json_bytes({"error": "too many event streams"})
            set_json(request, 503, data)
            request.setHeader(b"retry-after", b"5")
            return data
        return self.feed.connect(request)
