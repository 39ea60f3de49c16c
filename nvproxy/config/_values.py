# -*- test-case-name: tests.test_config -*-
"""
The configuration as frozen attrs values.  Their field defaults are the
settings' defaults: the settings table reads them from here (and from
L{DispatchPolicy}) instead of repeating them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from attrs import field, frozen

from nvproxy.config._access import AccessConfig, AccessOverride
from nvproxy.dispatch import DispatchPolicy
from nvproxy.engines import ENGINES

LogFormat = Literal["text", "json"]
LogLevelName = Literal["debug", "info", "warn", "error", "critical"]
Control = Literal["stdio"]


@frozen
class DispatchConfig:
    """
    The C{[dispatch]} section: the job's bounds and the upstream timeouts of
    spec §5.1, and passive outlier ejection.

    @ivar policy: the bounds of one job (C{max_attempts}, C{deadline},
        C{backoff}), handed to the L{nvproxy.dispatch.Dispatcher} as is.
    @ivar dial_timeout: the wait for an upstream connection.
    @ivar response_header_timeout: the wait for response headers and, once
        they arrived, for the first body byte; C{0} disables both.
    @ivar stream_idle_timeout: after commit, the longest silence between two
        chunks from the upstream before the stream is cut (with the
        dialect's error frame); C{0} (the default) never cuts.
    @ivar eject_base: how long a node's engine is ordered last after a
        transport failure (L{nvproxy.outliers}); C{0} disables ejection.
    @ivar eject_max: the longest ejection; each one in a row doubles the
        previous up to it.
    """

    policy: DispatchPolicy = field(factory=DispatchPolicy)
    dial_timeout: float = 10.0
    response_header_timeout: float = 1800.0
    stream_idle_timeout: float = 0.0
    eject_base: float = 1.0
    eject_max: float = 30.0


@frozen
class LimitsConfig:
    """
    Per-facade client limits.
    """

    max_body: int = 64 * 2**20
    max_connections: int = 4096
    header_timeout: float = 30.0
    idle_timeout: float = 60.0
    max_request_line: int = 8 * 2**10
    max_header_bytes: int = 64 * 2**10
    max_header_count: int = 100


@frozen
class VllmHold:
    """
    How long a request waits for a waking vLLM service, by sleep depth
    (FD §6.2.1).
    """

    sleeping: float = 30.0
    offloaded: float = 180.0
    restarting: float = 300.0


@frozen
class VllmServiceConfig:
    """
    One vLLM service (FD §6.1).

    @ivar aliases: other names of C{model}; matching is case-insensitive.
    @ivar default_for: request paths that use this service when the request
        names no model.
    @ivar idle_sleep: idle time before level-1 sleep; C{0} never.
    @ivar idle_offload: idle time before level-2 sleep; C{0} never.
    """

    name: str
    url: str
    model: str
    aliases: tuple[str, ...] = ()
    default_for: tuple[str, ...] = ()
    idle_sleep: float = 900.0
    idle_offload: float = 10800.0


def default_backend(engine_id: str, facade_port: int) -> str:
    """
    Where this node's engine is when the config does not say: its own port,
    or its relocated port when the facade occupies the own port (DESIGN §2).
    """
    engine = ENGINES[engine_id]
    port = engine.own_port
    if facade_port == engine.own_port:
        port = engine.relocated_port
    return f"http://127.0.0.1:{port}"


@frozen
class EngineConfig:
    """
    One engine's facade on this node.

    @ivar port: the configured facade port; C{0} is the engine's standalone
        default (spec §8).  A persisted port may override it: see
        L{nvproxy.ports.effective_port}.
    @ivar backend: the base URL of this node's engine.
    @ivar backend_configured: C{backend} was given explicitly; when false it is
        L{default_backend} of the configured port, and a caller that moves the
        facade (a persisted port) should recompute it.
    @ivar aliases: extra loopback-only listen addresses (spec §7).
    @ivar services: vLLM services (vLLM only).
    @ivar hold: vLLM wake hold deadlines (vLLM only).
    @ivar state_ttl: how long the last look at a vLLM service that found it
        awake is trusted while its state polls fail (vLLM only).
    @ivar access: this facade's C{[engines.E.access]} over C{[access]}.
    @ivar backend_api_key_file: a file holding the key this engine wants
        (sent upstream as C{Authorization: Bearer}).
    @ivar retry_after: the depth-aware 503's C{Retry-After}: C{"depth"}
        (FD §6.2.1 by depth) or C{"estimate"} (the learned wake estimate,
        rounded up, at least 1) (vLLM only).
    """

    id: str
    backend: str
    enabled: bool = True
    port: int = 0
    backend_configured: bool = False
    aliases: tuple[tuple[str, int], ...] = ()
    services: tuple[VllmServiceConfig, ...] = ()
    hold: VllmHold = VllmHold()
    state_ttl: float = 10.0
    access: AccessOverride = field(factory=AccessOverride)
    backend_api_key_file: str | None = None
    retry_after: str = "depth"

    @property
    def facade_port(self) -> int:
        """
        The configured facade port with C{0} resolved to the standalone
        default.
        """
        return self.port or ENGINES[self.id].standalone_port

    def access_in(self, config: Config) -> AccessConfig:
        """This facade's access rules in effect under C{config}."""
        return self.access.over(config.access)


@frozen
class NodeConfig:
    """
    Another node reached directly at its engines (no nvproxy there).

    @ivar engines: engine id -> base URL, in the engine table's order.
    """

    id: str
    engines: Mapping[str, str]


@frozen
class EtcdConfig:
    """
    Discovery through etcd (C{[discovery] provider = "etcd"}).

    @ivar endpoints: etcd client URLs, tried in turn.
    @ivar prefix: the key prefix; records live at C{PREFIX + "nodes/" + id}.
    @ivar lease_ttl: seconds a record outlives its node's last keep-alive.
    @ivar trust: C{"pinned"}: a node seen in etcd is dialed only if the
        cluster dir pins it; C{"etcd"}: the fingerprint in its record is
        pinned (whoever can write to etcd can join).
    @ivar cert: a client certificate for etcd (PEM), with C{key}.
    @ivar ca: the CA that signed etcd's server certificate (PEM).
    """

    endpoints: tuple[str, ...] = ("http://127.0.0.1:2379",)
    prefix: str = "/nvproxy/"
    lease_ttl: float = 10.0
    trust: str = "pinned"
    cert: str | None = None
    key: str | None = None
    ca: str | None = None


@frozen
class Config:
    """
    Everything nvproxy is configured with.

    @ivar node_id: L{None} means derive it: see L{resolve_node_id}.
    @ivar engines: every engine of L{ENGINES}, in its order, enabled or not.
    @ivar control: C{"stdio"} attaches the broker link (spec §3, §4).
    @ivar control_max_line: the longest line the broker link accepts, in
        bytes; a longer one is answered with an error and discarded.
    @ivar listen_interface: the address facades listen on.
    @ivar config_path: the TOML file read, if any.
    @ivar access: the C{[access]} rules of every facade without its own.
    """

    state_dir: str
    engines: Mapping[str, EngineConfig]
    node_id: str | None = None
    log_format: LogFormat = "text"
    log_level: LogLevelName = "info"
    admin_listen: tuple[str, int] = ("127.0.0.1", 8010)
    admin_enabled: bool = True
    dispatch: DispatchConfig = DispatchConfig()
    discovery_poll_interval: float = 2.0
    discovery_provider: str = "mesh"
    etcd: EtcdConfig = EtcdConfig()
    advertise_address: str | None = None
    limits: LimitsConfig = LimitsConfig()
    cluster_dir: str | None = None
    nodes: tuple[NodeConfig, ...] = ()
    control: Control | None = None
    control_max_line: int = 2**20
    listen_interface: str = "127.0.0.1"
    workload_log: str | None = None
    access: AccessConfig = field(factory=AccessConfig)
    shutdown_grace: float = 30.0
    log_access: bool = True
    config_path: str | None = field(default=None, eq=False)
