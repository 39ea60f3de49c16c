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
from collections.abc import Callable, Mapping
from typing import IO, Any

from attrs import evolve
from prometheus_client import CollectorRegistry
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, DeferredList, gatherResults, maybeDeferred
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator,
    IProtocolFactory,
)
from twisted.internet.stdio import StandardIO
from twisted.logger import Logger
from twisted.python import usage

from nvproxy.accounting import Accounting
from nvproxy.admin import admin_app, admin_resource
from nvproxy.brokerdiscovery import BrokerDiscovery
from nvproxy.cluster import (
    ClientTLSCache,
    ClusterDir,
    ClusterError,
    ClusterState,
    ClusterWatcher,
    ServerTLS,
)
from nvproxy.config import (
    FLAG_NAMES,
    Config,
    ConfigError,
    EngineConfig,
    LimitsConfig,
    Options,
    load_config,
    resolve_node_id,
)
from nvproxy.control import ControlLink
from nvproxy.discovery import Discovery, Endpoint, PollingDiscovery
from nvproxy.dispatch import Dispatcher
from nvproxy.drain import DrainState
from nvproxy.engines import ENGINES, Engine
from nvproxy.etcd import (
    EtcdClient,
    EtcdDiscovery,
    EtcdPeers,
    Records,
    SessionSettings,
    etcd_document,
    etcd_tls,
)
from nvproxy.keyring import KeyFileError, KeyRing
from nvproxy.metrics import Metrics
from nvproxy.noderecord import (
    Fleet,
    LocalRecord,
    PeerRecords,
    ReadinessCollector,
    encode,
)
from nvproxy.ops import Operations, effective_engine
from nvproxy.outliers import EjectionPolicy, OutlierTable
from nvproxy.poll import serve_events_untagged
from nvproxy.ports import PortStore, SelectionStore
from nvproxy.proxy.access import KeyPolicy, NetworkGate, access_warnings
from nvproxy.proxy.attempt import AttemptSettings
from nvproxy.proxy.backendauth import BackendKeyError, read_backend_key
from nvproxy.proxy.backends import Backend, HttpBackend, VllmBackend
from nvproxy.proxy.facade import Facade, FacadeParts, PeerFacade, personalities
from nvproxy.proxy.listener import DemuxFactory, PortListener, tls_personality
from nvproxy.proxy.site import ClientLimits, FacadeSite, GuardedSite
from nvproxy.proxy.upstream import TreqInventoryClient, Upstream
from nvproxy.readiness import AWAKE, ModelReadiness
from nvproxy.reload import Reloader
from nvproxy.scheduler import ReservationMap
from nvproxy.shutdown import Shutdown
from nvproxy.signals import install_signal_handlers
from nvproxy.statuspage import StatusPage
from nvproxy.vllm import VllmManager
from nvproxy.workload import JsonLinesSink, RingSink, WorkloadRecorder, WorkloadSink

log = Logger()


