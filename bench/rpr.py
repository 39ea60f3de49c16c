"""
The benchmark's floor: Twisted's stock C{twisted.web.proxy.ReverseProxyResource}
in front of one upstream, doing none of nvproxy's work (no routing, no
retries, no events, no metrics, no access log).

    python -m bench.rpr --port 0 --upstream 127.0.0.1:11434

It prints C{listening on HOST:PORT} once ready and runs until SIGTERM/SIGINT.
Its client speaks HTTP/1.0 to the upstream with C{Connection: close}, so
every request opens a new upstream connection and a streamed answer comes
back unframed until the close; towards its own clients it answers HTTP/1.1
(chunked when the upstream gave no length).  It listens with a backlog of
4,096, as nvproxy's facades and the bench's nginx do, so that 500 or 2,000
streams opened at once measure the proxy, not Twisted's default listen
queue of 50.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.web.proxy import ReverseProxyResource
from twisted.web.server import Site

from bench.refserver import QuietSite, run


def _site(reactor: Any, upstream: str) -> Site:
    host, _, port = upstream.rpartition(":")
    root = ReverseProxyResource(host, int(port), b"", reactor=reactor)
    return QuietSite(root, reactor=reactor)  # type: ignore[no-untyped-call]


def main(argv: Sequence[str] | None = None) -> None:
    """Run the reference proxy until SIGTERM/SIGINT."""
    run(
        "python -m bench.rpr",
        "Twisted's ReverseProxyResource, as a benchmark reference.",
        _site,
        backlog=4096,
        argv=argv,
    )


if __name__ == "__main__":
    main()
