"""
Tests for the composition root (L{nvproxy.service}) and the runtime
operations it hands the admin API and the broker (L{nvproxy.ops}): the
whole service built on a L{MemoryReactorClock}, no real socket.
"""

from __future__ import annotations

import os
from typing import Any

from attrs import evolve
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IProtocolFactory
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import Site
from zope.interface import implementer

from nvproxy.config import Config, load_config
from nvproxy.ops import Operations
from nvproxy.proxy.listener import CannotListen, DemuxFactory
from nvproxy.service import NvProxy, build

CONFIG = """\
node_id = "node-a"
listen_interface = "::"

[admin]
listen = "127.0.0.1:28010"

[engines.ollama]
port = 21435
backend = "http://127.0.0.1:21434"
aliases = ["127.0.0.2:21436", "127.0.0.3:21437"]

[engines.lmstudio]
enabled = false

[engines.llamacpp]
backend = "http://127.0.0.1:28081"

[engines.vllm]
port = 28000
backend = "http://127.0.0.1:28001"
"""

#: What CONFIG listens on: (interface, port) -> what kind of listener.
EXPECTED = {
    ("::", 21435): "facade",
    ("127.0.0.2", 21436): "alias",
    ("127.0.0.3", 21437): "alias",
    ("::", 8080): "facade",  # llama.cpp's standalone port (spec §8)
    ("::", 28000): "facade",
    ("127.0.0.1", 28010): "admin",
}


@implementer(IListeningPort)
class FakePort:
    """A listening port that remembers whether it was stopped."""

    def __init__(self, address: IPv4Address | IPv6Address) -> None:
        self.address = address
        self.stopped = False

    def startListening(self) -> None:
        pass

    def stopListening(self) -> None:
        self.stopped = True

    def getHost(self) -> IPv4Address | IPv6Address:
        return self.address