def local_endpoints(config: Config, node_id: str) -> list[Endpoint]:
    """
    This node's engine endpoints, and every direct node's.
    """
    endpoints = []
    for engine_config in config.engines.values():
        if not engine_config.enabled:
            continue
        if engine_config.services:
            # Registered services (the vLLM front door): one endpoint each.
            for service in engine_config.services:
                endpoints.append(
                    Endpoint(
                        node_id, engine_config.id, "local", service.url, service.name
                    )
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
    The whole daemon: every part built from the config and connected.  What
    runs at runtime on an operator's or the broker's request is
    L{nvproxy.ops.Operations} (C{ops}).
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
        self._etcd_tls: (
            Callable[[str, int], IOpenSSLClientConnectionCreator | None] | None
        ) = None
        self._peer_creators = ClientTLSCache()
        self.server_tls: ServerTLS | None = None
        if cluster is not None:
            cluster.setServiceParent(self)  # type: ignore[no-untyped-call]
            # Always, so a node that joins later needs no restart (§7): with
            # no identity yet every handshake simply fails.
            self.server_tls = ServerTLS(self._cluster_state)
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
            engine_id: effective_engine(engine_config, self.ports)
            for engine_id, engine_config in config.engines.items()
        }
        config = evolve(config, engines=self.engine_configs)
        self.config = config
        # Who may call each facade (DESIGN §3a); a bad keys file stops us.
        self.key_policies = _key_policies(config, reactor)
        # engine -> its facade's network gate (shared by its aliases)
        self.gates: dict[str, NetworkGate] = {}
        self.upstream = Upstream(
            reactor,
            config.dispatch.dial_timeout,
            tls_for=self._peer_tls,
            backend_keys=_backend_keys(config, node_id),
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
                retry_after_estimate=vllm_config.retry_after == "estimate",
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
        # The fleet (DESIGN §3): this node's record, its peers' records, and
        # readiness and draining in every discovery snapshot.
        self.drain = DrainState(config.state_dir)
        self.record = LocalRecord(
            node_id,
            self.discovery,
            ports=self._facade_ports,
            readiness=self._local_readiness,
            in_flight=lambda engine: self.accounting.in_flight.get(engine, 0),
            draining=lambda: self.drain.draining,
        )
        self.peer_records: PeerRecords | None = None
        # etcd (DESIGN §3, fleets): peers' records from an etcd prefix, no peer
        # polled; "static": configured nodes only.
        self.etcd_peers: EtcdPeers | None = None
        if config.discovery_provider == "etcd":
            self.etcd_peers = EtcdPeers(
                node_id,
                config.etcd.trust,
                lambda: cluster.current if cluster is not None else None,
                lambda: [e for e, c in self.engine_configs.items() if c.enabled],
            )
        elif cluster is not None and config.discovery_provider == "mesh":
            self.peer_records = PeerRecords(
                self.inventory_client,
                reactor,
                config.discovery_poll_interval,
                changed=self._readiness_changed,
            )
        self.fleet = Fleet(self.record, self.peer_records or self.etcd_peers)
        # With the broker link, the broker may feed an engine's inventory
        # (nvproxy.brokerdiscovery): polling publishes beside it.
        polled = self.discovery if config.control is None else Discovery()
        self.polling = PollingDiscovery(
            polled,
            self.inventory_client,
            reactor,
            self._endpoints(),
            interval=config.discovery_poll_interval,
            static_models=static,
            answered=lambda e: self.outliers.answered(e.engine, e.node_id),
            annotate=self.fleet.annotate,
        )
        self.polling.setServiceParent(self)  # type: ignore[no-untyped-call]
        if self.peer_records is not None:
            self.peer_records.set_peers(self._record_urls())
            self.peer_records.setServiceParent(self)  # type: ignore[no-untyped-call]
        self.etcd: EtcdDiscovery | None = None
        if self.etcd_peers is not None:
            self.etcd = self._etcd(config, reactor, node_id)
            self.etcd.setServiceParent(self)  # type: ignore[no-untyped-call]
        self.drain.subscribe(self._readiness_changed)
        if self.vllm is not None:
            self.vllm.subscribe(self._readiness_changed)
        self.discovery.subscribe(lambda _snapshot: self.record.refresh())
        self.registry.register(ReadinessCollector(self.discovery))
        if cluster is not None:
            cluster.subscribe(lambda _state: self._cluster_changed())
        self.dispatcher = Dispatcher(
            reactor, config.dispatch.policy, random=random.Random().random
        )
        self.shutdown = Shutdown(
            reactor,
            config.shutdown_grace,
            self.dispatcher,
            self._close_ports,
            self._close_connections,
        )
        self.reservations = ReservationMap()
        self.broker_discovery: BrokerDiscovery | None = None
        if config.control is not None:
            self.broker_discovery = BrokerDiscovery(
                polled, self.discovery, node_id, self._peer_url, reactor
            )
            self.reservations.on_change = self.broker_discovery.activity_changed
        self.workloads = RingSink(maxlen=1000)
        self.facades: dict[str, Facade] = {}
        self.listeners: dict[str, PortListener] = {}
        self.aliases: list[PortListener] = []
        self.sites: dict[str, FacadeSite] = {}
        self._engine_aliases: dict[str, list[PortListener]] = {}
        self._admin_site: GuardedSite | None = None
        self.ops = Operations(
            node_id=node_id,
            clock=reactor,
            discovery=self.discovery,
            dispatcher=self.dispatcher,
            reservations=self.reservations,
            outliers=self.outliers,
            workloads=self.workloads,
            pins=self.pins,
            selections=self.selections,
            ports=self.ports,
            engine_configs=self.engine_configs,
            listeners=self.listeners,
            add_facade=self._add_facade,
            remove_facade=self._remove_facade,
            endpoints_changed=self._set_endpoints,
            cluster=cluster,
            vllm=self.vllm,
            fleet=self.fleet,
            drain=self.drain,
            discovery_status=self._discovery_status,
        )
        sinks: list[WorkloadSink] = [self.workloads]
        self.link: ControlLink | None = None
        if config.control == "stdio":
            self.link = ControlLink(
                self.ops,
                lambda: self._link_closed(),
                max_line=config.control_max_line,
                discovery=self.broker_discovery,
            )
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
        self.metrics = Metrics(
            self.registry,
            self.ops.reservation_counts,
            self.outliers,
            known_model=self._advertised,
            vllm_services=None if self.vllm is None else self.vllm.status,
        )
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
            outliers=self.outliers,
        )
        if config.control is None:
            # With the broker link the process starts with no facade and
            # waits for facade/enable (spec §3).
            for engine_config in config.engines.values():
                if engine_config.enabled:
                    self._add_facade(engine_config)
        self.status_page: StatusPage | None = None
        if config.admin_enabled:
            host, port = config.admin_listen
            self.status_page = StatusPage(self.ops, reactor)
            admin = admin_app(
                self.ops,
                self.registry,
                vllm=self.vllm is not None,
                status_page=self.status_page,
            )
            site = _plain_site(admin_resource(admin), reactor, config.limits)
            self._admin_site = site
            self.admin = PortListener(reactor, "admin API", host, port, site)
            self.admin.setServiceParent(self)  # type: ignore[no-untyped-call]

    def _advertised(self, engine: str, model: str) -> bool:
        """Whether some node advertises C{model} for C{engine} (metric labels)."""
        entries = self.discovery.current.engines.get(engine, {})
        return any(model in entry.models for entry in entries.values())

    def enable_reload(self, load: Callable[[], Config]) -> None:
        """
        Let SIGHUP and C{POST /admin/reload} re-read the configuration with
        C{load} (the file, flags and environment of the start).
        """
        reloader = Reloader(
            self,
            load,
            lambda c: self.ops.enable_facade(c.id, c.port, c.aliases, False),
            self.ops.disable_facade,
        )
        self.ops.reloader = reloader.reload

    def rebuild_facade(self, engine_id: str) -> None:
        """
        New requests to C{engine_id}'s running facade take the current
        config (a reload); requests in flight keep theirs.
        """
        site = self.sites.get(engine_id)
        if site is not None:
            facade, resource = self.facade_resource(self.engine_configs[engine_id])
            self.facades[engine_id] = facade
            site.resource = resource

    def reload_access(self, new: Config) -> list[str]:
        """
        A reload's access rules: new key rules (every keys file read
        afresh) for the facades rebuilt next, new source networks for the
        running listeners at once.

        @raise ConfigError: a keys file cannot be used (nothing changed).
        """
        policies = _key_policies(new, self.reactor)
        changed = []
        for engine_id in new.engines:
            before = self.config.engines[engine_id].access_in(self.config)
            after = new.engines[engine_id].access_in(new)
            if before != after:
                changed.append(f"engines.{engine_id}.access")
            gate = self.gates.get(engine_id)
            if gate is not None:
                gate.networks = tuple(after.plaintext_from)
        self.key_policies = policies
        return changed

    def admin_site(self) -> GuardedSite | None:
        return self._admin_site

    def endpoints_changed(self) -> None:
        self.polling.set_endpoints(self._endpoints())

    # -- cluster ----------------------------------------------------------

    def _endpoints(self) -> list[Endpoint]:
        """
        Every endpoint discovery polls: this node's engines, direct nodes and
        (when this node is a cluster member) every peer's facades over mTLS.
        """
        endpoints = local_endpoints(self.config, self.node_id)
        if self.config.discovery_provider != "mesh":
            # etcd-fed peers are never polled (PollingDiscovery.set_fed)
            return endpoints
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

    def _peer_url(self, engine: str, peer_id: str) -> str | None:
        """Where pinned peer C{peer_id}'s C{engine} facade answers, if pinned."""
        if self.cluster is None or not self.cluster.current.member:
            return None
        for peer in self.cluster.current.peers:
            if peer.id == peer_id:
                host = f"[{peer.address}]" if ":" in peer.address else peer.address
                port = peer.port(engine) or ENGINES[engine].standalone_port
                return f"https://{host}:{port}"
        return None

    def _cluster_changed(self) -> None:
        """
        Membership or pins changed: poll the new set of peers, and drop idle
        pooled connections, which were authenticated against the old pins
        (new ones are dialled with the current pins).  With etcd, the
        records already seen are judged again against the new pins.
        """
        self._set_endpoints()
        self.upstream.pool.closeCachedConnections()
        if self.etcd is not None:
            self._etcd_records(self.etcd.records)

    def _set_endpoints(self) -> None:
        self.polling.set_endpoints(self._endpoints())
        if self.peer_records is not None:
            self.peer_records.set_peers(self._record_urls())

    def _record_urls(self) -> dict[str, str]:
        """Peer id -> one of its facades, where its node record is asked."""
        urls: dict[str, str] = {}
        for endpoint in self._endpoints():
            if endpoint.kind == "peer":
                urls.setdefault(endpoint.node_id, endpoint.base_url)
        return urls

    # -- the fleet --------------------------------------------------------

    def _facade_ports(self) -> dict[str, int]:
        return {
            engine_id: listener.bound_port() or listener.port
            for engine_id, listener in self.listeners.items()
        }

    def _local_readiness(self, engine_id: str, model: str) -> ModelReadiness:
        """A registered vLLM service's readiness; every other model is awake."""
        if ENGINES[engine_id].backend == "vllm" and self.vllm is not None:
            service = self.vllm.registry.lookup(model)
            if service is not None:
                return self.vllm.readiness(service.name)
        return AWAKE

    def _readiness_changed(self) -> None:
        """A local or a peer's readiness, or draining, changed."""
        self.polling.republish()
        self.record.refresh()

    # -- etcd -------------------------------------------------------------

    def _etcd(self, config: Config, reactor: Any, node_id: str) -> EtcdDiscovery:
        etcd = config.etcd
        self._etcd_tls = etcd_tls(etcd.endpoints, etcd.cert, etcd.key, etcd.ca)
        client = EtcdClient(self.upstream.treq, reactor, etcd.endpoints)

        def document() -> dict[str, Any]:
            fingerprint = None
            if self.cluster is not None and self.cluster.current.identity:
                fingerprint = str(self.cluster.current.identity.fingerprint)
            return etcd_document(
                encode(self.record.current()), config.advertise_address, fingerprint
            )

        def subscribe(changed: Callable[[], None]) -> Callable[[], None]:
            return self.record.subscribe(lambda _record: changed())

        return EtcdDiscovery(
            client,
            reactor,
            SessionSettings(etcd.prefix, etcd.lease_ttl),
            node_id,
            document,
            subscribe,
            self._etcd_records,
            registry=self.registry,
            random=random.Random().random,
            endpoint=lambda: client.endpoint,
        )

    def _etcd_records(self, documents: Records) -> None:
        """Every other node's record, as etcd has it now."""
        assert self.etcd_peers is not None
        before = self.etcd_peers.peers
        entries = self.etcd_peers.apply(documents)
        if self.etcd_peers.peers != before:
            # peers moved, left or changed pins: connections dialed to the
            # old ones go (a readiness change alone keeps them)
            self.upstream.pool.closeCachedConnections()
        self.polling.set_fed(entries)

    def _discovery_status(self) -> Mapping[str, Any]:
        if self.etcd is not None:
            return self.etcd.status()
        return {"provider": self.config.discovery_provider}

    def _cluster_state(self) -> ClusterState:
        """The cluster dir's pins, with the peers etcd names (their
        addresses and, with trust = "etcd", their pins)."""
        assert self.cluster is not None
        state = self.cluster.current
        if self.etcd_peers is not None:
            state = self.etcd_peers.cluster_state(state)
        return state

    def _peer_tls(self, host: str, port: int) -> IOpenSSLClientConnectionCreator | None:
        """
        The client TLS for dialing C{host}:C{port}: pinned mTLS when it is a
        peer, else C{None} (ordinary verification, e.g. an https direct node).
        """
        if self._etcd_tls is not None and (found := self._etcd_tls(host, port)):
            return found
        if self.cluster is None:
            return None
        state = self._cluster_state()
        peer = state.peer_at(host, port)
        return None if peer is None else self._peer_creators.creator(state, peer)

    def _peer_of(self, request: Any) -> str | None:
        """
        The pinned peer a TLS request comes from, checked per request so a
        removed pin stops an open keep-alive connection.
        """
        if self.server_tls is None:
            return None
        peer = self.server_tls.peer(request.transport)
        return None if peer is None else peer.id

    def _backend(self, engine: Engine) -> Backend:
        """
        This node's engine behind C{engine}'s facade, of the kind the engine
        table names (a vLLM without registered services is plain HTTP).
        """
        local = [
            endpoint
            for endpoint in local_endpoints(self.config, self.node_id)
            if endpoint.engine == engine.id and endpoint.kind == "local"
        ]
        if engine.backend == "vllm" and self.vllm is not None:
            return VllmBackend(engine, self.discovery, self.node_id, local, self.vllm)
        return HttpBackend(engine, self.discovery, self.node_id, local)

    def _facade_factory(
        self, site: IProtocolFactory, gate: NetworkGate
    ) -> IProtocolFactory:
        tls = None
        if self.server_tls is not None:
            tls = tls_personality(self.server_tls, site, self.reactor)
        return DemuxFactory(site, tls, self.reactor, allow_plaintext_from=gate)

    def facade_resource(self, engine_config: EngineConfig) -> tuple[Facade, Any]:
        """
        The request path of C{engine_config}'s facade, from the current
        config: its plaintext personality and the resource a site serves.
        """
        engine = ENGINES[engine_config.id]
        backend = self._backend(engine)
        dispatch = self.config.dispatch
        settings = AttemptSettings(
            agent=self.upstream.agent,
            clock=self.reactor,
            cooperator=self.upstream.cooperator,
            response_timeout=dispatch.response_header_timeout,
            stream_idle_timeout=dispatch.stream_idle_timeout,
        )
        parts = FacadeParts(backend, self.dispatcher, self.accounting, settings)
        facade = Facade(
            parts,
            discovery=self.discovery,
            inventory=self.inventory_client,
            keys=self.key_policies.get(engine.id),
        )
        peer = None
        if self.server_tls is not None:
            peer = PeerFacade(
                parts,
                peer_of=self._peer_of,
                node_record=lambda: encode(self.record.current()),
            )
        return facade, personalities(facade, peer)

    def _add_facade(self, engine_config: EngineConfig) -> None:
        engine = ENGINES[engine_config.id]
        facade, resource = self.facade_resource(engine_config)
        access = engine_config.access_in(self.config)
        gate = NetworkGate(access.plaintext_from)
        self.gates[engine.id] = gate
        for warning in access_warnings(access, self.config.listen_interface):
            log.warn("{engine} facade: {warning}", engine=engine.id, warning=warning)
        limits = self.config.limits
        site = FacadeSite(
            resource,
            error_body=engine.error_body,
            max_body=limits.max_body,
            max_connections=limits.max_connections,
            limits=_client_limits(limits),
            reactor=self.reactor,
            access_log=self.config.log_access,
        )
        port = engine_config.port
        listener = PortListener(
            self.reactor,
            f"{engine.name} facade",
            self.config.listen_interface,
            port,
            self._facade_factory(site, gate),
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
                DemuxFactory(site, None, self.reactor, allow_plaintext_from=gate),
                optional=True,
            )
            alias.setServiceParent(self)  # type: ignore[no-untyped-call]
            self.aliases.append(alias)
            self._engine_aliases.setdefault(engine.id, []).append(alias)
        self.facades[engine.id] = facade
        self.sites[engine.id] = site
        self.listeners[engine.id] = listener

    def _remove_facade(self, engine: str) -> Deferred[None]:
        """
        Undo L{_add_facade}: stop C{engine}'s facade and its aliases and
        forget them; nothing if none runs.
        """

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
        if self.running and not self.shutdown.draining:
            log.info("stopping: the broker link is closed")
            self.reactor.stop()

    def _close_ports(self) -> Deferred[Any]:
        listeners = [*self.listeners.values(), *self.aliases]
        if self.config.admin_enabled:
            listeners.append(self.admin)
        return gatherResults(
            [maybeDeferred(listener.stopService) for listener in listeners],
            consumeErrors=True,
        )

    def _close_connections(self, timeout: float) -> Deferred[Any]:
        closing: Deferred[Any] = gatherResults(
            [site.close_connections() for site in self.sites.values()],
            consumeErrors=True,
        )
        # Past the timeout the reactor's shutdown drops what is left.
        closing.addTimeout(timeout, self.reactor)
        closing.addErrback(lambda _: None)
        return closing

    def stopService(self) -> Deferred[Any]:
        if self.status_page is not None:
            # Event streams never end on their own.
            self.status_page.feed.close()

        # The drain (nvproxy.shutdown) first, then every other service.
        async def stop() -> None:
            await self.shutdown.begin()
            await maybeDeferred(super(NvProxy, self).stopService)

        stopped: Deferred[Any] = Deferred.fromCoroutine(stop())
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


