# -*- test-case-name: tests.test_keyring -*-
"""
C{nvproxyctl keys ...}: the API keys file (format: L{nvproxy.keyring}).
Plain file work: no admin API; a running nvproxy re-reads the file.

    nvproxyctl keys add NAME [--file PATH]     a new key, printed once
    nvproxyctl keys list [--file PATH]         the names
    nvproxyctl keys remove NAME [--file PATH]

The file is C{--file}, else C{$NVPROXY_API_KEYS_FILE}, else
L{DEFAULT_KEYS_FILE}.  Every change is written to a temporary file beside
it and renamed over it, so the daemon never reads half a file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import TextIO

from nvproxy.ctl.cluster import _Exit, _Parser, _subcommands, _Usage
from nvproxy.keyring import (
    KEY_NAME_PATTERN,
    KeyFileError,
    StoredKey,
    hash_key,
    new_key,
    parse_keys,
)

__all__ = ["DEFAULT_KEYS_FILE", "keys_command"]

DEFAULT_KEYS_FILE = "/etc/nvproxy/api-keys"


def _parser(out: TextIO) -> _Parser:
    parser, command = _subcommands(
        "nvproxyctl keys",
        "--file",
        "PATH",
        f"keys file (default: $NVPROXY_API_KEYS_FILE or {DEFAULT_KEYS_FILE})",
        out,
    )

    add = command("add", "generate a key, print it once, store its hash")
    add.add_argument("name", metavar="NAME")
    command("list", "list the key names")
    remove = command("remove", "remove a key")
    remove.add_argument("name", metavar="NAME")
    return parser


def _read(path: str, missing_ok: bool) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        if missing_ok:
            return ""
        raise


def _replace(path: str, text: str) -> None:
    """Write C{text} to C{path} atomically, keeping its mode (new: 0600)."""
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o600
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=".api-keys-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _without(text: str, name: str) -> str:
    kept = []
    for line in text.splitlines(keepends=True):
        fields = line.split("#", 1)[0].split()
        if fields and fields[0] == name:
            continue
        kept.append(line)
    return "".join(kept)


def keys_command(
    argv: list[str],
    out: TextIO,
    *,
    err: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """
    C{nvproxyctl keys ARGV}.

    @return: 0 on success, 1 when the operation fails, 2 on a usage error.
    """
    err = out if err is None else err
    environ = os.environ if environ is None else environ
    try:
        args = _parser(out).parse_args(argv)
    except _Usage as e:
        err.write(f"{e}\n")
        return 2
    except _Exit as e:
        return e.status
    path = args.file or environ.get("NVPROXY_API_KEYS_FILE") or DEFAULT_KEYS_FILE
    try:
        text = _read(path, missing_ok=args.command == "add")
        keys = parse_keys(text, path)
        names = [key.name for key in keys]
        if args.command == "list":
            for name in names:
                out.write(f"{name}\n")
        elif args.command == "add":
            if not KEY_NAME_PATTERN.fullmatch(args.name):
                err.write(
                    f"nvproxyctl keys add: {args.name!r} is not a key name (1 to 128"
                    " letters, digits, '.', '_', '@' or '-')\n"
                )
                return 2
            if args.name in names:
                err.write(f"nvproxyctl keys add: {args.name} already has a key\n")
                return 1
            key = new_key()
            if text and not text.endswith("\n"):
                text += "\n"
            _replace(path, text + StoredKey(args.name, hash_key(key)).line() + "\n")
            err.write(f"added key {args.name} to {path}; it is shown only once:\n")
            out.write(f"{key}\n")
        else:
            if args.name not in names:
                err.write(f"nvproxyctl keys remove: no key named {args.name}\n")
                return 1
            _replace(path, _without(text, args.name))
            err.write(f"removed key {args.name} from {path}\n")
    except (KeyFileError, OSError, UnicodeDecodeError) as e:
        err.write(f"nvproxyctl keys {args.command}: {e}\n")
        return 1
    return 0
