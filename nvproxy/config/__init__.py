# -*- test-case-name: tests.test_config -*-
"""
nvproxy's configuration: a TOML file, C{NVPROXY_*} environment variables and
command-line flags, validated into frozen attrs values (DESIGN §2).

Every setting is declared once, in the settings table
(L{nvproxy.config._settings}), which drives the TOML walk, the twistd
options, the environment variables and the README's flag reference.

Precedence, highest first: command-line flags, environment variables, the TOML
file, built-in defaults.  Every key of the file is checked: an unknown key, a
value of the wrong type or out of range stops the load with L{ConfigErrors}
whose text has one line per problem, each naming the key, e.g.::

    dispatch.max_attempts: must be an integer >= 1, got "x"
    engines.ollama.prot: unknown key
    --deadline: must be greater than 0, got "0s"
    config file nvproxy.toml: line 3: invalid TOML: Invalid value (column 12)

A value that came from a flag or an environment variable is named by the flag
(C{--max-attempts}) or the variable (C{NVPROXY_MAX_ATTEMPTS}).

Durations are written C{"250ms"}, C{"10s"}, C{"15m"}, C{"3h"}, C{"1h30m"} or as a
bare number of seconds; sizes as C{"64MiB"} (B, KB/KiB, MB/MiB, GB/GiB) or a bare
number of bytes.

Modules: L{_parse} (errors and value parsers), L{_values} (the attrs values),
L{_settings} (the table), L{_load} (the walk and cross-setting checks),
L{_node} (this node's id), L{_options} (twistd).
"""

from nvproxy.config._access import (
    LOOPBACK_NETWORKS,
    AccessConfig,
    AccessOverride,
    IPNetwork,
    parse_network,
)
from nvproxy.config._load import SYSTEM_STATE_DIR, default_state_dir, load_config
from nvproxy.config._node import (
    NODE_ID_FILE,
    node_id_from_hostname,
    resolve_node_id,
)
from nvproxy.config._options import Options
from nvproxy.config._parse import (
    NAME_PATTERN,
    NODE_ID_PATTERN,
    ConfigError,
    ConfigErrors,
    format_duration,
    format_size,
    is_loopback,
    node_id_problem,
    parse_duration,
    parse_size,
)
from nvproxy.config._settings import (
    FLAG_NAMES,
    TOP,
    Section,
    Setting,
    env_name,
    flags_reference,
    reference_keys,
)
from nvproxy.config._values import (
    Config,
    Control,
    DispatchConfig,
    EngineConfig,
    EtcdConfig,
    LimitsConfig,
    LogFormat,
    LogLevelName,
    NodeConfig,
    VllmHold,
    VllmServiceConfig,
    default_backend,
)

__all__ = [
    "FLAG_NAMES",
    "LOOPBACK_NETWORKS",
    "NAME_PATTERN",
    "NODE_ID_FILE",
    "NODE_ID_PATTERN",
    "SYSTEM_STATE_DIR",
    "TOP",
    "AccessConfig",
    "AccessOverride",
    "Config",
    "ConfigError",
    "ConfigErrors",
    "Control",
    "DispatchConfig",
    "EngineConfig",
    "EtcdConfig",
    "IPNetwork",
    "LimitsConfig",
    "LogFormat",
    "LogLevelName",
    "NodeConfig",
    "Options",
    "Section",
    "Setting",
    "VllmHold",
    "VllmServiceConfig",
    "default_backend",
    "default_state_dir",
    "env_name",
    "flags_reference",
    "format_duration",
    "format_size",
    "is_loopback",
    "load_config",
    "node_id_from_hostname",
    "node_id_problem",
    "parse_duration",
    "parse_network",
    "parse_size",
    "reference_keys",
    "resolve_node_id",
]
