"""
Tests for L{nvproxy.config}.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import tomllib
from collections.abc import Mapping
from io import StringIO
from types import MappingProxyType

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.testing import EventLoggingObserver
from twisted.logger import globalLogPublisher
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.config import (
    FLAG_NAMES,
    TOP,
    Config,
    ConfigError,
    ConfigErrors,
    DispatchConfig,
    EngineConfig,
    EtcdConfig,
    LimitsConfig,
    NodeConfig,
    Options,
    VllmHold,
    VllmServiceConfig,
    default_backend,
    default_state_dir,
    env_name,
    flags_reference,
    format_duration,
    format_size,
    load_config,
    node_id_from_hostname,
    parse_duration,
    parse_size,
    reference_keys,
    resolve_node_id,
)
from nvproxy.dispatch import DispatchPolicy
from nvproxy.engines import ENGINES

EXAMPLE = """\
node_id = "node-a"                    # default: derived from the host name
state_dir = "/var/lib/nvproxy"        # persisted ports (§8), vLLM wake intent
log_format = "text"                   # or "json"

[admin]
listen = "127.0.0.1:8010"             # refused unless loopback

[dispatch]                            # §5.1; defaults shown
max_attempts = 5
deadline = "10m"
dial_timeout = "10s"
response_header_timeout = "30m"       # also first-body timeout; "0" disables both
backoff = ["500ms", "1s", "2s", "4s"] # then the last value repeats; +-20% jitter

[discovery]
poll_interval = "2s"                  # inventory polling

[limits]                              # per facade
max_body = "64MiB"                    # 413 beyond
max_connections = 4096                # fast 503 beyond
header_timeout = "30s"                # request line + headers must arrive within it

[cluster]
dir = "/etc/nvproxy/cluster"          # absent = no mTLS

[engines.ollama]
enabled = true
port = 11435                          # facade port; 0 = standalone default
backend = "http://127.0.0.1:11434"    # this node's engine
aliases = ["127.0.0.2:11434"]         # loopback-only extra listen addresses (§7)

[engines.vllm]
port = 8000
hold = { sleeping = "30s", offloaded = "180s", restarting = "300s" }  # FD §6.2.1
[[engines.vllm.services]]             # FD §6.1
name = "text"
url = "http://127.0.0.1:8001"
model = "Qwen3.6-35B-A3B-FP8"
aliases = ["qwen3.6-35b-a3b-fp8"]
default_for = ["/v1/chat/completions", "/v1/completions"]
idle_sleep = "15m"                    # level 1; "0" never
idle_offload = "3h"                   # level 2; "0" never

