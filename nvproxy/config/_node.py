# -*- test-case-name: tests.test_config -*-
"""
This node's id: configured, persisted in the state directory, or derived
from the host name.
"""

from __future__ import annotations

import os
import re
from typing import Final

from twisted.logger import Logger

from nvproxy.config._parse import ConfigError, node_id_problem, show
from nvproxy.config._values import Config
from nvproxy.files import atomic_write

log = Logger(namespace="nvproxy.config")

NODE_ID_FILE: Final = "node-id"


def node_id_from_hostname(hostname: str) -> str:
    """
    A valid node id (see L{node_id_problem}) made from a host name: lower
    case, other characters become C{-}, each label trimmed of C{-} and cut
    to 63 characters, empty labels dropped; C{"node"} when nothing usable is
    left (or only an all-digit last label).
    """
    labels = []
    for label in hostname.strip().lower().split("."):
        label = re.sub(r"[^a-z0-9-]+", "-", label).strip("-")[:63].strip("-")
        if label:
            labels.append(label)
    candidate = ".".join(labels)[:253].strip(".-")
    if not candidate or node_id_problem(candidate) is not None:
        return "node"
    return candidate


def resolve_node_id(config: Config, hostname: str) -> str:
    """
    This node's id: the configured one; else the one persisted in
    C{<state_dir>/node-id}; else derived from C{hostname} and persisted (a
    failure to persist is logged, not fatal).

    @raise ConfigError: the persisted file cannot be read or holds an invalid
        id (the id names this node's certificate, so it is not replaced
        silently).
    """
    if config.node_id is not None:
        return config.node_id
    path = os.path.join(config.state_dir, NODE_ID_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as e:
        raise ConfigError(path, f"cannot read: {e.strerror or e}") from None
    else:
        text = data.decode("utf-8", "replace").strip()
        if node_id_problem(text) is not None:
            raise ConfigError(
                path,
                f"not a valid node id: {show(text)}; fix or delete the file",
            )
        return text
    node_id = node_id_from_hostname(hostname)
    try:
        atomic_write(path, node_id.encode("ascii") + b"\n")
    except OSError as e:
        log.warn(
            "cannot persist node id {node_id} to {path}: {error}",
            node_id=node_id,
            path=path,
            error=e.strerror or str(e),
        )
    return node_id
