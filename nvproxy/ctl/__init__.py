# -*- test-case-name: tests.test_admin,tests.test_cluster -*-
"""
C{nvproxyctl}: the operator's command line, for the loopback admin API and the
cluster dir.

    nvproxyctl [--admin HOST:PORT] status
    nvproxyctl wake SERVICE
    nvproxyctl sleep SERVICE [--level 1|2]
    nvproxyctl set-port ENGINE PORT
    nvproxyctl select ENGINE NODE | nvproxyctl select ENGINE --clear
    nvproxyctl drain | nvproxyctl drain --off
    nvproxyctl cluster init|fingerprint|add-peer|remove-peer|list ...
    nvproxyctl keys add|list|remove ...

The admin commands are HTTP calls to a running daemon; the C{cluster} commands
(L{nvproxy.ctl.cluster}) edit the cluster dir directly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO, cast
from urllib.parse import quote

from twisted.internet.interfaces import IReactorTime

DEFAULT_ADMIN = "127.0.0.1:8010"


class CtlError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nvproxyctl", description="Talk to a running nvproxy's admin API."
    )
    parser.add_argument(
        "--admin",
        default=os.environ.get("NVPROXY_ADMIN", DEFAULT_ADMIN),
        help=f"admin API address (default {DEFAULT_ADMIN}, env NVPROXY_ADMIN)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="show facades, nodes, reservations, vLLM services")
    wake = sub.add_parser("wake", help="wake a vLLM service")
    wake.add_argument("service")
    sleep = sub.add_parser("sleep", help="put a vLLM service to sleep")
    sleep.add_argument("service")
    sleep.add_argument("--level", type=int, choices=(1, 2), default=1)
    set_port = sub.add_parser("set-port", help="move a facade and persist its port")
    set_port.add_argument("engine")
    set_port.add_argument("port", type=int)
    select = sub.add_parser("select", help="pin an engine's requests to a node")
    select.add_argument("engine")
    select.add_argument("node", nargs="?")
    select.add_argument("--clear", action="store_true")
    drain = sub.add_parser(
        "drain", help="take this node out of rotation (--off: back in)"
    )
    drain.add_argument("--off", action="store_true")
    workloads = sub.add_parser("workloads", help="recent workloads")
    workloads.add_argument("--limit", type=int, default=20)
    cluster = sub.add_parser("cluster", help="cluster identity and peers")
    cluster.add_argument("args", nargs=argparse.REMAINDER)
    keys = sub.add_parser("keys", help="API keys: add NAME, list, remove NAME")
    keys.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _request(args: argparse.Namespace) -> tuple[str, str, bytes | None]:
    command = args.command
    for name in ("service", "engine"):
        if hasattr(args, name):
            setattr(args, name, quote(getattr(args, name), safe=""))
    if command == "status":
        return "GET", "/admin/status", None
    if command == "wake":
        return "POST", f"/admin/wake/{args.service}", None
    if command == "sleep":
        return "POST", f"/admin/sleep/{args.service}?level={args.level}", None
    if command == "set-port":
        return (
            "PUT",
            f"/admin/engines/{args.engine}/port",
            json.dumps({"port": args.port}).encode(),
        )
    if command == "select":
        if args.clear:
            return "DELETE", f"/admin/engines/{args.engine}/select", None
        if not args.node:
            raise CtlError("select needs a NODE or --clear")
        return (
            "PUT",
            f"/admin/engines/{args.engine}/select",
            json.dumps({"node": args.node}).encode(),
        )
    if command == "workloads":
        return "GET", f"/admin/workloads?limit={args.limit}", None
    if command == "drain":
        return ("DELETE" if args.off else "POST"), "/admin/drain", None
    raise CtlError(f"unknown command {command}")


_JSON: dict[bytes | str, list[bytes | str]] = {b"content-type": [b"application/json"]}


def _call(
    reactor: Any, admin: str, method: str, path: str, body: bytes | None, timeout: float
) -> Any:
    import treq

    async def call() -> tuple[int, bytes]:
        response = await treq.request(
            method,
            f"http://{admin}{path}",
            data=body,
            headers=_JSON,
            timeout=timeout,
            reactor=reactor,
        )
        return response.code, await treq.content(response)

    from twisted.internet.defer import Deferred

    return Deferred.fromCoroutine(call())


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    args = _parser().parse_args(argv)
    if args.command == "cluster":
        from twisted.internet import reactor

        from nvproxy.ctl.cluster import cluster_command

        # File work, nothing runs on the reactor: it is only the clock.
        return cluster_command(list(args.args), out, clock=cast(IReactorTime, reactor))
    if args.command == "keys":
        from nvproxy.ctl.keys import keys_command

        return keys_command(list(args.args), out, err=sys.stderr)
    try:
        method, path, body = _request(args)
    except CtlError as e:
        print(f"nvproxyctl: {e}", file=sys.stderr)
        return 2
    from twisted.internet.task import react

    result: list[int] = []

    async def run(reactor: Any) -> None:
        try:
            code, raw = await _call(
                reactor, args.admin, method, path, body, args.timeout
            )
        except Exception as e:
            print(
                f"nvproxyctl: cannot reach the admin API at {args.admin}: "
                f"{type(e).__name__}: {e}",
                file=sys.stderr,
            )
            result.append(1)
            return
        try:
            text = json.dumps(json.loads(raw), indent=2, sort_keys=True)
        except ValueError:
            text = raw.decode("utf-8", "replace")
        print(text, file=out)
        result.append(0 if 200 <= code < 300 else 1)

    def start(reactor: Any) -> Any:
        from twisted.internet.defer import Deferred

        return Deferred.fromCoroutine(run(reactor))

    try:
        react(start, [])
    except SystemExit as e:
        if e.code not in (0, None):
            return int(e.code) if isinstance(e.code, int) else 1
    return result[0] if result else 1
