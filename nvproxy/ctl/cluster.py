# -*- test-case-name: tests.test_cluster -*-
"""
C{nvproxyctl cluster ...}: create this node's identity and pin or unpin peers in
the cluster dir (format: L{nvproxy.cluster.store}).  Plain file work: no admin
API, no running reactor; the daemon's watcher picks the changes up.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any, NoReturn, TextIO

from twisted.internet.interfaces import IReactorTime

from nvproxy.cluster import DEFAULT_CLUSTER_DIR, ClusterDir, ClusterError, Peer

__all__ = ["cluster_command"]


class _Usage(Exception):
    pass


class _Exit(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


class _Parser(argparse.ArgumentParser):
    """argparse writing to our streams and raising instead of exiting."""

    def __init__(self, *args: Any, out: TextIO, **kwargs: Any) -> None:
        self.out = out
        super().__init__(*args, **kwargs)

    def _print_message(self, message: str, file: Any = None) -> None:
        if message:
            self.out.write(message)

    def error(self, message: str) -> NoReturn:
        raise _Usage(f"{self.prog}: error: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            self.out.write(message)
        raise _Exit(status)


def _engine_port(text: str) -> tuple[str, int]:
    engine, sep, port = text.partition("=")
    if not sep or not port.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not ENGINE=PORT")
    return engine.strip().lower(), int(port)


def _subcommands(
    prog: str, option: str, metavar: str, help: str, out: TextIO
) -> tuple[_Parser, Any]:
    """
    A C{nvproxyctl GROUP COMMAND} parser whose every command takes
    C{option} (the file or dir it works on); returns the parser and a
    C{command(name, help)} that adds one.
    """
    common = _Parser(add_help=False, out=out)
    common.add_argument(option, metavar=metavar, help=help)
    parser = _Parser(prog=prog, out=out)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> _Parser:
        parser: _Parser = commands.add_parser(
            name, help=help, parents=[common], out=out
        )
        return parser

    return parser, command


def _parser(out: TextIO) -> _Parser:
    parser, command = _subcommands(
        "nvproxyctl cluster",
        "--dir",
        "D",
        f"cluster dir (default: $NVPROXY_CLUSTER_DIR or {DEFAULT_CLUSTER_DIR})",
        out,
    )

    init = command("init", "create this node's key and certificate")
    init.add_argument("node_id", metavar="NODE_ID")
    command("fingerprint", "print this node's certificate fingerprint")
    add = command("add-peer", "pin a peer")
    add.add_argument("peer_id", metavar="ID")
    add.add_argument("address", metavar="ADDRESS")
    add.add_argument("fingerprint", metavar="FINGERPRINT")
    add.add_argument(
        "--port",
        action="append",
        type=_engine_port,
        default=[],
        metavar="ENGINE=PORT",
        help="the peer's facade port for an engine (repeatable)",
    )
    add.add_argument("--replace", action="store_true", help="replace an existing entry")
    remove = command("remove-peer", "unpin a peer")
    remove.add_argument("peer_id", metavar="ID")
    command("list", "list the pinned peers")
    return parser


def cluster_command(
    argv: list[str],
    out: TextIO,
    *,
    clock: IReactorTime,
    err: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """
    C{nvproxyctl cluster ARGV}: C{init NODE_ID}, C{fingerprint},
    C{add-peer ID ADDRESS FINGERPRINT [--port ENGINE=PORT ...] [--replace]},
    C{remove-peer ID}, C{list}; each takes C{--dir D}.  Synchronous file work on
    the cluster dir; C{clock} only dates the certificate C{init} makes.

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
    directory = ClusterDir(
        args.dir or environ.get("NVPROXY_CLUSTER_DIR") or DEFAULT_CLUSTER_DIR
    )
    try:
        if args.command == "init":
            identity = directory.init(args.node_id, clock)
            out.write(
                f"initialized node {identity.node_id} in {directory.path}\n"
                f"fingerprint {identity.fingerprint}\n"
            )
        elif args.command == "fingerprint":
            out.write(f"{directory.fingerprint()}\n")
        elif args.command == "add-peer":
            peer = Peer(args.peer_id, args.address, args.fingerprint, args.port)
            directory.add_peer(peer, replace=args.replace)
            out.write(f"added peer {peer.id} at {peer.address} ({peer.fingerprint})\n")
        elif args.command == "remove-peer":
            removed = directory.remove_peer(args.peer_id)
            out.write(f"removed peer {removed.id}\n")
        else:
            for p in directory.peers():
                ports = ",".join(f"{e}={n}" for e, n in p.ports) or "-"
                out.write(f"{p.id}\t{p.address}\t{ports}\t{p.fingerprint}\n")
    except (ClusterError, OSError) as e:
        err.write(f"nvproxyctl cluster {args.command}: {e}\n")
        return 1
    return 0
