"""
Tests for L{nvproxy.logs}: the level filter in front of the log output, set
from C{--log-level} / C{NVPROXY_LOG_LEVEL} / C{log_level} at start and
changed at runtime by the broker's C{log/set-level}.
"""

from __future__ import annotations

import io
import json
import sys

from attrs import evolve
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import ILogObserver, Logger, LogLevel, globalLogPublisher
from twisted.python.reflect import namedAny
from twisted.trial.unittest import SynchronousTestCase

from nvproxy import logs
from nvproxy.config import ConfigError, Options, load_config
from nvproxy.logs import (
    LEVELS,
    configure_twistd,
    current_level,
    level_filtered,
    set_level,
    text_observer,
)
from nvproxy.service import build
from nvproxy.testing.harness import proxy_config


class _LevelTestCase(SynchronousTestCase):
    """
    Leaves the process-wide level, and twistd's settings, as it found them.
    """

    def setUp(self) -> None:
        self.addCleanup(set_level, current_level())
        settings = dict(logs._twistd_settings)
        self.addCleanup(logs._twistd_settings.update, settings)

    def emit_all(self, observer: ILogObserver) -> None:
        """One event per level, in namespace C{nvproxy.test}."""
        log = Logger(namespace="nvproxy.test", observer=observer)
        for name in LEVELS:
            getattr(log, name)("event at {name}", name=name)


class _CountingFile(io.StringIO):
    flushes = 0
    writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


class BatchTests(SynchronousTestCase):
    """
    L{logs.batched}: lines written inside it are written and flushed once
    per file, at its end (one system call, even on an unbuffered file).
    """

    def test_flushed_per_event_outside(self) -> None:
        out = _CountingFile()
        log = Logger(namespace="nvproxy.test", observer=text_observer(out))
        log.info("one")
        log.info("two")
        self.assertEqual(out.flushes, 2)

    def test_flushed_once_inside(self) -> None:
        out, other = _CountingFile(), _CountingFile()
        log = Logger(namespace="nvproxy.test", observer=text_observer(out))
        log2 = Logger(namespace="nvproxy.test", observer=text_observer(other))
        with logs.batched():
            log.info("one")
            log.info("two")
            log2.info("three")
            with logs.batched():
                log.info("four")
            self.assertEqual((out.flushes, other.flushes), (0, 0))
        self.assertEqual((out.flushes, other.flushes), (1, 1))
        self.assertEqual((out.writes, other.writes), (1, 1))
        lines = out.getvalue().splitlines()
        self.assertEqual(
            [line.rsplit(" ", 1)[-1] for line in lines], ["one", "two", "four"]
        )
        log.info("five")
        self.assertEqual(out.flushes, 2)

    def test_unwritable_file_keeps_no_other_back(self) -> None:
        class Broken(_CountingFile):
            def write(self, text: str) -> int:
                raise OSError("disk full")

        broken, out = Broken(), _CountingFile()
        bad = Logger(namespace="nvproxy.test", observer=text_observer(broken))
        log = Logger(namespace="nvproxy.test", observer=text_observer(out))
        with logs.batched():
            bad.info("lost")
            log.info("kept")
        self.assertEqual(out.getvalue().rsplit(" ", 1)[-1], "kept\n")
        self.assertIsNone(logs._batch)

    def test_flushed_when_the_body_fails(self) -> None:
        out = _CountingFile()
        log = Logger(namespace="nvproxy.test", observer=text_observer(out))

        def body() -> None:
            with logs.batched():
                log.info("one")
                raise ZeroDivisionError

        self.assertRaises(ZeroDivisionError, body)
        self.assertEqual(out.flushes, 1)
        self.assertIsNone(logs._batch)


