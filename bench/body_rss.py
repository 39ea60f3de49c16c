"""
Peak RSS of the nvproxy daemon for one large JSON inference body.

Starts a fake Ollama engine and C{twistd -n nvproxy} in front of it, sends
one warm-up request, then one request whose JSON body is C{--mib} MiB (a
base64-like image string, the shape of a vision request), sampling the
daemon's RSS every 10 ms while it is in flight.  Prints the body size, the
baseline and peak RSS and the peak growth relative to the body size; exits 1
when the growth exceeds C{--max-ratio} times the body size.

    python -m bench.body_rss [--mib 60] [--max-ratio 1.2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import treq
from twisted.internet import defer, task

from bench.procs import start_engine, start_proxy


async def measure(reactor: Any, mib: int, workdir: Path) -> tuple[int, int, int, int]:
    engine, url = await start_engine(reactor, workdir, "engine", ["m:latest"])
    proxy = await start_proxy(reactor, workdir, url)
    try:
        generate = proxy.facade + "/api/generate"
        small = json.dumps({"model": "m", "prompt": "hi", "stream": False}).encode()
        for _ in range(3):
            response = await treq.post(generate, data=small)
            await treq.content(response)
        baseline = proxy.proc.usage().rss
        image = b"QUJD" * (mib * (1 << 20) // 4 - 16)
        body = b'{"model": "m", "prompt": "hi", "stream": false, "images": ["'
        body += image + b'"]}'
        del image
        peak = baseline

        def sample() -> None:
            nonlocal peak
            peak = max(peak, proxy.proc.usage().rss)

        sampler = task.LoopingCall(sample)
        sampler.start(0.01)
        response = await treq.post(generate, data=body)
        await treq.content(response)
        sampler.stop()
        sample()
        if response.code != 200:
            raise SystemExit(f"large request answered {response.code}")
        return len(body), baseline, peak, proxy.proc.usage().rss
    finally:
        await proxy.proc.stop(reactor)
        await engine.stop(reactor)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=60)
    parser.add_argument("--max-ratio", type=float, default=1.2)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="nvproxy-body-rss-"))

    async def run(reactor: Any) -> None:
        size, baseline, peak, after = await measure(reactor, args.mib, workdir)
        growth = peak - baseline
        print(f"body           {size / 2**20:8.1f} MiB")
        print(f"baseline RSS   {baseline / 2**20:8.1f} MiB")
        print(f"peak RSS       {peak / 2**20:8.1f} MiB")
        print(f"after RSS      {after / 2**20:8.1f} MiB")
        print(f"peak growth    {growth / 2**20:8.1f} MiB = {growth / size:.2f} x body")
        shutil.rmtree(workdir, ignore_errors=True)
        if growth > args.max_ratio * size:
            raise SystemExit(1)

    task.react(lambda reactor: defer.ensureDeferred(run(reactor)))


if __name__ == "__main__":
    main(sys.argv[1:])
