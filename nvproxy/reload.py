# -*- test-case-name: tests.test_operations -*-
"""
Reloading the configuration while the daemon runs (SIGHUP,
C{POST /admin/reload}, C{nvproxyctl reload}).

The file is read again with the same flags and environment as at start-up,
and the cluster dir is re-read.  A file with problems is refused with the
same one-line errors as at start-up (L{nvproxy.config.ConfigErrors}) and
the running configuration stays in force.  Otherwise each component takes
the new L{Config} in one place, for new requests only (requests in flight
keep what they started with):

* L{_apply_log}: the log level, the access log switch;
* L{_apply_dispatch}: dispatch policy (attempts, deadline, backoff);
* L{_apply_limits}: client limits of every facade and the admin API;
* L{_apply_facades}: engines enabled or disabled, a changed facade port
  (rebound like set-port: the old port is closed only once the new one is
  bound; a persisted port still wins), backends, direct nodes and response
  timeouts (each facade's request path is rebuilt from the new config);
  with the broker link, which facades run and on which port stay the
  broker's;
* C{reload_access} (the composition root): C{[access]} and every
  C{[engines.E.access]}, the keys files read afresh;
* L{_apply_shutdown}: C{shutdown.grace};
* L{_apply_vllm}: the vLLM holds, C{state_ttl} and each service's idle
  times (from its next idle period), when the services themselves (names,
  URLs, models, aliases, routes) are unchanged;
* the cluster dir, re-read.

What needs a restart is listed in the answer (C{restart_required}) and
logged: the keys in L{RESTART_KEYS}.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Final, Protocol

from attrs import evolve
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from nvproxy.cluster import ClusterWatcher
from nvproxy.config import Config, ConfigError, EngineConfig
from nvproxy.dispatch import Dispatcher
from nvproxy.logs import current_level, set_level
from nvproxy.ops import OperationError, effective_engine
from nvproxy.ports import PortStore
from nvproxy.proxy.listener import PortListener
from nvproxy.proxy.site import ClientLimits, FacadeSite, GuardedSite
from nvproxy.shutdown import Shutdown
from nvproxy.vllm import VllmManager

__all__ = ["RESTART_KEYS", "Reloadable", "Reloader"]

log = Logger()

RESTART_KEYS: Final[Mapping[str, Callable[[Config], object]]] = {
    "state_dir": lambda c: c.state_dir,
    "node_id": lambda c: c.node_id,
    "listen_interface": lambda c: c.listen_interface,
    "admin": lambda c: (c.admin_listen, c.admin_enabled),
    "control": lambda c: (c.control, c.control_max_line),
    "cluster.dir": lambda c: c.cluster_dir,
    "workloads.log": lambda c: c.workload_log,
    "log_format": lambda c: c.log_format,
    "dispatch.dial_timeout": lambda c: c.dispatch.dial_timeout,
    "dispatch.eject_base": lambda c: (c.dispatch.eject_base, c.dispatch.eject_max),
    "discovery.poll_interval": lambda c: c.discovery_poll_interval,
    "discovery.provider": lambda c: (c.discovery_provider, c.etcd),
    "discovery.advertise_address": lambda c: c.advertise_address,
    "engines.vllm.services": lambda c: c.engines["vllm"].services,
    "engines.vllm.hold": lambda c: (
        c.engines["vllm"].hold,
        c.engines["vllm"].state_ttl,
    ),
}
"""Settings a running daemon cannot change: how to read each."""


class Reloadable(Protocol):
    """What the reload changes: the composition root's parts."""

    config: Config

    @property
    def dispatcher(self) -> Dispatcher: ...

    @property
    def shutdown(self) -> Shutdown: ...

    @property
    def ports(self) -> PortStore: ...

    @property
    def cluster(self) -> ClusterWatcher | None: ...

    @property
    def engine_configs(self) -> MutableMapping[str, EngineConfig]: ...

    @property
    def listeners(self) -> Mapping[str, PortListener]: ...

    @property
    def sites(self) -> Mapping[str, FacadeSite]: ...

    @property
    def vllm(self) -> VllmManager | None: ...

    def rebuild_facade(self, engine_id: str) -> None: ...

    def reload_access(self, new: Config) -> list[str]: ...

    def admin_site(self) -> GuardedSite | None: ...

    def endpoints_changed(self) -> None: ...