class LevelFilterTests(_LevelTestCase):
    def written(self, out: io.StringIO) -> list[str]:
        lines = out.getvalue().splitlines()
        out.seek(0)
        out.truncate()
        return [line.rsplit(" ", 1)[-1] for line in lines]

    def test_set_level_at_runtime(self) -> None:
        """
        A running observer follows L{set_level}: debug appears once the
        level is debug and disappears again above it.
        """
        set_level("info")
        out = io.StringIO()
        observer = level_filtered(text_observer(out))
        self.emit_all(observer)
        self.assertEqual(self.written(out), ["info", "warn", "error", "critical"])
        set_level("debug")
        self.emit_all(observer)
        self.assertEqual(self.written(out), list(LEVELS))
        set_level("error")
        self.emit_all(observer)
        self.assertEqual(self.written(out), ["error", "critical"])
        self.assertEqual(current_level(), "error")

    def test_events_without_level_or_namespace_dropped(self) -> None:
        """As Twisted's level predicate does: no level, or no namespace."""
        set_level("debug")
        out = io.StringIO()
        observer = level_filtered(text_observer(out))
        observer({"log_format": "no level", "log_namespace": "x", "log_time": 0.0})
        observer({"log_format": "no namespace", "log_level": LogLevel.error})
        observer(
            {
                "log_format": "shown",
                "log_namespace": "x",
                "log_level": LogLevel.error,
                "log_time": 0.0,
            }
        )
        self.assertEqual(self.written(out), ["shown"])

    def test_port_chatter_dropped(self) -> None:
        out = io.StringIO()
        observer = level_filtered(text_observer(out))
        for text in ("Site starting on 8080", "(TCP Port 8080 Closed)", "kept"):
            observer(
                {
                    "log_namespace": "log_legacy",
                    "log_level": LogLevel.info,
                    "log_text": text,
                    "log_format": "{log_text}",
                    "log_time": 0.0,
                }
            )
        self.assertEqual(self.written(out), ["kept"])

    def test_unknown_level(self) -> None:
        set_level("warn")
        self.assertRaises(ValueError, set_level, "verbose")
        self.assertEqual(current_level(), "warn")

    def test_twistd_observer(self) -> None:
        """
        The observer twistd is told to load writes at the configured level.
        """
        out = io.StringIO()
        self.patch(sys, "stdout", out)
        name = configure_twistd("json", "debug", None, nodaemon=True)
        observer = namedAny(name)()
        self.emit_all(observer)
        records = [json.loads(line) for line in out.getvalue().splitlines()]
        self.assertEqual([r["level"] for r in records], list(LEVELS))
        self.assertEqual(records[0]["namespace"], "nvproxy.test")
        out.seek(0)
        out.truncate()
        set_level("warn")
        self.emit_all(observer)
        records = [json.loads(line) for line in out.getvalue().splitlines()]
        self.assertEqual([r["level"] for r in records], ["warn", "error", "critical"])


class LogLevelSettingTests(_LevelTestCase):
    """
    C{--log-level}, C{NVPROXY_LOG_LEVEL} and the C{log_level} key.
    """

    def load(
        self,
        document: str = "",
        flags: dict[str, str | None] | None = None,
        env: dict[str, str] | None = None,
    ) -> str:
        path = None
        if document:
            path = self.mktemp()
            with open(path, "w") as f:
                f.write(document)
        config = load_config(path, flags or {}, {"HOME": "/home/u", **(env or {})})
        return config.log_level

    def test_precedence(self) -> None:
        """
        Flag over variable over file over the default, any case.
        """
        self.assertEqual(self.load(), "info")
        self.assertEqual(self.load('log_level = "warn"\n'), "warn")
        env = {"NVPROXY_LOG_LEVEL": "DEBUG"}
        self.assertEqual(self.load('log_level = "warn"\n', env=env), "debug")
        flags = {"log-level": "error"}
        self.assertEqual(
            self.load('log_level = "warn"\n', env=env, flags=flags), "error"
        )

    def test_bad_level(self) -> None:
        choices = '"debug" or "info" or "warn" or "error" or "critical"'
        with self.assertRaises(ConfigError) as raised:
            self.load(flags={"log-level": "verbose"})
        self.assertEqual(
            str(raised.exception), f'--log-level: must be {choices}, got "verbose"'
        )
        with self.assertRaises(ConfigError) as raised:
            self.load(env={"NVPROXY_LOG_LEVEL": "loud"})
        self.assertEqual(
            str(raised.exception), f'NVPROXY_LOG_LEVEL: must be {choices}, got "loud"'
        )
        with self.assertRaises(ConfigError) as raised:
            self.load("log_level = 3\n")
        self.assertEqual(str(raised.exception), f"log_level: must be {choices}, got 3")

    def parse(self, argv: list[str], env: dict[str, str]) -> dict[str, object]:
        """
        Parse twistd plugin options as twistd does and return the parent's
        options, which name the log observer.
        """
        options = Options(env={"HOME": self.mktemp(), **env})
        parent: dict[str, object] = {"logger": None, "logfile": "-", "nodaemon": True}
        options.parent = parent
        options.parseOptions(argv)
        return parent

    def test_flag_and_env_reach_the_observer(self) -> None:
        """
        C{--log-level} and C{NVPROXY_LOG_LEVEL} choose the level of the
        observer twistd starts logging to.
        """
        for argv, env in [
            (["--log-level", "debug"], {}),
            ([], {"NVPROXY_LOG_LEVEL": "debug"}),
        ]:
            set_level("info")
            parent = self.parse(argv, env)
            out = io.StringIO()
            self.patch(sys, "stdout", out)
            observer = namedAny(str(parent["logger"]))()
            Logger(namespace="nvproxy.test", observer=observer).debug("shown")
            self.assertIn("shown", out.getvalue(), (argv, env))
            self.assertEqual(current_level(), "debug")