[[nodes]]                             # other nodes reached directly at their engines
id = "gpu-2"                          # (no nvproxy there, plain HTTP or HTTPS)
engines = { ollama = "http://10.0.0.2:11434", llamacpp = "http://10.0.0.2:8080" }
"""

ENV: Mapping[str, str] = {"NVPROXY_STATE_DIR": "/state"}
"""An environment that keeps the default state directory out of the tests."""


def default_engines(**changes: EngineConfig) -> MappingProxyType[str, EngineConfig]:
    engines = {
        engine_id: EngineConfig(
            engine_id, default_backend(engine_id, ENGINES[engine_id].standalone_port)
        )
        for engine_id in ENGINES
    }
    engines.update(changes)
    return MappingProxyType(engines)


class DurationTests(SynchronousTestCase):
    """
    L{parse_duration} and L{format_duration}.
    """

    def test_valid(self) -> None:
        table: list[tuple[str | int | float, float]] = [
            ("250ms", 0.25),
            ("10s", 10.0),
            ("15m", 900.0),
            ("3h", 10800.0),
            ("1h30m", 5400.0),
            ("1m30s500ms", 90.5),
            ("1.5s", 1.5),
            (".5h", 1800.0),
            ("0", 0.0),
            ("0s", 0.0),
            ("30", 30.0),
            ("2.5", 2.5),
            (" 10s ", 10.0),
            (0, 0.0),
            (7, 7.0),
            (0.25, 0.25),
        ]
        for text, seconds in table:
            self.assertEqual((text, parse_duration(text)), (text, seconds))

    def test_invalid(self) -> None:
        expected = (
            'must be a duration such as "250ms", "10s", "15m", "3h" or a number'
            " of seconds, got "
        )
        table: list[tuple[object, str]] = [
            ("x", expected + '"x"'),
            ("", expected + '""'),
            ("10 s", expected + '"10 s"'),
            ("1d", expected + '"1d"'),
            ("s", expected + '"s"'),
            ("1h-30m", expected + '"1h-30m"'),
            ("1e3", expected + '"1e3"'),
            (True, expected + "true"),
            ([1], expected + "[1]"),
            (float("inf"), expected + "inf"),
            (float("nan"), expected + "nan"),
            ("-1s", 'must not be negative, got "-1s"'),
            ("-5", 'must not be negative, got "-5"'),
            (-1, "must not be negative, got -1"),
            (-0.5, "must not be negative, got -0.5"),
        ]
        for value, message in table:
            with self.assertRaises(ConfigError) as raised:
                parse_duration(value)  # type: ignore[arg-type]
            self.assertEqual((value, str(raised.exception)), (value, message))
            self.assertIsNone(raised.exception.key)

    def test_format(self) -> None:
        table = [
            (0.0, "0s"),
            (0.25, "250ms"),
            (10.0, "10s"),
            (900.0, "15m"),
            (5400.0, "1h30m"),
            (3661.001, "1h1m1s1ms"),
            (0.0001, "0.0001s"),
        ]
        for seconds, text in table:
            self.assertEqual(format_duration(seconds), text)
        self.assertRaises(ValueError, format_duration, -1.0)
        self.assertRaises(ValueError, format_duration, float("inf"))

    @given(st.integers(min_value=0, max_value=10**12))
    def test_millisecond_round_trip(self, millis: int) -> None:
        """
        A whole number of milliseconds survives format then parse exactly.
        """
        seconds = millis / 1000
        self.assertEqual(parse_duration(format_duration(seconds)), seconds)

    @given(st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False))
    def test_float_round_trip(self, seconds: float) -> None:
        """
        Any finite non-negative number of seconds survives format then parse.
        """
        self.assertEqual(parse_duration(format_duration(seconds)), seconds)


class SizeTests(SynchronousTestCase):
    """
    L{parse_size} and L{format_size}.
    """

    def test_valid(self) -> None:
        table: list[tuple[str | int, int]] = [
            ("64MiB", 64 * 2**20),
            ("64 MiB", 64 * 2**20),
            ("10KB", 10_000),
            ("10KiB", 10_240),
            ("3MB", 3_000_000),
            ("2GB", 2_000_000_000),
            ("2GiB", 2 * 2**30),
            ("512B", 512),
            ("512", 512),
            ("1mib", 2**20),
            (4096, 4096),
            (0, 0),
        ]
        for text, size in table:
            self.assertEqual((text, parse_size(text)), (text, size))

    def test_invalid(self) -> None:
        expected = 'must be a size such as "64MiB" or a number of bytes, got '
        table: list[tuple[object, str]] = [
            ("64XB", expected + '"64XB"'),
            ("MiB", expected + '"MiB"'),
            ("1.5MiB", expected + '"1.5MiB"'),
            ("-1", expected + '"-1"'),
            ("", expected + '""'),
            (1.5, expected + "1.5"),
            (True, expected + "true"),
            (-1, "must not be negative, got -1"),
        ]
        for value, message in table:
            with self.assertRaises(ConfigError) as raised:
                parse_size(value)  # type: ignore[arg-type]
            self.assertEqual((value, str(raised.exception)), (value, message))

    def test_format(self) -> None:
        self.assertEqual(format_size(64 * 2**20), "64MiB")
        self.assertEqual(format_size(3 * 2**30), "3GiB")
        self.assertEqual(format_size(1536), "1536B")
        self.assertEqual(format_size(2048), "2KiB")
        self.assertEqual(format_size(0), "0B")
        self.assertRaises(ValueError, format_size, -1)

    @given(st.integers(min_value=0, max_value=2**50))
    def test_round_trip(self, size: int) -> None:
        self.assertEqual(parse_size(format_size(size)), size)


class LoadTestsMixin(SynchronousTestCase):
    """
    Helpers to load a config from TOML text.
    """

    def write(self, text: str) -> str:
        path = self.mktemp()
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def load(
        self,
        text: str | None = None,
        flags: Mapping[str, str | None] | None = None,
        env: Mapping[str, str] = ENV,
    ) -> Config:
        path = None if text is None else self.write(text)
        return load_config(path, flags or {}, env)

    def assertConfigError(
        self,
        text: str | None,
        message: str,
        flags: Mapping[str, str | None] | None = None,
        env: Mapping[str, str] = ENV,
    ) -> None:
        with self.assertRaises(ConfigError) as raised:
            self.load(text, flags, env)
        self.assertEqual(str(raised.exception), message)
        self.assertNotIn("\n", str(raised.exception))


class ExampleTests(LoadTestsMixin):
    """
    The example configuration of DESIGN §2 and the defaults.
    """

    def test_example(self) -> None:
        path = self.write(EXAMPLE)
        config = load_config(path, {}, {})
        text = VllmServiceConfig(
            name="text",
            url="http://127.0.0.1:8001",
            model="Qwen3.6-35B-A3B-FP8",
            aliases=("qwen3.6-35b-a3b-fp8",),
            default_for=("/v1/chat/completions", "/v1/completions"),
            idle_sleep=900.0,
            idle_offload=10800.0,
        )
        expected = Config(
            node_id="node-a",
            state_dir="/var/lib/nvproxy",
            log_format="text",
            admin_listen=("127.0.0.1", 8010),
            admin_enabled=True,
            dispatch=DispatchConfig(
                policy=DispatchPolicy(
                    max_attempts=5, deadline=600.0, backoff=(0.5, 1.0, 2.0, 4.0)
                ),
                dial_timeout=10.0,
                response_header_timeout=1800.0,
            ),
            discovery_poll_interval=2.0,
            limits=LimitsConfig(
                max_body=64 * 2**20, max_connections=4096, header_timeout=30.0
            ),
            cluster_dir="/etc/nvproxy/cluster",
            engines=default_engines(
                ollama=EngineConfig(
                    "ollama",
                    "http://127.0.0.1:11434",
                    port=11435,
                    backend_configured=True,
                    aliases=(("127.0.0.2", 11434),),
                ),
                vllm=EngineConfig(
                    "vllm",
                    "http://127.0.0.1:8001",
                    port=8000,
                    services=(text,),
                    hold=VllmHold(sleeping=30.0, offloaded=180.0, restarting=300.0),
                ),
            ),
            nodes=(
                NodeConfig(
                    "gpu-2",
                    MappingProxyType(
                        {
                            "ollama": "http://10.0.0.2:11434",
                            "llamacpp": "http://10.0.0.2:8080",
                        }
                    ),
                ),
            ),
            control=None,
            listen_interface="127.0.0.1",
        )
        self.assertEqual(config, expected)
        self.assertEqual(config.config_path, path)
        self.assertEqual(list(config.engines), list(ENGINES))

    def test_defaults(self) -> None:
        """
        No file, flags or environment: every engine enabled on its standalone
        port, the defaults of DESIGN §2.
        """
        config = self.load()
        self.assertEqual(
            config,
            Config(state_dir="/state", engines=default_engines()),
        )
        self.assertEqual(
            list(config.engines), ["ollama", "lmstudio", "llamacpp", "vllm"]
        )
        self.assertEqual(
            config.dispatch, DispatchConfig(DispatchPolicy(5, 600.0), 10.0, 1800.0)
        )
        self.assertEqual(config.limits, LimitsConfig(64 * 2**20, 4096, 30.0))
        self.assertEqual(config.admin_listen, ("127.0.0.1", 8010))
        self.assertIsNone(config.node_id)
        self.assertIsNone(config.cluster_dir)
        self.assertIsNone(config.config_path)

    def test_empty_file(self) -> None:
        self.assertEqual(self.load(""), self.load())

    def test_default_backends(self) -> None:
        """
        An engine is at its own port unless the facade sits there, then at its
        relocated port.
        """
        config = self.load()
        self.assertEqual(
            {engine_id: engine.backend for engine_id, engine in config.engines.items()},
            {
                "ollama": "http://127.0.0.1:11434",
                "lmstudio": "http://127.0.0.1:1235",
                "llamacpp": "http://127.0.0.1:8081",
                "vllm": "http://127.0.0.1:8001",
            },
        )
        self.assertEqual(
            {
                engine_id: engine.facade_port
                for engine_id, engine in config.engines.items()
            },
            {"ollama": 11435, "lmstudio": 1234, "llamacpp": 8080, "vllm": 8000},
        )
        for engine in config.engines.values():
            self.assertFalse(engine.backend_configured)

    def test_relocation_follows_port(self) -> None:
        config = self.load(
            "[engines.ollama]\nport = 11434\n"
            "[engines.lmstudio]\nport = 1240\n"
            "[engines.llamacpp]\nport = 8081\n"
            "[engines.vllm]\nport = 9000\n"
        )
        self.assertEqual(
            {engine_id: engine.backend for engine_id, engine in config.engines.items()},
            {
                "ollama": "http://127.0.0.1:11435",
                "lmstudio": "http://127.0.0.1:1234",
                "llamacpp": "http://127.0.0.1:8080",
                "vllm": "http://127.0.0.1:8000",
            },
        )
        self.assertEqual(default_backend("ollama", 11434), "http://127.0.0.1:11435")
        self.assertEqual(default_backend("ollama", 11435), "http://127.0.0.1:11434")

    def test_port_zero_is_standalone(self) -> None:
        engine = self.load("[engines.ollama]\nport = 0\n").engines["ollama"]
        self.assertEqual((engine.port, engine.facade_port), (0, 11435))

    def test_disabled_engine_kept(self) -> None:
        config = self.load("[engines.lmstudio]\nenabled = false\n")
        self.assertEqual(list(config.engines), list(ENGINES))
        self.assertFalse(config.engines["lmstudio"].enabled)
        self.assertTrue(config.engines["ollama"].enabled)

    def test_normalizations(self) -> None:
        config = self.load(
            'listen_interface = "::"\n'
            "[admin]\n"
            'listen = "[::1]:9010"\n'
            "[engines.ollama]\n"
            'backend = "https://gpu.example:11434/"\n'
            'aliases = ["localhost:11500", "[::ffff:127.0.0.3]:11434"]\n'
        )
        self.assertEqual(config.listen_interface, "::")
        self.assertEqual(config.admin_listen, ("::1", 9010))
        ollama = config.engines["ollama"]
        self.assertEqual(ollama.backend, "https://gpu.example:11434")
        self.assertEqual(ollama.aliases, (("127.0.0.1", 11500), ("127.0.0.3", 11434)))

    def test_admin_disabled(self) -> None:
        config = self.load("[admin]\nenabled = false\n")
        self.assertFalse(config.admin_enabled)

    def test_numbers_as_durations(self) -> None:
        config = self.load(
            "[dispatch]\ndeadline = 60\nresponse_header_timeout = 0\n"
            'backoff = [0.1, "1s"]\n'
        )
        self.assertEqual(
            (
                config.dispatch.policy.deadline,
                config.dispatch.response_header_timeout,
                config.dispatch.policy.backoff,
            ),
            (60.0, 0.0, (0.1, 1.0)),
        )

    def test_state_dir_expands_user(self) -> None:
        self.patch(os.path, "expanduser", lambda p: p.replace("~", "/home/u"))
        config = self.load('state_dir = "~/nvp"\n', env={})
        self.assertEqual(config.state_dir, "/home/u/nvp")


class ValidationTests(LoadTestsMixin):
    """
    Every invalid configuration is refused with one line naming the key.
    """

    def check(self, table: list[tuple[str, str]]) -> None:
        for text, message in table:
            with self.assertRaises(ConfigError, msg=text) as raised:
                self.load(text)
            self.assertEqual((text, str(raised.exception)), (text, message))

    def test_unknown_keys(self) -> None:
        self.check(
            [
                ("prot = 1\n", "prot: unknown key"),
                ("[engines.ollama]\nprot = 1\n", "engines.ollama.prot: unknown key"),
                ("[dispatch]\nretries = 1\n", "dispatch.retries: unknown key"),
                ("[limits]\nmax = 1\n", "limits.max: unknown key"),
                ("[admin]\nport = 1\n", "admin.port: unknown key"),
                ("[discovery]\ninterval = 1\n", "discovery.interval: unknown key"),
                ("[cluster]\npath = 'x'\n", "cluster.path: unknown key"),
                ('"a b" = 1\n', '"a b": unknown key'),
                (
                    "[engines.vllm]\nhold = { asleep = '1s' }\n",
                    "engines.vllm.hold.asleep: unknown key",
                ),
                (
                    "[[engines.vllm.services]]\nname = 'a'\nurl = 'http://h'\n"
                    "model = 'm'\nport = 1\n",
                    "engines.vllm.services[0].port: unknown key",
                ),
                ("[[nodes]]\nid = 'n'\nurl = 'x'\n", "nodes[0].url: unknown key"),
                (
                    "[engines.foo]\nport = 1\n",
                    "engines.foo: unknown engine; known engines are ollama,"
                    " lmstudio, llamacpp, vllm",
                ),
                (
                    "[engines.ollama]\nservices = []\n",
                    "engines.ollama.services: only valid for vllm",
                ),
                (
                    "[engines.llamacpp]\nhold = {}\n",
                    "engines.llamacpp.hold: only valid for vllm",
                ),
            ]
        )

    def test_types(self) -> None:
        self.check(
            [
                ("node_id = 3\n", "node_id: must be a string, got 3"),
                ('node_id = ""\n', "node_id: must not be empty"),
                ("[cluster]\ndir = []\n", "cluster.dir: must be a string, got []"),
                ("admin = 1\n", "admin: must be a table, got 1"),
                ("engines = 1\n", "engines: must be a table, got 1"),
                ("engines.ollama = 1\n", "engines.ollama: must be a table, got 1"),
                (
                    "[engines.ollama]\nenabled = 'yes'\n",
                    'engines.ollama.enabled: must be true or false, got "yes"',
                ),
                (
                    "[admin]\nenabled = 1\n",
                    "admin.enabled: must be true or false, got 1",
                ),
                (
                    "[dispatch]\nmax_attempts = 'x'\n",
                    'dispatch.max_attempts: must be an integer >= 1, got "x"',
                ),
                (
                    "[dispatch]\nmax_attempts = '5'\n",
                    'dispatch.max_attempts: must be an integer >= 1, got "5"',
                ),
                (
                    "[dispatch]\nmax_attempts = 0\n",
                    "dispatch.max_attempts: must be an integer >= 1, got 0",
                ),
                (
                    "[dispatch]\nmax_attempts = 2.0\n",
                    "dispatch.max_attempts: must be an integer >= 1, got 2.0",
                ),
                (
                    "[limits]\nmax_connections = true\n",
                    "limits.max_connections: must be an integer >= 1, got true",
                ),
                (
                    "[dispatch]\nbackoff = '1s'\n",
                    'dispatch.backoff: must be an array, got "1s"',
                ),
                ("nodes = {}\n", "nodes: must be an array, got a table"),
                ("nodes = [1]\n", "nodes[0]: must be a table, got 1"),
                (
                    "[engines.ollama]\naliases = '127.0.0.2:1'\n",
                    'engines.ollama.aliases: must be an array, got "127.0.0.2:1"',
                ),
                (
                    "[[engines.vllm.services]]\nname = 'a'\nurl = 'http://h'\n"
                    "model = 'm'\naliases = [1]\n",
                    "engines.vllm.services[0].aliases[0]: must be a string, got 1",
                ),
                (
                    "log_format = 'xml'\n",
                    'log_format: must be "text" or "json", got "xml"',
                ),
                ("log_format = 1\n", 'log_format: must be "text" or "json", got 1'),
            ]
        )

    def test_state_dir_type(self) -> None:
        self.assertConfigError(
            "state_dir = [1, 2]\n", "state_dir: must be a string, got [1, 2]", env={}
        )

    def test_durations_and_sizes(self) -> None:
        expected = (
            'must be a duration such as "250ms", "10s", "15m", "3h" or a number'
            " of seconds, got "
        )
        self.check(
            [
                (
                    "[dispatch]\ndeadline = 'soon'\n",
                    f'dispatch.deadline: {expected}"soon"',
                ),
                (
                    "[dispatch]\ndeadline = '0s'\n",
                    'dispatch.deadline: must be greater than 0, got "0s"',
                ),
                (
                    "[dispatch]\ndial_timeout = 0\n",
                    "dispatch.dial_timeout: must be greater than 0, got 0",
                ),
                (
                    "[dispatch]\nresponse_header_timeout = '-1s'\n",
                    'dispatch.response_header_timeout: must not be negative, got "-1s"',
                ),
                (
                    "[dispatch]\nbackoff = []\n",
                    "dispatch.backoff: must list at least one duration",
                ),
                (
                    "[dispatch]\nbackoff = ['1s', '0s']\n",
                    "dispatch.backoff: the last duration must be above 0",
                ),
                (
                    "[dispatch]\nbackoff = ['1s', 'x']\n",
                    f'dispatch.backoff[1]: {expected}"x"',
                ),
                (
                    "[discovery]\npoll_interval = '0'\n",
                    'discovery.poll_interval: must be greater than 0, got "0"',
                ),
                (
                    "[limits]\nheader_timeout = 'x'\n",
                    f'limits.header_timeout: {expected}"x"',
                ),
                (
                    "[limits]\nmax_body = '64 megs'\n",
                    'limits.max_body: must be a size such as "64MiB" or a number of'
                    ' bytes, got "64 megs"',
                ),
                (
                    "[limits]\nmax_body = 0\n",
                    "limits.max_body: must be at least 1 byte, got 0",
                ),
                (
                    "[engines.vllm]\nhold = { sleeping = '0s' }\n",
                    'engines.vllm.hold.sleeping: must be greater than 0, got "0s"',
                ),
                (
                    "[[engines.vllm.services]]\nname = 'a'\nurl = 'http://h'\n"
                    "model = 'm'\nidle_sleep = 'never'\n",
                    f'engines.vllm.services[0].idle_sleep: {expected}"never"',
                ),
            ]
        )

    def test_ports(self) -> None:
        self.check(
            [
                (
                    "[engines.ollama]\nport = 70000\n",
                    "engines.ollama.port: must be 0 (standalone default) or"
                    " 1..65535, got 70000",
                ),
                (
                    "[engines.vllm]\nport = -1\n",
                    "engines.vllm.port: must be 0 (standalone default) or"
                    " 1..65535, got -1",
                ),
                (
                    "[engines.vllm]\nport = '8000'\n",
                    "engines.vllm.port: must be 0 (standalone default) or"
                    ' 1..65535, got "8000"',
                ),
                (
                    "[engines.lmstudio]\nport = 8080\n",
                    "engines.llamacpp.port: 8080 is also the facade port of lmstudio",
                ),
                (
                    "[admin]\nlisten = '127.0.0.1:8000'\n",
                    "admin.listen: port 8000 is also the facade port of vllm",
                ),
                (
                    "[engines.ollama]\nport = 11434\n"
                    "backend = 'http://127.0.0.1:11434'\n",
                    "engines.ollama.backend: points at this facade's own port 11434",
                ),
                (
                    "[[engines.vllm.services]]\nname = 'a'\n"
                    "url = 'http://localhost:8000'\nmodel = 'm'\n",
                    "engines.vllm.services[0].url: points at this facade's own"
                    " port 8000",
                ),
            ]
        )

    def test_port_clash_ignores_disabled(self) -> None:
        config = self.load(
            "[engines.lmstudio]\nport = 8080\n[engines.llamacpp]\nenabled = false\n"
        )
        self.assertEqual(config.engines["lmstudio"].facade_port, 8080)

    def test_urls(self) -> None:
        url = "must be an http:// or https:// URL with a host, got "
        self.check(
            [
                (
                    "[engines.ollama]\nbackend = 'ftp://h'\n",
                    f'engines.ollama.backend: {url}"ftp://h"',
                ),
                (
                    "[engines.ollama]\nbackend = '127.0.0.1:11434'\n",
                    f'engines.ollama.backend: {url}"127.0.0.1:11434"',
                ),
                (
                    "[engines.ollama]\nbackend = 'http://'\n",
                    f'engines.ollama.backend: {url}"http://"',
                ),
                (
                    "[engines.ollama]\nbackend = 'http://h:99999'\n",
                    f'engines.ollama.backend: {url}"http://h:99999"',
                ),
                (
                    "[engines.ollama]\nbackend = 'http://h:0'\n",
                    'engines.ollama.backend: must not use port 0, got "http://h:0"',
                ),
                (
                    "[engines.ollama]\nbackend = 'http://h/?a=1'\n",
                    "engines.ollama.backend: must not have a query or fragment,"
                    ' got "http://h/?a=1"',
                ),
                (
                    "[engines.ollama]\nbackend = 'http://u:p@h'\n",
                    "engines.ollama.backend: must not contain user information",
                ),
                (
                    "[[nodes]]\nid = 'n'\nengines = { vllm = 'h:8000' }\n",
                    f'nodes[0].engines.vllm: {url}"h:8000"',
                ),
            ]
        )

    def test_listen_addresses(self) -> None:
        hostport = "must be HOST:PORT with an IP address, got "
        self.check(
            [
                (
                    "[admin]\nlisten = '0.0.0.0:8010'\n",
                    "admin.listen: must be a loopback address",
                ),
                (
                    "[admin]\nlisten = '[::]:8010'\n",
                    "admin.listen: must be a loopback address",
                ),
                (
                    "[admin]\nlisten = '10.0.0.1:8010'\n",
                    "admin.listen: must be a loopback address",
                ),
                ("[admin]\nlisten = '8010'\n", f'admin.listen: {hostport}"8010"'),
                (
                    "[admin]\nlisten = 'example.com:8010'\n",
                    f'admin.listen: {hostport}"example.com:8010"',
                ),
                (
                    "[admin]\nlisten = '::1:8010'\n",
                    f'admin.listen: {hostport}"::1:8010"',
                ),
                (
                    "[admin]\nlisten = '[127.0.0.1]:8010'\n",
                    f'admin.listen: {hostport}"[127.0.0.1]:8010"',
                ),
                (
                    "[admin]\nlisten = '127.0.0.1:0'\n",
                    'admin.listen: port must be 1..65535, got "127.0.0.1:0"',
                ),
                (
                    "[engines.ollama]\naliases = ['192.168.1.2:11434']\n",
                    "engines.ollama.aliases[0]: must be a loopback address",
                ),
                (
                    "[engines.ollama]\naliases = ['127.0.0.2:1', '127.0.0.2:1']\n",
                    'engines.ollama.aliases[1]: duplicate alias "127.0.0.2:1"',
                ),
                (
                    "listen_interface = 'eth0'\n",
                    'listen_interface: must be an IP address to listen on, got "eth0"',
                ),
            ]
        )

    def test_identifiers(self) -> None:
        identifier = (
            "must be 1 to 63 letters, digits, '.', '_' or '-', starting with a"
            " letter or digit, got "
        )
        dns = (
            "must be a DNS name: letters, digits, '-' and '.', not an IP address, got "
        )
        self.check(
            [
                ("node_id = 'a b'\n", f'node_id: {dns}"a b"'),
                ("node_id = '-a'\n", f'node_id: {dns}"-a"'),
                ("node_id = 'gpu_1'\n", f'node_id: {dns}"gpu_1"'),
                ("node_id = '10.0.0.1'\n", f'node_id: {dns}"10.0.0.1"'),
                (f"node_id = '{'a' * 64}'\n", f'node_id: {dns}"{"a" * 57}..."'),
                ("[[nodes]]\nid = 'x/y'\n", f'nodes[0].id: {dns}"x/y"'),
                (
                    "[[engines.vllm.services]]\nname = 'a b'\nurl = 'http://h'\n"
                    "model = 'm'\n",
                    f'engines.vllm.services[0].name: {identifier}"a b"',
                ),
            ]
        )

    def test_required(self) -> None:
        self.check(
            [
                ("[[nodes]]\nengines = {}\n", "nodes[0].id: is required"),
                ("[[nodes]]\nid = 'n'\n", "nodes[0].engines: is required"),
                (
                    "[[nodes]]\nid = 'n'\nengines = {}\n",
                    "nodes[0].engines: must map at least one engine to a URL",
                ),
                (
                    "[[engines.vllm.services]]\nurl = 'http://h'\nmodel = 'm'\n",
                    "engines.vllm.services[0].name: is required",
                ),
                (
                    "[[engines.vllm.services]]\nname = 'a'\nmodel = 'm'\n",
                    "engines.vllm.services[0].url: is required",
                ),
                (
                    "[[engines.vllm.services]]\nname = 'a'\nurl = 'http://h'\n",
                    "engines.vllm.services[0].model: is required",
                ),
            ]
        )

    def test_nodes(self) -> None:
        self.check(
            [
                (
                    "[[nodes]]\nid = 'n'\nengines = { ollama = 'http://a' }\n"
                    "[[nodes]]\nid = 'n'\nengines = { ollama = 'http://b' }\n",
                    'nodes[1].id: duplicate node id "n"',
                ),
                (
                    "node_id = 'me'\n"
                    "[[nodes]]\nid = 'me'\nengines = { ollama = 'http://a' }\n",
                    'nodes[0].id: "me" is this node\'s own id',
                ),
                (
                    "[[nodes]]\nid = 'n'\nengines = { gpt = 'http://a' }\n",
                    "nodes[0].engines.gpt: unknown engine; known engines are"
                    " ollama, lmstudio, llamacpp, vllm",
                ),
            ]
        )

    def test_node_engines_in_table_order(self) -> None:
        config = self.load(
            "[[nodes]]\nid = 'n'\n"
            "engines = { vllm = 'http://a:8000/v1/', ollama = 'http://a:11434/' }\n"
        )
        self.assertEqual(
            dict(config.nodes[0].engines),
            {"ollama": "http://a:11434", "vllm": "http://a:8000/v1"},
        )
        self.assertEqual(list(config.nodes[0].engines), ["ollama", "vllm"])

    def test_vllm_services(self) -> None:
        service = "[[engines.vllm.services]]\nname = '{}'\nurl = 'http://h:{}'\n"
        self.check(
            [
                (
                    service.format("a", 1)
                    + "model = 'M'\n"
                    + service.format("a", 2)
                    + "model = 'N'\n",
                    'engines.vllm.services[1].name: duplicate service name "a"',
                ),
                (
                    service.format("a", 1)
                    + "model = 'Big'\n"
                    + service.format("b", 2)
                    + "model = 'small'\naliases = ['BIG']\n",
                    'engines.vllm.services[1].aliases[0]: "BIG" already names a'
                    ' model of service "a"',
                ),
                (
                    service.format("a", 1)
                    + "model = 'Big'\naliases = ['large']\n"
                    + service.format("b", 2)
                    + "model = 'LARGE'\n",
                    'engines.vllm.services[1].model: "LARGE" already names a'
                    ' model of service "a"',
                ),
                (
                    service.format("a", 1) + "model = 'M'\n"
                    "default_for = ['/v1/completions']\n"
                    + service.format("b", 2)
                    + "model = 'N'\n"
                    "default_for = ['/v1/embeddings', '/v1/completions']\n",
                    'engines.vllm.services[1].default_for[1]: "/v1/completions" is'
                    ' already the default of service "a"',
                ),
                (
                    service.format("a", 1) + "model = 'M'\n"
                    "default_for = ['v1/completions']\n",
                    "engines.vllm.services[0].default_for[0]: must be a path"
                    ' starting with "/" (optionally prefixed "multipart:"),'
                    ' got "v1/completions"',
                ),
                (
                    "[engines.vllm]\nservices = {}\n",
                    "engines.vllm.services: must be an array, got a table",
                ),
            ]
        )

    def test_vllm_alias_of_own_model(self) -> None:
        """
        A service may list its own model in another case as an alias, as the
        DESIGN example does; idle timers accept 0 (never).
        """
        config = self.load(
            "[[engines.vllm.services]]\nname = 'a'\nurl = 'http://h'\n"
            "model = 'Big'\naliases = ['big', 'BIG']\n"
            "idle_sleep = 0\nidle_offload = '0'\n"
        )
        (service,) = config.engines["vllm"].services
        self.assertEqual(
            (service.aliases, service.idle_sleep, service.idle_offload),
            (("big", "BIG"), 0.0, 0.0),
        )

    def test_file_problems(self) -> None:
        missing = self.mktemp()
        with self.assertRaises(ConfigError) as raised:
            load_config(missing, {}, ENV)
        self.assertEqual(
            str(raised.exception),
            f"config file {missing}: cannot read: No such file or directory",
        )

        directory = self.mktemp()
        os.mkdir(directory)
        with self.assertRaises(ConfigError) as raised:
            load_config(directory, {}, ENV)
        self.assertEqual(
            str(raised.exception),
            f"config file {directory}: cannot read: Is a directory",
        )

        path = self.write('node_id = "a"\n[admin]\nlisten = \n')
        with self.assertRaises(ConfigError) as raised:
            load_config(path, {}, ENV)
        self.assertEqual(
            str(raised.exception),
            f"config file {path}: line 3: invalid TOML: Invalid value (column 10)",
        )

        path = self.write("a = 1\nb")
        with self.assertRaises(ConfigError) as raised:
            load_config(path, {}, ENV)
        self.assertEqual(
            str(raised.exception),
            f"config file {path}: invalid TOML: Expected '=' after a key in a"
            " key/value pair (at end of document)",
        )

        path = self.mktemp()
        with open(path, "wb") as f:
            f.write(b'node_id = "\xff"\n')
        with self.assertRaises(ConfigError) as raised:
            load_config(path, {}, ENV)
        self.assertEqual(
            str(raised.exception), f"config file {path}: not UTF-8 text at byte 11"
        )

    def test_multiline_values_stay_one_line(self) -> None:
        with self.assertRaises(ConfigError) as raised:
            self.load('log_format = """a\nb"""\n')
        self.assertEqual(
            str(raised.exception), 'log_format: must be "text" or "json", got "a\\nb"'
        )


class PrecedenceTests(LoadTestsMixin):
    """
    Flags win over the environment, which wins over the file, which wins over
    the defaults.
    """

    FILE = (
        'node_id = "file"\n'
        'state_dir = "/file/state"\n'
        'log_format = "json"\n'
        'listen_interface = "127.0.0.3"\n'
        "[admin]\nlisten = '127.0.0.1:7001'\n"
        "[dispatch]\nmax_attempts = 3\ndeadline = '1m'\ndial_timeout = '3s'\n"
        "response_header_timeout = '5m'\n"
        "[cluster]\ndir = '/file/cluster'\n"
    )

    def test_file(self) -> None:
        config = self.load(self.FILE, env={})
        self.assertEqual(
            (
                config.node_id,
                config.state_dir,
                config.log_format,
                config.listen_interface,
                config.admin_listen,
                config.dispatch,
                config.cluster_dir,
            ),
            (
                "file",
                "/file/state",
                "json",
                "127.0.0.3",
                ("127.0.0.1", 7001),
                DispatchConfig(DispatchPolicy(3, 60.0), 3.0, 300.0),
                "/file/cluster",
            ),
        )

    def test_env_over_file(self) -> None:
        env = {
            "NVPROXY_NODE_ID": "env",
            "NVPROXY_STATE_DIR": "/env/state",
            "NVPROXY_LOG_FORMAT": "text",
            "NVPROXY_LISTEN_INTERFACE": "0.0.0.0",
            "NVPROXY_ADMIN": "127.0.0.1:7002",
            "NVPROXY_MAX_ATTEMPTS": "7",
            "NVPROXY_DEADLINE": "2m",
            "NVPROXY_DIAL_TIMEOUT": "4s",
            "NVPROXY_RESPONSE_HEADER_TIMEOUT": "0",
            "NVPROXY_CLUSTER_DIR": "/env/cluster",
            "NVPROXY_CONTROL": "stdio",
        }
        config = self.load(self.FILE, env=env)
        self.assertEqual(
            (
                config.node_id,
                config.state_dir,
                config.log_format,
                config.listen_interface,
                config.admin_listen,
                config.dispatch,
                config.cluster_dir,
                config.control,
            ),
            (
                "env",
                "/env/state",
                "text",
                "0.0.0.0",
                ("127.0.0.1", 7002),
                DispatchConfig(DispatchPolicy(7, 120.0), 4.0, 0.0),
                "/env/cluster",
                "stdio",
            ),
        )

    def test_flags_over_env(self) -> None:
        env = {
            "NVPROXY_NODE_ID": "env",
            "NVPROXY_STATE_DIR": "/env/state",
            "NVPROXY_MAX_ATTEMPTS": "7",
            "NVPROXY_DEADLINE": "2m",
            "NVPROXY_DIAL_TIMEOUT": "4s",
            "NVPROXY_RESPONSE_HEADER_TIMEOUT": "0",
            "NVPROXY_CLUSTER_DIR": "/env/cluster",
            "NVPROXY_ADMIN": "127.0.0.1:7002",
            "NVPROXY_LOG_FORMAT": "text",
        }
        flags = {
            "node-id": "flag",
            "state-dir": "/flag/state",
            "max-attempts": "9",
            "deadline": "3m",
            "dial-timeout": "500ms",
            "response-header-timeout": "45",
            "cluster-dir": "/flag/cluster",
            "admin": "[::1]:7003",
            "log-format": "json",
            "listen-interface": "::",
            "control": "stdio",
        }
        config = self.load(self.FILE, flags=flags, env=env)
        self.assertEqual(
            (
                config.node_id,
                config.state_dir,
                config.log_format,
                config.listen_interface,
                config.admin_listen,
                config.dispatch,
                config.cluster_dir,
                config.control,
            ),
            (
                "flag",
                "/flag/state",
                "json",
                "::",
                ("::1", 7003),
                DispatchConfig(DispatchPolicy(9, 180.0), 0.5, 45.0),
                "/flag/cluster",
                "stdio",
            ),
        )

    def test_unset_flags_and_empty_env(self) -> None:
        """
        A flag given as L{None} and an empty variable are unset.
        """
        flags: dict[str, str | None] = dict.fromkeys(FLAG_NAMES)
        env = {env_name(name): "" for name in FLAG_NAMES}
        env["HOME"] = "/home/u"
        config = self.load(self.FILE, flags=flags, env=env)
        self.assertEqual(config, self.load(self.FILE, env={"HOME": "/home/u"}))
        self.assertEqual(config.node_id, "file")

    def test_admin_off(self) -> None:
        self.assertFalse(self.load(flags={"admin": "off"}).admin_enabled)
        env = dict(ENV, NVPROXY_ADMIN="OFF")
        self.assertFalse(self.load(env=env).admin_enabled)
        config = self.load("[admin]\nenabled = false\n", flags={"admin": "127.0.0.1:1"})
        self.assertEqual(
            (config.admin_enabled, config.admin_listen), (True, ("127.0.0.1", 1))
        )

    def test_admin_off_frees_port(self) -> None:
        """
        A disabled admin listener does not clash with a facade.
        """
        config = self.load("[admin]\nlisten = '127.0.0.1:8000'\nenabled = false\n")
        self.assertFalse(config.admin_enabled)

    def test_config_path_sources(self) -> None:
        path = self.write('node_id = "from-file"\n')
        self.assertEqual(load_config(None, {"config": path}, ENV).node_id, "from-file")
        env = dict(ENV, NVPROXY_CONFIG=path)
        self.assertEqual(load_config(None, {}, env).node_id, "from-file")
        other = self.write('node_id = "other"\n')
        self.assertEqual(load_config(other, {}, env).node_id, "other")
        self.assertEqual(load_config(None, {"config": other}, env).node_id, "other")

    def test_unknown_flag(self) -> None:
        self.assertRaises(ValueError, load_config, None, {"nope": "1"}, ENV)

    def test_flag_errors_name_the_flag(self) -> None:
        table: list[tuple[dict[str, str], dict[str, str], str]] = [
            (
                {"max-attempts": "x"},
                {},
                '--max-attempts: must be an integer >= 1, got "x"',
            ),
            (
                {},
                {"NVPROXY_MAX_ATTEMPTS": "0"},
                'NVPROXY_MAX_ATTEMPTS: must be an integer >= 1, got "0"',
            ),
            ({"deadline": "0s"}, {}, '--deadline: must be greater than 0, got "0s"'),
            (
                {},
                {"NVPROXY_RESPONSE_HEADER_TIMEOUT": "forever"},
                "NVPROXY_RESPONSE_HEADER_TIMEOUT: must be a duration such as"
                ' "250ms", "10s", "15m", "3h" or a number of seconds, got "forever"',
            ),
            (
                {"dial-timeout": "-1"},
                {},
                '--dial-timeout: must not be negative, got "-1"',
            ),
            ({"admin": "0.0.0.0:8010"}, {}, "--admin: must be a loopback address"),
            (
                {"log-format": "xml"},
                {},
                '--log-format: must be "text" or "json", got "xml"',
            ),
            ({"control": "tcp"}, {}, '--control: must be "stdio", got "tcp"'),
            (
                {"node-id": "a b"},
                {},
                "--node-id: must be a DNS name: letters, digits, '-' and '.',"
                ' not an IP address, got "a b"',
            ),
            ({"state-dir": " "}, {}, "--state-dir: must not be empty"),
            (
                {"listen-interface": "lan"},
                {},
                '--listen-interface: must be an IP address to listen on, got "lan"',
            ),
            (
                {"admin": "127.0.0.1:8080"},
                {},
                "--admin: port 8080 is also the facade port of llamacpp",
            ),
        ]
        for flags, env, message in table:
            self.assertConfigError(None, message, flags=flags, env=dict(ENV, **env))

    def test_flag_overrides_bad_file_value(self) -> None:
        """
        A value overridden by a flag is not read from the file.
        """
        config = self.load(
            "[dispatch]\nmax_attempts = 'x'\n", flags={"max-attempts": "2"}
        )
        self.assertEqual(config.dispatch.policy.max_attempts, 2)


class StateDirTests(SynchronousTestCase):
    """
    L{default_state_dir}.
    """

    def test_root(self) -> None:
        self.assertEqual(
            default_state_dir({}, euid=0, writable=lambda path: True),
            "/var/lib/nvproxy",
        )

    def test_root_cannot_write(self) -> None:
        self.assertEqual(
            default_state_dir({"HOME": "/root"}, euid=0, writable=lambda path: False),
            "/root/.local/state/nvproxy",
        )

    def test_xdg(self) -> None:
        self.assertEqual(
            default_state_dir(
                {"XDG_STATE_HOME": "/x/state", "HOME": "/home/u"},
                euid=1000,
                writable=lambda path: True,
            ),
            "/x/state/nvproxy",
        )

    def test_relative_xdg_ignored(self) -> None:
        self.assertEqual(
            default_state_dir(
                {"XDG_STATE_HOME": "state", "HOME": "/home/u"},
                euid=1000,
                writable=lambda path: True,
            ),
            "/home/u/.local/state/nvproxy",
        )

    def test_writable_checks_nearest_existing_parent(self) -> None:
        checked: list[str] = []

        def writable(path: str) -> bool:
            checked.append(path)
            return False

        default_state_dir({"HOME": "/h"}, euid=0, writable=writable)
        self.assertEqual(checked, ["/var/lib/nvproxy"])


class NodeIdTests(SynchronousTestCase):
    """
    L{resolve_node_id} and L{node_id_from_hostname}.
    """

    def config(self, node_id: str | None = None) -> Config:
        state_dir = self.mktemp()
        return Config(state_dir=state_dir, engines=default_engines(), node_id=node_id)

    def test_configured(self) -> None:
        config = self.config("fixed")
        self.assertEqual(resolve_node_id(config, "host"), "fixed")
        self.assertFalse(os.path.exists(config.state_dir))

    def test_derived_then_persisted(self) -> None:
        config = self.config()
        self.assertEqual(resolve_node_id(config, "gpu-1.lan"), "gpu-1.lan")
        path = os.path.join(config.state_dir, "node-id")
        with open(path) as f:
            self.assertEqual(f.read(), "gpu-1.lan\n")
        self.assertEqual(resolve_node_id(config, "renamed"), "gpu-1.lan")
        self.assertEqual(os.listdir(config.state_dir), ["node-id"])

    def test_invalid_persisted(self) -> None:
        config = self.config()
        os.makedirs(config.state_dir)
        path = os.path.join(config.state_dir, "node-id")
        with open(path, "w") as f:
            f.write("bad id\n")
        with self.assertRaises(ConfigError) as raised:
            resolve_node_id(config, "host")
        self.assertEqual(
            str(raised.exception),
            f'{path}: not a valid node id: "bad id"; fix or delete the file',
        )

    def test_cannot_persist(self) -> None:
        """
        A state directory that cannot be written is logged, not fatal.
        """
        blocker = self.mktemp()
        with open(blocker, "w") as f:
            f.write("")
        config = Config(
            state_dir=os.path.join(blocker, "state"), engines=default_engines()
        )
        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        self.assertEqual(resolve_node_id(config, "host"), "host")
        self.assertEqual(len(events), 1)
        self.assertEqual(events[0]["node_id"], "host")
        self.assertEqual(events[0]["log_namespace"], "nvproxy.config")

    def test_from_hostname(self) -> None:
        table = [
            ("gpu-1", "gpu-1"),
            ("GPU_1.example.com", "gpu-1.example.com"),
            ("my host", "my-host"),
            ("-x-", "x"),
            ("ünï", "n"),
            ("", "node"),
            ("...", "node"),
            ("10", "node"),
            ("a" * 80, "a" * 63),
        ]
        for hostname, node_id in table:
            self.assertEqual(
                (hostname, node_id_from_hostname(hostname)), (hostname, node_id)
            )

    @given(st.text(max_size=100))
    def test_from_hostname_always_valid(self, hostname: str) -> None:
        from nvproxy.config import node_id_problem

        self.assertIsNone(node_id_problem(node_id_from_hostname(hostname)))


class OptionsTests(SynchronousTestCase):
    """
    L{Options}, the twistd plugin's command line.
    """

    def test_parse(self) -> None:
        options = Options(env={"NVPROXY_STATE_DIR": "/s", "NVPROXY_DEADLINE": "1m"})
        options.parseOptions(
            ["--response-header-timeout", "0", "--admin", "off", "--control", "stdio"]
        )
        config = options.config
        self.assertEqual(
            (
                config.dispatch.response_header_timeout,
                config.dispatch.policy.deadline,
                config.admin_enabled,
                config.control,
                config.state_dir,
            ),
            (0.0, 60.0, False, "stdio", "/s"),
        )

    def test_every_flag_is_an_option(self) -> None:
        options = Options(env=ENV)
        args = []
        for name in FLAG_NAMES:
            args.extend([f"--{name}", "x"])
        self.assertRaises(usage.UsageError, options.parseOptions, args)
        self.assertEqual(
            sorted(k for k in options if k in FLAG_NAMES), sorted(FLAG_NAMES)
        )

    def test_config_file(self) -> None:
        path = self.mktemp()
        with open(path, "w") as f:
            f.write("[engines.ollama]\nport = 11500\n")
        options = Options(env=ENV)
        options.parseOptions(["-c", path])
        self.assertEqual(options.config.engines["ollama"].facade_port, 11500)

    def test_error_is_usage_error(self) -> None:
        options = Options(env=ENV)
        with self.assertRaises(usage.UsageError) as raised:
            options.parseOptions(["--max-attempts", "x"])
        self.assertEqual(
            str(raised.exception), '--max-attempts: must be an integer >= 1, got "x"'
        )


class WorkloadLogTests(SynchronousTestCase):
    def test_workload_log(self) -> None:
        path = self.mktemp()
        with open(path, "w") as f:
            f.write('[workloads]\nlog = "/var/log/nvproxy/workloads.jsonl"\n')
        config = load_config(path, {}, {"HOME": "/nonexistent"})
        self.assertEqual(config.workload_log, "/var/log/nvproxy/workloads.jsonl")
        self.assertIsNone(load_config(None, {}, {"HOME": "/x"}).workload_log)

    def test_unknown_key(self) -> None:
        path = self.mktemp()
        with open(path, "w") as f:
            f.write("[workloads]\nfile = 'x'\n")
        with self.assertRaises(ConfigError) as caught:
            load_config(path, {}, {"HOME": "/x"})
        self.assertEqual(str(caught.exception), "workloads.file: unknown key")


def _configuration_section() -> str:
    """README.rst's Configuration section, up to the next section."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.rst"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("\nConfiguration\n-------------\n")
    end = re.search(r"\n[^\n]+\n-{3,}\n", text[start + 30 :])
    assert end is not None
    return text[start : start + 30 + end.start()]