class ListeningReactor(MemoryReactorClock):
    """
    A L{MemoryReactorClock} whose ports record C{stopListening}, and where
    the ports in C{occupied} cannot be bound.
    """

    def __init__(self, occupied: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.occupied = occupied
        self.ports: dict[tuple[str, int], FakePort] = {}

    def listenTCP(
        self,
        port: int,
        factory: IProtocolFactory,
        backlog: int = 50,
        interface: str = "",
    ) -> FakePort:
        if port in self.occupied:
            raise CannotListenError(interface, port, OSError("address in use"))
        listening = super().listenTCP(port, factory, backlog, interface)
        fake = FakePort(listening.getHost())
        self.ports[(interface, port)] = fake
        return fake


def service_config(test: SynchronousTestCase, text: str = CONFIG) -> Config:
    state_dir = os.path.abspath(test.mktemp())
    os.makedirs(state_dir)
    path = os.path.join(state_dir, "nvproxy.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return load_config(path, {"state-dir": state_dir}, {"HOME": state_dir})


def _kind(factory: Any, interface: str) -> str:
    if isinstance(factory, Site):
        return "admin"
    assert isinstance(factory, DemuxFactory), factory
    # No cluster dir: no facade has a TLS personality; aliases never do.
    assert factory.tls is None
    return "facade" if interface == "::" else "alias"


class BuildTests(SynchronousTestCase):
    """
    L{build} then C{startService}: every listener the config asks for, and
    nothing else, on the reactor it was given.
    """

    def start(self, reactor: MemoryReactorClock, config: Config) -> NvProxy:
        proxy = build(config, reactor, hostname="ignored")
        proxy.startService()
        return proxy

    def listening(self, reactor: MemoryReactorClock) -> dict[tuple[str, int], str]:
        found: dict[tuple[str, int], str] = {}
        for port, factory, _backlog, interface in reactor.tcpServers:
            found[(interface, port)] = _kind(factory, interface)
        return found

    def test_nothing_listens_before_start(self) -> None:
        reactor = MemoryReactorClock()
        proxy = build(service_config(self), reactor, hostname="ignored")
        self.assertEqual(reactor.tcpServers, [])
        self.assertEqual(proxy.node_id, "node-a")
        self.assertEqual(sorted(proxy.listeners), ["llamacpp", "ollama", "vllm"])

    def test_listens_on_every_enabled_facade_alias_and_admin(self) -> None:
        reactor = MemoryReactorClock()
        proxy = self.start(reactor, service_config(self))
        self.addCleanup(proxy.stopService)
        self.assertEqual(self.listening(reactor), EXPECTED)
        self.assertEqual(len(reactor.tcpServers), len(EXPECTED))
        ready = self.successResultOf(proxy.ready())
        self.assertEqual([ok for ok, _ in ready], [True] * len(EXPECTED))
        self.assertEqual(
            {
                engine: listener.bound_port()
                for engine, listener in proxy.listeners.items()
            },
            {"ollama": 21435, "llamacpp": 8080, "vllm": 28000},
        )
        self.assertEqual(proxy.admin.bound_port(), 28010)

    def test_ipv4_interface(self) -> None:
        reactor = MemoryReactorClock()
        config = service_config(self, CONFIG.replace('"::"', '"0.0.0.0"'))
        proxy = self.start(reactor, config)
        self.addCleanup(proxy.stopService)
        self.assertEqual(
            sorted(
                port
                for port, _, _, interface in reactor.tcpServers
                if interface == "0.0.0.0"
            ),
            [8080, 21435, 28000],
        )

    def test_admin_disabled(self) -> None:
        reactor = MemoryReactorClock()
        config = evolve(service_config(self), admin_enabled=False)
        proxy = self.start(reactor, config)
        self.addCleanup(proxy.stopService)
        self.assertNotIn(("127.0.0.1", 28010), self.listening(reactor))
        self.assertEqual(len(reactor.tcpServers), len(EXPECTED) - 1)

    def test_stop_stops_every_listener(self) -> None:
        reactor = ListeningReactor()
        proxy = self.start(reactor, service_config(self))
        self.assertEqual(set(reactor.ports), set(EXPECTED))
        self.assertEqual([p.stopped for p in reactor.ports.values()], [False] * 6)
        self.successResultOf(proxy.stopService())
        self.assertEqual([p.stopped for p in reactor.ports.values()], [True] * 6)
        self.assertEqual(
            [listener.listening for listener in proxy.listeners.values()],
            [None, None, None],
        )
        self.assertEqual([alias.listening for alias in proxy.aliases], [None, None])

    def test_occupied_port_is_contained(self) -> None:
        """
        A facade that cannot bind is reported and the others keep running
        (spec §3.2); an occupied alias leaves its primary alone (§7).
        """
        reactor = ListeningReactor(occupied=frozenset({8080, 21437}))
        proxy = self.start(reactor, service_config(self))
        self.addCleanup(proxy.stopService)
        self.assertEqual(
            set(reactor.ports), set(EXPECTED) - {("::", 8080), ("127.0.0.3", 21437)}
        )
        self.assertIsNone(proxy.listeners["llamacpp"].listening)
        self.assertIsNotNone(proxy.listeners["ollama"].listening)
        self.assertEqual(
            [a.listening is not None for a in proxy.aliases], [True, False]
        )
        facades = {f["engine"]: f for f in proxy.ops.status()["facades"]}
        self.assertEqual(
            (facades["llamacpp"]["listening"], facades["llamacpp"]["port"]),
            (False, 8080),
        )
        self.assertIn("address in use", facades["llamacpp"]["error"])
        self.assertEqual(
            (facades["ollama"]["listening"], facades["ollama"]["error"]), (True, None)
        )


class BrokerFacadeTests(SynchronousTestCase):
    """
    C{facade/enable} and C{facade/disable} (spec §3) through the operations,
    on a service that started with no facade.
    """

    def setUp(self) -> None:
        self.reactor = ListeningReactor(occupied=frozenset({29999}))
        self.proxy = build(
            evolve(service_config(self), control="stdio"), self.reactor, hostname="x"
        )
        assert self.proxy.link is not None
        # Attached already: startService does not open standard input.
        self.proxy.link.makeConnection(StringTransport())
        self.proxy.startService()
        self.addCleanup(self.proxy.stopService)

    def test_starts_with_admin_only(self) -> None:
        self.assertEqual(set(self.reactor.ports), {("127.0.0.1", 28010)})
        self.assertEqual(self.proxy.listeners, {})

    def test_enable_then_disable(self) -> None:
        ops = self.proxy.ops
        bound = self.successResultOf(
            ops.enable_facade("ollama", 0, [("127.0.0.2", 21436)], False)
        )
        self.assertEqual(bound, 11435)  # 0: the standalone port (§8)
        self.assertEqual(
            set(self.reactor.ports),
            {("127.0.0.1", 28010), ("::", 11435), ("127.0.0.2", 21436)},
        )
        # Enabling a listening facade again answers its port, binds nothing.
        self.assertEqual(
            self.successResultOf(ops.enable_facade("ollama", 12000, [], False)), 11435
        )
        self.assertEqual(len(self.reactor.ports), 3)
        self.assertEqual(self.proxy.engine_configs["ollama"].enabled, True)
        self.successResultOf(ops.disable_facade("ollama"))
        self.assertEqual(
            {key: port.stopped for key, port in self.reactor.ports.items()},
            {
                ("127.0.0.1", 28010): False,
                ("::", 11435): True,
                ("127.0.0.2", 21436): True,
            },
        )
        self.assertEqual(
            (self.proxy.listeners, self.proxy.aliases, self.proxy.facades), ({}, [], {})
        )

    def test_enable_that_cannot_listen_leaves_nothing(self) -> None:
        failure = self.failureResultOf(
            self.proxy.ops.enable_facade(
                "ollama", 29999, [("127.0.0.2", 21436)], False
            ),
            CannotListen,
        )
        self.assertIn("address in use", str(failure.value))
        self.assertEqual(
            (self.proxy.listeners, self.proxy.aliases, self.proxy.facades), ({}, [], {})
        )
        # The alias that did bind was released with it.
        self.assertEqual(self.reactor.ports[("127.0.0.2", 21436)].stopped, True)

    def test_persisted_port_wins_unless_ignored(self) -> None:
        self.proxy.ports.set("ollama", 21500)
        ops = self.proxy.ops
        self.assertEqual(
            self.successResultOf(ops.enable_facade("ollama", 21435, [], False)), 21500
        )
        self.successResultOf(ops.disable_facade("ollama"))
        self.assertEqual(
            self.successResultOf(ops.enable_facade("ollama", 21435, [], True)), 21435
        )


class StatusTests(SynchronousTestCase):
    def test_status(self) -> None:
        reactor = MemoryReactorClock()
        proxy = build(service_config(self), reactor, hostname="x")
        proxy.startService()
        self.addCleanup(proxy.stopService)
        proxy.ops.select("ollama", "gpu-2")
        status = proxy.ops.status()
        self.assertEqual(
            sorted(status),
            [
                "cluster",
                "discovery",
                "draining",
                "ejected",
                "facades",
                "generation",
                "inflight",
                "loads",
                "node_id",
                "nodes",
                "process",
                "records",
                "reservations",
                "vllm",
            ],
        )
        self.assertEqual(status["node_id"], "node-a")
        self.assertEqual(status["cluster"], {"member": False})
        self.assertEqual(status["inflight"], 0)
        self.assertEqual(status["vllm"], [])
        self.assertEqual(status["ejected"], {})
        self.assertEqual(
            status["facades"],
            [
                {
                    "engine": "ollama",
                    "port": 21435,
                    "listening": True,
                    "error": None,
                    "selected": "gpu-2",
                },
                {
                    "engine": "llamacpp",
                    "port": 8080,
                    "listening": True,
                    "error": None,
                    "selected": None,
                },
                {
                    "engine": "vllm",
                    "port": 28000,
                    "listening": True,
                    "error": None,
                    "selected": None,
                },
            ],
        )
        process = status["process"]
        self.assertEqual(sorted(process), ["delayed_calls", "open_fds", "rss_bytes"])
        self.assertEqual(process["delayed_calls"], len(reactor.getDelayedCalls()))


def operations_over(proxy: NvProxy, vllm: Any) -> Operations:
    """
    Operations over C{proxy}'s parts with another vLLM manager (a fake).
    """
    return Operations(
        node_id=proxy.node_id,
        clock=proxy.reactor,
        discovery=proxy.discovery,
        dispatcher=proxy.dispatcher,
        reservations=proxy.reservations,
        outliers=proxy.outliers,
        workloads=proxy.workloads,
        pins=proxy.pins,
        selections=proxy.selections,
        ports=proxy.ports,
        engine_configs=proxy.engine_configs,
        listeners=proxy.listeners,
        add_facade=proxy._add_facade,
        remove_facade=proxy._remove_facade,
        endpoints_changed=lambda: None,
        vllm=vllm,
    )
