"""
Tests for L{nvproxy.ports}.
"""

from __future__ import annotations

import json
import os

from attrs import evolve
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.testing import (
    EventLoggingObserver,
    MemoryReactorClock,
    StringTransport,
)
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.admin import AdminError
from nvproxy.config import EngineConfig
from nvproxy.engines import ENGINES
from nvproxy.ports import (
    PortStore,
    SelectionStore,
    atomic_write,
    effective_port,
    valid_port,
)
from nvproxy.service import NvProxy, build
from nvproxy.testing.harness import proxy_config


class PortStoreTests(SynchronousTestCase):
    """
    L{PortStore} persists one facade port per engine.
    """

    def setUp(self) -> None:
        self.state_dir = os.path.join(self.mktemp(), "state")
        self.store = PortStore(self.state_dir)

    def write(self, engine_id: str, data: bytes) -> str:
        os.makedirs(self.state_dir, exist_ok=True)
        path = os.path.join(self.state_dir, ENGINES[engine_id].port_file)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def test_file_names(self) -> None:
        self.assertEqual(
            {
                engine_id: os.path.basename(self.store.path(engine_id))
                for engine_id in ENGINES
            },
            {
                "ollama": "proxy-port.json",
                "lmstudio": "lmstudio-proxy-port.json",
                "llamacpp": "llamacpp-proxy-port.json",
                "vllm": "vllm-proxy-port.json",
            },
        )

    def test_nothing_persisted(self) -> None:
        """
        A missing state directory or file means no persisted port.
        """
        for engine_id in ENGINES:
            self.assertIsNone(self.store.get(engine_id))

    def test_set_and_get(self) -> None:
        self.store.set("ollama", 11500)
        self.store.set("vllm", 9000)
        self.assertEqual(self.store.get("ollama"), 11500)
        self.assertEqual(self.store.get("vllm"), 9000)
        self.assertIsNone(self.store.get("lmstudio"))
        with open(os.path.join(self.state_dir, "proxy-port.json"), "rb") as f:
            self.assertEqual(json.loads(f.read()), {"port": 11500})

    def test_restored_by_new_store(self) -> None:
        """
        A port survives the store: a new process reading the same directory
        finds it.
        """
        self.store.set("llamacpp", 8090)
        self.assertEqual(PortStore(self.state_dir).get("llamacpp"), 8090)

    def test_overwrite(self) -> None:
        self.store.set("lmstudio", 1300)
        self.store.set("lmstudio", 1301)
        self.assertEqual(self.store.get("lmstudio"), 1301)

    def test_no_temporary_file_left(self) -> None:
        self.store.set("ollama", 11500)
        self.store.set("ollama", 11501)
        self.store.set("vllm", 9000)
        self.assertEqual(
            sorted(os.listdir(self.state_dir)),
            ["proxy-port.json", "vllm-proxy-port.json"],
        )

    def test_failed_write_keeps_old_file(self) -> None:
        """
        When the final rename fails, the old port stays and the temporary file
        is removed.
        """
        self.store.set("ollama", 11500)

        def failingReplace(source: str, destination: str) -> None:
            raise OSError(28, "No space left on device")

        self.patch(os, "replace", failingReplace)
        self.assertRaises(OSError, self.store.set, "ollama", 11600)
        self.assertEqual(os.listdir(self.state_dir), ["proxy-port.json"])
        self.assertEqual(self.store.get("ollama"), 11500)

    def test_clear(self) -> None:
        self.store.set("ollama", 11500)
        self.store.clear("ollama")
        self.assertIsNone(self.store.get("ollama"))
        self.assertEqual(os.listdir(self.state_dir), [])
        self.store.clear("ollama")
        PortStore(os.path.join(self.state_dir, "missing")).clear("vllm")

    def test_set_rejects_bad_ports(self) -> None:
        for port in (0, -1, 65536, True, 8000.0, "8000"):
            with self.assertRaises(ValueError) as raised:
                self.store.set("ollama", port)  # type: ignore[arg-type]
            self.assertEqual(
                str(raised.exception), f"port must be 1..65535, got {port!r}"
            )
        self.assertFalse(os.path.exists(self.state_dir))

    def test_unknown_engine(self) -> None:
        for call in (self.store.get, self.store.clear):
            self.assertRaises(ValueError, call, "gpt")
        self.assertRaises(ValueError, self.store.set, "gpt", 1)

    def test_corrupt_files_ignored(self) -> None:
        """
        A file that does not hold C{{"port": 1..65535}} is ignored with one
        warning naming the engine and the file.
        """
        table = [
            b"",
            b"{",
            b"\xff\xfe",
            b"[]",
            b'"8000"',
            b"{}",
            b'{"port": "8000"}',
            b'{"port": 0}',
            b'{"port": 70000}',
            b'{"port": true}',
            b'{"port": 80.0}',
        ]
        for data in table:
            path = self.write("vllm", data)
            events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
            self.assertEqual((data, self.store.get("vllm")), (data, None))
            self.assertEqual(len(events), 1, data)
            event = events[0]
            self.assertEqual(
                (event["log_level"], event["engine"], event["path"]),
                (LogLevel.warn, "vllm", path),
            )

    def test_unreadable_file_ignored(self) -> None:
        """
        A port file that cannot be read (here: a directory) is ignored.
        """
        os.makedirs(os.path.join(self.state_dir, "proxy-port.json"))
        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        self.assertIsNone(self.store.get("ollama"))
        self.assertEqual(len(events), 1)
        self.assertEqual(events[0]["problem"], "cannot read: Is a directory")

    def test_extra_fields_tolerated(self) -> None:
        self.write("ollama", b'{"port": 11500, "engine": "ollama"}')
        self.assertEqual(self.store.get("ollama"), 11500)

    @given(st.integers(min_value=1, max_value=65535))
    def test_round_trip(self, port: int) -> None:
        self.store.set("lmstudio", port)
        self.assertEqual(self.store.get("lmstudio"), port)