class Reloader:
    """
    @param load: reads the configuration as at start-up (same file, flags
        and environment); raises L{ConfigError} on problems.
    @param enable_facade: starts an engine's facade (L{Operations.enable_facade}).
    @param disable_facade: stops one.
    """

    def __init__(
        self,
        service: Reloadable,
        load: Callable[[], Config],
        enable_facade: Callable[[EngineConfig], Deferred[int]],
        disable_facade: Callable[[str], Deferred[None]],
    ) -> None:
        self._service = service
        self._load = load
        self._enable = enable_facade
        self._disable = disable_facade

    def reload(self) -> Deferred[Mapping[str, Any]]:
        """
        Reload; fires with C{{"reloaded": True, "changed": [...],
        "restart_required": [...]}}, or fails with L{OperationError} (400,
        C{details: {"errors": [line, ...]}}) leaving everything as it was.
        """
        return Deferred.fromCoroutine(self._reload())

    async def _reload(self) -> Mapping[str, Any]:
        service = self._service
        try:
            new = self._load()
        except ConfigError as e:
            lines = str(e).splitlines()
            for line in lines:
                log.error("reload refused: {error}", error=line)
            raise OperationError(
                400, "configuration refused", details={"errors": lines}
            ) from None
        old = service.config
        try:
            # the keys files are read afresh; one that cannot be used
            # refuses the reload like a bad file
            access_changed = service.reload_access(new)
        except ConfigError as e:
            log.error("reload refused: {error}", error=str(e))
            raise OperationError(
                400, "configuration refused", details={"errors": [str(e)]}
            ) from None
        restart = [key for key, read in RESTART_KEYS.items() if read(old) != read(new)]
        # What cannot change stays as it runs.
        new = evolve(
            new,
            state_dir=old.state_dir,
            node_id=old.node_id,
            listen_interface=old.listen_interface,
            admin_listen=old.admin_listen,
            admin_enabled=old.admin_enabled,
            control=old.control,
            control_max_line=old.control_max_line,
            cluster_dir=old.cluster_dir,
            workload_log=old.workload_log,
            log_format=old.log_format,
            discovery_provider=old.discovery_provider,
            etcd=old.etcd,
            advertise_address=old.advertise_address,
        )
        if "engines.vllm.services" in restart:
            # Other services than those running: all of vLLM's settings wait.
            vllm_old, vllm_new = old.engines["vllm"], new.engines["vllm"]
            engines = dict(new.engines)
            engines["vllm"] = evolve(
                vllm_new,
                services=vllm_old.services,
                hold=vllm_old.hold,
                state_ttl=vllm_old.state_ttl,
            )
            new = evolve(new, engines=engines)
        # One line per component; each takes what it needs of the new config
        # and returns the keys that changed.
        changed: list[str] = []
        changed += _apply_log(old, new)
        changed += _apply_dispatch(service, old, new)
        changed += _apply_limits(service, old, new)
        changed += _apply_shutdown(service, old, new)
        changed += _apply_vllm(service, old, new)
        # before the facades are rebuilt: they take the new key rules
        changed += access_changed
        changed += await self._apply_facades(old, new)
        if service.cluster is not None:
            service.cluster.reload()
        for key in restart:
            log.warn("reload: {key} changed; it takes effect at restart", key=key)
        log.info(
            "configuration reloaded: changed {changed}",
            changed=", ".join(changed) or "nothing",
        )
        return {"reloaded": True, "changed": changed, "restart_required": restart}

    async def _apply_facades(self, old: Config, new: Config) -> list[str]:
        """
        Engines, ports, backends, direct nodes and response timeouts: the
        new config in force, then each running facade's request path
        rebuilt from it; facades enabled, disabled or rebound.
        """
        service = self._service
        changed: list[str] = []
        service.config = new
        # With the broker link the broker enables facades and sets ports.
        managed = old.control is not None
        for engine_id, engine_config in new.engines.items():
            before = old.engines[engine_id]
            running = service.listeners.get(engine_id)
            if managed:
                if running is not None:
                    service.rebuild_facade(engine_id)
                continue
            if engine_config.enabled and running is None:
                service.engine_configs[engine_id] = engine_config
                await self._enable(engine_config)
                changed.append(f"engines.{engine_id}.enabled")
                continue
            if not engine_config.enabled:
                if running is not None:
                    await self._disable(engine_id)
                    changed.append(f"engines.{engine_id}.enabled")
                continue
            assert running is not None
            effective = effective_engine(engine_config, service.ports)
            service.engine_configs[engine_id] = effective
            if effective.port != running.port:
                try:
                    await running.move(effective.port)
                    changed.append(f"engines.{engine_id}.port")
                except Exception as e:
                    log.error(
                        "reload: {engine} facade cannot move to port {port},"
                        " staying on {old}: {error}",
                        engine=engine_id,
                        port=effective.port,
                        old=running.port,
                        error=str(e),
                    )
                    service.engine_configs[engine_id] = evolve(
                        effective, port=running.port
                    )
            if before != engine_config and f"engines.{engine_id}.port" not in changed:
                changed.append(f"engines.{engine_id}")
            service.rebuild_facade(engine_id)
        if old.nodes != new.nodes:
            changed.append("nodes")
        if (old.dispatch.response_header_timeout, old.dispatch.stream_idle_timeout) != (
            new.dispatch.response_header_timeout,
            new.dispatch.stream_idle_timeout,
        ):
            changed.append("dispatch timeouts")
        service.endpoints_changed()
        return changed


