"""
A diagnostic reference: the Agent floor (L{bench.agentfloor}) on nvproxy's
own server classes.  The same leaf forwards each request through the same
C{Agent} on one persistent pool, but the site is nvproxy's C{FacadeSite}
(its channel's limits, deadlines, timers and write path, its request's
body bounds and date), without the access log, and nothing else of
nvproxy's: no routing, dispatch, events, metrics or stats.

    python -m bench.facadefloor --port 0 --upstream 127.0.0.1:11434

Between the Agent floor (twisted.web's own server) and the lean floor
(L{bench.leanfloor}, the least a server can do), it shows what nvproxy's
server side costs, and nvproxy minus it what nvproxy's own work costs.
It prints C{listening on HOST:PORT} once ready and runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.agentfloor import _Front, floor_agent
from bench.refserver import run
from nvproxy.proxy.site import FacadeSite, plain_error_body


def _site(reactor: Any, upstream: str) -> FacadeSite:
    front = _Front(floor_agent(reactor), f"http://{upstream}".encode())
    return FacadeSite(
        front,
        error_body=plain_error_body,
        max_body=2**24,
        max_connections=2**16,
        reactor=reactor,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Run the reference proxy until SIGTERM/SIGINT."""
    run(
        "python -m bench.facadefloor",
        "The Agent floor on nvproxy's server classes, as a reference.",
        _site,
        backlog=4096,
        argv=argv,
    )


if __name__ == "__main__":
    main()
