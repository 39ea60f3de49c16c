"""
The fake vLLM (L{nvproxy.testing.fakevllm}) in a process of its own, on
the real reactor, for the benchmark's wake scenario.

    python -m bench.fakevllm --model M --wake-latency 1.0 --rpc-latency 0.2

It prints C{listening on HOST:PORT} once ready and runs until
SIGTERM/SIGINT.  Its wake sequence is scripted: C{/wake_up} answers after
C{--wake-latency} seconds, C{/collective_rpc} (the weights reload after a
level-2 sleep) after C{--rpc-latency}, and C{/health} is 503 for
C{--health-delay} seconds after a wake.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorCore

from nvproxy.testing.fakevllm import FakeVLLM


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fakevllm",
        description="A fake vLLM with a scripted wake, on a real port.",
    )
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--model", default="bench-model")
    parser.add_argument("--wake-latency", type=float, default=1.0)
    parser.add_argument("--rpc-latency", type=float, default=0.0)
    parser.add_argument("--health-delay", type=float, default=0.0)
    return parser.parse_args(argv)


def _serve(reactor: Any, args: argparse.Namespace) -> Deferred[None]:
    fake = FakeVLLM(
        reactor,
        model=args.model,
        wake_latency=args.wake_latency,
        rpc_latency=args.rpc_latency,
        health_delay=args.health_delay,
    )

    def start() -> None:
        port = fake.listen(reactor, args.port)
        print(f"listening on 127.0.0.1:{port}", flush=True)

    cast(IReactorCore, reactor).callWhenRunning(start)
    return Deferred()


def main(argv: Sequence[str] | None = None) -> None:
    """Run the fake until SIGTERM/SIGINT."""
    from twisted.internet.task import react

    react(_serve, (_parse(sys.argv[1:] if argv is None else argv),))


if __name__ == "__main__":
    main()
