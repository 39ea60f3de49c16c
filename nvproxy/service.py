# -*- test-case-name: tests.test_service -*-
"""
The composition root: builds every part of nvproxy from a L{Config} and
wires them together.  It is the only module that imports the global reactor
(and only inside L{makeService}, so tests pass their own).
"""

from __future__ import annotations

import os
import random
import secrets
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any
from urllib.parse import urlsplit

from attrs import evolve
from prometheus_client import CollectorRegistry
from twisted.application.service import MultiService, Service
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.internet.interfaces import (
    IListeningPort,
    IOpenSSLClientConnectionCreator,
    IProtocolFactory,
)
from twisted.internet.stdio import StandardIO
from twisted.logger import Logger
from twisted.python import usage
from twisted.python.failure import Failure

from nvproxy import config as _config
from nvproxy.accounting import Accounting
from nvproxy.admin import AdminError, admin_app
from nvproxy.cluster import (
    ClientTLS,
    ClusterDir,
    ClusterError,
    ClusterWatcher,
    ServerTLS,
)
from nvproxy.config import (
    Config,
    ConfigError,
    EngineConfig,
    default_backend,
    resolve_node_id,
)
from nvproxy.control import ControlLink
from nvproxy.discovery import Discovery, Endpoint, NodeEntry, PollingDiscovery
from nvproxy.dispatch import Dispatcher, DispatchPolicy
from nvproxy.engines import ENGINES
from nvproxy.logs import configure_twistd, set_level
from nvproxy.metrics import Metrics
from nvproxy.outliers import EjectionPolicy, OutlierTable
from nvproxy.ports import PortStore, SelectionStore, effective_port
from nvproxy.proxy.facade import Facade
from nvproxy.proxy.listener import DemuxFactory, tls_personality
from nvproxy.proxy.pathnorm import is_hidden
from nvproxy.proxy.site import FacadeSite
from nvproxy.proxy.upstream import TreqInventoryClient, Upstream
from nvproxy.scheduler import ReservationMap, SchedulerSnapshot
from nvproxy.vllm import VllmManager, admin_routes
from nvproxy.workload import JsonLinesSink, RingSink, WorkloadRecorder, WorkloadSink

log = Logger()