def _key_policies(config: Config, clock: Any) -> dict[str, KeyPolicy]:
    """
    Each engine's API-key rules, one L{KeyRing} per keys file.

    @raise ConfigError: a keys file cannot be used.
    """
    rings: dict[str, KeyRing] = {}
    policies: dict[str, KeyPolicy] = {}
    for engine_id, engine_config in config.engines.items():
        access = engine_config.access_in(config)
        path = access.api_keys_file
        if path is None:
            continue
        if path not in rings:
            key = "access.api_keys_file"
            if engine_config.access.api_keys_file is not None:
                key = f"engines.{engine_id}.{key}"
            try:
                rings[path] = KeyRing(path, clock)
            except KeyFileError as e:
                raise ConfigError(key, str(e)) from None
        policies[engine_id] = KeyPolicy(
            rings[path],
            require_on_loopback=access.require_key_on_loopback,
            max_concurrent=access.max_concurrent_per_key,
        )
    return policies


def _backend_keys(config: Config, node_id: str) -> dict[str, str]:
    """
    Engine base URL -> the key that engine wants (this node's engines and
    direct nodes'; never a peer's facade).

    @raise ConfigError: a key file cannot be used.
    """
    keys: dict[str, str] = {}
    for engine_id, engine_config in config.engines.items():
        path = engine_config.backend_api_key_file
        if path is None or not engine_config.enabled:
            continue
        try:
            key = read_backend_key(path)
        except BackendKeyError as e:
            raise ConfigError(
                f"engines.{engine_id}.backend_api_key_file", str(e)
            ) from None
        for endpoint in local_endpoints(config, node_id):
            if endpoint.engine == engine_id:
                keys[endpoint.base_url] = key
    return keys


