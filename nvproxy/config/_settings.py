# -*- test-case-name: tests.test_config -*-
"""
The settings table: every setting declared once, with its TOML key, its
command-line flag and environment variable (if any), its parser, its help
text and where its value goes.  The TOML walk, the twistd options, the
environment and the README's flag reference are all derived from it.

A setting's default is its value type's field default (L{Config},
L{DispatchConfig}, L{nvproxy.dispatch.DispatchPolicy}, ...), read from the
field the setting fills, so it is written down once there; a default that is
computed at load time is described in words instead.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from typing import Any, Final

import attrs
from attrs import evolve, frozen

from nvproxy.config._access import NETWORKS
from nvproxy.config._parse import (
    BACKOFF,
    BOOL,
    ENGINE_URLS,
    ETCD_PREFIX,
    IDENTIFIER,
    INTERFACE,
    LOOPBACK,
    LOOPBACK_OR_OFF,
    NODE_ID,
    PATH,
    PORT,
    ROUTE,
    SIZE,
    STRING,
    URL,
    Parser,
    array,
    choice,
    duration,
    integer,
)
from nvproxy.config._values import (
    Config,
    EngineConfig,
    NodeConfig,
    VllmServiceConfig,
)
from nvproxy.logs import LEVELS


@frozen
class Setting:
    """
    One setting.

    @ivar key: its dotted TOML key inside its section's table
        (C{"dispatch.deadline"} at the top; C{"port"} inside
        C{[engines.<engine>]}); L{None} for a flag-only setting.
    @ivar parser: how its value is read; L{None} for a table or an array of
        tables whose keys are the settings of C{entries}.
    @ivar help: one sentence for C{--help} and the README.
    @ivar flag: its command-line flag, also read from the environment
        variable L{env_name}C{(flag)}.
    @ivar short: a one-letter flag.
    @ivar into: where its value goes: an attribute path on the section's value
        (default: the key), or a function C{(value, parsed) -> value}.
    @ivar required: an entry of an array of tables must have it.
    @ivar only: the one engine whose table may have it.
    @ivar default: the default in words, when it is computed at load time.
    @ivar entries: the section of its table or of each entry of its array.
    """

    key: str | None
    parser: Parser[Any] | None
    help: str
    flag: str | None = None
    short: str | None = None
    into: str | Callable[[Any, Any], Any] | None = None
    required: bool = False
    only: str | None = None
    default: str | None = None
    entries: Section | None = None

    @property
    def name(self) -> str:
        """The key, or the flag of a flag-only setting."""
        return self.key or f"--{self.flag}"


@frozen
class Section:
    """
    The settings of one kind of TOML table and the value type they fill.

    @ivar prefix: how the README names the table: C{""} for the top level,
        C{"engines.<engine>"}, C{"nodes[]"} (each entry of an array).
    """

    prefix: str
    value_type: type
    settings: tuple[Setting, ...]

    def default_text(self, setting: Setting) -> str:
        """
        The default of C{setting} as an operator writes it, or in words.
        """
        if setting.default is not None:
            return setting.default
        if not isinstance(setting.into or setting.key, str) or setting.parser is None:
            raise ValueError(f"{setting.name}: no field default to show")
        value = _field_default(self.value_type, str(setting.into or setting.key))
        if value is attrs.NOTHING:
            return "required"
        if value is None:
            return "none"
        return setting.parser.write(value)


def _field_default(cls: type, path: str) -> object:
    value: Any = attrs.NOTHING
    for name in path.split("."):
        value = attrs.fields_dict(cls)[name].default
        if isinstance(value, attrs.Factory):  # type: ignore[arg-type]
            value = value.factory()
        cls = type(value)
    return value


def env_name(flag: str) -> str:
    """
    The environment variable of a flag: C{"dial-timeout"} ->
    C{"NVPROXY_DIAL_TIMEOUT"}.
    """
    return "NVPROXY_" + flag.upper().replace("-", "_")


def _admin_switch(config: Config, listen: tuple[str, int] | None) -> Config:
    """C{--admin HOST:PORT} listens there (even if disabled in the file)."""
    if listen is None:
        return evolve(config, admin_enabled=False)
    return evolve(config, admin_listen=listen, admin_enabled=True)


_ACCESS: Final = (
    Setting(
        "access.plaintext_from",
        NETWORKS,
        "Source networks (CIDR) allowed plaintext HTTP; others are refused"
        " before a byte is read.",
        flag="plaintext-from",
    ),
    Setting(
        "access.api_keys_file",
        PATH,
        "API keys (NAME sha256:HEX per line); when set, non-loopback callers"
        " must present one.",
        flag="api-keys-file",
        default="none (no keys)",
    ),
    Setting(
        "access.require_key_on_loopback",
        BOOL,
        "Loopback callers must present a key too.",
    ),
    Setting(
        "access.max_concurrent_per_key",
        integer(0),
        "Requests one key may have in flight; 429 beyond; 0 is unlimited.",
    ),
)
"""The C{[access]} settings; each also in C{[engines.E.access]}."""

_HOLD = "How long a request waits for a service waking from {}."

SERVICE: Final = Section(
    "engines.vllm.services[]",
    VllmServiceConfig,
    (
        Setting(
            "name", IDENTIFIER, "The service's name (one URL segment).", required=True
        ),
        Setting("url", URL, "Its base URL.", required=True),
        Setting("model", STRING, "The model it serves.", required=True),
        Setting("aliases", array(STRING), "Other names of the model, in any case."),
        Setting(
            "default_for",
            array(ROUTE),
            "Request paths it serves when the request names no model"
            ' ("multipart:/path" for multipart requests).',
        ),
        Setting("idle_sleep", duration(zero=True), "Idle time before level-1 sleep."),
        Setting("idle_offload", duration(zero=True), "Idle time before level-2 sleep."),
    ),
)

ENGINE: Final = Section(
    "engines.<engine>",
    EngineConfig,
    (
        Setting("enabled", BOOL, "Run this engine's facade."),
        Setting("port", PORT, "Facade port; 0 is the engine's standalone default."),
        Setting(
            "backend",
            URL,
            "This node's engine.",
            default="the engine's own port, or its relocated port when the facade"
            " takes the own port",
        ),
        Setting(
            "aliases",
            array(LOOPBACK, unique="alias"),
            "Extra loopback-only listen addresses.",
        ),
        Setting(
            "hold.sleeping",
            duration(zero=False),
            _HOLD.format("level-1 sleep"),
            only="vllm",
        ),
        Setting(
            "hold.offloaded",
            duration(zero=False),
            _HOLD.format("level-2 sleep"),
            only="vllm",
        ),
        Setting(
            "hold.restarting",
            duration(zero=False),
            _HOLD.format("a restart"),
            only="vllm",
        ),
        Setting(
            "state_ttl",
            duration(zero=True),
            "Trust in the last look at an awake service while its state polls fail.",
            only="vllm",
        ),
        Setting(
            "backend_api_key_file",
            PATH,
            "A file holding the key this engine wants, sent as"
            " Authorization: Bearer on every request to it.",
        ),
        Setting(
            "retry_after",
            choice("depth", "estimate"),
            'Retry-After of the depth-aware 503: "depth" (FD §6.2.1) or'
            ' "estimate" (the learned wake estimate, rounded up).',
            only="vllm",
        ),
        *(
            Setting(
                setting.key,
                setting.parser,
                setting.help,
                default="as in [access]",
            )
            for setting in _ACCESS
            if setting.key is not None
        ),
        Setting(
            "services",
            None,
            "The vLLM services behind this facade.",
            only="vllm",
            entries=SERVICE,
        ),
    ),
)

NODE: Final = Section(
    "nodes[]",
    NodeConfig,
    (
        Setting("id", NODE_ID, "The node's id.", required=True),
        Setting(
            "engines", ENGINE_URLS, "Engine -> its base URL on the node.", required=True
        ),
    ),
)

_POLICY = "dispatch.policy."

TOP: Final = Section(
    "",
    Config,
    (
        Setting(
            None,
            STRING,
            "TOML configuration file.",
            flag="config",
            short="c",
            default="none",
        ),
        Setting(
            "node_id",
            NODE_ID,
            "This node's id, a DNS name.",
            flag="node-id",
            default="from the host name, then persisted in state_dir",
        ),
        Setting(
            "state_dir",
            PATH,
            "Persisted ports, node selections, node id, vLLM wake intent.",
            flag="state-dir",
            default="/var/lib/nvproxy for root, else $XDG_STATE_HOME/nvproxy"
            " or ~/.local/state/nvproxy",
        ),
        Setting(
            "log_format",
            choice("text", "json"),
            'Log format: "text" or "json" (one JSON object per line).',
            flag="log-format",
        ),
        Setting(
            "log_level",
            choice(*LEVELS, fold_case=True),
            'Log level, any case: "debug" (per-request routing), "info", "warn",'
            ' "error" or "critical".',
            flag="log-level",
        ),
        Setting(
            "listen_interface",
            INTERFACE,
            "Address the facades listen on.",
            flag="listen-interface",
        ),
        Setting(
            None,
            choice("stdio"),
            'Attach the broker link: "stdio".',
            flag="control",
            into="control",
        ),
        Setting(
            "control.max_line",
            SIZE,
            "Longest broker-link line; a longer one gets a JSON-RPC error and is"
            " discarded.",
            flag="control-max-line",
            into="control_max_line",
        ),
        Setting(
            "admin.listen",
            LOOPBACK,
            "Admin API listen address, loopback only.",
            into="admin_listen",
        ),
        Setting("admin.enabled", BOOL, "Serve the admin API.", into="admin_enabled"),
        Setting(
            None,
            LOOPBACK_OR_OFF,
            'Admin API listen address (loopback HOST:PORT; also enables it) or "off".',
            flag="admin",
            into=_admin_switch,
            default="as in [admin]",
        ),
        Setting(
            "dispatch.max_attempts",
            integer(1),
            "At most this many dispatches of one request.",
            flag="max-attempts",
            into=_POLICY + "max_attempts",
        ),
        Setting(
            "dispatch.deadline",
            duration(zero=False),
            "No new dispatch after this.",
            flag="deadline",
            into=_POLICY + "deadline",
        ),
        Setting(
            "dispatch.dial_timeout",
            duration(zero=False),
            "Upstream connect timeout.",
            flag="dial-timeout",
        ),
        Setting(
            "dispatch.response_header_timeout",
            duration(zero=True),
            "Wait for response headers, then for the first body byte; 0 disables.",
            flag="response-header-timeout",
        ),
        Setting(
            "dispatch.backoff",
            BACKOFF,
            "Waits between rounds; the last repeats; +-20% jitter.",
            into=_POLICY + "backoff",
        ),
        Setting(
            "dispatch.eject_base",
            duration(zero=True),
            "Order a node last for this long after a transport failure; 0 disables.",
            flag="eject-base",
        ),
        Setting(
            "dispatch.eject_max",
            duration(zero=False),
            "The longest such ejection; each one in a row doubles, up to this.",
            flag="eject-max",
        ),
        Setting(
            "dispatch.stream_idle_timeout",
            duration(zero=True),
            "Cut a committed stream silent this long; 0 never.",
        ),
        Setting(
            "discovery.poll_interval",
            duration(zero=False),
            "Inventory polling of every node; vLLM state polls.",
            into="discovery_poll_interval",
        ),
        Setting(
            "discovery.provider",
            choice("mesh", "etcd", "static"),
            "Where peers' node records come from: polling every pinned peer,"
            " an etcd prefix, or nowhere (configured nodes only).",
            flag="discovery",
            into="discovery_provider",
        ),
        Setting(
            "discovery.endpoints",
            array(URL, unique="endpoint"),
            "etcd client URLs, tried in turn.",
            flag="etcd-endpoints",
            into="etcd.endpoints",
        ),
        Setting(
            "discovery.prefix", ETCD_PREFIX, "etcd key prefix.", into="etcd.prefix"
        ),
        Setting(
            "discovery.lease_ttl",
            duration(zero=False),
            "How long this node's etcd record outlives its last keep-alive.",
            into="etcd.lease_ttl",
        ),
        Setting(
            "discovery.trust",
            choice("pinned", "etcd"),
            'Dial nodes seen in etcd only if the cluster dir pins them, or "etcd":'
            " pin the fingerprint their record carries.",
            into="etcd.trust",
        ),
        Setting(
            "discovery.tls.cert", PATH, "Client certificate for etcd.", into="etcd.cert"
        ),
        Setting("discovery.tls.key", PATH, "Its key.", into="etcd.key"),
        Setting("discovery.tls.ca", PATH, "CA of etcd's server.", into="etcd.ca"),
        Setting(
            "discovery.advertise_address",
            STRING,
            "This node's address for peers, published in its etcd record.",
            into="advertise_address",
            default="none",
        ),
        Setting("limits.max_body", SIZE, "Largest request body; 413 beyond."),
        Setting(
            "limits.max_connections",
            integer(1),
            "Open connections per facade; an immediate 503 beyond.",
        ),
        Setting(
            "limits.header_timeout",
            duration(zero=False),
            "Request line and headers must arrive within this of their first byte;"
            " 408 beyond.",
        ),
        Setting(
            "limits.idle_timeout",
            duration(zero=False),
            "Close a connection silent this long between requests or mid-body.",
        ),
        Setting(
            "limits.max_request_line",
            SIZE,
            "Longest request line; 414 beyond.",
        ),
        Setting(
            "limits.max_header_bytes",
            SIZE,
            "Largest header section (after the request line); 431 beyond.",
        ),
        Setting(
            "limits.max_header_count",
            integer(1),
            "Most header fields in one request; 431 beyond.",
        ),
        Setting(
            "cluster.dir",
            PATH,
            "Cluster identity and pinned peers (mTLS).",
            flag="cluster-dir",
            into="cluster_dir",
            default="none (no mTLS)",
        ),
        Setting(
            "workloads.log",
            PATH,
            "Append every workload lifecycle event to this file as a JSON line.",
            into="workload_log",
        ),
        *_ACCESS,
        Setting(
            "shutdown.grace",
            duration(zero=True),
            "On SIGTERM, committed requests get this long to finish; the rest"
            " are then cancelled.",
            flag="shutdown-grace",
            into="shutdown_grace",
        ),
        Setting(
            "log.access",
            BOOL,
            "Log one access line per request at info.",
            into="log_access",
        ),
        Setting(
            "engines", None, "One table per engine (engines.ENGINE).", entries=ENGINE
        ),
        Setting(
            "nodes",
            None,
            "Other nodes, reached directly at their engines.",
            entries=NODE,
        ),
    ),
)


FLAGS: Final = tuple(setting for setting in TOP.settings if setting.flag)
FLAG_NAMES: Final = tuple(str(setting.flag) for setting in FLAGS)
"""Long names of the command-line flags; each also reads C{NVPROXY_<NAME>}."""


def reference_keys(section: Section = TOP) -> Iterator[str]:
    """
    Every TOML key, as the README's example names it: C{"dispatch.deadline"},
    C{"engines.<engine>.port"}, C{"engines.vllm.state_ttl"},
    C{"engines.vllm.services[].name"}, C{"nodes[].id"}.
    """
    for setting in section.settings:
        if setting.key is None:
            continue
        prefix = section.prefix
        if setting.only is not None:
            prefix = prefix.replace("<engine>", setting.only)
        key = f"{prefix}.{setting.key}" if prefix else setting.key
        if setting.entries is None:
            yield key
        else:
            yield from reference_keys(setting.entries)


def _option_help(setting: Setting) -> str:
    where = f"{setting.key}; " if setting.key else ""
    return f"{setting.help} [{where}default: {TOP.default_text(setting)}]"


def option_parameters() -> list[list[str | None]]:
    """
    The twistd C{optParameters} of every flag; the default is L{None} so
    that a flag not given can be told apart.
    """
    return [
        [setting.flag, setting.short, None, _option_help(setting)] for setting in FLAGS
    ]


def flags_reference(width: int = 88) -> str:
    """
    The README's list of flags: flag, variable, file key, default, help.
    """
    lines = []
    for setting in FLAGS:
        assert setting.flag is not None
        names = f"``--{setting.flag}``"
        if setting.short:
            names = f"``-{setting.short}``, {names}"
        names += f" / ``{env_name(setting.flag)}``"
        where = [f"``{setting.key}``"] if setting.key else []
        default = TOP.default_text(setting)
        if setting.default is None and default != "none":
            default = f"``{default}``"
        where.append(f"default {default}")
        item = f"* {names} ({', '.join(where)}): {setting.help}"
        lines.extend(
            textwrap.wrap(
                item,
                width,
                subsequent_indent="  ",
                break_long_words=False,
                break_on_hyphens=False,
            )
        )
    return "\n".join(lines) + "\n"
