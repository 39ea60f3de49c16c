"""
The chaos soak's engine double: one process per node, a llama.cpp-style
OpenAI server written on asyncio streams (deliberately not on Twisted's HTTP
stack, so it cannot share a defect with the daemon's client pool).

    python -m bench.soak.engine --host 127.0.0.11 --port 0 --node n1 \\
        --models soak-w0,soak-w1 --seed 7 --receipts n1.jsonl

It serves C{GET /models} and C{GET /v1/models} (the model list) and
C{POST /v1/chat/completions} (streaming SSE ending C{data: [DONE]}, or one
JSON document).  Each inference request carrying C{x-soak-id} is a
I{receipt}; its fault is drawn from a random source seeded with
C{(seed, node, soak id, how often this node saw that id)}, so a run's faults
do not depend on the order requests arrive in.  When the receipt ends, one
JSON line records what happened (L{Receipt}); times are C{time.monotonic()},
which is system-wide on Linux and so comparable across the soak's processes.

Answers name their node and receipt (C{x-soak-node}, C{x-soak-receipt}
headers, and C{"soak"} in every JSON document and SSE event), so the harness
can tell which engine produced what its client got.

Commands, one per line on stdin, each acknowledged with C{ok COMMAND} on
stdout: C{stop} (stop listening and kill every connection, as a crash would),
C{start} (listen again on the same address), C{hide} / C{show} (the model
list omits / lists the models again), C{close-idle} (close keep-alive
connections between requests), C{calm} / C{chaos} (faults off / on),
C{quit}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import struct
import sys
import time
from typing import Any

FAULTS: tuple[tuple[str, float], ...] = (
    ("ok", 0.61),
    ("status_500", 0.03),
    ("status_502", 0.03),
    ("status_503", 0.04),
    ("status_429", 0.03),
    ("status_404", 0.03),
    ("abort", 0.05),  # read the request, then close before any header
    ("delay_short", 0.05),  # answer normally after well under the header timeout
    ("delay_long", 0.02),  # answer after well past the header timeout
    ("silent", 0.03),  # headers, then nothing until the proxy gives up
    ("die", 0.05),  # headers and some body, then reset (mid-stream death)
    ("empty", 0.03),  # 200 with an empty body
)
"""Fault name -> probability per receipt."""

CALM: tuple[tuple[str, float], ...] = (("ok", 1.0),)

STREAM_CHUNKS = 12
NONSTREAM_WORDS = 12
SILENCE_CAP = 60.0  # a silent receipt gives up after this, whatever the proxy does
_REASONS = {
    200: "OK",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


def choose_fault(
    seed: int, node: str, soak_id: str, nth: int, faults: tuple[tuple[str, float], ...]
) -> str:
    """The fault of the C{nth} receipt (from 0) of C{soak_id} on C{node}."""
    r = random.Random(f"{seed}:{node}:{soak_id}:{nth}").random()
    total = 0.0
    for name, weight in faults:
        total += weight
        if r < total:
            return name
    return faults[0][0]


class PeerClosed(Exception):
    """The proxy closed the connection."""


class Conn:
    """One accepted connection: a buffered reader that can watch for EOF."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.buffer = b""
        self.busy = False
        self.killed = False

    async def _fill(self, timeout: float | None) -> None:
        data = await asyncio.wait_for(self.reader.read(65536), timeout)
        if not data:
            raise PeerClosed()
        self.buffer += data

    async def read_until(self, marker: bytes, timeout: float | None) -> bytes:
        while marker not in self.buffer:
            if len(self.buffer) > 1 << 20:
                raise PeerClosed()
            await self._fill(timeout)
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    async def read_exactly(self, n: int, timeout: float | None) -> bytes:
        while len(self.buffer) < n:
            await self._fill(timeout)
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    async def wait_closed_or(self, seconds: float) -> bool:
        """Sleep C{seconds}; C{True} if the peer closed meanwhile."""
        try:
            await self._fill(seconds)
        except TimeoutError:
            return False
        except (PeerClosed, OSError):
            return True
        # The proxy does not pipeline: data here is unexpected but kept.
        return False

    def write(self, data: bytes) -> None:
        if self.killed or self.writer.is_closing():
            raise PeerClosed()
        self.writer.write(data)

    async def drain(self) -> None:
        try:
            await self.writer.drain()
        except (ConnectionError, OSError) as e:
            raise PeerClosed() from e
        if self.killed:
            raise PeerClosed()

    def reset(self) -> None:
        """Close with a TCP reset (SO_LINGER 0), as a crashed process would."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
            except OSError:
                pass
        self.writer.transport.abort()


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.host: str = args.host
        self.port: int = args.port
        self.node: str = args.node
        self.models: list[str] = [m for m in args.models.split(",") if m]
        self.seed: int = args.seed
        self.header_timeout: float = args.header_timeout
        self.idle_timeout: float = args.idle_timeout
        self.faults = FAULTS if not args.calm else CALM
        self.hidden = False
        self.receipts = 0
        self.seen: dict[str, int] = {}
        self.conns: set[Conn] = set()
        self.server: asyncio.Server | None = None
        self.out = open(args.receipts, "a", encoding="utf-8")

    def record(self, entry: dict[str, Any]) -> None:
        self.out.write(json.dumps(entry, separators=(",", ":")) + "\n")
        self.out.flush()

    async def start(self) -> None:
        self.server = await asyncio.start_server(
            self.serve, self.host, self.port, reuse_address=True
        )
        sock = self.server.sockets[0]
        self.port = sock.getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for conn in list(self.conns):
            conn.killed = True
            conn.reset()

    def close_idle(self) -> None:
        for conn in list(self.conns):
            if not conn.busy:
                conn.writer.close()

    # -- HTTP ---------------------------------------------------------------

    async def serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        conn = Conn(reader, writer)
        self.conns.add(conn)
        try:
            while not conn.killed:
                try:
                    head = await conn.read_until(b"\r\n\r\n", self.idle_timeout)
                except (TimeoutError, PeerClosed, OSError):
                    break
                conn.busy = True
                lines = head.decode("latin-1").split("\r\n")
                method, target, version = ([*lines[0].split(" "), "", ""])[:3]
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await self.read_body(conn, headers)
                keep = version == "HTTP/1.1" and (
                    headers.get("connection", "").lower() != "close"
                )
                keep = await self.handle(conn, method, target, headers, body) and keep
                conn.busy = False
                if not keep:
                    break
        except (TimeoutError, PeerClosed, OSError, ValueError):
            pass
        finally:
            self.conns.discard(conn)
            if not writer.is_closing():
                writer.close()

    async def read_body(self, conn: Conn, headers: dict[str, str]) -> bytes:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size_line = await conn.read_until(b"\r\n", 30)
                size = int(size_line.split(b";")[0], 16)
                chunk = await conn.read_exactly(size + 2, 30)
                if size == 0:
                    break
                parts.append(chunk[:-2])
            return b"".join(parts)
        length = int(headers.get("content-length", "0") or 0)
        return await conn.read_exactly(length, 30)

    @staticmethod
    def head(status: int, headers: list[tuple[str, str]]) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
        lines += [f"{name}: {value}" for name, value in headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def json_answer(
        self,
        conn: Conn,
        status: int,
        doc: Any,
        extra: list[tuple[str, str]] | None = None,
    ) -> None:
        if extra is None:
            extra = []
        body = json.dumps(doc).encode()
        conn.write(
            self.head(
                status,
                [
                    ("Content-Type", "application/json"),
                    ("Content-Length", str(len(body))),
                    *extra,
                ],
            )
            + body
        )

    async def handle(
        self,
        conn: Conn,
        method: str,
        target: str,
        headers: dict[str, str],
        body: bytes,
    ) -> bool:
        path = target.split("?", 1)[0]
        if method == "GET" and path in ("/models", "/v1/models"):
            models = [] if self.hidden else self.models
            self.json_answer(
                conn,
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": m, "object": "model", "owned_by": "soak"} for m in models
                    ],
                },
            )
            await conn.drain()
            return True
        if method == "POST" and path in ("/v1/chat/completions", "/chat/completions"):
            soak_id = headers.get("x-soak-id")
            if soak_id:
                return await self.receipt(conn, soak_id, body)
        self.json_answer(conn, 404, {"error": {"message": "not found", "code": 404}})
        await conn.drain()
        return True

    # -- receipts -----------------------------------------------------------

    async def receipt(self, conn: Conn, soak_id: str, body: bytes) -> bool:
        t_recv = time.monotonic()
        self.receipts += 1
        number = self.receipts
        nth = self.seen.get(soak_id, 0)
        self.seen[soak_id] = nth + 1
        fault = choose_fault(self.seed, self.node, soak_id, nth, self.faults)
        try:
            request = json.loads(body)
            stream = bool(request.get("stream"))
            model = str(request.get("model"))
        except (ValueError, AttributeError):
            stream, model = False, "?"
        rec: dict[str, Any] = {
            "kind": "receipt",
            "soak": soak_id,
            "node": self.node,
            "receipt": number,
            "t_recv": t_recv,
            "fault": fault,
            "stream": stream,
            "model": model,
            "status": None,
            "t_head": None,
            "t_first": None,
            "t_done": None,
            "end": None,
        }
        keep = True
        try:
            keep = await self.apply(conn, rec, fault, stream, model)
        except PeerClosed:
            rec["end"] = "killed" if conn.killed else "peer_closed"
            keep = False
        except OSError:
            rec["end"] = "killed" if conn.killed else "peer_closed"
            keep = False
        finally:
            if rec["end"] is None:
                rec["end"] = "killed" if conn.killed else "peer_closed"
            rec["t_end"] = time.monotonic()
            self.record(rec)
        return keep

    def tag(self, rec: dict[str, Any]) -> dict[str, Any]:
        return {"node": self.node, "receipt": rec["receipt"], "id": rec["soak"]}

    def tag_headers(self, rec: dict[str, Any]) -> list[tuple[str, str]]:
        return [("x-soak-node", self.node), ("x-soak-receipt", str(rec["receipt"]))]

    async def apply(
        self, conn: Conn, rec: dict[str, Any], fault: str, stream: bool, model: str
    ) -> bool:
        rng = random.Random(f"{self.seed}:{self.node}:{rec['receipt']}:timing")
        if fault.startswith("status_"):
            status = int(fault.split("_")[1])
            rec["status"] = status
            rec["t_head"] = time.monotonic()
            # Headers and the small error body in ONE write: the case where
            # the rest of the response shares the socket read with the headers.
            self.json_answer(
                conn,
                status,
                {
                    "error": {"message": f"soak fault {status}", "code": status},
                    "soak": self.tag(rec),
                },
                self.tag_headers(rec),
            )
            await conn.drain()
            rec["t_done"] = time.monotonic()
            rec["end"] = "complete"
            return True
        if fault == "abort":
            if rng.random() < 0.5:
                conn.reset()
                rec["end"] = "aborted_rst"
            else:
                conn.writer.close()
                rec["end"] = "aborted_fin"
            return False
        if fault in ("delay_short", "delay_long"):
            t = self.header_timeout
            delay = (
                rng.uniform(0.05, 0.5) * t
                if fault == "delay_short"
                else rng.uniform(1.5, 2.0) * t
            )
            if await conn.wait_closed_or(delay):
                rec["end"] = "peer_closed"
                return False
        if fault == "silent":
            rec["status"] = 200
            head = self.head(
                200,
                [
                    (
                        "Content-Type",
                        "text/event-stream" if stream else "application/json",
                    ),
                    ("Transfer-Encoding", "chunked"),
                    *self.tag_headers(rec),
                ],
            )
            conn.write(head)
            rec["t_head"] = time.monotonic()
            await conn.drain()
            closed = await conn.wait_closed_or(SILENCE_CAP)
            rec["end"] = "silent" if closed else "silent_cap"
            return False
        if fault == "empty":
            rec["status"] = 200
            conn.write(
                self.head(
                    200,
                    [
                        ("Content-Type", "application/json"),
                        ("Content-Length", "0"),
                        *self.tag_headers(rec),
                    ],
                )
            )
            rec["t_head"] = time.monotonic()
            await conn.drain()
            rec["t_done"] = rec["t_first"] = time.monotonic()
            rec["end"] = "complete"
            return True
        die = fault == "die"
        rec["status"] = 200
        if stream:
            return await self.stream(conn, rec, model, rng, die)
        return await self.document(conn, rec, model, rng, die)

    async def stream(
        self,
        conn: Conn,
        rec: dict[str, Any],
        model: str,
        rng: random.Random,
        die: bool,
    ) -> bool:
        name = f"soak-{self.node}-{rec['receipt']}"
        head = self.head(
            200,
            [
                ("Content-Type", "text/event-stream"),
                ("Cache-Control", "no-cache"),
                ("Transfer-Encoding", "chunked"),
                *self.tag_headers(rec),
            ],
        )
        die_after = rng.randint(1, STREAM_CHUNKS - 1) if die else None
        events: list[bytes] = []
        for i in range(STREAM_CHUNKS):
            event: dict[str, Any] = {
                "id": name,
                "object": "chat.completion.chunk",
                "model": model,
                "choices": [
                    {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
                ],
                "soak": self.tag(rec),
            }
            events.append(b"data: " + json.dumps(event).encode() + b"\n\n")
        final = {
            "id": name,
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {
                "prompt_tokens": 5,
                "completion_tokens": STREAM_CHUNKS,
                "total_tokens": 5 + STREAM_CHUNKS,
            },
            "soak": self.tag(rec),
        }
        events.append(b"data: " + json.dumps(final).encode() + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        first = True
        for i, data in enumerate(events):
            frame = b"%x\r\n%s\r\n" % (len(data), data)
            conn.write(head + frame if first else frame)
            if first:
                rec["t_head"] = time.monotonic()
            await conn.drain()
            if first:
                rec["t_first"] = time.monotonic()
                first = False
            if die_after is not None and i + 1 >= die_after:
                conn.reset()
                rec["end"] = "died"
                return False
            if rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0.0, 0.004))
        conn.write(b"0\r\n\r\n")
        await conn.drain()
        rec["t_done"] = time.monotonic()
        rec["end"] = "complete"
        return True

    async def document(
        self,
        conn: Conn,
        rec: dict[str, Any],
        model: str,
        rng: random.Random,
        die: bool,
    ) -> bool:
        doc = {
            "id": f"soak-{self.node}-{rec['receipt']}",
            "object": "chat.completion",
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": " ".join(f"w{i}" for i in range(NONSTREAM_WORDS)),
                    },
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": 5,
                "completion_tokens": NONSTREAM_WORDS,
                "total_tokens": 5 + NONSTREAM_WORDS,
            },
            "soak": self.tag(rec),
        }
        body = json.dumps(doc).encode()
        head = self.head(
            200,
            [
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                *self.tag_headers(rec),
            ],
        )
        if die:
            cut = rng.randint(1, len(body) - 1)
            conn.write(head + body[:cut])
            rec["t_head"] = time.monotonic()
            await conn.drain()
            rec["t_first"] = time.monotonic()
            await asyncio.sleep(rng.uniform(0.0, 0.01))
            conn.reset()
            rec["end"] = "died"
            return False
        conn.write(head + body)
        rec["t_head"] = time.monotonic()
        await conn.drain()
        rec["t_first"] = rec["t_done"] = time.monotonic()
        rec["end"] = "complete"
        return True

    # -- control ------------------------------------------------------------

    async def control(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
        )
        while True:
            line = await reader.readline()
            if not line:
                break
            command = line.decode().strip()
            now = time.monotonic()
            if command == "stop":
                await self.stop()
            elif command == "start":
                if self.server is None:
                    await self.start()
            elif command == "hide":
                self.hidden = True
            elif command == "show":
                self.hidden = False
            elif command == "close-idle":
                self.close_idle()
            elif command == "calm":
                self.faults = CALM
            elif command == "chaos":
                self.faults = FAULTS
            elif command == "quit":
                print("ok quit", flush=True)
                break
            else:
                print(f"error unknown command {command!r}", flush=True)
                continue
            self.record(
                {"kind": "event", "node": self.node, "event": command, "t": now}
            )
            print(f"ok {command}", flush=True)
        await self.stop()


async def amain(args: argparse.Namespace) -> int:
    engine = Engine(args)
    await engine.start()
    print(f"listening on {engine.host}:{engine.port}", flush=True)
    await engine.control()
    engine.out.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak.engine")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--node", required=True)
    parser.add_argument("--models", required=True, help="comma-separated model ids")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--receipts", required=True, help="JSON-lines output file")
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=1.5,
        help="the proxy's response header timeout: delays are placed well "
        "below or well above it",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=5.0,
        help="close a keep-alive connection idle this long (seconds)",
    )
    parser.add_argument("--calm", action="store_true", help="no faults")
    args = parser.parse_args(argv)
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