def _readme_example() -> str:
    """The README's example configuration file."""
    block = _configuration_section().split(".. code-block:: toml\n", 1)[1]
    lines = []
    for line in block.splitlines()[1:]:
        if line and not line.startswith("    "):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines))


def _flatten(table: Mapping[str, object], prefix: str, declared: set[str]) -> set[str]:
    """
    The keys of a TOML document named as L{reference_keys} names them.
    """
    keys: set[str] = set()
    for name, value in table.items():
        key = f"{prefix}.{name}" if prefix else name
        parts = key.split(".")
        if parts[0] == "engines" and len(parts) > 2:
            generic = ".".join(["engines", "<engine>", *parts[2:]])
            if generic in declared or any(
                k.startswith(generic + ".") for k in declared
            ):
                key = generic
        if key in declared:
            keys.add(key)
        elif isinstance(value, dict):
            keys |= _flatten(value, key, declared)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for entry in value:
                keys |= _flatten(entry, key + "[]", declared)
        else:
            keys.add(key)
    return keys


class SettingsTableTests(LoadTestsMixin):
    """
    The settings table drives the file, the flags, the environment and the
    twistd options.
    """

    FLAG_VALUES: Mapping[str, tuple[str, str]] = {
        # flag -> (its text, the same as a TOML line)
        "node-id": ("gpu-9", 'node_id = "gpu-9"'),
        "state-dir": ("/x", 'state_dir = "/x"'),
        "log-format": ("json", 'log_format = "json"'),
        "log-level": ("warn", 'log_level = "warn"'),
        "listen-interface": ("::", 'listen_interface = "::"'),
        "max-attempts": ("3", "dispatch.max_attempts = 3"),
        "deadline": ("1m", 'dispatch.deadline = "1m"'),
        "dial-timeout": ("2s", 'dispatch.dial_timeout = "2s"'),
        "response-header-timeout": ("0", 'dispatch.response_header_timeout = "0"'),
        "eject-base": ("2s", 'dispatch.eject_base = "2s"'),
        "eject-max": ("1m", 'dispatch.eject_max = "1m"'),
        "cluster-dir": ("/c", 'cluster.dir = "/c"'),
        "control-max-line": ("64KiB", 'control.max_line = "64KiB"'),
        "plaintext-from": (
            "10.0.0.0/8, fd00::/8",
            'access.plaintext_from = ["10.0.0.0/8", "fd00::/8"]',
        ),
        "api-keys-file": ("/k", 'access.api_keys_file = "/k"'),
        "discovery": ("etcd", 'discovery.provider = "etcd"'),
        "etcd-endpoints": (
            "http://10.0.0.1:2379, http://10.0.0.2:2379",
            'discovery.endpoints = ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]',
        ),
        "shutdown-grace": ("5s", 'shutdown.grace = "5s"'),
    }

    def test_flag_env_and_file_agree(self) -> None:
        """
        Every flag with a file key sets the same value as that key, whether
        given as the flag or as its environment variable.
        """
        keyed = {s.flag for s in TOP.settings if s.flag and s.key}
        self.assertEqual(set(self.FLAG_VALUES), keyed)
        home = {"HOME": "/home/u"}
        for flag, (text, line) in self.FLAG_VALUES.items():
            from_file = self.load(line + "\n", env=home)
            self.assertNotEqual(from_file, self.load(env=home), flag)
            self.assertEqual(self.load(flags={flag: text}, env=home), from_file, flag)
            env = dict(home, **{env_name(flag): text})
            self.assertEqual(self.load(env=env), from_file, flag)

    def test_flag_only_settings(self) -> None:
        self.assertEqual(
            {s.flag for s in TOP.settings if s.key is None},
            {"config", "control", "admin"},
        )

    def test_declared_once(self) -> None:
        keys = list(reference_keys())
        self.assertEqual(len(keys), len(set(keys)))
        self.assertEqual(len(FLAG_NAMES), len(set(FLAG_NAMES)))
        self.assertEqual(len({env_name(flag) for flag in FLAG_NAMES}), len(FLAG_NAMES))

    def test_defaults_are_the_values_defaults(self) -> None:
        """
        The defaults the table shows are those of the loaded default config,
        and the dispatch bounds are L{DispatchPolicy}'s own.
        """
        shown = {
            s.name: TOP.default_text(s)
            for s in TOP.settings
            if s.default is None and s.parser is not None
        }
        self.assertEqual(
            shown,
            {
                "log_format": "text",
                "log_level": "info",
                "listen_interface": "127.0.0.1",
                "--control": "none",
                "control.max_line": "1MiB",
                "admin.listen": "127.0.0.1:8010",
                "admin.enabled": "true",
                "dispatch.max_attempts": "5",
                "dispatch.deadline": "10m",
                "dispatch.dial_timeout": "10s",
                "dispatch.response_header_timeout": "30m",
                "dispatch.backoff": "500ms, 1s, 2s, 4s",
                "dispatch.eject_base": "1s",
                "dispatch.eject_max": "30s",
                "dispatch.stream_idle_timeout": "0s",
                "discovery.poll_interval": "2s",
                "discovery.provider": "mesh",
                "discovery.endpoints": "http://127.0.0.1:2379",
                "discovery.prefix": "/nvproxy/",
                "discovery.lease_ttl": "10s",
                "discovery.trust": "pinned",
                "discovery.tls.cert": "none",
                "discovery.tls.key": "none",
                "discovery.tls.ca": "none",
                "limits.max_body": "64MiB",
                "limits.max_connections": "4096",
                "limits.header_timeout": "30s",
                "limits.idle_timeout": "1m",
                "limits.max_request_line": "8KiB",
                "limits.max_header_bytes": "64KiB",
                "limits.max_header_count": "100",
                "workloads.log": "none",
                "access.plaintext_from": "127.0.0.0/8, ::1/128",
                "access.require_key_on_loopback": "false",
                "access.max_concurrent_per_key": "0",
                "shutdown.grace": "30s",
                "log.access": "true",
            },
        )
        self.assertEqual(self.load().dispatch.policy, DispatchPolicy())

    def test_options_from_table(self) -> None:
        """
        Every flag is a twistd option with its help, and no default (so a
        flag not given falls through to the environment and the file).
        """
        options = {row[0]: row for row in Options.optParameters}
        self.assertEqual(list(options), list(FLAG_NAMES))
        for setting in TOP.settings:
            if setting.flag:
                long, short, default, help = options[setting.flag]
                self.assertEqual((short, default), (setting.short, None))
                self.assertIn(setting.help, help)
                self.assertIn(TOP.default_text(setting), help)

    def test_options_help(self) -> None:
        text = str(Options(env=ENV))
        for flag in FLAG_NAMES:
            self.assertIn(f"--{flag}=", text)
        self.assertIn("[dispatch.max_attempts; default: 5]", text)


