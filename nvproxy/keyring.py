# -*- test-case-name: tests.test_keyring -*-
"""
API keys at rest: the keys file and the ring a facade checks callers
against (DESIGN §3a).

The file holds one key per line as C{NAME sha256:HEX}, the SHA-256 of the
key and never the key itself; C{#} starts a comment, blank lines are
ignored::

    # who                 what they present, hashed
    billing-svc  sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08

A L{KeyRing} re-reads the file when it changes (its size, mtime or inode,
looked at no more than once per C{check_interval} on the injected clock,
when a key is checked): no restart, no thread, no timer.  A file that does
not parse is refused with one line naming the line number, and the previous
keys stay in force.  Comparison is constant-time over the digests; no key,
digest or line of the file ever reaches a log line.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Iterable
from typing import Final

from attrs import frozen
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

__all__ = [
    "KEY_NAME_PATTERN",
    "KeyFileError",
    "KeyRing",
    "StoredKey",
    "format_keys",
    "hash_key",
    "new_key",
    "parse_keys",
    "read_keys",
]

log = Logger()

KEY_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
"""A key's name: what workload events and metrics call its holder."""

_HASH: Final = re.compile(r"sha256:([0-9a-fA-F]{64})")

KEY_BYTES: Final = 32
"""Random bytes in a generated key (256 bits)."""


class KeyFileError(Exception):
    """The keys file cannot be used; C{str()} is one line (never its content)."""


@frozen
class StoredKey:
    """One line of the keys file: a name and the SHA-256 of its key."""

    name: str
    digest: bytes

    def line(self) -> str:
        return f"{self.name} sha256:{self.digest.hex()}"


def hash_key(key: str) -> bytes:
    """The SHA-256 of a presented key, as stored."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def new_key() -> str:
    """A fresh random key: L{KEY_BYTES} bytes, URL-safe base64 (43 chars)."""
    return secrets.token_urlsafe(KEY_BYTES)


def parse_keys(text: str, where: str) -> tuple[StoredKey, ...]:
    """
    The keys of a keys file's C{text}.

    @param where: how the file is named in an error.
    @raise KeyFileError: a line is not C{NAME sha256:HEX} or repeats a name
        (the message names the line number, never its content).
    """
    keys: list[StoredKey] = []
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise KeyFileError(f"{where}: line {number}: expected NAME sha256:HEX")
        name, hashed = fields
        if not KEY_NAME_PATTERN.fullmatch(name):
            raise KeyFileError(
                f"{where}: line {number}: a name is 1 to 128 letters, digits,"
                " '.', '_', '@' or '-', starting with a letter or digit"
            )
        match = _HASH.fullmatch(hashed)
        if match is None:
            raise KeyFileError(
                f"{where}: line {number}: expected sha256: and 64 hex digits"
                " after the name (the key's hash, never the key)"
            )
        if name in names:
            raise KeyFileError(f"{where}: line {number}: duplicate name {name}")
        names.add(name)
        keys.append(StoredKey(name, bytes.fromhex(match.group(1))))
    return tuple(keys)


def read_keys(path: str) -> tuple[StoredKey, ...]:
    """
    Read and parse the keys file at C{path}.

    @raise KeyFileError: it cannot be read or does not parse.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KeyFileError(f"{path}: not UTF-8 text at byte {e.start}") from None
    return parse_keys(text, path)


def format_keys(keys: Iterable[StoredKey]) -> str:
    return "".join(key.line() + "\n" for key in keys)


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class KeyRing:
    """
    The keys of one keys file, kept current.

    @param check_interval: seconds between looks at the file.
    @raise KeyFileError: (from the constructor) the file cannot be used at
        start.
    """

    def __init__(
        self, path: str, clock: IReactorTime, check_interval: float = 1.0
    ) -> None:
        self.path = path
        self._clock = clock
        self._interval = check_interval
        self._stamp = _stamp(path)
        self._keys = read_keys(path)
        self._checked = clock.seconds()
        self._refused: tuple[int, int, int] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        self.refresh()
        return tuple(key.name for key in self._keys)

    def refresh(self) -> None:
        """Re-read the file if it changed and the interval has passed."""
        now = self._clock.seconds()
        if now - self._checked < self._interval:
            return
        self._checked = now
        stamp = _stamp(self.path)
        if stamp == self._stamp or (stamp is not None and stamp == self._refused):
            return
        if stamp is None:
            log.warn(
                "API keys file {path} is gone: keeping the {count} keys read before",
                path=self.path,
                count=len(self._keys),
            )
            self._stamp = None
            return
        try:
            keys = read_keys(self.path)
        except KeyFileError as e:
            self._refused = stamp
            log.error(
                "API keys file refused, keeping the previous keys: {error}",
                error=str(e),
            )
            return
        self._stamp = stamp
        self._refused = None
        self._keys = keys
        log.info(
            "API keys file {path} re-read: {count} keys",
            path=self.path,
            count=len(keys),
        )

    def match(self, presented: str) -> str | None:
        """
        The name of the key C{presented}, or L{None}.  Every stored digest
        is compared, in constant time each, whichever matches.
        """
        self.refresh()
        digest = hash_key(presented)
        found: str | None = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = key.name
        return found
