# -*- test-case-name: tests.test_config -*-
"""
Loading: the TOML walk driven by the settings table, flags and environment
variables over it, the checks that span several settings, and every problem
collected into one L{ConfigErrors}.

Each setting is checked on its own, so one load reports every bad setting;
an entry of an array of tables (C{[[nodes]]}, C{[[engines.vllm.services]]})
counts as one setting and is reported by its first problem.  A check that
spans several settings runs only when each of them is fine.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from attrs import define, evolve, field

from nvproxy.config._parse import (
    ConfigError,
    ConfigErrors,
    Raw,
    is_loopback,
    items,
    join,
    read_string,
    show,
    table,
    unknown_engine,
)
from nvproxy.config._settings import (
    ENGINE,
    FLAG_NAMES,
    NODE,
    SERVICE,
    TOP,
    Section,
    Setting,
    env_name,
)
from nvproxy.config._values import (
    Config,
    EngineConfig,
    NodeConfig,
    VllmServiceConfig,
    default_backend,
)
from nvproxy.engines import ENGINES

SYSTEM_STATE_DIR = "/var/lib/nvproxy"


class _Problems:
    """
    The problems found so far.
    """

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    def add(self, error: ConfigError) -> None:
        self.errors.extend(error.errors)

    @contextmanager
    def collect(self) -> Iterator[None]:
        """Record a L{ConfigError} raised inside and carry on after the block."""
        try:
            yield
        except ConfigError as e:
            self.add(e)

    def __bool__(self) -> bool:
        return bool(self.errors)


class _Sources:
    """
    Flag and environment values, flags first; an empty variable is unset.
    """

    def __init__(self, flags: Mapping[str, str | None], env: Mapping[str, str]):
        self._flags = flags
        self._env = env

    def get(self, flag: str | None) -> Raw | None:
        if flag is None:
            return None
        value = self._flags.get(flag)
        if value is not None:
            return Raw(value, f"--{flag}", text=True)
        variable = env_name(flag)
        text = self._env.get(variable)
        if text:
            return Raw(text, variable, text=True)
        return None


_NO_SOURCES = _Sources({}, {})


@define
class _Read:
    """
    What one table gave, by L{Setting.name}.

    @ivar raws: where each given setting came from, also the bad ones.
    @ivar values: the parsed value of each good one; for a setting with
        C{entries}, its L{Raw} for the caller's reader.
    """

    raws: dict[str, Raw] = field(factory=dict)
    values: dict[str, Any] = field(factory=dict)

    def fine(self, *names: str) -> bool:
        """None of C{names} was given with a bad value."""
        return all(name in self.values or name not in self.raws for name in names)


def _walk(
    document: Mapping[str, object],
    prefix: str,
    keys: Collection[str],
    refused: Mapping[str, str],
    problems: _Problems,
) -> dict[str, Raw]:
    """
    The raw values of the dotted C{keys} in C{document}; any other key, and
    a key in C{refused} (-> the problem), is a problem.
    """
    found: dict[str, Raw] = {}
    for name, raw in document.items():
        key = join(prefix, name)
        inner = [k.partition(".")[2] for k in keys if k.startswith(name + ".")]
        if name in refused:
            problems.add(ConfigError(key, refused[name]))
        elif name in keys:
            found[name] = Raw(raw, key)
        elif not inner:
            problems.add(ConfigError(key, "unknown key"))
        else:
            with problems.collect():
                below = _walk(table(Raw(raw, key)), key, inner, {}, problems)
                found.update({f"{name}.{k}": v for k, v in below.items()})
    return found


def _read(
    section: Section,
    document: Mapping[str, object],
    prefix: str,
    problems: _Problems,
    *,
    sources: _Sources = _NO_SOURCES,
    engine: str | None = None,
    settings: Collection[Setting] | None = None,
) -> _Read:
    """
    Read C{section}'s settings (or just C{settings} of it) from a table at
    C{prefix} and, where a setting has a flag, from C{sources} first.

    @param engine: the engine whose table this is (for L{Setting.only}).
    """
    chosen = [
        setting
        for setting in (section.settings if settings is None else settings)
        if setting.only in (None, engine)
    ]
    refused = {
        str(setting.key).partition(".")[0]: f"only valid for {setting.only}"
        for setting in section.settings
        if setting.key and setting.only not in (None, engine)
    }
    keys = [setting.key for setting in chosen if setting.key]
    found = _walk(document, prefix, keys, refused, problems)
    result = _Read()
    for setting in chosen:
        raw = sources.get(setting.flag)
        if raw is None and setting.key is not None:
            raw = found.get(setting.key)
        if raw is None:
            if setting.required:
                problems.add(ConfigError(join(prefix, setting.name), "is required"))
            continue
        result.raws[setting.name] = raw
        if setting.parser is None:
            result.values[setting.name] = raw
            continue
        with problems.collect():
            result.values[setting.name] = setting.parser.read(raw)
    return result


def _fill(value: Any, section: Section, read: _Read) -> Any:
    """
    C{value} with each good setting of C{read} put where it goes.
    """
    for setting in section.settings:
        if setting.name in read.values and setting.parser is not None:
            value = _put(
                value, setting.into or str(setting.key), read.values[setting.name]
            )
    return value


def _put(value: Any, into: str | Callable[[Any, Any], Any], parsed: object) -> Any:
    if callable(into):
        return into(value, parsed)
    name, _, rest = into.partition(".")
    if rest:
        parsed = _put(getattr(value, name), rest, parsed)
    return evolve(value, **{name: parsed})


def _entries(
    section: Section, value: Raw, problems: _Problems
) -> Iterator[tuple[Raw, _Read]]:
    """
    Each entry of an array of tables that has no problem, with what it gave;
    an entry with problems is reported by its first.
    """
    try:
        entries = items(value)
    except ConfigError as e:
        problems.add(e)
        return
    for entry in entries:
        mine = _Problems()
        with mine.collect():
            read = _read(section, table(entry), entry.key, mine)
        if mine:
            problems.add(mine.errors[0])
        else:
            yield entry, read


def _build(section: Section, read: _Read) -> Any:
    return section.value_type(
        **{
            str(setting.into or setting.key): read.values[setting.name]
            for setting in section.settings
            if setting.name in read.values
        }
    )


def _services(
    value: Raw, facade_port: int | None, problems: _Problems
) -> tuple[VllmServiceConfig, ...]:
    """
    The vLLM services; none may be the facade at C{facade_port} itself.
    """
    services: list[VllmServiceConfig] = []
    names: dict[str, str] = {}
    routes: dict[str, str] = {}
    for entry, read in _entries(SERVICE, value, problems):
        service: VllmServiceConfig = _build(SERVICE, read)
        try:
            _check_service(entry, service, services, names, routes)
            if facade_port is not None:
                _not_self(read.raws["url"].key, service.url, facade_port)
        except ConfigError as e:
            problems.add(e)
            continue
        for name in (service.model, *service.aliases):
            names[name.casefold()] = service.name
        for route in service.default_for:
            routes[route] = service.name
        services.append(service)
    return tuple(services)


def _check_service(
    entry: Raw,
    service: VllmServiceConfig,
    services: list[VllmServiceConfig],
    names: Mapping[str, str],
    routes: Mapping[str, str],
) -> None:
    """
    Refuse a service whose name, model names or default routes an earlier
    one has.
    """
    if service.name in {s.name for s in services}:
        raise ConfigError(
            join(entry.key, "name"), f"duplicate service name {show(service.name)}"
        )
    owner = names.get(service.model.casefold())
    if owner is not None:
        raise ConfigError(
            join(entry.key, "model"),
            f"{show(service.model)} already names a model of service {show(owner)}",
        )
    for index, alias in enumerate(service.aliases):
        owner = names.get(alias.casefold())
        if owner is not None:
            raise ConfigError(
                f"{join(entry.key, 'aliases')}[{index}]",
                f"{show(alias)} already names a model of service {show(owner)}",
            )
    for index, route in enumerate(service.default_for):
        owner = routes.get(route)
        if owner is not None:
            raise ConfigError(
                f"{join(entry.key, 'default_for')}[{index}]",
                f"{show(route)} is already the default of service {show(owner)}",
            )


def _not_self(key: str, url: str, facade_port: int) -> None:
    """
    Refuse a backend that is the facade itself: every request would loop.
    """
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if parts.hostname and is_loopback(parts.hostname) and port == facade_port:
        raise ConfigError(key, f"points at this facade's own port {facade_port}")


def _engine(
    engine_id: str, document: Mapping[str, object], problems: _Problems
) -> tuple[EngineConfig, bool]:
    """
    One engine's table, and whether it is fine.
    """
    prefix = join("engines", engine_id)
    mine = _Problems()
    read = _read(ENGINE, document, prefix, mine, engine=engine_id)
    facade_port = read.values.get("port") or ENGINES[engine_id].standalone_port
    engine = EngineConfig(
        engine_id,
        default_backend(engine_id, facade_port),
        backend_configured="backend" in read.values,
    )
    engine = _fill(engine, ENGINE, read)
    port_known = facade_port if read.fine("port") else None
    if "services" in read.values:
        services = _services(read.values["services"], port_known, mine)
        engine = evolve(engine, services=services)
    if port_known is not None and "backend" in read.values:
        with mine.collect():
            _not_self(read.raws["backend"].key, engine.backend, facade_port)
    problems.errors.extend(mine.errors)
    return engine, not mine


def _engines(value: Raw | None, problems: _Problems) -> dict[str, EngineConfig]:
    """
    Every engine of L{ENGINES}, in its order; its facade port must not be
    another enabled engine's.
    """
    section: dict[str, object] = {}
    if value is not None:
        with problems.collect():
            section = table(value)
    for name in section:
        if name not in ENGINES:
            problems.add(unknown_engine(join("engines", name)))
    engines: dict[str, EngineConfig] = {}
    fine: dict[str, bool] = {}
    for engine_id in ENGINES:
        document: dict[str, object] = {}
        key = join("engines", engine_id)
        fine[engine_id] = False
        if engine_id in section:
            try:
                document = table(Raw(section[engine_id], key))
            except ConfigError as e:
                problems.add(e)
                engines[engine_id] = EngineConfig(
                    engine_id, default_backend(engine_id, 0)
                )
                continue
        engines[engine_id], fine[engine_id] = _engine(engine_id, document, problems)
    ports: dict[int, str] = {}
    for engine_id, engine in engines.items():
        if not (engine.enabled and fine[engine_id]):
            continue
        other = ports.get(engine.facade_port)
        if other is not None:
            problems.add(
                ConfigError(
                    join(join("engines", engine_id), "port"),
                    f"{engine.facade_port} is also the facade port of {other}",
                )
            )
        ports.setdefault(engine.facade_port, engine_id)
    return engines


def _nodes(
    value: Raw | None, own_id: str | None, problems: _Problems
) -> tuple[NodeConfig, ...]:
    if value is None:
        return ()
    nodes: list[NodeConfig] = []
    for _entry, read in _entries(NODE, value, problems):
        node: NodeConfig = _build(NODE, read)
        key = read.raws["id"].key
        if node.id in {other.id for other in nodes}:
            problems.add(ConfigError(key, f"duplicate node id {show(node.id)}"))
        elif node.id == own_id:
            problems.add(ConfigError(key, f"{show(node.id)} is this node's own id"))
        else:
            nodes.append(node)
    return tuple(nodes)


# The file


def _writable(path: str) -> bool:
    existing = path
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            return False
        existing = parent
    return os.access(existing, os.W_OK)


def default_state_dir(
    env: Mapping[str, str],
    *,
    euid: int | None = None,
    writable: Callable[[str], bool] = _writable,
) -> str:
    """
    C{/var/lib/nvproxy} for root when it can be written, else
    C{$XDG_STATE_HOME/nvproxy}, else C{~/.local/state/nvproxy}.
    """
    if euid is None:
        euid = os.geteuid()
    if euid == 0 and writable(SYSTEM_STATE_DIR):
        return SYSTEM_STATE_DIR
    xdg = env.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):
        return os.path.join(xdg, "nvproxy")
    home = env.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".local", "state", "nvproxy")


def _read_document(path: str) -> dict[str, object]:
    where = f"config file {path}"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(where, f"cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(where, f"not UTF-8 text at byte {e.start}") from None
    try:
        return tomllib.loads(text)
    except RecursionError:
        # tomllib recurses per nesting level of inline arrays and tables.
        raise ConfigError(where, "invalid TOML: nested too deeply") from None
    except tomllib.TOMLDecodeError as e:
        message = str(e)
        match = re.fullmatch(r"(.*) \(at line (\d+), column (\d+)\)", message)
        if match is None:
            raise ConfigError(where, f"invalid TOML: {message}") from None
        raise ConfigError(
            f"{where}: line {match.group(2)}",
            f"invalid TOML: {match.group(1)} (column {match.group(3)})",
        ) from None


_CONFIG = next(setting for setting in TOP.settings if setting.flag == "config")


def load_config(
    path: str | None,
    flags: Mapping[str, str | None],
    env: Mapping[str, str],
) -> Config:
    """
    Build the configuration from a TOML file, environment variables and
    command-line flags, in increasing order of precedence.

    @param path: the TOML file; L{None} falls back to C{flags["config"]}, then
        C{NVPROXY_CONFIG}, then no file (defaults only).
    @param flags: flag long name (see L{FLAG_NAMES}) -> value, L{None} when
        not given.
    @param env: the process environment.
    @raise ConfigErrors: anything is wrong; every problem found, one line
        each.
    """
    unknown = set(flags) - set(FLAG_NAMES)
    if unknown:
        raise ValueError(f"unknown flags {sorted(unknown)}")
    problems = _Problems()
    sources = _Sources(flags, env)
    if path is None and (value := sources.get("config")):
        with problems.collect():
            path = read_string(value)
    document: dict[str, object] = {}
    if path is not None:
        with problems.collect():
            document = _read_document(path)
    settings = [setting for setting in TOP.settings if setting is not _CONFIG]
    read = _read(TOP, document, "", problems, sources=sources, settings=settings)
    values = read.values
    engines = _engines(values.get("engines"), problems)
    defaults = Config(
        state_dir=values.get("state_dir") or default_state_dir(env),
        engines=MappingProxyType(engines),
        nodes=_nodes(values.get("nodes"), values.get("node_id"), problems),
        config_path=path,
    )
    config: Config = _fill(defaults, TOP, read)
    _check_ejection(config, read, problems)
    _check_admin_port(config, read, problems)
    _check_etcd(config, read, problems)
    if problems:
        raise ConfigErrors(problems.errors)
    return config


def _check_ejection(config: Config, read: _Read, problems: _Problems) -> None:
    base, maximum = "dispatch.eject_base", "dispatch.eject_max"
    dispatch = config.dispatch
    if not read.fine(base, maximum) or dispatch.eject_base <= dispatch.eject_max:
        return
    if maximum in read.raws:
        raw = read.raws[maximum]
        problem = f"must not be below {base}, got {show(raw.raw)}"
    else:
        raw = read.raws[base]
        problem = f"must not be above {maximum}, got {show(raw.raw)}"
    problems.add(ConfigError(raw.key, problem))


def _check_etcd(config: Config, read: _Read, problems: _Problems) -> None:
    if config.discovery_provider != "etcd" or not read.fine("discovery.provider"):
        return
    etcd = config.etcd
    if config.cluster_dir is not None and config.advertise_address is None:
        raw = read.raws.get("discovery.provider")
        key = raw.key if raw is not None else "discovery.provider"
        problems.add(
            ConfigError(
                "discovery.advertise_address",
                f'required with {key} = "etcd" and a cluster dir:'
                " peers dial this node there",
            )
        )
    if (etcd.cert is None) != (etcd.key is None):
        problems.add(
            ConfigError(
                "discovery.tls.key" if etcd.key is None else "discovery.tls.cert",
                "discovery.tls.cert and discovery.tls.key go together",
            )
        )


def _check_admin_port(config: Config, read: _Read, problems: _Problems) -> None:
    if not (config.admin_enabled and read.fine("admin.listen", "--admin")):
        return
    source = read.raws.get("--admin")
    key = "admin.listen" if source is None else source.key
    port = config.admin_listen[1]
    for engine in config.engines.values():
        if engine.enabled and engine.facade_port == port:
            problems.add(
                ConfigError(key, f"port {port} is also the facade port of {engine.id}")
            )