class ReadmeTests(LoadTestsMixin):
    """
    README.rst's configuration reference and the settings table agree.
    """

    def test_flags_reference_is_generated(self) -> None:
        """
        The flag list in the README is L{flags_reference}'s.
        """
        section = _configuration_section()
        start = section.index("\n.. flags: generated by")
        start = section.index("\n\n", start) + 2
        end = section.index("\n.. end of flags\n")
        self.assertEqual(
            section[start:end],
            flags_reference(),
            "README.rst is out of date: replace its flag list with the output of"
            " python -c 'import nvproxy.config as c; print(c.flags_reference())'",
        )

    def test_names_in_reference_are_flags(self) -> None:
        section = _configuration_section()
        flags = set(re.findall(r"--([a-z][a-z-]*)", section))
        self.assertEqual(flags, set(FLAG_NAMES))
        variables = set(re.findall(r"NVPROXY_[A-Z_]+", section))
        self.assertEqual(variables, {env_name(flag) for flag in FLAG_NAMES})

    def test_example_has_every_key(self) -> None:
        """
        Every TOML key of the README's example is in the table, and every key
        of the table is in the example.
        """
        declared = set(reference_keys())
        example = tomllib.loads(_readme_example())
        self.assertEqual(_flatten(example, "", declared), declared)

    def test_example_loads(self) -> None:
        config = load_config(self.write(_readme_example()), {}, ENV)
        self.assertEqual(config.engines["vllm"].services[0].name, "text")
        self.assertEqual(config.workload_log, "/var/log/nvproxy/workloads.jsonl")