def _client_limits(limits: LimitsConfig) -> ClientLimits:
    return ClientLimits(
        header_timeout=limits.header_timeout,
        idle_timeout=limits.idle_timeout,
        max_request_line=limits.max_request_line,
        max_header_bytes=limits.max_header_bytes,
        max_header_count=limits.max_header_count,
    )


def _plain_site(resource: Any, reactor: Any, limits: LimitsConfig) -> GuardedSite:
    # The admin listener: the facades' head limits, JSON errors.
    return GuardedSite(resource, limits=_client_limits(limits), reactor=reactor)


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
    flags = {name: options[name] for name in FLAG_NAMES}
    service.enable_reload(lambda: load_config(options["config"], flags, os.environ))

    def on_hup() -> None:
        # Errors are logged by the reload itself.
        service.ops.reload().addErrback(lambda _: None)

    reactor.callWhenRunning(install_signal_handlers, reactor, service.shutdown, on_hup)
    reactor.callWhenRunning(tune_collector)
    serve_events_untagged(reactor)
    return service


YOUNG_THRESHOLD = 10_000
"""
Net container allocations that start a young-generation collection
(Python's default: 700).
"""


def tune_collector() -> None:
    """
    Move everything built at start-up (modules, config, the service tree)
    out of the cyclic collector's reach: a full collection then walks only
    what requests allocate, so it no longer stalls a request for tens of
    milliseconds (measured: the c=1 p99 tail, docs/performance.rst).
    Nothing frozen is freed, which is what start-up objects want anyway.

    Requests leave no cyclic garbage (tests/test_gc.py), so the young
    generation is collected at L{YOUNG_THRESHOLD} instead of 700: 32
    requests in flight alone crossed 700 every few requests (671 young
    collections, 5 full ones, 5 % of the CPU of a chat run at c=32), and
    at 10,000 the same run had 3, taking 10 ms in all, with the same c=1
    latency.  The older generations keep Python's ratios.
    """
    import gc

    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
