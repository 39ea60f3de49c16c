"""
A normal client's latency while many connections trickle their headers.

Starts a fake Ollama engine and C{twistd -n nvproxy} (Ollama facade only,
C{[limits] header_timeout} as given, C{max_connections = 4096}), each in its
own process.  The normal client (this process) sends C{--requests} small
non-streaming C{POST /api/generate} requests one after another on one
keep-alive connection, first alone (the baseline), then while a separate
trickling process (this module with C{--trickle}) holds C{--connections}
connections to the facade, each sending one header byte every 0.5-1 s.  The
trickling process records when the server closed each connection, relative
to that connection's first byte, and stops by itself after 3 x the header
timeout.

Prints baseline and during p50/p99, the p99 ratio, how many trickling
connections were dropped and their min/median/max drop time.  Exits 1 when a
trickling connection was not dropped, or was dropped before its deadline or
later than the deadline plus C{--margin}; 0 otherwise (the latencies are a
measurement, not a check).

    python -m bench.slowloris [--connections 1000] [--header-timeout 2s]
        [--requests 300] [--margin 0.5s] [--sources 1] [--keep]
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import selectors
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import treq
from twisted.internet import defer, task
from twisted.web.client import HTTPConnectionPool

from bench.procs import (
    BenchError,
    Proc,
    Proxy,
    launch_proxy,
    spawn,
    start_engine,
    wait_ready,
)

# Opening the trickling connections in batches with a short pause keeps the
# facade's accept queue (the listener's default backlog, 50) from overflowing.
_BATCH = 40
_BATCH_PAUSE = 0.02
_READY = "trickling "
_RESULT = "result "


def _duration(text: str) -> float:
    text = text.strip()
    if text.endswith("ms"):
        return float(text[:-2]) / 1000
    if text.endswith("s"):
        return float(text[:-1])
    return float(text)


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, min(len(ordered), round(q * len(ordered) + 0.5)))
    return ordered[rank - 1]


# --- the trickling process -------------------------------------------------


class _Conn:
    def __init__(self, sock: socket.socket, interval: float) -> None:
        self.sock = sock
        self.interval = interval
        self.first: float | None = None
        self.next_send = 0.0
        self.sent = 0
        self.closed: float | None = None
        self.received = b""


_HEAD = b"GET /api/tags HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Trickle: " + b"a" * 8192


def trickle(port: int, count: int, header_timeout: float, sources: int) -> None:
    """
    Open C{count} connections to 127.0.0.1:C{port} and trickle header bytes;
    print one C{trickling} line once every connection has sent its first
    byte and one C{result} JSON line at the end.  Blocking I/O is fine
    here: this process does nothing else.
    """
    rng = random.Random(17)
    selector = selectors.DefaultSelector()
    conns: list[_Conn] = []
    failed = 0
    started = time.monotonic()
    for i in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if sources > 1:
            sock.bind((f"127.0.0.{1 + i % sources}", 0))
        sock.settimeout(5.0)
        try:
            sock.connect(("127.0.0.1", port))
            sock.send(_HEAD[:1])
        except OSError:
            failed += 1
            sock.close()
            continue
        sock.setblocking(False)
        conn = _Conn(sock, rng.uniform(0.5, 1.0))
        conn.first = time.monotonic()
        conn.sent = 1
        conn.next_send = conn.first + conn.interval
        conns.append(conn)
        selector.register(sock, selectors.EVENT_READ, conn)
        if (i + 1) % _BATCH == 0:
            time.sleep(_BATCH_PAUSE)
    opened = time.monotonic()
    print(
        f"{_READY}{len(conns)} connections ({failed} failed)"
        f" in {opened - started:.3f}s",
        flush=True,
    )
    stop_at = opened + 3 * header_timeout
    open_conns = set(range(len(conns)))
    index = {id(c): n for n, c in enumerate(conns)}
    while open_conns:
        now = time.monotonic()
        if now >= stop_at:
            break
        wake = min([conns[n].next_send for n in open_conns] + [stop_at])
        for key, _ in selector.select(max(0.0, min(wake - now, 0.05))):
            conn = key.data
            try:
                data = conn.sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                conn.received += data
                continue
            conn.closed = time.monotonic()
            selector.unregister(conn.sock)
            conn.sock.close()
            open_conns.discard(index[id(conn)])
        now = time.monotonic()
        for n in list(open_conns):
            conn = conns[n]
            if now < conn.next_send:
                continue
            try:
                conn.sock.send(_HEAD[conn.sent : conn.sent + 1])
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    continue
                conn.closed = time.monotonic()
                selector.unregister(conn.sock)
                conn.sock.close()
                open_conns.discard(n)
                continue
            conn.sent += 1
            conn.next_send = now + conn.interval
    drops = []
    statuses: dict[str, int] = {}
    for conn in conns:
        if conn.closed is not None and conn.first is not None:
            drops.append(conn.closed - conn.first)
        status = conn.received.split(b"\r\n", 1)[0].decode("latin-1")[:40]
        statuses[status or "(nothing)"] = statuses.get(status or "(nothing)", 0) + 1
    for n in open_conns:
        conns[n].sock.close()
    firsts = [c.first for c in conns if c.first is not None]
    closes = [c.closed for c in conns if c.closed is not None]
    result = {
        "opened": len(conns),
        "failed": failed,
        "open_seconds": opened - started,
        "drops": drops,
        "still_open": len(open_conns),
        "statuses": statuses,
        "bytes_sent_max": max((c.sent for c in conns), default=0),
        "first_byte_span": [min(firsts), max(firsts)] if firsts else None,
        "first_close": min(closes) if closes else None,
    }
    print(_RESULT + json.dumps(result), flush=True)


# --- the bench process -----------------------------------------------------


async def _launch(
    reactor: Any, workdir: Path, backend: str, header_timeout: float
) -> Proxy:
    limits = f'[limits]\nheader_timeout = "{header_timeout}s"\nmax_connections = 4096\n'
    return await launch_proxy(reactor, workdir, backend, extra_config=limits)


async def _requests(
    reactor: Any, pool: HTTPConnectionPool, url: str, count: int
) -> tuple[list[float], float, float, int]:
    """C{count} sequential requests; latencies, start, end, errors."""
    body = json.dumps({"model": "m", "prompt": "hi", "stream": False}).encode()
    latencies: list[float] = []
    errors = 0
    begin = time.monotonic()
    for _ in range(count):
        start = time.monotonic()
        try:
            response = await treq.post(url, data=body, pool=pool, timeout=30)
            await treq.content(response)
            if response.code != 200:
                errors += 1
        except Exception:
            errors += 1
            continue
        latencies.append(time.monotonic() - start)
    return latencies, begin, time.monotonic(), errors


async def measure(reactor: Any, args: argparse.Namespace, workdir: Path) -> int:
    engine, backend = await start_engine(reactor, workdir, "engine", ["m:latest"])
    procs: list[Proc] = [engine]
    try:
        proxy = await _launch(reactor, workdir, backend, args.header_timeout)
        procs.append(proxy.proc)
        await wait_ready(reactor, proxy, {"bench": ""})
        url = proxy.facade + "/api/generate"
        pool = HTTPConnectionPool(reactor, persistent=True)
        pool.maxPersistentPerHost = 1
        await _requests(reactor, pool, url, 20)  # warm-up
        base, _, _, base_err = await _requests(reactor, pool, url, args.requests)

        port = int(proxy.facade.rsplit(":", 1)[1])
        argv = [
            sys.executable,
            "-m",
            "bench.slowloris",
            "--trickle",
            "--port",
            str(port),
            "--connections",
            str(args.connections),
            "--header-timeout",
            f"{args.header_timeout}s",
            "--sources",
            str(args.sources),
        ]
        trickler, ready = await spawn(
            reactor, "trickle", argv, workdir, _READY.encode(), timeout=60
        )
        procs.append(trickler)
        during, begin, end, during_err = await _requests(
            reactor, pool, url, args.requests
        )
        await trickler.child.ended
        await pool.closeCachedConnections()
    finally:
        for proc in reversed(procs):
            await proc.stop(reactor)
    result = None
    for line in (workdir / "trickle.log").read_text().splitlines():
        if line.startswith(_RESULT):
            result = json.loads(line[len(_RESULT) :])
    if result is None:
        raise BenchError(f"the trickling process gave no result; see {workdir}")

    drops: list[float] = result["drops"]
    timeout = args.header_timeout
    early = [d for d in drops if d < timeout]
    late = [d for d in drops if d > timeout + args.margin]
    b50, b99 = _percentile(base, 0.5), _percentile(base, 0.99)
    d50, d99 = _percentile(during, 0.5), _percentile(during, 0.99)
    first_close = result["first_close"]
    rows = [
        ("connections opened", f"{result['opened']} / {args.connections}"),
        ("connect failures", f"{result['failed']}"),
        ("time to open all", f"{result['open_seconds']:.3f} s"),
        ("requests per phase", f"{args.requests} (one keep-alive connection)"),
        ("baseline p50 / p99", f"{b50 * 1000:.2f} / {b99 * 1000:.2f} ms"),
        ("during p50 / p99", f"{d50 * 1000:.2f} / {d99 * 1000:.2f} ms"),
        ("p99 during / baseline", f"{d99 / b99:.2f} x"),
        ("errors base / during", f"{base_err} / {during_err}"),
        (
            "during window",
            f"{end - begin:.3f} s; first drop at "
            + (f"{first_close - begin:+.3f} s" if first_close else "none"),
        ),
        ("dropped by server", f"{len(drops)} / {result['opened']}"),
        ("still open at stop", f"{result['still_open']}"),
    ]
    if drops:
        rows.append(
            (
                "drop after 1st byte",
                f"min {min(drops):.3f} / median {statistics.median(drops):.3f}"
                f" / max {max(drops):.3f} s",
            )
        )
    rows += [
        (
            "early / late drops",
            f"{len(early)} before {timeout:g} s / {len(late)}"
            f" after {timeout + args.margin:g} s",
        ),
        ("bytes sent (most)", f"{result['bytes_sent_max']}"),
        (
            "answers",
            ", ".join(f"{k!r}: {v}" for k, v in sorted(result["statuses"].items())),
        ),
    ]
    ok = (
        result["opened"] == args.connections
        and len(drops) == result["opened"]
        and not early
        and not late
    )
    rows.append(("deadline check", "ok" if ok else "FAILED"))
    width = max(len(name) for name, _ in rows)
    print(f"slowloris: {args.connections} connections, header_timeout {timeout:g} s")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.slowloris")
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--header-timeout", type=_duration, default=2.0)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument(
        "--margin",
        type=_duration,
        default=0.5,
        help="how late after the deadline a drop may be (default 0.5s)",
    )
    parser.add_argument(
        "--sources",
        type=int,
        default=1,
        help="spread the trickling connections over 127.0.0.1..N",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    parser.add_argument("--trickle", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trickle:
        trickle(args.port, args.connections, args.header_timeout, args.sources)
        return
    workdir = Path(tempfile.mkdtemp(prefix="nvproxy-slowloris-"))

    async def run(reactor: Any) -> None:
        status = await measure(reactor, args, workdir)
        if args.keep or status:
            print(f"work dir: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        if status:
            raise SystemExit(status)

    task.react(lambda reactor: defer.ensureDeferred(run(reactor)))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