class EtcdDiscoveryConfigTests(LoadTestsMixin):
    """C{[discovery] provider = "etcd"} and its keys."""

    def test_etcd(self) -> None:
        config = self.load(
            "[discovery]\nprovider = 'etcd'\nendpoints = ['http://10.0.0.1:2379']\n"
            "prefix = '/fleet/'\nlease_ttl = '6s'\nadvertise_address = '10.0.0.7'\n"
            "trust = 'etcd'\n[discovery.tls]\ncert = '/c.pem'\nkey = '/k.pem'\n"
            "ca = '/ca.pem'\n"
        )
        self.assertEqual(config.discovery_provider, "etcd")
        self.assertEqual(
            config.etcd,
            EtcdConfig(
                ("http://10.0.0.1:2379",),
                "/fleet/",
                6.0,
                "etcd",
                "/c.pem",
                "/k.pem",
                "/ca.pem",
            ),
        )
        self.assertEqual(config.advertise_address, "10.0.0.7")

    def test_errors(self) -> None:
        with self.assertRaises(ConfigErrors) as raised:
            self.load(
                "[discovery]\nprovider = 'etcd'\nprefix = 'fleet'\ntrust = 'x'\n"
                "endpoints = ['http://a:1', 'http://a:1']\n"
                "tls = { cert = '/c.pem' }\n[cluster]\ndir = '/c'\n"
            )
        self.assertEqual(
            [str(e) for e in raised.exception.errors],
            [
                'discovery.endpoints[1]: duplicate endpoint "http://a:1"',
                'discovery.prefix: must start and end with /, got "fleet"',
                'discovery.trust: must be "pinned" or "etcd", got "x"',
                "discovery.advertise_address: required with discovery.provider ="
                ' "etcd" and a cluster dir: peers dial this node there',
                "discovery.tls.key: discovery.tls.cert and discovery.tls.key go"
                " together",
            ],
        )


