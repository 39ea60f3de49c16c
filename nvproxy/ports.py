# -*- test-case-name: tests.test_ports -*-
"""
Operator choices persisted in C{state_dir}: facade ports (spec §8) and node
selections.

A port chosen at runtime (C{set-port}) is written per engine to
C{<state_dir>/<engine.port_file>} as C{{"port": N}} and restored when that
facade is enabled, taking precedence over the configured port, so the facade
returns where the user left it.  A broker-coordinated start may bypass it
(C{ignore_persisted}).

A node selected for an engine (C{select ENGINE NODE}, the broker's
C{ENGINE:node/select}) is written, with every other engine's, to
C{<state_dir>/selected-nodes.json} as C{{"selected": {"ollama": "gpu-2"}}}
and restored at start; clearing the last one removes the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from attrs import frozen
from twisted.logger import Logger

from nvproxy.config import EngineConfig
from nvproxy.engines import ENGINES
from nvproxy.files import atomic_write

log = Logger()

__all__ = [
    "PortStore",
    "SelectionStore",
    "atomic_write",
    "effective_port",
    "valid_port",
]


def valid_port(port: object) -> bool:
    """
    Whether C{port} is a bindable, announceable port: an C{int} in 1..65535.
    """
    return isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535


@frozen
class PortStore:
    """
    The persisted facade ports of one node, in C{state_dir}.
    """

    state_dir: str

    def path(self, engine_id: str) -> str:
        """
        The persisted-port file of an engine.

        @raise ValueError: unknown engine.
        """
        engine = ENGINES.get(engine_id)
        if engine is None:
            raise ValueError(f"unknown engine {engine_id!r}")
        return os.path.join(self.state_dir, engine.port_file)

    def get(self, engine_id: str) -> int | None:
        """
        The persisted port of an engine, or L{None} when there is none.  A file
        that cannot be read or does not hold C{{"port": 1..65535}} is ignored
        with a warning.
        """
        path = self.path(engine_id)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._ignore(engine_id, path, f"cannot read: {e.strerror or e}")
            return None
        try:
            document = json.loads(data)
        except ValueError:
            self._ignore(engine_id, path, "not JSON")
            return None
        port = document.get("port") if isinstance(document, dict) else None
        if not valid_port(port):
            self._ignore(engine_id, path, 'expected {"port": N} with N in 1..65535')
            return None
        assert isinstance(port, int)
        return port

    def _ignore(self, engine_id: str, path: str, problem: str) -> None:
        log.warn(
            "ignoring persisted port of {engine} in {path}: {problem}",
            engine=engine_id,
            path=path,
            problem=problem,
        )

    def set(self, engine_id: str, port: int) -> None:
        """
        Persist an engine's facade port.

        @raise ValueError: unknown engine, or C{port} not in 1..65535.
        @raise OSError: it could not be written.
        """
        path = self.path(engine_id)
        if not valid_port(port):
            raise ValueError(f"port must be 1..65535, got {port!r}")
        atomic_write(path, json.dumps({"port": port}).encode("ascii") + b"\n")

    def clear(self, engine_id: str) -> None:
        """
        Forget an engine's persisted port.

        @raise ValueError: unknown engine.
        @raise OSError: the file exists but could not be removed.
        """
        try:
            os.unlink(self.path(engine_id))
        except FileNotFoundError:
            pass


@frozen
class SelectionStore:
    """
    The persisted node selections (pins) of one node, in C{state_dir}.
    """

    state_dir: str

    FILE = "selected-nodes.json"

    @property
    def path(self) -> str:
        return os.path.join(self.state_dir, self.FILE)

    def load(self) -> dict[str, str]:
        """
        The persisted selections, engine id -> node id.  A file that cannot
        be read or parsed is ignored with a warning, and so is an entry for
        an unknown engine or without a node id.
        """
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return {}
        except OSError as e:
            self._ignore(f"cannot read: {e.strerror or e}")
            return {}
        try:
            document = json.loads(data)
        except ValueError:
            self._ignore("not JSON")
            return {}
        selected = document.get("selected") if isinstance(document, dict) else None
        if not isinstance(selected, dict):
            self._ignore('expected {"selected": {"ENGINE": "NODE", ...}}')
            return {}
        result: dict[str, str] = {}
        for engine_id, node in selected.items():
            if engine_id not in ENGINES or not isinstance(node, str) or not node:
                self._ignore(f"bad entry for {engine_id!r}")
                continue
            result[engine_id] = node
        return result

    def save(self, selected: Mapping[str, str]) -> None:
        """
        Persist the whole set of selections; none removes the file.

        @raise OSError: it could not be written or removed.
        """
        if not selected:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            return
        document = {"selected": dict(sorted(selected.items()))}
        atomic_write(self.path, json.dumps(document).encode("utf-8") + b"\n")

    def _ignore(self, problem: str) -> None:
        log.warn(
            "ignoring persisted node selections in {path}: {problem}",
            path=self.path,
            problem=problem,
        )


def effective_port(
    engine: EngineConfig, store: PortStore, ignore_persisted: bool = False
) -> int:
    """
    The port an engine's facade binds: the persisted port, unless ignored;
    else the configured port; else the engine's standalone default (spec §8).
    """
    if not ignore_persisted:
        persisted = store.get(engine.id)
        if persisted is not None:
            return persisted
    return engine.facade_port
