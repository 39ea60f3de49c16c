# -*- test-case-name: tests.test_service -*-
"""
What an operator and the broker can do to a running node, implemented once.

The admin API (L{nvproxy.admin}) and the broker link (L{nvproxy.control})
are two thin adapters over L{Operations}: each parses its own wire format,
calls the same method, and renders the answer (or the L{OperationError}) in
its own way::

    admin API  ──┐                        ┌─► facades (listeners, ports)
                 ├─► Operations ──────────┼─► pins, reservations, log level
    broker link ─┘                        └─► vLLM wake / sleep, status

The composition root (L{nvproxy.service}) builds an L{Operations} over the
parts it wired and hands it to both.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from attrs import evolve
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from nvproxy.cluster import ClusterWatcher
from nvproxy.config import EngineConfig, default_backend, is_loopback
from nvproxy.discovery import Discovery
from nvproxy.dispatch import Dispatcher
from nvproxy.drain import DrainState
from nvproxy.logs import set_level
from nvproxy.noderecord import Fleet
from nvproxy.outliers import OutlierTable
from nvproxy.ports import PortStore, SelectionStore, effective_port
from nvproxy.proxy.listener import CannotListen, PortListener
from nvproxy.scheduler import ReservationMap, SchedulerSnapshot
from nvproxy.vllm import ManagerStopped, Refused, UnknownService, VllmManager, Waking
from nvproxy.workload import RingSink

__all__ = ["OperationError", "Operations", "effective_engine"]


class OperationError(Exception):
    """
    An operation refused, with the HTTP status the admin API answers; the
    broker link maps it to a JSON-RPC error code.

    @ivar retry_after: seconds for a C{Retry-After} header, if any.
    @ivar details: more fields of the JSON error object besides C{error}.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        retry_after: int | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.details: Mapping[str, Any] = details or {}


def effective_engine(
    engine_config: EngineConfig, ports: PortStore, ignore_persisted: bool = False
) -> EngineConfig:
    """
    C{engine_config} with its real facade port: a persisted port (§8) wins
    over the configured one unless C{ignore_persisted}; a default backend
    follows that port (the relocation rule).
    """
    port = effective_port(engine_config, ports, ignore_persisted)
    backend = engine_config.backend
    if not engine_config.backend_configured:
        backend = default_backend(engine_config.id, port)
    return evolve(engine_config, port=port, backend=backend)