class EveryErrorTests(LoadTestsMixin):
    """
    An invalid configuration reports every problem, one line each, naming
    the key.
    """

    def errors(
        self,
        text: str | None,
        flags: Mapping[str, str | None] | None = None,
        env: Mapping[str, str] = ENV,
    ) -> list[str]:
        with self.assertRaises(ConfigErrors) as raised:
            self.load(text, flags, env)
        lines = [str(error) for error in raised.exception.errors]
        self.assertEqual(str(raised.exception), "\n".join(lines))
        for line in lines:
            self.assertNotIn("\n", line)
        return lines

    def test_every_setting(self) -> None:
        lines = self.errors(
            "node_id = 3\n"
            "colour = 'red'\n"
            "[dispatch]\nmax_attempts = 0\ndeadline = 'soon'\n"
            "[limits]\nmax_body = 0\n"
            "[engines.ollama]\nport = 70000\nprot = 1\n"
            "[engines.lmstudio]\nhold = {}\n",
            flags={"dial-timeout": "0"},
            env=dict(ENV, NVPROXY_LOG_FORMAT="xml"),
        )
        self.assertEqual(
            lines,
            [
                "colour: unknown key",
                "node_id: must be a string, got 3",
                'NVPROXY_LOG_FORMAT: must be "text" or "json", got "xml"',
                "dispatch.max_attempts: must be an integer >= 1, got 0",
                'dispatch.deadline: must be a duration such as "250ms", "10s",'
                ' "15m", "3h" or a number of seconds, got "soon"',
                '--dial-timeout: must be greater than 0, got "0"',
                "limits.max_body: must be at least 1 byte, got 0",
                "engines.ollama.prot: unknown key",
                "engines.ollama.port: must be 0 (standalone default) or 1..65535,"
                " got 70000",
                "engines.lmstudio.hold: only valid for vllm",
            ],
        )

    def test_file_and_flags(self) -> None:
        """
        An unreadable file does not hide the flags' problems.
        """
        missing = self.mktemp()
        lines = self.errors(None, flags={"config": missing, "max-attempts": "x"})
        self.assertEqual(
            lines,
            [
                f"config file {missing}: cannot read: No such file or directory",
                '--max-attempts: must be an integer >= 1, got "x"',
            ],
        )

    def test_one_line_per_entry(self) -> None:
        """
        Each entry of an array of tables is reported by its first problem.
        """
        lines = self.errors(
            "[[nodes]]\nengines = {}\n"
            "[[nodes]]\nid = 'ok'\nengines = { ollama = 'http://a' }\n"
            "[[nodes]]\nid = 'x/y'\nurl = 1\n"
            "[[engines.vllm.services]]\nname = 'a'\nurl = 'http://h'\nmodel = 'm'\n"
            "[[engines.vllm.services]]\nname = 'a'\nurl = 'ftp://h'\nmodel = 'n'\n"
        )
        self.assertEqual(
            lines,
            [
                "engines.vllm.services[1].url: must be an http:// or https:// URL"
                ' with a host, got "ftp://h"',
                "nodes[0].id: is required",
                "nodes[2].url: unknown key",
            ],
        )

    def test_checks_across_settings_skip_bad_values(self) -> None:
        """
        A check over several settings runs only when each of them is fine:
        a bad port is not also "the facade's own port", a bad ejection bound
        is not also compared with the other.
        """
        self.assertEqual(
            self.errors(
                "[engines.ollama]\nport = 'x'\nbackend = 'http://127.0.0.1:11435'\n"
                "[dispatch]\neject_base = '1m'\neject_max = '0'\n"
            ),
            [
                'dispatch.eject_max: must be greater than 0, got "0"',
                "engines.ollama.port: must be 0 (standalone default) or 1..65535,"
                ' got "x"',
            ],
        )

    def test_single(self) -> None:
        with self.assertRaises(ConfigErrors) as raised:
            self.load("[dispatch]\nmax_attempts = 0\n")
        error = raised.exception
        self.assertEqual(
            (error.key, error.problem, len(error.errors)),
            ("dispatch.max_attempts", "must be an integer >= 1, got 0", 1),
        )
        self.assertIsInstance(error, ConfigError)

    def test_several_is_config_error(self) -> None:
        error = ConfigErrors([ConfigError("a", "x"), ConfigError(None, "y")])
        self.assertIsInstance(error, ConfigError)
        self.assertEqual(str(error), "a: x\ny")
        self.assertEqual(str(ConfigErrors([error])), "a: x\ny")
        self.assertRaises(ValueError, ConfigErrors, [])


