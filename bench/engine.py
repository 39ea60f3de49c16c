"""
A fake engine process for the benchmarks: L{nvproxy.testing.fakeengine} with a
default behaviour set from the command line, and a C{GET /bench/stats} route
counting the requests received per path.

    python -m bench.engine --dialect ollama --port 0 --models m --chunks 200
    python -m bench.engine --models m --refuse    # advertises m, resets inference
    python -m bench.engine --models m --chunks 5 --stream-chunks 200

With C{--stream-chunks}, streamed requests (C{"stream"} true or absent, the
Ollama default) answer with that many tokens and the others with C{--chunks},
so one engine serves both the chat and the stream workloads.

It prints C{listening on HOST:PORT} once ready and runs until SIGTERM/SIGINT.
The recorded requests of the fake are dropped as they are counted, so a long
run does not grow the process.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

import attrs
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IListeningPort,
    IReactorCore,
    IReactorTCP,
    IReactorTime,
)
from twisted.internet.protocol import ServerFactory
from twisted.web.http import Request as HTTPRequest
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from nvproxy.testing.fakeengine import DIALECTS, Behaviour, FakeEngine

STATS_PATH = b"/bench/stats"


class _CountingRoot(Resource):
    """Answers L{STATS_PATH}; hands everything else to the fake engine."""

    isLeaf = True

    def __init__(self, engine: FakeEngine, streamed: Behaviour | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._engine = engine
        self._plain = engine.default
        self._streamed = streamed
        self._inner = engine.resource()
        self.counts: Counter[str] = Counter()

    def render(self, request: Request) -> int | bytes:
        if request.path == STATS_PATH:
            request.setHeader(b"Content-Type", b"application/json")
            return json.dumps(dict(self.counts)).encode("utf-8")
        if self._streamed is not None:
            self._engine.default = (
                self._streamed if _is_streamed(request) else self._plain
            )
        result = cast(int | bytes, self._inner.render(request))
        for recorded in self._engine.requests:
            self.counts[recorded.path] += 1
        self._engine.requests.clear()
        return result


def _is_streamed(request: Request) -> bool:
    """Whether an Ollama request body asks for a stream (the default)."""
    content = request.content
    if content is None:
        return True
    raw = content.read()
    content.seek(0)
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        return True
    return not isinstance(body, dict) or body.get("stream", True) is not False


class _QuietSite(Site):
    noisy = False

    def log(self, request: HTTPRequest) -> None:
        """No access log."""


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine", description="A fake engine for benchmarks."
    )
    parser.add_argument("--dialect", choices=DIALECTS, default="ollama")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--models", default="bench-model", help="comma-separated")
    parser.add_argument("--chunks", type=int, default=5, help="tokens per answer")
    parser.add_argument(
        "--stream-chunks",
        type=int,
        default=None,
        help="tokens per streamed answer (default: --chunks)",
    )
    parser.add_argument(
        "--chunk-interval", type=float, default=0.0, help="seconds between parts"
    )
    parser.add_argument("--latency", type=float, default=0.0, help="seconds")
    parser.add_argument(
        "--refuse", action="store_true", help="reset every inference connection"
    )
    return parser.parse_args(argv)


def _serve(reactor: Any, args: argparse.Namespace) -> Deferred[None]:
    engine = FakeEngine(
        dialect=args.dialect,
        models=[m for m in args.models.split(",") if m],
        clock=cast(IReactorTime, reactor),
    )
    engine.default = Behaviour(
        chunks=args.chunks,
        chunk_interval=args.chunk_interval,
        latency=args.latency,
        refuse=args.refuse,
    )
    streamed = None
    if args.stream_chunks is not None:
        streamed = attrs.evolve(engine.default, chunks=args.stream_chunks)
    root = _CountingRoot(engine, streamed)
    site = _QuietSite(root, reactor=reactor)  # type: ignore[no-untyped-call]
    done: Deferred[None] = Deferred()
    listening: list[IListeningPort] = []

    def start() -> None:
        try:
            port = cast(IReactorTCP, reactor).listenTCP(
                args.port, cast(ServerFactory, site), interface=args.host
            )
        except Exception:
            done.errback()
            return
        listening.append(port)
        address = cast(IPv4Address, port.getHost())
        print(f"listening on {args.host}:{address.port}", flush=True)

    def stop() -> Deferred[None]:
        for port in listening:
            port.stopListening()
        return engine.stop()

    core = cast(IReactorCore, reactor)
    core.addSystemEventTrigger("before", "shutdown", stop)
    core.callWhenRunning(start)
    return done


def main(argv: Sequence[str] | None = None) -> None:
    """Run a benchmark engine until SIGTERM/SIGINT."""
    from twisted.internet.task import react

    react(_serve, (_parse(sys.argv[1:] if argv is None else argv),))


if __name__ == "__main__":
    main()
