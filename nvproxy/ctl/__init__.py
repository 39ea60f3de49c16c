# -*- test-case-name: tests.test_admin,tests.test_cluster -*-
"""
C{nvproxyctl}: the operator's command line, for the loopback admin API and the
cluster dir.

    nvproxyctl [--admin HOST:PORT] [--json] [--timeout S] status
    nvproxyctl wake SERVICE [--wait]
    nvproxyctl sleep SERVICE [--level 1|2]
    nvproxyctl set-port ENGINE PORT
    nvproxyctl select ENGINE NODE | nvproxyctl select ENGINE --clear
    nvproxyctl workloads [--limit N]
    nvproxyctl reload
    nvproxyctl check-config FILE
    nvproxyctl drain | nvproxyctl drain --off
    nvproxyctl cluster init|fingerprint|add-peer|remove-peer|list ...
    nvproxyctl keys add|list|remove ...

The admin commands are HTTP calls to a running daemon; the C{cluster} commands
(L{nvproxy.ctl.cluster}) edit the cluster dir directly; C{check-config} reads
a file and starts nothing.  Answers print as tables and sentences
(L{nvproxy.ctl._format}), or exactly as the daemon sent them with C{--json}.

Exit codes: 0 done; 1 refused by the daemon (its message is printed), a
wake that failed or did not finish within C{--timeout}, or a configuration
file with problems; 2 the daemon cannot be reached, or bad usage.
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

from nvproxy.ctl._format import FORMATTERS, refusal

DEFAULT_ADMIN = "127.0.0.1:8010"

OK, REFUSED, UNREACHABLE = 0, 1, 2
"""The exit codes."""


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
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the daemon (for wake: the whole wake)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the daemon's JSON answer as is"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="show facades, nodes, reservations, vLLM services")
    wake = sub.add_parser("wake", help="wake a vLLM service")
    wake.add_argument("service")
    wake.add_argument(
        "--wait", action="store_true", help="show its state changes until awake"
    )
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
    sub.add_parser("reload", help="reload the configuration file and cluster dir")
    check = sub.add_parser("check-config", help="validate a configuration file")
    check.add_argument("file")
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
    if command == "reload":
        return "POST", "/admin/reload", None
    raise CtlError(f"unknown command {command}")


_JSON: dict[bytes | str, list[bytes | str]] = {b"content-type": [b"application/json"]}


def _call(
    reactor: Any, admin: str, method: str, path: str, body: bytes | None, timeout: float
) -> Any:
    import treq
    from twisted.internet.defer import CancelledError, Deferred
    from twisted.web.client import ResponseFailed

    async def call() -> tuple[int, bytes]:
        try:
            response = await treq.request(
                method,
                f"http://{admin}{path}",
                data=body,
                headers=_JSON,
                reactor=reactor,
            )
            return response.code, await treq.content(response)
        except ResponseFailed as e:
            # Cancelled by the timeout below: let it say so.
            if any(reason.check(CancelledError) for reason in e.reasons):
                raise CancelledError() from None
            raise

    # The whole exchange, answer included, within the timeout: it then fails
    # with twisted.internet.defer.TimeoutError.
    return Deferred.fromCoroutine(call()).addTimeout(timeout, reactor)


def _check_config(path: str, out: TextIO) -> int:
    from nvproxy.config import ConfigError, load_config

    try:
        load_config(path, {}, os.environ)
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"nvproxyctl: {line}", file=sys.stderr)
        return REFUSED
    print(f"{path}: configuration OK", file=out)
    return OK


def _unreachable(admin: str, e: Exception) -> str:
    return (
        f"nvproxyctl: cannot reach the admin API at {admin} (is nvproxy running?):"
        f" {type(e).__name__}: {e}"
    )


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


async def _wake_progress(
    reactor: Any, args: argparse.Namespace, out: TextIO, started: float
) -> None:
    """Print each state change of the service being woken, with elapsed time."""
    from twisted.internet.task import deferLater

    last: object = None
    while True:
        try:
            code, raw = await _call(
                reactor, args.admin, "GET", "/admin/status", None, 5.0
            )
        except Exception:
            code, raw = 0, b""
        answer = _decode(raw) if code == 200 else None
        if isinstance(answer, dict):
            for service in answer.get("vllm") or []:
                if service.get("name") != args.raw_service:
                    continue
                state = (service.get("state"), service.get("sleep_depth"))
                if state != last:
                    last = state
                    depth = f" ({state[1]})" if state[1] else ""
                    elapsed = reactor.seconds() - started
                    print(f"{elapsed:6.1f}s  {state[0]}{depth}", file=out, flush=True)
        await deferLater(reactor, 0.5, lambda: None)


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
    if args.command == "check-config":
        return _check_config(args.file, out)
    args.raw_service = getattr(args, "service", None)
    try:
        method, path, body = _request(args)
    except CtlError as e:
        print(f"nvproxyctl: {e}", file=sys.stderr)
        return UNREACHABLE
    from twisted.internet.defer import CancelledError, Deferred
    from twisted.internet.defer import TimeoutError as CallTimeout
    from twisted.internet.task import react

    result: list[int] = []

    async def run(reactor: Any) -> None:
        started = reactor.seconds()
        progress = None
        if args.command == "wake" and args.wait:
            progress = Deferred.fromCoroutine(
                _wake_progress(reactor, args, out, started)
            )
            progress.addErrback(lambda f: f.trap(CancelledError))
        try:
            code, raw = await _call(
                reactor, args.admin, method, path, body, args.timeout
            )
        except CallTimeout as e:
            if args.command == "wake":
                print(
                    f"nvproxyctl: {args.raw_service} is not awake after"
                    f" {args.timeout:g}s; the wake goes on",
                    file=sys.stderr,
                )
                result.append(REFUSED)
            else:
                print(_unreachable(args.admin, e), file=sys.stderr)
                result.append(UNREACHABLE)
            return
        except Exception as e:
            print(_unreachable(args.admin, e), file=sys.stderr)
            result.append(UNREACHABLE)
            return
        finally:
            if progress is not None:
                progress.cancel()
        answer = _decode(raw)
        if not 200 <= code < 300:
            if args.json and answer is not None:
                print(json.dumps(answer, indent=2, sort_keys=True), file=out)
            for line in refusal(answer, raw):
                print(f"nvproxyctl: {line}", file=sys.stderr)
            result.append(REFUSED)
            return
        if args.json or answer is None:
            text = (
                json.dumps(answer, indent=2, sort_keys=True)
                if answer is not None
                else raw.decode("utf-8", "replace")
            )
        else:
            text = FORMATTERS[args.command](answer)
            if args.command == "wake" and args.wait:
                text += f" after {reactor.seconds() - started:.1f}s"
        print(text, file=out)
        result.append(OK)

    def start(reactor: Any) -> Any:
        return Deferred.fromCoroutine(run(reactor))

    try:
        react(start, [])
    except SystemExit as e:
        if e.code not in (0, None):
            return int(e.code) if isinstance(e.code, int) else REFUSED
    return result[0] if result else REFUSED