_WORDS = sorted(
    {part for key in reference_keys() for part in re.split(r"[.\[\]]+", key) if part}
    | set(ENGINES)
    | {"engines", "nodes", "services", "hold", "prot"}
)
_SCALARS = (
    st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats()
    | st.booleans()
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "10s",
            "0",
            "-1s",
            "64MiB",
            "http://127.0.0.1:8000",
            "http://h:0",
            "127.0.0.1:8010",
            "[::1]:1",
            "off",
            "stdio",
            "json",
            "DEBUG",
            "/v1/completions",
            "multipart:/x",
            "text",
        ]
    )
)
_KEYS = st.sampled_from(_WORDS) | st.text(min_size=1, max_size=4)
_VALUES = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(_KEYS, children, max_size=4)
    ),
    max_leaves=12,
)


def _toml(value: object) -> str:
    """A value as TOML, with inline tables and arrays."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml, value)) + "]"
    assert isinstance(value, dict)
    return (
        "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    )


class RandomDocumentTests(LoadTestsMixin):
    @given(
        st.dictionaries(_KEYS, _VALUES, max_size=6),
        st.dictionaries(st.sampled_from(FLAG_NAMES), st.text(max_size=8)),
    )
    def test_only_config_errors(
        self, document: dict[str, object], flags: dict[str, str]
    ) -> None:
        """
        Any document and any flags either load or fail with config errors,
        one line each.
        """
        flags.pop("config", None)
        text = "".join(f"{json.dumps(k)} = {_toml(v)}\n" for k, v in document.items())
        try:
            self.load(text, flags=flags)
        except ConfigErrors as e:
            for error in e.errors:
                self.assertTrue(str(error))
                self.assertNotIn("\n", str(error))


class TwistdOptionsTests(SynchronousTestCase):
    """
    L{Options} parsed by twistd (with a parent): problems are lines on
    stderr and exit status 2, not twistd's whole usage text.
    """

    def parse(self, argv: list[str], env: Mapping[str, str] = ENV) -> str:
        err = StringIO()
        self.patch(sys, "stderr", err)
        options = Options(env=env)
        options.parent = {"logger": "already.chosen"}
        with self.assertRaises(SystemExit) as raised:
            options.parseOptions(argv)
        self.assertEqual(raised.exception.code, 2)
        return err.getvalue()

    def test_bad_flag(self) -> None:
        self.assertEqual(
            self.parse(["--no-such-flag"]),
            "nvproxy: option --no-such-flag not recognized"
            " (see twistd nvproxy --help)\n",
        )

    def test_every_problem(self) -> None:
        env = dict(ENV, NVPROXY_EJECT_MAX="0")
        self.assertEqual(
            self.parse(["--max-attempts", "x", "--admin", "10.0.0.1:1"], env),
            "nvproxy: --admin: must be a loopback address\n"
            'nvproxy: --max-attempts: must be an integer >= 1, got "x"\n'
            'nvproxy: NVPROXY_EJECT_MAX: must be greater than 0, got "0"\n',
        )

    def test_without_parent(self) -> None:
        """
        Outside twistd the problems are one L{usage.UsageError}, a line each.
        """
        options = Options(env=ENV)
        with self.assertRaises(usage.UsageError) as raised:
            options.parseOptions(["--deadline", "0", "--control", "tcp"])
        self.assertEqual(
            str(raised.exception).splitlines(),
            [
                '--control: must be "stdio", got "tcp"',
                '--deadline: must be greater than 0, got "0"',
            ],
        )

    def test_logger_kept(self) -> None:
        """
        A log observer twistd was told to use is not replaced.
        """
        options = Options(env=ENV)
        parent = {"logger": "already.chosen"}
        options.parent = parent
        options.parseOptions(["--log-format", "json"])
        self.assertEqual(parent, {"logger": "already.chosen"})