class BrokerSetLevelTests(_LevelTestCase):
    def test_broker_set_level(self) -> None:
        """
        The broker's C{log/set-level}, sent to a real nvproxy's link, changes
        what the running log output shows.
        """
        set_level("info")
        config = evolve(proxy_config(self.mktemp(), {}), control="stdio")
        proxy = build(config, MemoryReactorClock(), hostname="local")
        link = proxy.link
        assert link is not None
        transport = StringTransport()
        link.makeConnection(transport)
        out = io.StringIO()
        observer = level_filtered(text_observer(out))
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        log = Logger(namespace="nvproxy.test")

        def set_via_broker(level: str) -> object:
            transport.clear()
            request = {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "log/set-level",
                "params": {"level": level},
            }
            link.dataReceived(json.dumps(request).encode() + b"\n")
            return json.loads(transport.value())

        log.debug("before")
        self.assertEqual(set_via_broker("debug")["result"], {"level": "debug"})
        log.debug("while debug")
        self.assertEqual(set_via_broker("info")["result"], {"level": "info"})
        log.debug("after")
        shown = out.getvalue()
        self.assertNotIn("before", shown)
        self.assertIn("while debug", shown)
        self.assertNotIn("after", shown)
        error = set_via_broker("verbose")
        self.assertEqual(error["error"]["code"], -32602)
        self.assertEqual(current_level(), "info")


class TextLineTests(SynchronousTestCase):
    def test_same_as_twisted(self) -> None:
        """
        The text observer's line is Twisted's C{formatEventAsClassicLogText}
        for plain events, calls in formats, failures, a system, a format that
        does not apply, and an empty one.
        """
        from twisted.logger import LogLevel, formatEventAsClassicLogText
        from twisted.python.failure import Failure

        failure = Failure(ZeroDivisionError("division by zero"))
        base = {"log_time": 1796169064.25, "log_namespace": "ns"}
        events: list[dict[str, object]] = [
            {"log_format": "a {a} {b!r}\nnext", "a": 1, "b": "x"},
            {"log_format": "call {f()}", "f": lambda: 3},
            {"log_format": "missing {x}", "log_level": LogLevel.warn},
            {"log_format": ""},
            {"log_format": "system", "log_system": "-"},
            {"log_format": "failed", "log_failure": failure},
            {"log_format": None, "log_text": "legacy"},
        ]
        for event in events:
            event = {**base, "log_level": LogLevel.info, **event}
            self.assertEqual(
                logs.event_as_text_line(dict(event)),
                formatEventAsClassicLogText(dict(event)),
                event,
            )

    def test_debug_built_only_when_shown(self) -> None:
        """
        L{logs.Logger} makes no debug event while the output is above debug,
        and makes it once debug is shown; other levels are untouched.
        """
        seen: list[str] = []
        log = logs.Logger(observer=lambda event: seen.append(event["log_format"]))
        self.addCleanup(set_level, current_level())
        set_level("info")
        log.debug("hidden")
        log.info("shown")
        set_level("debug")
        log.debug("detail")
        self.assertEqual(seen, ["shown", "detail"])

    def test_emit_same_event_as_twisted(self) -> None:
        """
        L{logs.Logger} makes the event Twisted's makes at each level (its
        C{info} and C{debug} complete the call's own dict of fields), and an
        invalid level still gets Twisted's complaint.
        """
        import twisted.logger

        self.addCleanup(set_level, current_level())
        set_level("debug")
        ours: list[dict[str, object]] = []
        theirs: list[dict[str, object]] = []
        for level in ("debug", "info", "warn", "error"):
            for made, Made in ((ours, logs.Logger), (theirs, twisted.logger.Logger)):
                log = Made(namespace="n", observer=made.append)
                getattr(log, level)("x {a} {b}", a=1, b=level)
        self.assertEqual(
            [(event["log_level"], event["b"]) for event in ours],
            [
                (getattr(LogLevel, level), level)
                for level in ("debug", "info", "warn", "error")
            ],
        )
        for event in ours + theirs:
            self.assertIsInstance(event.pop("log_time"), float)
            event.pop("log_logger")
        self.assertEqual(ours, theirs)
        complaints: list[dict[str, object]] = []
        logs.Logger(observer=complaints.append).emit("loud")  # type: ignore[arg-type]
        self.assertIn("invalid log level", str(complaints[0]["log_format"]))