def _apply_log(old: Config, new: Config) -> list[str]:
    changed = []
    if new.log_level != current_level():
        set_level(new.log_level)
        changed.append("log_level")
    if old.log_access != new.log_access:
        changed.append("log.access")
    return changed


def _apply_dispatch(service: Reloadable, old: Config, new: Config) -> list[str]:
    if old.dispatch.policy == new.dispatch.policy:
        return []
    service.dispatcher.set_policy(new.dispatch.policy)
    return ["dispatch"]


def _apply_limits(service: Reloadable, old: Config, new: Config) -> list[str]:
    changed = []
    limits = new.limits
    client = ClientLimits(
        header_timeout=limits.header_timeout,
        idle_timeout=limits.idle_timeout,
        max_request_line=limits.max_request_line,
        max_header_bytes=limits.max_header_bytes,
        max_header_count=limits.max_header_count,
    )
    sites: list[GuardedSite] = list(service.sites.values())
    admin = service.admin_site()
    if admin is not None:
        sites.append(admin)
    for site in sites:
        site.limits = client
        site.timeOut = limits.idle_timeout
        if isinstance(site, FacadeSite):
            site.max_body = limits.max_body
            site.max_connections = limits.max_connections
            site.access_log = new.log_access
    if old.limits != new.limits:
        changed.append("limits")
    return changed


def _service_identities(config: Config) -> object:
    """What of the vLLM services a reload cannot change."""
    return tuple(
        (s.name, s.url, s.model, s.aliases, s.default_for)
        for s in config.engines["vllm"].services
    )


def _apply_vllm(service: Reloadable, old: Config, new: Config) -> list[str]:
    before, after = old.engines["vllm"], new.engines["vllm"]
    if service.vllm is None:
        return []
    changed = []
    if before.hold != after.hold:
        changed.append("engines.vllm.hold")
    if before.state_ttl != after.state_ttl:
        changed.append("engines.vllm.state_ttl")
    if before.services != after.services:
        changed.append("engines.vllm.services (idle times)")
    if changed:
        service.vllm.reconfigure(after.hold, after.state_ttl, after.services)
    return changed


def _apply_shutdown(service: Reloadable, old: Config, new: Config) -> list[str]:
    if old.shutdown_grace == new.shutdown_grace:
        return []
    service.shutdown.grace = new.shutdown_grace
    return ["shutdown.grace"]
