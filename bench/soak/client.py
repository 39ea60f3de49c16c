"""
The soak's load generator: raw HTTP/1.1 over asyncio streams, one keep-alive
connection per worker, able to walk away from a request at any point.

Each L{Answer} records what the client saw: the status and headers, the body
bytes, whether the body's framing completed (Content-Length reached, or the
last chunk of a chunked body), and when.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Answer:
    soak: str
    index: int
    worker: int
    model: str
    stream: bool
    plan: str | None  # None, "before" (response) or "during" (the body)
    t_send: float = 0.0
    wall_send: float = 0.0
    t_head: float | None = None
    t_end: float = 0.0
    wall_end: float = 0.0
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    complete: bool = False
    error: str | None = None
    disconnected: bool = False
    t_disconnect: float | None = None
    reused: bool = False
    keep_alive: bool = False

    @property
    def duration(self) -> float:
        return self.t_end - self.t_send

    def markers(self) -> set[tuple[str, int]]:
        """Every (node, receipt) the headers and the body name."""
        found: set[tuple[str, int]] = set()
        node, number = (
            self.headers.get("x-soak-node"),
            self.headers.get("x-soak-receipt"),
        )
        if node and number and number.isdigit():
            found.add((node, int(number)))
        for doc in self.documents():
            tag = doc.get("soak") if isinstance(doc, dict) else None
            if isinstance(tag, dict):
                found.add((str(tag.get("node")), int(tag.get("receipt", -1))))
        return found

    def documents(self) -> list[Any]:
        """The JSON documents of the body: one, or one per SSE event."""
        text = self.body.decode("utf-8", "replace")
        if self.headers.get("content-type", "").startswith("text/event-stream"):
            out = []
            for event in text.split("\n\n"):
                if event.startswith("data: ") and event != "data: [DONE]":
                    try:
                        out.append(json.loads(event[6:]))
                    except ValueError:
                        pass
            return out
        try:
            return [json.loads(text)] if text else []
        except ValueError:
            return []


class Closed(Exception):
    pass


class Connection:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.buffer = b""
        self.used = 0
        self.last_used = time.monotonic()

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def _fill(self) -> None:
        data = await self.reader.read(65536)
        if not data:
            raise Closed()
        self.buffer += data

    async def read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            await self._fill()
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    async def read_exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            await self._fill()
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    async def read_some(self) -> bytes:
        if not self.buffer:
            await self._fill()
        data, self.buffer = self.buffer, b""
        return data

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()

    def abort(self) -> None:
        self.writer.transport.abort()


def request_bytes(host: str, answer: Answer) -> bytes:
    body = json.dumps(
        {
            "model": answer.model,
            "stream": answer.stream,
            "messages": [{"role": "user", "content": f"soak {answer.soak}"}],
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        f"Host: {host}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"x-soak-id: {answer.soak}\r\n"
        "\r\n"
    )
    return head.encode("latin-1") + body


async def _read_head(conn: Connection, answer: Answer) -> None:
    head = await conn.read_until(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    answer.status = int(parts[1])
    for line in lines[1:]:
        name, _, value = line.partition(":")
        answer.headers[name.strip().lower()] = value.strip()
    answer.t_head = time.monotonic()
    answer.keep_alive = answer.headers.get("connection", "").lower() != "close"


async def _read_body(conn: Connection, answer: Answer, stop_after_first: bool) -> None:
    """Read the body into C{answer}; with C{stop_after_first}, return after
    the first bytes (leaving C{complete} false unless it is all there)."""
    headers = answer.headers
    parts: list[bytes] = []
    try:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await conn.read_until(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    await conn.read_until(b"\r\n")
                    answer.complete = True
                    return
                parts.append((await conn.read_exactly(size + 2))[:-2])
                if stop_after_first:
                    return
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left > 0:
                if not conn.buffer:
                    await conn._fill()
                chunk = conn.buffer[:left]
                conn.buffer = conn.buffer[left:]
                parts.append(chunk)
                left -= len(chunk)
                if stop_after_first and left > 0:
                    return
            answer.complete = True
        else:
            answer.keep_alive = False
            try:
                while True:
                    parts.append(await conn.read_some())
                    if stop_after_first:
                        return
            except Closed:
                answer.complete = True
    finally:
        answer.body = b"".join(parts)


async def exchange(
    conn: Connection,
    host: str,
    answer: Answer,
    timeout: float,
    before_delay: float,
) -> None:
    """
    Send C{answer}'s request on C{conn} and read what comes back, walking
    away as C{answer.plan} says.  Never raises: errors land in C{answer}.
    """
    answer.reused = conn.used > 0
    conn.used += 1
    answer.t_send = time.monotonic()
    answer.wall_send = time.time()

    async def run() -> None:
        conn.writer.write(request_bytes(host, answer))
        await conn.writer.drain()
        await _read_head(conn, answer)
        await _read_body(conn, answer, stop_after_first=answer.plan == "during")

    task = asyncio.ensure_future(run())
    limit = before_delay if answer.plan == "before" else timeout
    try:
        await asyncio.wait_for(asyncio.shield(task), limit)
    except TimeoutError:
        if answer.plan == "before":
            answer.disconnected = True
            answer.t_disconnect = time.monotonic()
            task.cancel()
            conn.close()
        else:
            answer.error = "timeout"
            task.cancel()
            conn.abort()
    except Closed:
        answer.error = "eof_before_headers" if answer.status is None else "eof_in_body"
    except (ConnectionError, OSError) as e:
        answer.error = (
            f"{type(e).__name__}_before_headers"
            if answer.status is None
            else f"{type(e).__name__}_in_body"
        )
    except ValueError as e:
        answer.error = f"bad_http: {e}"
    else:
        if answer.plan == "during" and not answer.complete:
            answer.disconnected = True
            answer.t_disconnect = time.monotonic()
            conn.abort()
    try:
        await asyncio.wait_for(task, 1.0)
    except BaseException:
        pass
    answer.t_end = time.monotonic()
    answer.wall_end = time.time()
    conn.last_used = time.monotonic()