class Operations:
    """
    The runtime operations of one node: L{nvproxy.admin.AdminBackend} and
    L{nvproxy.control.ControlTarget}.

    It holds the live tables the service built and shares with the request
    path (C{pins} with accounting, C{engine_configs} with the config,
    C{listeners} with the service), and changes them in place.

    @param add_facade: build and start the facade of an engine config (the
        composition root's wiring; it adds to C{listeners}).
    @param remove_facade: stop an engine's facade and forget it.
    @param endpoints_changed: re-derive what discovery polls.
    """

    def __init__(
        self,
        *,
        node_id: str,
        clock: IReactorTime,
        discovery: Discovery,
        dispatcher: Dispatcher,
        reservations: ReservationMap,
        outliers: OutlierTable,
        workloads: RingSink,
        pins: MutableMapping[str, str],
        selections: SelectionStore,
        ports: PortStore,
        engine_configs: MutableMapping[str, EngineConfig],
        listeners: Mapping[str, PortListener],
        add_facade: Callable[[EngineConfig], None],
        remove_facade: Callable[[str], Deferred[None]],
        endpoints_changed: Callable[[], None],
        cluster: ClusterWatcher | None = None,
        vllm: VllmManager | None = None,
        fleet: Fleet | None = None,
        drain: DrainState | None = None,
        discovery_status: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self._fleet = fleet
        self._drain = drain
        self._discovery_status = discovery_status
        self._node_id = node_id
        self._clock = clock
        self._discovery = discovery
        self._dispatcher = dispatcher
        self._reservations = reservations
        self._outliers = outliers
        self._workloads = workloads
        self._pins = pins
        self._selections = selections
        self._ports = ports
        self._engine_configs = engine_configs
        self._listeners = listeners
        self._add_facade = add_facade
        self._remove_facade = remove_facade
        self._endpoints_changed = endpoints_changed
        self._cluster = cluster
        self._vllm = vllm
        self.reloader: Callable[[], Deferred[Mapping[str, Any]]] | None = None

    # -- facades (the broker's facade/enable, facade/disable) ---------------

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
        default.  Fires with the bound port; fails with L{CannotListen} if
        it cannot listen, and then leaves nothing of it behind.
        """

        async def enable() -> int:
            listener = self._listeners.get(engine)
            if listener is not None and listener.listening is not None:
                bound = listener.bound_port()
                assert bound is not None
                return bound
            if listener is not None:
                await self.disable_facade(engine)
            configured = evolve(
                self._engine_configs[engine],
                enabled=True,
                port=port,
                aliases=tuple(aliases),
            )
            effective = effective_engine(configured, self._ports, ignore_persisted)
            self._engine_configs[engine] = effective
            self._add_facade(effective)
            listening = await self._listeners[engine].ready
            if not listening:
                error = self._listeners[engine].error
                await self.disable_facade(engine)
                raise CannotListen(error or "cannot listen")
            self._endpoints_changed()
            return self._listeners[engine].bound_port() or effective.port

        return Deferred.fromCoroutine(enable())

    def disable_facade(self, engine: str) -> Deferred[None]:
        """Stop C{engine}'s facade and its aliases; nothing if none runs."""
        return self._remove_facade(engine)

    def set_port(self, engine: str, port: int) -> Deferred[Mapping[str, Any]]:
        """
        Move C{engine}'s facade to C{port} and persist it (§8); the old port
        is released only once the new one is bound.
        """
        return Deferred.fromCoroutine(self._set_port(engine, port))

    async def _set_port(self, engine: str, port: int) -> Mapping[str, Any]:
        listener = self._listeners.get(engine)
        if listener is None:
            raise OperationError(404, f"engine {engine!r} is not enabled")
        backend = urlsplit(self._engine_configs[engine].backend)
        if backend.port == port and is_loopback(backend.hostname or ""):
            raise OperationError(
                409, f"port {port} is where this node's {engine} engine is"
            )
        try:
            await listener.move(port)
        except Exception as e:
            raise OperationError(409, f"cannot listen on port {port}: {e}") from None
        self._ports.set(engine, port)
        return {"engine": engine, "port": port, "persisted": True}

    # -- routing ------------------------------------------------------------

    def select(self, engine: str, node: str | None) -> Mapping[str, Any]:
        """
        Pin C{engine}'s requests to C{node} first (C{node/select}, §5);
        L{None} clears the pin.  Persisted before it applies.
        """
        if engine not in self._listeners:
            raise OperationError(404, f"engine {engine!r} is not enabled")
        pins = dict(self._pins)
        if node is None:
            pins.pop(engine, None)
        else:
            pins[engine] = node
        try:
            # Persisted first: a selection that would not survive a restart
            # is refused, not half applied.
            self._selections.save(pins)
        except OSError as e:
            raise OperationError(
                500, f"cannot persist the selection: {e.strerror or e}"
            ) from None
        if node is None:
            self._pins.pop(engine, None)
        else:
            self._pins[engine] = node
        return {"engine": engine, "selected": node}

    def apply_priority(self, snapshot: SchedulerSnapshot) -> bool:
        """The broker's scheduler snapshot (§6); false when not newer."""
        return self._reservations.apply_snapshot(snapshot)

    def set_log_level(self, level: str) -> None:
        set_level(level)

    def drain(self, draining: bool) -> Mapping[str, Any]:
        """
        Take this node out of rotation (or back in): every node, this one
        included, stops choosing it for new dispatches unless it is the only
        owner; in-flight work finishes.  Persisted before it applies.
        """
        if self._drain is None:
            raise OperationError(404, "not found")
        try:
            self._drain.set(draining)
        except OSError as e:
            raise OperationError(
                500, f"cannot persist the drain state: {e.strerror or e}"
            ) from None
        return {"node_id": self._node_id, "draining": draining}

    def reload(self) -> Deferred[Mapping[str, Any]]:
        """
        Reload the configuration file and the cluster dir (SIGHUP, the
        admin API, the broker): see L{nvproxy.reload}.  Refused with 400
        and C{errors} (one line per problem) when the file has problems.
        """
        if self.reloader is None:
            raise OperationError(409, "this daemon has no configuration to reload")
        return self.reloader()

    # -- vLLM (FD §6.5) -----------------------------------------------------

    def wake(self, service: str) -> Deferred[Mapping[str, Any]]:
        """
        Wake the vLLM service C{service}, with no hold deadline.  Refused
        with 404 (unknown), 503 (the wake failed: C{sleep_depth} and
        C{Retry-After}; or shutting down).
        """

        async def wake() -> Mapping[str, Any]:
            vllm = self._vllm_for(service)
            try:
                await vllm.wake(service)
            except Waking as e:
                raise OperationError(
                    503,
                    str(e),
                    retry_after=e.retry_after,
                    details={"sleep_depth": e.depth.value},
                ) from None
            except ManagerStopped:
                raise OperationError(503, "shutting down") from None
            return {"service": service, "state": "awake"}

        return Deferred.fromCoroutine(wake())

    def sleep(self, service: str, level: int) -> Deferred[Mapping[str, Any]]:
        """
        Sleep the vLLM service C{service} at C{level} (1 or 2).  Refused
        with 404 (unknown), 409 (active requests, busy, down), 503 (shutting
        down), 502 (the service answered the sleep with an error).
        """

        async def sleep() -> Mapping[str, Any]:
            vllm = self._vllm_for(service)
            try:
                await vllm.sleep(service, level)
            except Refused as e:
                raise OperationError(409, f"refused: {e}") from None
            except ManagerStopped:
                raise OperationError(503, "shutting down") from None
            except Exception as e:
                raise OperationError(502, f"sleep failed: {e}") from None
            return {"service": service, "state": "asleep", "level": level}

        return Deferred.fromCoroutine(sleep())

    def _vllm_for(self, service: str) -> VllmManager:
        if self._vllm is None:
            raise OperationError(404, "not found")
        try:
            self._vllm.registry.service(service)
        except UnknownService:
            raise OperationError(404, f"unknown vLLM service {service!r}") from None
        return self._vllm

    # -- reading ------------------------------------------------------------

    def recent_workloads(self, limit: int) -> list[Any]:
        return self._workloads.recent(limit)

    def reservation_counts(self) -> Mapping[str, int]:
        """Reservations per node, over every node discovery knows."""
        snapshot = self._discovery.current
        nodes = {node for entries in snapshot.engines.values() for node in entries}
        return {node: self._reservations.reservations(node) for node in sorted(nodes)}

    def status(self) -> Mapping[str, Any]:
        """C{GET /admin/status}."""
        snapshot = self._discovery.current
        facades = []
        for engine_id, listener in self._listeners.items():
            facades.append(
                {
                    "engine": engine_id,
                    "port": listener.bound_port() or listener.port,
                    "listening": listener.listening is not None,
                    "error": listener.error,
                    "selected": self._pins.get(engine_id),
                }
            )
        nodes: dict[str, dict[str, list[str]]] = {}
        for engine_id, entries in snapshot.engines.items():
            for node_id, entry in entries.items():
                nodes.setdefault(node_id, {})[engine_id] = sorted(entry.models)
        cluster: dict[str, Any] = {"member": False}
        if self._cluster is not None:
            state = self._cluster.current
            cluster = {
                "member": state.member,
                "peers": [peer.id for peer in state.peers],
                "error": None
                if self._cluster.error is None
                else str(self._cluster.error),
            }
        return {
            "node_id": self._node_id,
            "cluster": cluster,
            "facades": facades,
            "nodes": nodes,
            "inflight": self._dispatcher.inflight(),
            "generation": snapshot.generation,
            "reservations": dict(self.reservation_counts()),
            "vllm": self._vllm.status() if self._vllm is not None else [],
            "loads": dict(self._reservations.snapshot_of_loads()),
            "ejected": self._outliers.status(),
            "process": self._process_status(),
            "draining": self._drain.draining if self._drain is not None else False,
            "records": self._fleet.records() if self._fleet is not None else [],
            "discovery": dict(self._discovery_status())
            if self._discovery_status is not None
            else {"provider": "mesh"},
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
        delayed = getattr(self._clock, "getDelayedCalls", None)
        delayed_calls = len(delayed()) if callable(delayed) else None
        return {
            "open_fds": open_fds,
            "delayed_calls": delayed_calls,
            "rss_bytes": _rss_bytes(),
        }


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
