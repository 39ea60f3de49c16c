"""
Tests for the broker link (spec §3, §4): JSON-RPC 2.0 over newline-delimited
JSON, unit-tested with a fake target, then against a real nvproxy.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import evolve
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import LogLevel, capturedLogs
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.control import MAX_DEPTH, MAX_LINE, ControlLink, split_address
from nvproxy.scheduler import SchedulerSnapshot
from nvproxy.testing.harness import facade_url, free_port, proxy_config
from tests.test_forwarding import ProxyTestCase


class FakeTarget:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail_enable = False

    def enable_facade(
        self,
        engine: str,
        port: int,
        aliases: Sequence[tuple[str, int]],
        ignore_persisted: bool,
    ) -> Deferred[int]:
        self.calls.append(("enable", engine, port, list(aliases), ignore_persisted))
        if self.fail_enable:
            return fail(OSError("Address already in use"))
        return succeed(port or 11435)

    def disable_facade(self, engine: str) -> Deferred[None]:
        self.calls.append(("disable", engine))
        return succeed(None)

    def select(self, engine: str, node: str | None) -> Mapping[str, Any]:
        self.calls.append(("select", engine, node))
        return {"engine": engine, "selected": node}

    def set_port(self, engine: str, port: int) -> Deferred[Mapping[str, Any]]:
        self.calls.append(("set-port", engine, port))
        return succeed({"engine": engine, "port": port, "persisted": True})

    def apply_priority(self, snapshot: SchedulerSnapshot) -> bool:
        self.calls.append(("priority", snapshot.generation, snapshot.priority))
        return True

    def set_log_level(self, level: str) -> None:
        self.calls.append(("level", level))


class LinkTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.target = FakeTarget()
        self.closed: list[bool] = []
        self.link = ControlLink(self.target, lambda: self.closed.append(True))
        self.transport = StringTransport()
        self.link.makeConnection(self.transport)

    def send(self, message: object) -> list[dict[str, Any]]:
        self.transport.clear()
        self.link.dataReceived(json.dumps(message).encode() + b"\n")
        return [json.loads(line) for line in self.transport.value().splitlines()]

    def test_enable(self) -> None:
        out = self.send(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "facade/enable",
                "params": {
                    "engine": "ollama",
                    "port": 0,
                    "aliases": ["127.0.0.2:11434"],
                },
            }
        )
        self.assertEqual(
            out,
            [
                {"jsonrpc": "2.0", "method": "ollama:ready", "params": {"port": 11435}},
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "result": {"engine": "ollama", "port": 11435},
                },
            ],
        )
        self.assertEqual(
            self.target.calls, [("enable", "ollama", 0, [("127.0.0.2", 11434)], False)]
        )

    def test_enable_bind_failure(self) -> None:
        self.target.fail_enable = True
        out = self.send(
            {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "facade/enable",
                "params": {"engine": "vllm", "port": 8000},
            }
        )
        self.assertEqual(out[0]["method"], "vllm:error")
        self.assertEqual(out[0]["params"]["kind"], "bind")
        self.assertEqual(out[1]["id"], 2)
        self.assertEqual(out[1]["error"]["code"], -32000)

    def test_bad_params(self) -> None:
        for params in (
            {"engine": "tgi", "port": 1},
            {"engine": "ollama", "port": 70000},
            {"engine": "ollama", "port": 1, "aliases": ["nope"]},
        ):
            out = self.send(
                {"jsonrpc": "2.0", "id": 3, "method": "facade/enable", "params": params}
            )
            self.assertEqual(out[-1]["error"]["code"], -32602, params)
        self.assertEqual(self.target.calls, [])

    def test_addressing(self) -> None:
        """
        Facade-scoped methods need an engine address; an unaddressed one
        resolves to no facade (spec §4).
        """
        out = self.send(
            {
                "jsonrpc": "2.0",
                "id": 4,
                "method": "node/select",
                "params": {"nodeId": "a"},
            }
        )
        self.assertEqual(out[0]["error"]["code"], -32602)
        out = self.send(
            {
                "jsonrpc": "2.0",
                "id": 5,
                "method": "lmstudio:node/select",
                "params": {"nodeId": "gpu-2"},
            }
        )
        self.assertEqual(out[0]["result"], {"engine": "lmstudio", "selected": "gpu-2"})
        self.assertEqual(self.target.calls, [("select", "lmstudio", "gpu-2")])

    def test_split_address(self) -> None:
        self.assertEqual(split_address("ollama:node/select"), ("ollama", "node/select"))
        self.assertEqual(split_address("errors:report"), (None, "errors:report"))
        self.assertEqual(split_address("workload:started"), (None, "workload:started"))

    def test_priority(self) -> None:
        out = self.send(
            {
                "jsonrpc": "2.0",
                "id": 6,
                "method": "node/set-priority",
                "params": {
                    "generation": 7,
                    "priority": ["b", "a"],
                    "pending": {"a": 2},
                    "gpuPressure": {"b": 0.5},
                },
            }
        )
        self.assertEqual(
            out, [{"jsonrpc": "2.0", "id": 6, "result": {"applied": True}}]
        )
        self.assertEqual(self.target.calls, [("priority", 7, ("b", "a"))])

    def test_errors(self) -> None:
        self.transport.clear()
        self.link.dataReceived(b"{not json\n")
        self.assertEqual(json.loads(self.transport.value())["error"]["code"], -32700)
        out = self.send({"jsonrpc": "2.0", "id": 8, "method": "frobnicate"})
        self.assertEqual(out[0]["error"]["code"], -32601)
        out = self.send({"id": 9, "method": "log/set-level"})
        self.assertEqual(out[0]["error"]["code"], -32600)
        # A notification with an error gets no answer.
        out = self.send({"jsonrpc": "2.0", "method": "frobnicate"})
        self.assertEqual(out, [])

    def test_close(self) -> None:
        self.link.connectionLost(None)
        self.assertEqual(self.closed, [True])


VALID = (
    b'{"jsonrpc":"2.0","id":"next","method":"log/set-level","params":{"level":"info"}}'
)
"""A valid request; its answer shows the link still reads lines."""

VALID_ANSWER = {"jsonrpc": "2.0", "id": "next", "result": {"level": "info"}}


class HostileLineTests(SynchronousTestCase):
    """
    Nothing the broker sends closes the link or escapes as an exception:
    each bad line gets its JSON-RPC error and the next line is read.
    """

    def setUp(self) -> None:
        self.target = FakeTarget()
        self.closed: list[bool] = []
        self.link = ControlLink(self.target, lambda: self.closed.append(True))
        self.transport = StringTransport()
        self.link.makeConnection(self.transport)

    def feed(self, *chunks: bytes) -> list[dict[str, Any]]:
        """
        Deliver C{chunks}, then L{VALID}; the answers before VALID's, which
        must be the last line written.
        """
        self.transport.clear()
        with capturedLogs() as events:
            for chunk in chunks:
                self.link.dataReceived(chunk)
            self.link.dataReceived(VALID + b"\n")
        bad = [e for e in events if e["log_level"] >= LogLevel.error]
        self.assertEqual(bad, [])
        self.assertFalse(self.transport.disconnecting)
        self.assertEqual(self.closed, [])
        out = [json.loads(line) for line in self.transport.value().splitlines()]
        self.assertEqual(out[-1], VALID_ANSWER)
        return out[:-1]

    def assertError(
        self, out: list[dict[str, Any]], code: int, ident: object = None
    ) -> str:
        self.assertEqual(len(out), 1, out)
        self.assertEqual(set(out[0]), {"jsonrpc", "id", "error"})
        self.assertEqual(out[0]["id"], ident)
        self.assertEqual(out[0]["error"]["code"], code)
        message = out[0]["error"]["message"]
        assert isinstance(message, str)
        return message

    def test_deeply_nested_array(self) -> None:
        """
        JSON nested 100,000 deep (beyond what the parser can descend) is an
        invalid request naming the depth limit, not a RecursionError.
        """
        deep = b"[" * 100_000 + b"]" * 100_000 + b"\n"
        message = self.assertError(self.feed(deep), -32600)
        self.assertIn(str(MAX_DEPTH), message)

    def test_deeply_nested_unclosed(self) -> None:
        out = self.feed(b'{"a":' * 100_000 + b"\n")
        self.assertIn(out[0]["error"]["code"], (-32700, -32600))
        self.assertEqual(len(out), 1)

    def test_nested_params_keep_their_id(self) -> None:
        """
        A request the parser reads but nested deeper than the limit is
        refused before any handler sees (or prints) its params.
        """
        level: object = "info"
        for _ in range(MAX_DEPTH + 200):
            level = [level]
        line = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": 7,
                "method": "log/set-level",
                "params": {"level": level},
            }
        ).encode()
        message = self.assertError(self.feed(line + b"\n"), -32600, 7)
        self.assertIn(str(MAX_DEPTH), message)
        self.assertEqual(self.target.calls, [("level", "info")])

    def test_nesting_at_the_limit(self) -> None:
        """
        A message exactly L{MAX_DEPTH} deep (the top-level object counts) is
        carried out.
        """
        value: object = []
        for _ in range(MAX_DEPTH - 3):
            value = [value]
        line = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": 8,
                "method": "log/set-level",
                "params": {"level": "debug", "x": value},
            }
        ).encode()
        out = self.feed(line + b"\n")
        self.assertEqual(
            out, [{"jsonrpc": "2.0", "id": 8, "result": {"level": "debug"}}]
        )

    def test_not_json(self) -> None:
        """
        Invalid JSON, including the NaN and Infinity Python would accept and
        bad UTF-8, is a parse error with id null.
        """
        for line in (
            b"{not json",
            b'{"jsonrpc":"2.0","id":NaN,"method":"log/set-level"}',
            b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"a":-Infinity}}',
            b'{"jsonrpc":"2.0","id":"\xff","method":"x"}',
            b"\x00\x01\x02",
            b'{"jsonrpc":"2.0","id":' + b"9" * 5000 + b',"method":"x"}',
        ):
            self.assertError(self.feed(line + b"\n"), -32700)

    def test_bad_ids(self) -> None:
        """
        An id that is not a string, a finite number or null makes the
        request invalid; the answer's id is null, and nothing is done.
        """
        for ident in (b"true", b"[1]", b'{"a":1}', b"1e400"):
            line = (
                b'{"jsonrpc":"2.0","id":'
                + ident
                + b',"method":"log/set-level","params":{"level":"warn"}}'
            )
            self.assertError(self.feed(line + b"\n"), -32600)
        self.assertEqual(self.target.calls, [("level", "info")] * 4)

    def test_bad_method(self) -> None:
        """
        A request with an id but no string method is answered as invalid
        with its id; a response to us (result or error, no method) is not.
        """
        out = self.feed(b'{"jsonrpc":"2.0","id":3,"method":5}\n')
        self.assertError(out, -32600, 3)
        out = self.feed(b'{"jsonrpc":"2.0","id":4}\n')
        self.assertError(out, -32600, 4)
        out = self.feed(b'{"jsonrpc":"2.0","id":5,"result":{}}\n')
        self.assertEqual(out, [])

    def test_not_an_object(self) -> None:
        for line in (b"[]", b"3", b'"x"', b"null", b'{"jsonrpc":"1.0","id":1}'):
            self.assertError(self.feed(line + b"\n"), -32600)

    def test_bad_values_in_params(self) -> None:
        """
        Values that used to escape as exceptions (an infinite float for an
        int, a non-ASCII digit in a port) are invalid params.
        """
        for params in (
            {"generation": 1, "pending": {"a": 1e400}},
            {"engine": "ollama", "port": 1, "aliases": ["h:\u00b2"]},
            {"engine": "ollama", "port": 1, "aliases": ["h:" + "1" * 5000]},
        ):
            method = "node/set-priority" if "generation" in params else "facade/enable"
            line = json.dumps(
                {"jsonrpc": "2.0", "id": 9, "method": method, "params": params}
            ).replace("Infinity", "1e400")
            self.assertError(self.feed(line.encode() + b"\n"), -32602, 9)

    def test_default_max_line(self) -> None:
        """
        The default limit is 1 MiB: a line of exactly that size is read, one
        byte more is refused.
        """
        self.assertEqual(self.link.max_line, MAX_LINE)
        self.assertEqual(MAX_LINE, 2**20)
        exact = VALID[:-1] + b" " * (MAX_LINE - len(VALID)) + b"}"
        self.assertEqual(len(exact), MAX_LINE)
        self.assertEqual(self.feed(exact + b"\n"), [VALID_ANSWER])
        message = self.assertError(self.feed(b" " + exact + b"\n"), -32600)
        self.assertIn("1MiB", message)

    def test_long_line_in_chunks(self) -> None:
        """
        An 8 MB line arriving in pipe-sized chunks is refused once, as soon
        as it is known to be too long, and discarded up to its newline; the
        request after the newline in the same chunk is carried out.
        """
        self.transport.clear()
        chunk = b"x" * 65536
        self.link.dataReceived(chunk * 16)
        self.link.dataReceived(b"x")
        out = [json.loads(line) for line in self.transport.value().splitlines()]
        message = self.assertError(out, -32600)
        self.assertEqual(message, "line longer than 1MiB (1048576 bytes); discarded")
        out = self.feed(*[chunk] * 110, b"tail\n")
        self.assertEqual(out, [])
        self.assertEqual(self.link._buffer, b"")

    def test_long_line_in_one_chunk(self) -> None:
        """
        A small limit; several lines in one chunk, the long one in the middle
        refused alone.
        """
        self.link.max_line = 64
        line = (
            b'{"jsonrpc":"2.0","id":1,"method":"log/set-level",'
            b'"params":{"level":"warn"}}'
        )
        self.assertGreater(len(line), 64)
        short = b'{"jsonrpc":"2.0","id":2,"method":"frobnicate"}'
        self.transport.clear()
        self.link.dataReceived(short + b"\n" + line + b"\n" + short + b"\n")
        out = [json.loads(x) for x in self.transport.value().splitlines()]
        self.assertEqual([m["id"] for m in out], [2, None, 2])
        self.assertEqual(out[1]["error"]["code"], -32600)
        self.assertIn("64B", out[1]["error"]["message"])
        self.assertEqual(self.target.calls, [])

    def test_only_close_stops(self) -> None:
        """
        Closing the link calls its close hook and says so in the log.
        """
        self.feed(b"[" * 5000 + b"\n", b"x" * (MAX_LINE + 1) + b"\n")
        with capturedLogs() as events:
            self.link.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.closed, [True])
        self.assertEqual(
            [e["log_format"] for e in events], ["broker link closed: {why}"]
        )
        self.assertIn("closed cleanly", events[0]["why"])


_IDS = st.one_of(
    st.none(),
    st.integers(),
    st.text(max_size=5),
    st.floats(),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_PARAM_KEYS = st.sampled_from(
    [
        "engine",
        "port",
        "aliases",
        "ignorePersistedPort",
        "nodeId",
        "node",
        "generation",
        "priority",
        "pending",
        "gpuPressure",
        "level",
    ]
)
_PARAM_VALUES = st.one_of(
    _JSON,
    st.sampled_from(["ollama", "vllm", "info", "h:1", "h:\u00b2", "[::1]:80"]),
    st.lists(st.sampled_from(["a", "127.0.0.2:11434", "x:99999"]), max_size=3),
    st.dictionaries(st.text(max_size=3), st.floats() | st.integers(), max_size=2),
)
_METHODS = st.one_of(
    st.sampled_from(
        [
            "facade/enable",
            "facade/disable",
            "ollama:node/select",
            "node/select",
            "lmstudio:set-port",
            "node/set-priority",
            "log/set-level",
            "vllm:ready",
            "errors:report",
        ]
    ),
    st.text(max_size=12),
    st.integers(),
    st.none(),
)


@st.composite
def _rpcish(draw: st.DrawFn) -> bytes:
    message: dict[str, object] = {}
    if draw(st.booleans()) or draw(st.booleans()):
        message["jsonrpc"] = draw(st.sampled_from(["2.0", "2.0", "1.0", 2.0]))
    if draw(st.booleans()):
        message["id"] = draw(_IDS)
    if draw(st.integers(0, 4)):
        message["method"] = draw(_METHODS)
    if draw(st.booleans()):
        message["params"] = draw(
            st.dictionaries(_PARAM_KEYS, _PARAM_VALUES, max_size=4) | _JSON
        )
    if draw(st.integers(0, 9)) == 0:
        message[draw(st.sampled_from(["result", "error"]))] = draw(_JSON)
    return json.dumps(message).encode()


_LINES = st.one_of(
    st.binary(max_size=80).map(lambda b: b.replace(b"\n", b"")),
    _JSON.map(lambda v: json.dumps(v).encode()),
    _rpcish(),
    _rpcish(),
    st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(400, 1500).map(lambda n: b"{" + b" " * n + b"}"),
)


def _request_id(line: bytes, max_line: int) -> object:
    """
    The test's own reading: the id of C{line} if it is a JSON-RPC 2.0
    request with an id the link must answer; else L{Ellipsis}.
    """
    if len(line) > max_line:
        return ...
    try:
        message = json.loads(line, parse_constant=_refuse)
    except (ValueError, RecursionError):
        return ...
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        return ...
    ident = message.get("id")
    if (
        ident is None
        or isinstance(ident, bool)
        or not isinstance(ident, str | int | float)
    ):
        return ...
    if ident in (float("inf"), float("-inf")):
        return ...
    if "method" not in message and ("result" in message or "error" in message):
        return ...
    return ident


def _refuse(name: str) -> object:
    raise ValueError(name)


class FuzzTests(SynchronousTestCase):
    @settings(max_examples=300)
    @given(
        lines=st.lists(_LINES, max_size=8),
        cuts=st.lists(st.integers(0, 4000), max_size=6),
    )
    def test_random_lines(self, lines: list[bytes], cuts: list[int]) -> None:
        """
        Random bytes, JSON values and JSON-RPC-ish objects, cut into random
        chunks: the link never raises, never closes, logs no error, answers
        each request that has an id exactly once and each over-long line
        once.
        """
        target = FakeTarget()
        closed: list[bool] = []
        link = ControlLink(target, lambda: closed.append(True), max_line=1024)
        transport = StringTransport()
        link.makeConnection(transport)
        data = b"".join(line + b"\n" for line in lines)
        with capturedLogs() as events:
            start = 0
            for cut in sorted(set(cuts)):
                link.dataReceived(data[start:cut])
                start = max(start, cut)
            link.dataReceived(data[start:])
        self.assertEqual([e for e in events if e["log_level"] >= LogLevel.error], [])
        self.assertFalse(transport.disconnecting)
        self.assertEqual(closed, [])
        out = [json.loads(x) for x in transport.value().splitlines()]
        for message in out:
            self.assertEqual(message["jsonrpc"], "2.0")
        expected = Counter(
            json.dumps(ident)
            for ident in (_request_id(line, link.max_line) for line in lines)
            if ident is not ...
        )
        answered = Counter(
            json.dumps(m["id"]) for m in out if "id" in m and m["id"] is not None
        )
        self.assertEqual(answered, expected)
        too_long = sum(len(line) > link.max_line for line in lines)
        refused = sum(
            "line longer than" in m.get("error", {}).get("message", "") for m in out
        )
        self.assertEqual(refused, too_long)


class ServiceCloseTests(SynchronousTestCase):
    def test_only_a_closed_link_stops(self) -> None:
        """
        The service gives the link C{control.max_line}; bad lines leave the
        reactor running, closing the link stops it with a log line.
        """
        from nvproxy.service import build

        config = evolve(
            proxy_config(self.mktemp(), {"ollama": "http://127.0.0.1:1"}),
            control="stdio",
            control_max_line=4096,
        )
        clock = MemoryReactorClock()
        proxy = build(config, clock, hostname="local")
        assert proxy.link is not None
        self.assertEqual(proxy.link.max_line, 4096)
        transport = StringTransport()
        proxy.link.makeConnection(transport)
        proxy.startService()
        self.addCleanup(proxy.stopService)
        proxy.link.dataReceived(b"x" * 5000 + b"\n" + b"[" * 100_000 + b"\n")
        self.assertEqual(len(transport.value().splitlines()), 2)
        self.assertFalse(clock.hasStopped)
        with capturedLogs() as events:
            proxy.link.connectionLost(Failure(ConnectionDone()))
        self.assertTrue(clock.hasStopped)
        self.assertIn(
            "stopping: the broker link is closed", [e["log_format"] for e in events]
        )


class ServiceLinkTests(ProxyTestCase):
    async def test_broker_enables_facades_and_gets_events(self) -> None:
        """
        With the link, nvproxy starts with no facade; facade/enable starts
        one, reports ready, and workload events flow to the broker.
        """
        fake = await self.engine("openai", ["m"])
        config = evolve(
            proxy_config(self.mktemp(), {"lmstudio": fake.url}), control="stdio"
        )
        from nvproxy.service import build

        proxy = build(config, reactor, hostname="local")
        assert proxy.link is not None
        transport = StringTransport()
        proxy.link.makeConnection(transport)
        proxy._link_closed = lambda: None  # type: ignore[method-assign]
        proxy.startService()
        self.addCleanup(proxy.stopService)
        self.assertEqual(proxy.listeners, {})
        port = free_port()
        proxy.link.dataReceived(
            json.dumps(
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "facade/enable",
                    "params": {"engine": "lmstudio", "port": port},
                }
            ).encode()
            + b"\n"
        )
        for _ in range(50):
            if b'"id":1' in transport.value():
                break
            await _tick()
        lines = [json.loads(line) for line in transport.value().splitlines()]
        self.assertIn(
            {"jsonrpc": "2.0", "method": "lmstudio:ready", "params": {"port": port}},
            lines,
        )
        await proxy.polling.poll()
        transport.clear()
        code, _, _ = await self.post(
            facade_url(proxy, "lmstudio") + "/v1/completions", {"model": "m"}
        )
        self.assertEqual(code, 200)
        methods = [
            json.loads(line)["method"] for line in transport.value().splitlines()
        ]
        self.assertEqual(
            methods,
            [
                "workload:submitted",
                "workload:submitted",
                "workload:started",
                "workload:completed",
            ],
        )
        # A snapshot is applied once; a redelivery is not.
        for expected in (True, False):
            transport.clear()
            proxy.link.dataReceived(
                b'{"jsonrpc":"2.0","id":2,"method":"node/set-priority",'
                b'"params":{"generation":3,"priority":["local"]}}\n'
            )
            self.assertEqual(
                json.loads(transport.value())["result"], {"applied": expected}
            )


async def _tick() -> None:
    from twisted.internet.task import deferLater

    await deferLater(reactor, 0.02, lambda: None)
