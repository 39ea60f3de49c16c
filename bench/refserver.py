"""
What the Python reference proxies (L{bench.rpr}, L{bench.agentfloor},
L{bench.leanfloor}, L{bench.facadefloor}) share: their command line, and
listening on a port that is printed once bound (C{listening on HOST:PORT})
for the bench to read; and a site without an access log for those built on
twisted.web's C{Site}.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorCore, IReactorTCP
from twisted.internet.protocol import ServerFactory
from twisted.web.http import Request as HTTPRequest
from twisted.web.server import Site


class QuietSite(Site):
    noisy = False

    def log(self, request: HTTPRequest) -> None:
        """No access log: a reference does nothing it does not have to."""


def run(
    prog: str,
    description: str,
    site_for: Callable[[Any, str], ServerFactory[Any]],
    backlog: int = 50,
    argv: Sequence[str] | None = None,
) -> None:
    """
    Parse C{--host}, C{--port} and C{--upstream HOST:PORT}, listen with the
    site C{site_for(reactor, upstream)} and run until SIGTERM/SIGINT.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--upstream", required=True, help="HOST:PORT")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    def serve(reactor: Any) -> Deferred[None]:
        site = site_for(reactor, args.upstream)
        done: Deferred[None] = Deferred()

        def start() -> None:
            try:
                listening = cast(IReactorTCP, reactor).listenTCP(
                    args.port, site, backlog, interface=args.host
                )
            except Exception:
                done.errback()
                return
            address = cast(IPv4Address, listening.getHost())
            print(f"listening on {args.host}:{address.port}", flush=True)

        cast(IReactorCore, reactor).callWhenRunning(start)
        return done

    from twisted.internet.task import react

    react(serve)