class AtomicWriteTests(SynchronousTestCase):
    """
    L{atomic_write}.
    """

    def test_creates_directories(self) -> None:
        path = os.path.join(self.mktemp(), "a", "b", "file")
        atomic_write(path, b"data")
        with open(path, "rb") as f:
            self.assertEqual(f.read(), b"data")
        self.assertEqual(os.listdir(os.path.dirname(path)), ["file"])

    def test_failed_write_leaves_nothing(self) -> None:
        directory = self.mktemp()
        os.makedirs(directory)

        def failingFsync(fd: int) -> None:
            raise OSError(5, "Input/output error")

        self.patch(os, "fsync", failingFsync)
        self.assertRaises(OSError, atomic_write, os.path.join(directory, "f"), b"x")
        self.assertEqual(os.listdir(directory), [])


class EffectivePortTests(SynchronousTestCase):
    """
    L{effective_port}: persisted, else configured, else standalone default.
    """

    def setUp(self) -> None:
        self.store = PortStore(self.mktemp())

    def engine(self, engine_id: str, port: int = 0) -> EngineConfig:
        return EngineConfig(engine_id, "http://127.0.0.1:1", port=port)

    def test_standalone_default(self) -> None:
        self.assertEqual(
            {
                engine_id: effective_port(self.engine(engine_id), self.store)
                for engine_id in ENGINES
            },
            {"ollama": 11435, "lmstudio": 1234, "llamacpp": 8080, "vllm": 8000},
        )

    def test_configured(self) -> None:
        self.assertEqual(
            effective_port(self.engine("ollama", 11600), self.store), 11600
        )

    def test_persisted_wins(self) -> None:
        self.store.set("ollama", 11700)
        self.assertEqual(
            effective_port(self.engine("ollama", 11600), self.store), 11700
        )
        self.assertEqual(effective_port(self.engine("ollama"), self.store), 11700)
        self.assertEqual(effective_port(self.engine("vllm"), self.store), 8000)

    def test_ignore_persisted(self) -> None:
        self.store.set("ollama", 11700)
        self.assertEqual(
            effective_port(
                self.engine("ollama", 11600), self.store, ignore_persisted=True
            ),
            11600,
        )
        self.assertEqual(
            effective_port(self.engine("ollama"), self.store, ignore_persisted=True),
            11435,
        )

    def test_corrupt_persisted_falls_back(self) -> None:
        os.makedirs(self.store.state_dir)
        with open(self.store.path("lmstudio"), "w") as f:
            f.write("not json")
        EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        self.assertEqual(
            effective_port(self.engine("lmstudio", 1300), self.store), 1300
        )

    def test_cleared(self) -> None:
        self.store.set("llamacpp", 8090)
        self.store.clear("llamacpp")
        self.assertEqual(effective_port(self.engine("llamacpp"), self.store), 8080)


class ValidPortTests(SynchronousTestCase):
    def test_valid_port(self) -> None:
        self.assertEqual(
            [valid_port(p) for p in (1, 65535, 0, 65536, -1, True, 1.0, "1", None)],
            [True, True, False, False, False, False, False, False, False],
        )


