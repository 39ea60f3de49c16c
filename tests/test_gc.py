"""
A served request leaves no reference cycle behind: everything it allocated
is freed by reference counting, so the cyclic collector (whose full
collections stall every request in the process) has nothing to find.

The engine runs in a process of its own (its objects are not ours), the
client is nvproxy's own upstream agent, and C{gc.DEBUG_SAVEALL} keeps
whatever a collection would have freed, to be counted and named.
"""

from __future__ import annotations

import gc
import json
import sys
from collections import Counter
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.protocol import ProcessProtocol
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import readBody
from twisted.web.http_headers import Headers

from nvproxy.proxy.upstream import BytesProducer, Upstream
from nvproxy.testing.harness import (
    facade_url,
    free_port,
    proxy_config,
    start_proxy,
    wait_healthy,
)

reactor: Any = _reactor


class _Engine(ProcessProtocol):
    def __init__(self) -> None:
        self.ended: Deferred[None] = Deferred()

    def processEnded(self, reason: Any) -> None:
        self.ended.callback(None)


class NoCyclicGarbageTests(TestCase):
    timeout = 60

    async def setup(self) -> tuple[Upstream, str]:
        port = free_port()
        engine = _Engine()
        process = reactor.spawnProcess(
            engine,
            sys.executable,
            [
                sys.executable,
                "-m",
                "nvproxy.testing.fakeengine",
                "--dialect",
                "ollama",
                "--port",
                str(port),
                "--models",
                "m:latest",
            ],
            env=None,
        )

        async def stop() -> None:
            process.signalProcess("TERM")
            await engine.ended

        self.addCleanup(lambda: ensureDeferred(stop()))
        engine_url = f"http://127.0.0.1:{port}"
        await wait_healthy(reactor, engine_url + "/api/tags", within=20)
        proxy = await start_proxy(
            reactor,
            proxy_config(self.mktemp(), {"ollama": engine_url}, poll_interval=60),
        )
        self.addCleanup(proxy.stopService)
        client = Upstream(reactor, 5.0)
        self.addCleanup(client.close)
        return client, facade_url(proxy, "ollama") + "/api/chat"

    async def garbage_per_request(self, stream: bool) -> Counter[str]:
        client, url = await self.setup()
        body = json.dumps(
            {
                "model": "m:latest",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": stream,
            }
        ).encode()
        headers = Headers({b"content-type": [b"application/json"]})

        async def one() -> None:
            response = await client.agent.request(
                b"POST", url.encode(), headers, BytesProducer(body)
            )
            self.assertEqual(response.code, 200)
            await readBody(response)

        for _ in range(5):  # warm: pooled connections, caches, metric children
            await one()
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(10):
                await one()
            gc.collect()
            found = Counter(
                f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
            )
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        return found

    def test_chat(self) -> Deferred[None]:
        async def run() -> None:
            self.assertEqual(await self.garbage_per_request(False), Counter())

        return ensureDeferred(run())

    def test_stream(self) -> Deferred[None]:
        async def run() -> None:
            self.assertEqual(await self.garbage_per_request(True), Counter())

        return ensureDeferred(run())


class CollectorTests(SynchronousTestCase):
    def test_tuned_at_start(self) -> None:
        """
        At start the heap built so far is frozen and the young generation's
        threshold raised; the older generations keep their ratios.
        """
        from nvproxy.service import YOUNG_THRESHOLD, tune_collector

        threshold = gc.get_threshold()
        self.addCleanup(gc.set_threshold, *threshold)
        self.addCleanup(gc.unfreeze)
        tune_collector()
        self.assertGreater(gc.get_freeze_count(), 0)
        self.assertEqual(gc.get_threshold(), (YOUNG_THRESHOLD, *threshold[1:]))
