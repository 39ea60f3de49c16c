# -*- test-case-name: tests.test_ports -*-
"""
Writing state files so that a crash or a concurrent reader never sees half of
one: persisted ports, the node id, vLLM wake intent, the cluster dir.
"""

from __future__ import annotations

import contextlib
import os
import tempfile


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    mode: int | None = None,
    exclusive: bool = False,
) -> None:
    """
    Put C{data} at C{path} atomically: write a temporary file in the same
    directory (created if missing), flush it to disk, then rename it over
    C{path} (or, C{exclusive}, link it, failing if C{path} exists), and
    flush the directory.  On failure the old file is untouched and no
    temporary file is left behind.

    @param mode: the new file's permission bits (default: C{mkstemp}'s 0600
        widened by nothing); set before any data is written.
    @raise OSError: the write failed (C{FileExistsError} when C{exclusive}
        and C{path} exists).
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(
        dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            os.link(temporary, path)
        else:
            os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    with contextlib.suppress(OSError):
        directory_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(directory_fd)
        finally:
            os.close(directory_fd)