class SelectionStoreTests(SynchronousTestCase):
    """
    L{SelectionStore} persists every engine's selected node in one file.
    """

    def setUp(self) -> None:
        self.state_dir = os.path.join(self.mktemp(), "state")
        self.store = SelectionStore(self.state_dir)

    def write(self, data: bytes) -> None:
        os.makedirs(self.state_dir, exist_ok=True)
        with open(self.store.path, "wb") as f:
            f.write(data)

    def test_nothing_persisted(self) -> None:
        self.assertEqual(self.store.load(), {})

    def test_save_and_load(self) -> None:
        self.store.save({"vllm": "gpu-3", "ollama": "gpu-2"})
        self.assertEqual(os.path.basename(self.store.path), "selected-nodes.json")
        with open(self.store.path, "rb") as f:
            self.assertEqual(
                json.loads(f.read()), {"selected": {"ollama": "gpu-2", "vllm": "gpu-3"}}
            )
        restored = SelectionStore(self.state_dir).load()
        self.assertEqual(restored, {"ollama": "gpu-2", "vllm": "gpu-3"})

    def test_none_left_removes_file(self) -> None:
        self.store.save({"ollama": "gpu-2"})
        self.store.save({})
        self.assertFalse(os.path.exists(self.store.path))
        self.store.save({})  # nothing to remove is fine
        self.assertEqual(self.store.load(), {})

    def test_corrupt_files_ignored(self) -> None:
        """
        An unreadable document is ignored as a whole, a bad entry alone;
        each with a warning.
        """
        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        for data in (b"not json", b"[]", b'{"selected": ["ollama"]}', b"{}"):
            self.write(data)
            self.assertEqual(self.store.load(), {}, data)
        self.write(
            json.dumps(
                {
                    "selected": {
                        "ollama": "gpu-2",
                        "nope": "x",
                        "vllm": "",
                        "lmstudio": 3,
                    }
                }
            ).encode()
        )
        self.assertEqual(self.store.load(), {"ollama": "gpu-2"})
        self.assertEqual(len(events), 7)
        self.assertTrue(all(e["log_level"] is LogLevel.warn for e in events))

    def test_failed_write_keeps_old_file(self) -> None:
        self.store.save({"ollama": "gpu-2"})

        def failingReplace(source: str, destination: str) -> None:
            raise OSError(28, "No space left on device")

        self.patch(os, "replace", failingReplace)
        self.assertRaises(OSError, self.store.save, {"ollama": "gpu-9"})
        self.assertEqual(os.listdir(self.state_dir), ["selected-nodes.json"])
        self.assertEqual(self.store.load(), {"ollama": "gpu-2"})


class PersistedSelectionTests(SynchronousTestCase):
    """
    C{select} (the admin API's and the broker's C{node/select}) persists the
    pin in C{state_dir}; a new nvproxy over the same directory restores it.
    """

    def setUp(self) -> None:
        self.state_dir = self.mktemp()
        self.config = proxy_config(
            self.state_dir,
            {"ollama": "http://127.0.0.1:1", "llamacpp": "http://127.0.0.1:2"},
        )

    def proxy(self) -> NvProxy:
        return build(self.config, MemoryReactorClock(), hostname="local")

    def selected(self, proxy: NvProxy) -> dict[str, str | None]:
        return {f["engine"]: f["selected"] for f in proxy.ops.status()["facades"]}

    def test_pin_restored(self) -> None:
        first = self.proxy()
        first.ops.select("ollama", "gpu-2")
        first.ops.select("llamacpp", "gpu-3")
        second = self.proxy()
        self.assertEqual(second.pins, {"ollama": "gpu-2", "llamacpp": "gpu-3"})
        self.assertEqual(
            self.selected(second), {"ollama": "gpu-2", "llamacpp": "gpu-3"}
        )

    def test_unselect_persisted(self) -> None:
        first = self.proxy()
        first.ops.select("ollama", "gpu-2")
        first.ops.select("llamacpp", "gpu-3")
        first.ops.select("ollama", None)
        self.assertEqual(self.proxy().pins, {"llamacpp": "gpu-3"})
        first.ops.select("llamacpp", None)
        self.assertEqual(self.proxy().pins, {})
        self.assertEqual(os.listdir(self.state_dir), [])

    def test_unpersisted_selection_refused(self) -> None:
        """
        A selection that cannot be written is refused and changes nothing.
        """
        proxy = self.proxy()
        proxy.ops.select("ollama", "gpu-2")

        def failingReplace(source: str, destination: str) -> None:
            raise OSError(28, "No space left on device")

        self.patch(os, "replace", failingReplace)
        with self.assertRaises(AdminError) as raised:
            proxy.ops.select("ollama", "gpu-9")
        self.assertEqual(
            (raised.exception.status, raised.exception.message),
            (500, "cannot persist the selection: No space left on device"),
        )
        self.assertEqual(proxy.pins, {"ollama": "gpu-2"})
        self.assertEqual(self.proxy().pins, {"ollama": "gpu-2"})

    def test_broker_select_persisted(self) -> None:
        """
        The broker's C{ENGINE:node/select} persists and clears the same way.
        """
        config = evolve(self.config, control="stdio")
        proxy = build(config, MemoryReactorClock(), hostname="local")
        link = proxy.link
        assert link is not None
        transport = StringTransport()
        link.makeConnection(transport)

        def send(method: str, params: dict[str, object]) -> None:
            request = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
            link.dataReceived(json.dumps(request).encode() + b"\n")

        send("facade/enable", {"engine": "ollama", "port": 11999})
        send("ollama:node/select", {"nodeId": "gpu-2"})
        self.assertEqual(build(config, MemoryReactorClock()).pins, {"ollama": "gpu-2"})
        send("ollama:node/select", {"nodeId": None})
        self.assertEqual(build(config, MemoryReactorClock()).pins, {})
        answers = [json.loads(line) for line in transport.value().splitlines()]
        self.assertEqual(
            [
                a["result"]
                for a in answers
                if "result" in a and "selected" in a["result"]
            ],
            [
                {"engine": "ollama", "selected": "gpu-2"},
                {"engine": "ollama", "selected": None},
            ],
        )
