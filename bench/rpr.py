"""
The benchmark's floor: Twisted's stock C{twisted.web.proxy.ReverseProxyResource}
in front of one upstream, doing none of nvproxy's work (no routing, no
retries, no events, no metrics, no access log).

    python -m bench.rpr --port 0 --upstream 127.0.0.1:11434

It prints C{listening on HOST:PORT} once ready and runs until SIGTERM/SIGINT.
Its client speaks HTTP/1.0 to the upstream with C{Connection: close}, so
every request opens a new upstream connection and a streamed answer comes
back unframed until the close; towards its own clients it answers HTTP/1.1
(chunked when the upstream gave no length).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, cast

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorCore, IReactorTCP
from twisted.internet.protocol import ServerFactory
from twisted.web.http import Request as HTTPRequest
from twisted.web.proxy import ReverseProxyResource
from twisted.web.server import Site


class _QuietSite(Site):
    noisy = False

    def log(self, request: HTTPRequest) -> None:
        """No access log: the floor does nothing it does not have to."""


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rpr",
        description="Twisted's ReverseProxyResource, as a benchmark reference.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--upstream", required=True, help="HOST:PORT")
    return parser.parse_args(argv)


def _serve(reactor: Any, args: argparse.Namespace) -> Deferred[None]:
    host, _, port = args.upstream.rpartition(":")
    root = ReverseProxyResource(host, int(port), b"", reactor=reactor)
    site = _QuietSite(root, reactor=reactor)  # type: ignore[no-untyped-call]
    done: Deferred[None] = Deferred()

    def start() -> None:
        try:
            listening = cast(IReactorTCP, reactor).listenTCP(
                args.port, cast(ServerFactory, site), interface=args.host
            )
        except Exception:
            done.errback()
            return
        address = cast(IPv4Address, listening.getHost())
        print(f"listening on {args.host}:{address.port}", flush=True)

    cast(IReactorCore, reactor).callWhenRunning(start)
    return done


def main(argv: Sequence[str] | None = None) -> None:
    """Run the reference proxy until SIGTERM/SIGINT."""
    from twisted.internet.task import react

    react(_serve, (_parse(sys.argv[1:] if argv is None else argv),))


if __name__ == "__main__":
    main()
