# -*- test-case-name: tests.test_forwarding -*-
"""
Running a whole nvproxy in-process on loopback, for integration tests and
benchmarks: free ports, a config built from a few keyword arguments, and a
client that leaves no connection behind.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import treq
from attrs import evolve
from treq.client import HTTPClient
from twisted.internet.defer import Deferred
from twisted.web.client import Agent, HTTPConnectionPool

from nvproxy.config import Config, load_config
from nvproxy.service import NvProxy, build


def free_port(interface: str = "127.0.0.1") -> int:
    """
    A TCP port that was free a moment ago (bind to 0, read it, release it).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((interface, 0))
        return int(s.getsockname()[1])


def proxy_config(
    state_dir: str,
    backends: Mapping[str, str],
    *,
    nodes: Mapping[str, Mapping[str, str]] | None = None,
    poll_interval: float = 0.05,
    admin: bool = False,
    **dispatch: Any,
) -> Config:
    """
    A config enabling only the engines in C{backends} (engine -> this node's
    engine URL) on free ports, with fast polling.

    @param nodes: direct nodes, node id -> engine -> URL.
    @param dispatch: overrides of L{nvproxy.config.DispatchConfig} fields.
    """
    base = load_config(
        None, {"state-dir": state_dir, "node-id": "local"}, {"HOME": state_dir}
    )
    engines = {}
    for engine_id, engine in base.engines.items():
        if engine_id in backends:
            engines[engine_id] = evolve(
                engine,
                enabled=True,
                port=free_port(),
                backend=backends[engine_id],
                backend_configured=True,
            )
        else:
            engines[engine_id] = evolve(engine, enabled=False)
    from nvproxy.config import NodeConfig

    return evolve(
        base,
        engines=engines,
        admin_enabled=admin,
        admin_listen=("127.0.0.1", free_port()),
        discovery_poll_interval=poll_interval,
        dispatch=evolve(base.dispatch, **dispatch),
        nodes=tuple(
            NodeConfig(node_id, dict(urls)) for node_id, urls in (nodes or {}).items()
        ),
    )


async def start_proxy(reactor: Any, config: Config) -> NvProxy:
    """
    Build and start nvproxy; returns once every listener tried to bind and
    the first inventory poll finished.
    """
    proxy = build(config, reactor, hostname="local")
    proxy.startService()
    await proxy.ready()
    await proxy.polling.poll()
    return proxy


def facade_url(proxy: NvProxy, engine: str) -> str:
    port = proxy.listeners[engine].bound_port()
    return f"http://127.0.0.1:{port}"


class Client:
    """
    A treq client on its own pool, closed by L{close} so trial's reactor
    stays clean.
    """

    def __init__(self, reactor: Any, persistent: bool = True) -> None:
        self.pool = HTTPConnectionPool(reactor, persistent=persistent)
        self.http = HTTPClient(Agent(reactor, pool=self.pool))

    async def request(
        self, method: str, url: str, **kwargs: Any
    ) -> tuple[int, Any, bytes]:
        response = await self.http.request(method, url, **kwargs)
        body = await treq.content(response)
        return response.code, response.headers, body

    def close(self) -> Deferred[None]:
        closed: Deferred[None] = self.pool.closeCachedConnections()
        return closed