class Options(_config.Options):
    """
    twistd options; C{--log-format json} also switches twistd's own log
    observer, which must be chosen while options are parsed (twistd starts
    logging before it calls L{makeService}'s result).
    """

    def parseOptions(self, options: Any = None) -> None:
        try:
            super().parseOptions(options)  # type: ignore[no-untyped-call]
        except usage.UsageError as e:
            # One clear line, not twistd's whole usage text.
            print(f"nvproxy: {e} (see twistd nvproxy --help)", file=sys.stderr)
            raise SystemExit(2) from None

    def postOptions(self) -> None:
        try:
            super().postOptions()
        except usage.UsageError as e:
            # One clear line, not twistd's whole usage text: the flags were
            # fine, their values were not.
            print(f"nvproxy: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        parent = getattr(self, "parent", None)
        if parent is not None and not parent.get("logger"):
            parent["logger"] = configure_twistd(
                self.config.log_format,
                self.config.log_level,
                parent.get("logfile"),
                bool(parent.get("nodaemon")),
                stderr=self.config.control == "stdio",
            )


def _server_endpoint(reactor: Any, interface: str, port: int) -> Any:
    if ":" in interface:
        return TCP6ServerEndpoint(reactor, port, interface=interface)
    return TCP4ServerEndpoint(reactor, port, interface=interface)


class PortListener(Service):
    """
    One listening port whose failure to bind is logged and contained: the
    other facades keep running (spec §3.2).
    """

    def __init__(
        self,
        reactor: Any,
        label: str,
        interface: str,
        port: int,
        factory: IProtocolFactory,
        optional: bool = False,
    ) -> None:
        self._reactor = reactor
        self._optional = optional
        self.label = label
        self.interface = interface
        self.port = port
        self._factory = factory
        self.listening: IListeningPort | None = None
        self.error: str | None = None
        self.ready: Deferred[bool] = Deferred()

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._listen()

    def _listen(self) -> None:
        endpoint = _server_endpoint(self._reactor, self.interface, self.port)
        d = endpoint.listen(self._factory)
        d.addCallbacks(self._listening, self._failed)

    def _listening(self, port: IListeningPort) -> None:
        self.listening = port
        self.error = None
        log.info(
            "{label} listening on {interface}:{port}",
            label=self.label,
            interface=self.interface,
            port=_port_of(port),
        )
        if not self.ready.called:
            self.ready.callback(True)

    def _failed(self, reason: Failure) -> None:
        self.error = str(reason.value)
        emit = log.warn if self._optional else log.error
        emit(
            "{label} cannot listen on {interface}:{port}: {error}",
            label=self.label,
            interface=self.interface,
            port=self.port,
            error=self.error,
        )
        if not self.ready.called:
            self.ready.callback(False)

    def stopService(self) -> Deferred[None] | None:
        super().stopService()  # type: ignore[no-untyped-call]
        port, self.listening = self.listening, None
        if port is not None:
            stopped: Deferred[None] | None = port.stopListening()
            return stopped
        return None

    def move(self, port: int) -> Deferred[None]:
        """
        Listen on C{port} instead; the old port is released only once the
        new one is bound, so a failed move leaves the facade where it was.
        """
        endpoint = _server_endpoint(self._reactor, self.interface, port)

        async def move() -> None:
            new = await endpoint.listen(self._factory)
            old, self.listening = self.listening, new
            self.port = port
            self.error = None
            log.info("{label} moved to port {port}", label=self.label, port=port)
            if old is not None:
                stopped = old.stopListening()
                if stopped is not None:
                    await stopped

        return Deferred.fromCoroutine(move())

    def bound_port(self) -> int | None:
        if self.listening is None:
            return None
        return _port_of(self.listening)


class CannotListen(Exception):
    pass


def _effective(
    engine_config: EngineConfig, ports: PortStore, ignore_persisted: bool = False
) -> EngineConfig:
    port = effective_port(engine_config, ports, ignore_persisted)
    backend = engine_config.backend
    if not engine_config.backend_configured:
        backend = default_backend(engine_config.id, port)
    return evolve(engine_config, port=port, backend=backend)


def _port_of(port: IListeningPort) -> int:
    address = port.getHost()
    assert isinstance(address, (IPv4Address, IPv6Address))
    return address.port


def local_endpoints(config: Config, node_id: str) -> list[Endpoint]:
    """
    This node's engine endpoints, and every direct node's.
    """
    endpoints = []
    for engine_config in config.engines.values():
        if not engine_config.enabled:
            continue
        if engine_config.id == "vllm" and engine_config.services:
            for service in engine_config.services:
                endpoints.append(
                    Endpoint(node_id, "vllm", "local", service.url, service.name)
                )
        else:
            endpoints.append(
                Endpoint(node_id, engine_config.id, "local", engine_config.backend)
            )
    for node in config.nodes:
        for engine_id, url in node.engines.items():
            if config.engines[engine_id].enabled:
                endpoints.append(Endpoint(node.id, engine_id, "direct", url))
    return endpoints


class NvProxy(MultiService):
    """
    The whole daemon.  Also the admin API's backend.
    """

    def __init__(
        self,
        config: Config,
        reactor: Any,
        node_id: str,
        cluster: ClusterWatcher | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.config = config
        self.cluster = cluster
        self.server_tls: ServerTLS | None = None
        if cluster is not None:
            cluster.setServiceParent(self)  # type: ignore[no-untyped-call]
            # Always, so a node that joins later needs no restart (§7): with
            # no identity yet every handshake simply fails.
            self.server_tls = ServerTLS(lambda: cluster.current)
        self.reactor = reactor
        self.node_id = node_id
        # Node selections survive a restart (nvproxy.ports.SelectionStore).
        self.selections = SelectionStore(config.state_dir)
        self.pins: dict[str, str] = self.selections.load()
        for engine_id, pinned in sorted(self.pins.items()):
            log.info(
                "{engine}: restored selection of node {node}",
                engine=engine_id,
                node=pinned,
            )
        self.ports = PortStore(config.state_dir)
        self.registry = CollectorRegistry()
        # Persisted ports (§8) win over configured ones; a default backend
        # follows the facade's real port (the relocation rule).
        self.engine_configs = {
            engine_id: _effective(engine_config, self.ports)
            for engine_id, engine_config in config.engines.items()
        }
        config = evolve(config, engines=self.engine_configs)
        self.config = config
        self.upstream = Upstream(
            reactor, config.dispatch.dial_timeout, tls_for=self._peer_tls
        )
        self.discovery = Discovery()
        vllm_config = config.engines["vllm"]
        self.vllm: VllmManager | None = None
        static: dict[Endpoint, list[str]] = {}
        if vllm_config.enabled and vllm_config.services:
            self.vllm = VllmManager(
                vllm_config.services,
                vllm_config.hold,
                self.upstream.treq,
                reactor,
                config.state_dir,
                poll_interval=config.discovery_poll_interval,
                state_ttl=vllm_config.state_ttl,
                metrics=self.registry,
            )
            self.vllm.setServiceParent(self)  # type: ignore[no-untyped-call]
            # A registered service advertises its model whatever its sleep
            # state: asking a sleeping or restarting one would either wake it
            # or lose its requests to a 502 instead of the depth-aware hold.
            for endpoint in local_endpoints(config, node_id):
                if endpoint.service is not None:
                    service = self.vllm.registry.service(endpoint.service)
                    static[endpoint] = [service.model]
        self.inventory_client = TreqInventoryClient(self.upstream.treq, reactor)
        # Process-wide, per (engine, node): an answered poll reinstates.
        self.outliers = OutlierTable(
            reactor,
            EjectionPolicy(config.dispatch.eject_base, config.dispatch.eject_max),
        )
        self.polling = PollingDiscovery(
            self.discovery,
            self.inventory_client,
            reactor,
            self._endpoints(),
            interval=config.discovery_poll_interval,
            static_models=static,
            answered=lambda e: self.outliers.answered(e.engine, e.node_id),
        )
        self.polling.setServiceParent(self)  # type: ignore[no-untyped-call]
        if cluster is not None:
            cluster.subscribe(lambda _state: self._cluster_changed())
        dispatch = config.dispatch
        self.dispatcher = Dispatcher(
            reactor,
            DispatchPolicy(
                max_attempts=dispatch.max_attempts,
                deadline=dispatch.deadline,
                backoff=dispatch.backoff,
            ),
            random=random.Random().random,
        )
        self.reservations = ReservationMap()
        self.workloads = RingSink(maxlen=1000)
        sinks: list[WorkloadSink] = [self.workloads]
        self.link: ControlLink | None = None
        if config.control == "stdio":
            self.link = ControlLink(self, lambda: self._link_closed())
            sinks.append(self.link)
        self._workload_file: IO[str] | None = None
        if config.workload_log is not None:
            # Opened once at start; each event is one flushed JSON line.
            try:
                self._workload_file = open(config.workload_log, "a", encoding="utf-8")
            except OSError as e:
                raise ConfigError(
                    "workloads.log", f"cannot open: {e.strerror}"
                ) from None
            sinks.append(JsonLinesSink(self._workload_file))
        self.metrics = Metrics(self.registry, self._reservation_counts, self.outliers)
        self.accounting = Accounting(
            reactor,
            self.reservations,
            WorkloadRecorder(
                reactor,
                sinks,
                run_id=secrets.token_hex(8),
                originated_from=node_id,
            ),
            self.metrics,
            self.pins,
            awake=self._awake,
            outliers=self.outliers,
        )
        self.facades: dict[str, Facade] = {}
        self.listeners: dict[str, PortListener] = {}
        self.aliases: list[PortListener] = []
        self.sites: dict[str, FacadeSite] = {}
        self._engine_aliases: dict[str, list[PortListener]] = {}
        if config.control is None:
            # With the broker link the process starts with no facade and
            # waits for facade/enable (spec §3).
            for engine_config in config.engines.values():
                if engine_config.enabled:
                    self._add_facade(engine_config)
        if config.admin_enabled:
            host, port = config.admin_listen
            vllm = self.vllm
            admin = admin_app(
                self,
                self.registry,
                extra=(lambda app: admin_routes(app, vllm)) if vllm else None,
            )
            site = _plain_site(admin.resource(), reactor)
            self.admin = PortListener(reactor, "admin API", host, port, site)
            self.admin.setServiceParent(self)  # type: ignore[no-untyped-call]

    # -- cluster ----------------------------------------------------------

    def _endpoints(self) -> list[Endpoint]:
        """
        Every endpoint discovery polls: this node's engines, direct nodes and
        (when this node is a cluster member) every peer's facades over mTLS.
        """
        endpoints = local_endpoints(self.config, self.node_id)
        if self.cluster is not None and self.cluster.current.member:
            for peer in self.cluster.current.peers:
                host = f"[{peer.address}]" if ":" in peer.address else peer.address
                for engine_id, engine_config in self.config.engines.items():
                    # peers.json may leave an engine at its standalone port.
                    port = peer.port(engine_id) or ENGINES[engine_id].standalone_port
                    if engine_config.enabled:
                        endpoints.append(
                            Endpoint(
                                peer.id, engine_id, "peer", f"https://{host}:{port}"
                            )
                        )
        return endpoints

    def _cluster_changed(self) -> None:
        """
        Membership or pins changed: poll the new set of peers, and drop idle
        pooled connections, which were authenticated against the old pins
        (new ones are dialled with the current pins).
        """
        self.polling.set_endpoints(self._endpoints())
        self.upstream.pool.closeCachedConnections()

    def _peer_tls(self, host: str, port: int) -> IOpenSSLClientConnectionCreator | None:
        """
        The client TLS for dialing C{host}:C{port}: pinned mTLS when it is a
        peer, else C{None} (ordinary verification, e.g. an https direct node).
        """
        if self.cluster is None:
            return None
        state = self.cluster.current
        peer = state.peer_at(host, port)
        if peer is None or state.identity is None:
            return None
        creator: IOpenSSLClientConnectionCreator = ClientTLS.for_peer(
            state.identity, peer
        )
        return creator

    def _peer_of(self, request: Any) -> str | None:
        """
        The pinned peer a TLS request comes from, checked per request so a
        removed pin stops an open keep-alive connection.
        """
        if self.server_tls is None:
            return None
        peer = self.server_tls.peer(request.transport)
        return None if peer is None else peer.id

    def _local_endpoint(self, engine_id: str, model: str | None) -> Endpoint | None:
        entry = self.discovery.current.node(engine_id, self.node_id)
        if entry is not None and model is not None and model in entry.models:
            return entry.models[model]
        for endpoint in local_endpoints(self.config, self.node_id):
            if endpoint.engine == engine_id:
                return endpoint
        return None

    def _awake(self, engine_id: str, entry: NodeEntry, model: str | None) -> bool:
        """
        Whether C{entry} can serve C{model} without a wake: only this node's
        vLLM services are known to sleep (DESIGN §4: awake owners first).
        """
        if self.vllm is None or entry.kind != "local" or model is None:
            return True
        endpoint = entry.models.get(model)
        if endpoint is None or endpoint.service is None:
            return True
        return self.vllm.is_awake(endpoint.service)

    def _facade_factory(self, site: IProtocolFactory) -> IProtocolFactory:
        tls = None
        if self.server_tls is not None:
            tls = tls_personality(self.server_tls, site, self.reactor)
        return DemuxFactory(site, tls, self.reactor)

    def _add_facade(self, engine_config: EngineConfig) -> None:
        engine = ENGINES[engine_config.id]
        facade = Facade(
            engine=engine,
            discovery=self.discovery,
            dispatcher=self.dispatcher,
            agent=self.upstream.agent,
            inventory=self.inventory_client,
            clock=self.reactor,
            response_timeout=self.config.dispatch.response_header_timeout,
            stream_idle_timeout=self.config.dispatch.stream_idle_timeout,
            cooperator=self.upstream.cooperator,
            accounting=self.accounting,
            peer_of=self._peer_of,
            local=lambda model: self._local_endpoint(engine.id, model),
            vllm=self.vllm if engine.id == "vllm" else None,
            hidden=is_hidden,
        )
        limits = self.config.limits
        site = FacadeSite(
            facade.resource(),
            error_body=engine.error_body,
            max_body=limits.max_body,
            max_connections=limits.max_connections,
            header_timeout=limits.header_timeout,
            reactor=self.reactor,
        )
        port = engine_config.port
        listener = PortListener(
            self.reactor,
            f"{engine.name} facade",
            self.config.listen_interface,
            port,
            self._facade_factory(site),
        )
        listener.setServiceParent(self)  # type: ignore[no-untyped-call]
        for host, alias_port in engine_config.aliases:
            # Loopback-only extra addresses (§7): plaintext, no TLS; an
            # occupied alias is a warning and leaves the primary alone.
            alias = PortListener(
                self.reactor,
                f"{engine.name} alias",
                host,
                alias_port,
                DemuxFactory(site, None, self.reactor),
                optional=True,
            )
            alias.setServiceParent(self)  # type: ignore[no-untyped-call]
            self.aliases.append(alias)
            self._engine_aliases.setdefault(engine.id, []).append(alias)
        self.facades[engine.id] = facade
        self.sites[engine.id] = site
        self.listeners[engine.id] = listener

    # -- ControlTarget (the broker link) ------------------------------------

    def enable_facade(
        self,
        engine: str,
        port: int,
        aliases: Sequence[tuple[str, int]],
        ignore_persisted: bool,
    ) -> Deferred[int]:
        """
        Start C{engine}'s facade (spec §3): a persisted port wins over
        C{port} unless C{ignore_persisted} (§8); C{0} is the standalone
        default.  Fires with the bound port; fails if it cannot listen, and
        then leaves nothing of it behind.
        """

        async def enable() -> int:
            listener = self.listeners.get(engine)
            if listener is not None and listener.listening is not None:
                return _port_of(listener.listening)
            if listener is not None:
                await self.disable_facade(engine)
            configured = evolve(
                self.config.engines[engine],
                enabled=True,
                port=port,
                aliases=tuple(aliases),
            )
            effective = _effective(configured, self.ports, ignore_persisted)
            self.engine_configs[engine] = effective
            self._add_facade(effective)
            listening = await self.listeners[engine].ready
            if not listening:
                error = self.listeners[engine].error
                await self.disable_facade(engine)
                raise CannotListen(error or "cannot listen")
            self.polling.set_endpoints(self._endpoints())
            return self.listeners[engine].bound_port() or effective.port

        return Deferred.fromCoroutine(enable())

    def disable_facade(self, engine: str) -> Deferred[None]:
        async def disable() -> None:
            listener = self.listeners.pop(engine, None)
            self.facades.pop(engine, None)
            self.sites.pop(engine, None)
            for service in [listener, *self._engine_aliases.pop(engine, [])]:
                if service is None:
                    continue
                if service in self.aliases:
                    self.aliases.remove(service)
                stopped = service.disownServiceParent()  # type: ignore[no-untyped-call]
                if isinstance(stopped, Deferred):
                    await stopped

        return Deferred.fromCoroutine(disable())

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        if self.link is not None and self.link.transport is None:
            StandardIO(self.link, reactor=self.reactor)

    def _link_closed(self) -> None:
        # §11: broker link closed -> facades stop serving, the pool closes.
        if self.running:
            self.reactor.stop()

    def apply_priority(self, snapshot: SchedulerSnapshot) -> bool:
        return self.reservations.apply_snapshot(snapshot)

    def set_log_level(self, level: str) -> None:
        set_level(level)

    def _reservation_counts(self) -> Mapping[str, int]:
        snapshot = self.discovery.current
        nodes = {node for entries in snapshot.engines.values() for node in entries}
        return {node: self.reservations.reservations(node) for node in sorted(nodes)}

    def stopService(self) -> Deferred[Any]:
        self.dispatcher.shutdown()
        d = super().stopService()  # type: ignore[no-untyped-call]
        stopped: Deferred[Any] = d if isinstance(d, Deferred) else succeed(None)
        stopped.addBoth(lambda _: self.upstream.close())
        stopped.addBoth(lambda _: self._close_workload_log())
        return stopped

    def _close_workload_log(self) -> None:
        # After the listeners are down: a request refused during shutdown
        # still writes its events.
        if self._workload_file is not None:
            self._workload_file.close()
            self._workload_file = None

    def ready(self) -> Deferred[Any]:
        """
        Fires once every listener has tried to bind.
        """
        listeners = list(self.listeners.values()) + self.aliases
        if self.config.admin_enabled:
            listeners.append(self.admin)
        return DeferredList([listener.ready for listener in listeners])

    # -- AdminBackend -----------------------------------------------------

    def status(self) -> Mapping[str, Any]:
        snapshot = self.discovery.current
        facades = []
        for engine_id, listener in self.listeners.items():
            facades.append(
                {
                    "engine": engine_id,
                    "port": listener.bound_port() or listener.port,
                    "listening": listener.listening is not None,
                    "error": listener.error,
                    "selected": self.pins.get(engine_id),
                }
            )
        nodes: dict[str, dict[str, list[str]]] = {}
        for engine_id, entries in snapshot.engines.items():
            for node_id, entry in entries.items():
                nodes.setdefault(node_id, {})[engine_id] = sorted(entry.models)
        cluster: dict[str, Any] = {"member": False}
        if self.cluster is not None:
            state = self.cluster.current
            cluster = {
                "member": state.member,
                "peers": [peer.id for peer in state.peers],
                "error": None
                if self.cluster.error is None
                else str(self.cluster.error),
            }
        return {
            "node_id": self.node_id,
            "cluster": cluster,
            "facades": facades,
            "nodes": nodes,
            "inflight": self.dispatcher.inflight(),
            "generation": snapshot.generation,
            "reservations": dict(self._reservation_counts()),
            "vllm": self.vllm.status() if self.vllm is not None else [],
            "loads": dict(self.reservations.snapshot_of_loads()),
            "ejected": self.outliers.status(),
            "process": self._process_status(),
        }

    def _process_status(self) -> dict[str, int | None]:
        """
        What a harness outside the process watches for leaks: open file
        descriptors, pending DelayedCalls and resident memory (C{None} where
        the platform or the reactor does not tell).
        """
        try:
            open_fds: int | None = len(os.listdir("/proc/self/fd"))
        except OSError:
            open_fds = None
        delayed = getattr(self.reactor, "getDelayedCalls", None)
        delayed_calls = len(delayed()) if callable(delayed) else None
        return {
            "open_fds": open_fds,
            "delayed_calls": delayed_calls,
            "rss_bytes": _rss_bytes(),
        }

    def set_port(self, engine: str, port: int) -> Deferred[Mapping[str, Any]]:
        return Deferred.fromCoroutine(self._set_port(engine, port))

    async def _set_port(self, engine: str, port: int) -> Mapping[str, Any]:
        listener = self.listeners.get(engine)
        if listener is None:
            raise AdminError(404, f"engine {engine!r} is not enabled")
        backend = urlsplit(self.engine_configs[engine].backend)
        if backend.port == port and _config.is_loopback(backend.hostname or ""):
            raise AdminError(
                409, f"port {port} is where this node's {engine} engine is"
            )
        try:
            await listener.move(port)
        except Exception as e:
            raise AdminError(409, f"cannot listen on port {port}: {e}") from None
        self.ports.set(engine, port)
        return {"engine": engine, "port": port, "persisted": True}

    def select(self, engine: str, node: str | None) -> Mapping[str, Any]:
        if engine not in self.facades:
            raise AdminError(404, f"engine {engine!r} is not enabled")
        pins = dict(self.pins)
        if node is None:
            pins.pop(engine, None)
        else:
            pins[engine] = node
        try:
            # Persisted first: a selection that would not survive a restart
            # is refused, not half applied.
            self.selections.save(pins)
        except OSError as e:
            raise AdminError(
                500, f"cannot persist the selection: {e.strerror or e}"
            ) from None
        if node is None:
            self.pins.pop(engine, None)
        else:
            self.pins[engine] = node
        return {"engine": engine, "selected": node}

    def recent_workloads(self, limit: int) -> list[Any]:
        return self.workloads.recent(limit)


def _plain_site(resource: Any, reactor: Any) -> IProtocolFactory:
    from twisted.web.server import Site

    site = Site(resource, reactor=reactor)
    site.displayTracebacks = False
    return site


def build(config: Config, reactor: Any, hostname: str | None = None) -> NvProxy:
    """
    Build the daemon for C{config} on C{reactor}.

    @raise ClusterError: the cluster dir cannot be read.
    """
    cluster = None
    if config.cluster_dir is not None:
        cluster = ClusterWatcher(ClusterDir(config.cluster_dir), reactor)
    identity = cluster.current.identity if cluster is not None else None
    if identity is not None:
        # The certificate names this node; any other id would fail peers'
        # service-identity checks.
        if config.node_id is not None and config.node_id != identity.node_id:
            raise ClusterError(
                f"cluster.dir: this node's certificate is for {identity.node_id!r}"
                f" but node_id is {config.node_id!r}"
            )
        node_id = identity.node_id
    else:
        node_id = resolve_node_id(config, hostname or socket.gethostname())
    return NvProxy(config, reactor, node_id, cluster)


def makeService(options: usage.Options) -> NvProxy:
    """
    The twistd entry point.
    """
    from twisted.internet import reactor

    assert isinstance(options, Options)
    try:
        service = build(options.config, reactor)
    except (ClusterError, ConfigError) as e:
        print(f"nvproxy: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    log.info(
        "nvproxy node {node} starting with engines {engines}",
        node=service.node_id,
        engines=",".join(service.facades) or "none (waiting for facade/enable)",
    )
    return service


def _rss_bytes() -> int | None:
    """This process's resident set size: C{/proc/self/statm}, else C{resource}."""
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:
        return None
    # ru_maxrss is the peak, in KiB on Linux and bytes on macOS: a fallback.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
