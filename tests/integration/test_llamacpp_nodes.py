"""
Two real C{llama-server} instances as two nodes behind one llama.cpp facade
(opt-in like L{tests.integration.test_llamacpp}: C{NVPROXY_REAL_ENGINES=1}
and a cached binary, see C{tox -e real}).

This node's engine is instance A; the direct node C{node-b} is instance B.
Both serve the same tiny GGUF model as C{tiny}, so either can answer, and
each test pins the facade to the node it wants first (C{PUT
/admin/engines/llamacpp/select}) so it knows which instance is serving.
Discovery polls once at start and then not for a minute: what happens when
an instance dies is the dispatcher's doing, not discovery's.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.internet.utils import getProcessOutputAndValue
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from nvproxy.service import NvProxy
from nvproxy.testing.harness import Client, facade_url, proxy_config, start_proxy
from tests.integration import llamacpp
from tests.integration.test_llamacpp import _real_skip, sse_data

MODEL = "tiny"
NODE_A, NODE_B = "local", "node-b"
LONG = 8000
"""Tokens asked of a long answer: 10-30 s on two cores, long enough to be
cut or abandoned part-way (each slot has an 8K context, see L{start})."""
CANCELLED = "stop: cancel task"
"""What llama-server logs when it drops a task whose client went away."""


class _Stream(Protocol):
    """
    A raw HTTP client for one streaming request: counts the SSE events
    received and can hang up at any moment.
    """

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.received = bytearray()
        self.closed: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(self.request)

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def events(self) -> int:
        return self.received.count(b"data:")

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:
        self.closed.callback(None)


class TwoLlamaServerTests(TestCase):
    """The llama.cpp facade over two real instances of the engine."""

    skip = _real_skip()
    timeout = 120

    client: Client
    proxy: NvProxy
    facade: str
    admin: str
    servers: dict[str, llamacpp.LlamaServer]

    async def start(self, aliases: tuple[str, str] = (MODEL, MODEL)) -> None:
        binary = llamacpp.find_llama_server()
        assert binary is not None  # else skipped
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        model = llamacpp.write_tiny_model(os.path.join(directory, "tiny.gguf"))
        self.servers = {}
        for node, alias in zip((NODE_A, NODE_B), aliases, strict=True):
            server = await llamacpp.start_llama_server(
                reactor, binary, model, alias=alias, extra=("-c", "16384")
            )
            self.addCleanup(server.stop)
            self.servers[node] = server
        config = proxy_config(
            os.path.join(directory, "state"),
            {"llamacpp": self.servers[NODE_A].url},
            nodes={NODE_B: {"llamacpp": self.servers[NODE_B].url}},
            poll_interval=60.0,
            admin=True,
            max_attempts=3,
            response_header_timeout=30.0,
        )
        self.client = Client(reactor)
        self.addCleanup(self.client.close)
        self.proxy = await start_proxy(reactor, config)
        self.addCleanup(self.proxy.stopService)
        self.facade = facade_url(self.proxy, "llamacpp")
        self.admin = f"http://127.0.0.1:{config.admin_listen[1]}"

    async def pin(self, node: str) -> None:
        code, _, body = await self.client.request(
            "PUT",
            self.admin + "/admin/engines/llamacpp/select",
            data=json.dumps({"node": node}).encode(),
            headers={"Content-Type": ["application/json"]},
        )
        self.assertEqual(code, 200, body)

    async def workloads(self) -> list[dict[str, Any]]:
        code, _, body = await self.client.request(
            "GET", self.admin + "/admin/workloads?limit=50"
        )
        self.assertEqual(code, 200, body)
        entries: list[dict[str, Any]] = json.loads(body)["workloads"]
        return entries

    async def terminal(self) -> dict[str, Any]:
        """The latest workload once it has its terminal event (bounded)."""
        for _ in range(200):
            entries = await self.workloads()
            if entries and entries[0]["workloadInfo"]["state"] != "running":
                return entries[0]
            await deferLater(reactor, 0.05, lambda: None)
        self.fail(f"no terminal workload event: {(await self.workloads())[:1]}")

    def chat(self, **extra: object) -> bytes:
        return json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 12,
                **extra,
            }
        ).encode()

    async def openai(self, *args: str) -> dict[str, Any]:
        script = textwrap.dedent(
            """
            import json, sys
            import openai

            client = openai.OpenAI(
                base_url=sys.argv[1] + "/v1", api_key="unused",
                max_retries=0, timeout=30,
            )
            messages = [{"role": "user", "content": "hello"}]
            plain = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8
            )
            pieces, usage = [], None
            for chunk in client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, stream=True,
                stream_options={"include_usage": True},
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage.model_dump()
            print(json.dumps({
                "models": [m.id for m in client.models.list()],
                "content": plain.choices[0].message.content,
                "usage": plain.usage.model_dump(),
                "pieces": len(pieces),
                "stream_usage": usage,
            }))
            """
        )
        d = getProcessOutputAndValue(
            sys.executable, ["-c", script, self.facade, *args], env=dict(os.environ)
        )
        d.addTimeout(60, reactor)
        out, err, code = await d
        self.assertEqual(code, 0, err.decode("utf-8", "replace"))
        result: dict[str, Any] = json.loads(out)
        return result

    async def test_openai_client_on_each_node(self) -> None:
        """
        The official client, streaming and not, served by either instance;
        the workloads name the node that served them and carry exactly the
        usage the engine reported.
        """
        await self.start()
        for node in (NODE_A, NODE_B):
            await self.pin(node)
            result = await self.openai()
            self.assertEqual(result["models"], [MODEL])
            self.assertTrue(result["content"])
            self.assertEqual(result["usage"]["completion_tokens"], 8)
            self.assertEqual(result["pieces"], 8)
            self.assertEqual(result["stream_usage"]["completion_tokens"], 8)
            recent = await self.workloads()
            # Newest first: the stream, then the plain answer.
            stream, plain = (entry["workloadInfo"] for entry in recent[:2])
            for info, usage in (
                (plain, result["usage"]),
                (stream, result["stream_usage"]),
            ):
                self.assertEqual(
                    (info["state"], info["engine"], info["scheduledOn"]),
                    ("completed", "llamacpp", node),
                )
                self.assertEqual(
                    (info["stats"]["promptTokens"], info["stats"]["completionTokens"]),
                    (usage["prompt_tokens"], usage["completion_tokens"]),
                )

    async def test_inventory_merged(self) -> None:
        """
        C{/models} and C{/v1/models} on the facade list both instances'
        models, each entry as its own engine gives it.
        """
        await self.start(aliases=("tiny-a", "tiny-b"))
        direct = {}
        for server in self.servers.values():
            code, _, body = await self.client.request("GET", server.url + "/v1/models")
            self.assertEqual(code, 200, body)
            (entry,) = json.loads(body)["data"]
            direct[entry["id"]] = entry
        self.assertEqual(set(direct), {"tiny-a", "tiny-b"})
        for path in ("/models", "/v1/models"):
            code, _, body = await self.client.request("GET", self.facade + path)
            self.assertEqual(code, 200, (path, body))
            listing = json.loads(body)
            self.assertEqual(listing["object"], "list")
            merged = {entry["id"]: entry for entry in listing["data"]}
            self.assertEqual(set(merged), set(direct), path)
            for name, entry in merged.items():
                self.assertEqual(entry["aliases"], direct[name]["aliases"], path)

    async def test_failover_when_an_instance_is_killed(self) -> None:
        """
        With A pinned and then killed, a chat still succeeds: A refuses the
        connection, the request goes on to B before anything was sent to the
        client, and the workload ends completed on B.
        """
        await self.start()
        await self.pin(NODE_A)
        code, _, body = await self.client.request(
            "POST", self.facade + "/v1/chat/completions", data=self.chat()
        )
        self.assertEqual(code, 200, body)
        await self.servers[NODE_A].kill()
        for stream in (False, True):
            code, _, body = await self.client.request(
                "POST",
                self.facade + "/v1/chat/completions",
                data=self.chat(stream=stream),
            )
            self.assertEqual(code, 200, body)
            entry = await self.terminal()
            # Each dispatch is a submitted event naming its node.
            places = [
                e["workloadInfo"]["scheduledOn"]
                for e in entry["events"]
                if e["method"] == "workload:submitted"
                and "scheduledOn" in e["workloadInfo"]
            ]
            info = entry["workloadInfo"]
            self.assertEqual(
                (info["state"], info["scheduledOn"]), ("completed", NODE_B)
            )
            # Pinned A stays first even while ejected: tried, refused, then B.
            self.assertEqual(places, [NODE_A, NODE_B])
            if stream:
                self.assertEqual(sse_data(body)[-1], "[DONE]")
            else:
                self.assertEqual(json.loads(body)["usage"]["completion_tokens"], 12)

    async def stream_to(self, node: str, stream: bool = True) -> _Stream:
        """
        Start a long chat pinned to C{node}; return once the engine is
        working on it (a few events arrived, for a stream).
        """
        await self.pin(node)
        body = self.chat(max_tokens=LONG, stream=stream)
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: nvproxy\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        ) + body
        client = _Stream(request)
        port = int(self.facade.rsplit(":", 1)[1])
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port)
        await connectProtocol(endpoint, client)
        for _ in range(400):
            if (client.events() >= 20 or not stream) and await self.slots_busy(node):
                break
            await deferLater(reactor, 0.025, lambda: None)
        if stream:
            self.assertGreaterEqual(client.events(), 20, bytes(client.received[:500]))
        self.assertEqual(await self.slots_busy(node), 1)
        return client

    async def test_stream_cut_when_the_serving_instance_dies(self) -> None:
        """
        Killing A after the answer began: no failover (§1.1, committed), the
        client's stream ends with the C{upstream_cut} error frame, and the
        workload is C{completed} with C{truncated}.
        """
        await self.start()
        stream = await self.stream_to(NODE_A)
        await self.servers[NODE_A].kill()
        for _ in range(400):
            if stream.closed.called:
                break
            await deferLater(reactor, 0.025, lambda: None)
        self.assertTrue(stream.closed.called, "the client's connection stayed open")
        text = bytes(stream.received)
        self.assertIn(b"upstream_cut", text)
        self.assertNotIn(b"data: [DONE]", text)
        entry = await self.terminal()
        info = entry["workloadInfo"]
        self.assertEqual(
            (info["state"], info["scheduledOn"], info.get("truncated")),
            ("completed", NODE_A, True),
        )
        placed = [
            e["workloadInfo"]["scheduledOn"]
            for e in entry["events"]
            if e["method"] == "workload:submitted"
            and "scheduledOn" in e["workloadInfo"]
        ]
        self.assertEqual(placed, [NODE_A])

    async def slots_busy(self, node: str) -> int:
        code, _, body = await self.client.request(
            "GET", self.servers[node].url + "/slots"
        )
        self.assertEqual(code, 200, body)
        slots = json.loads(body)
        return sum(1 for slot in slots if slot["is_processing"])

    async def hang_up(self, stream: bool) -> float | None:
        """
        Hang up on a long answer of A's; the seconds until A's slot was
        free, None if it was still busy 5 s later.
        """
        client = await self.stream_to(NODE_A, stream=stream)
        hung_up = reactor.seconds()
        assert client.transport is not None
        client.transport.loseConnection()
        for _ in range(200):
            if await self.slots_busy(NODE_A) == 0:
                return float(reactor.seconds() - hung_up)
            await deferLater(reactor, 0.025, lambda: None)
        return None

    async def test_hang_up_mid_stream_frees_the_slot(self) -> None:
        """
        A client that closes its connection mid-stream frees the engine's
        slot at once (spec §5.7 left this unverified; docs/cancellation.rst
        records the measurement): nvproxy drops the upstream connection and
        llama-server cancels the task, long before the answer would have
        ended.  The workload is C{cancelled} (C{client_gone}).
        """
        await self.start()
        freed = await self.hang_up(stream=True)
        self.assertIsNotNone(freed, "the slot was still busy 5 s after the hang-up")
        assert freed is not None
        print(f"\nstreaming: slot freed {freed * 1000:.0f} ms after the hang-up")
        self.assertLess(freed, 2.0)
        self.assertEqual(self.servers[NODE_A].output.count(CANCELLED), 1)
        info = (await self.terminal())["workloadInfo"]
        self.assertEqual((info["state"], info["error"]), ("cancelled", "client_gone"))

    async def test_hang_up_before_a_plain_answer(self) -> None:
        """
        A client that hangs up while a non-streaming answer is generated:
        nvproxy cancels the workload at once and closes its upstream
        connection, but llama-server (this version) mostly notices only
        when it writes the answer, so the slot stays busy to the end.  This
        is the engine's behaviour, recorded rather than asserted: the test
        prints what it saw (docs/cancellation.rst).
        """
        await self.start()
        freed = await self.hang_up(stream=False)
        info = (await self.terminal())["workloadInfo"]
        self.assertEqual((info["state"], info["error"]), ("cancelled", "client_gone"))
        seen = "busy 5 s later" if freed is None else f"freed after {freed:.2f} s"
        print(f"\nnon-streaming: slot {seen}")
