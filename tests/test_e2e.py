"""
End to end: C{twistd -n nvproxy --config ...} as a subprocess, driven by the
official C{openai} and C{ollama} Python clients (each run in a subprocess of
its own, since they block) against fake engines served by this process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.utils import getProcessOutputAndValue
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from nvproxy.testing.fakeengine import Behaviour, FakeEngine
from nvproxy.testing.harness import (
    Client,
    NotHealthy,
    eventually,
    free_port,
    wait_healthy,
)

SECRET = "PROMPT-CANARY-7f3a9c"
"""Sent as the prompt in every request; must never appear in the log."""


class _Twistd(ProcessProtocol):
    def __init__(self) -> None:
        self.output = bytearray()
        self.ended: Deferred[int] = Deferred()

    def outReceived(self, data: bytes) -> None:
        self.output += data

    errReceived = outReceived

    def processEnded(self, reason: Failure) -> None:
        code = 0
        if reason.check(ProcessTerminated):
            value = reason.value
            # twistd re-raises the signal it stopped on: -SIGTERM is clean.
            code = value.exitCode if value.exitCode is not None else -value.signal
        elif not reason.check(ProcessDone):
            code = -1
        self.ended.callback(code)


def _twistd_argv(*args: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        "import sys; from twisted.scripts.twistd import run; sys.exit(run())",
        "-n",
        "--pidfile=",
        "nvproxy",
        *args,
    ]


async def run_client(script: str, timeout: float = 60.0) -> tuple[bytes, bytes, int]:
    d = getProcessOutputAndValue(
        sys.executable, ["-c", textwrap.dedent(script)], env=dict(os.environ)
    )
    d.addTimeout(timeout, reactor)
    out, err, code = await d
    return out, err, code


class EndToEndTests(TestCase):
    timeout = 120

    async def start(self, config: str, *extra: str) -> tuple[_Twistd, int]:
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        path = os.path.join(directory, "nvproxy.toml")
        with open(path, "w") as f:
            f.write(config)
        protocol = _Twistd()
        process = reactor.spawnProcess(
            protocol,
            sys.executable,
            _twistd_argv("--config", path, "--state-dir", directory, *extra),
            env=dict(os.environ),
            path=directory,
        )

        async def stop() -> None:
            if not protocol.ended.called:
                process.signalProcess(signal.SIGTERM)
                await protocol.ended

        self.addCleanup(lambda: Deferred.fromCoroutine(stop()))
        return protocol, process.pid

    async def wait_for(self, protocol: _Twistd, url: str) -> None:
        """Wait until the admin status at C{url} lists a node."""

        def up(code: int, body: bytes) -> bool:
            return code == 200 and bool(json.loads(body)["nodes"])

        try:
            await wait_healthy(
                reactor,
                url,
                within=20.0,
                alive=lambda: not protocol.ended.called,
                healthy=up,
            )
        except NotHealthy as e:
            why = "twistd exited" if e.exited else "nvproxy did not come up"
            self.fail(f"{why}:\n{protocol.output.decode()}")

    async def two_facades(
        self, behaviour: Behaviour, *extra: str
    ) -> tuple[_Twistd, int, FakeEngine, dict[str, int]]:
        """
        twistd with an Ollama facade in front of a fake Ollama and a vLLM
        facade in front of a fake OpenAI engine, both behaving as
        C{behaviour}; returns once it is up, with the fake Ollama and the
        ports (C{ollama}, C{vllm}, C{admin}).
        """
        ollama = FakeEngine("ollama", ["llama3:latest"], reactor)
        ollama.default = behaviour
        await ollama.listen(reactor)
        self.addCleanup(ollama.stop)
        openai = FakeEngine("openai", ["qwen"], reactor)
        openai.default = behaviour
        await openai.listen(reactor)
        self.addCleanup(openai.stop)
        ports = {"ollama": free_port(), "vllm": free_port(), "admin": free_port()}
        config = f"""
            node_id = "e2e"
            [admin]
            listen = "127.0.0.1:{ports["admin"]}"
            [discovery]
            poll_interval = "100ms"
            [engines.ollama]
            port = {ports["ollama"]}
            backend = "{ollama.url}"
            [engines.vllm]
            port = {ports["vllm"]}
            backend = "{openai.url}"
            [engines.lmstudio]
            enabled = false
            [engines.llamacpp]
            enabled = false
        """
        protocol, pid = await self.start(textwrap.dedent(config), *extra)
        await self.wait_for(protocol, f"http://127.0.0.1:{ports['admin']}/admin/status")
        return protocol, pid, ollama, ports

    async def test_sdk_clients(self) -> None:
        """
        The openai and ollama SDKs work unchanged through nvproxy, streaming
        and not, and the prompt never reaches the log.
        """
        protocol, pid, ollama, ports = await self.two_facades(
            Behaviour(chunks=8), "--log-format", "json"
        )

        out, err, code = await run_client(
            f"""
            import json, openai
            client = openai.OpenAI(base_url="http://127.0.0.1:{ports["vllm"]}/v1",
                                   api_key="unused", max_retries=0, timeout=30)
            answer = client.chat.completions.create(
                model="qwen", messages=[{{"role": "user", "content": "{SECRET}"}}])
            chunks = list(client.chat.completions.create(
                model="qwen", stream=True,
                messages=[{{"role": "user", "content": "{SECRET}"}}]))
            models = [m.id for m in client.models.list()]
            try:
                client.chat.completions.create(model="nope", messages=[])
                missing = None
            except openai.APIStatusError as e:
                missing = e.status_code
            print(json.dumps({{
                "content": answer.choices[0].message.content,
                "usage": answer.usage.completion_tokens,
                "chunks": len(chunks),
                "models": models,
                "missing": missing,
            }}))
            """
        )
        self.assertEqual(code, 0, err.decode())
        result = json.loads(out)
        self.assertTrue(result["content"])
        self.assertEqual(result["usage"], 8)
        self.assertGreaterEqual(result["chunks"], 8)
        self.assertEqual(result["models"], ["qwen"])
        self.assertEqual(result["missing"], 502)

        out, err, code = await run_client(
            f"""
            import json, ollama
            client = ollama.Client(host="http://127.0.0.1:{ports["ollama"]}")
            answer = client.generate(model="llama3", prompt="{SECRET}")
            streamed = list(client.chat(model="llama3", stream=True,
                messages=[{{"role": "user", "content": "{SECRET}"}}]))
            names = [m.model for m in client.list().models]
            print(json.dumps({{
                "response": answer.response,
                "eval_count": answer.eval_count,
                "parts": len(streamed),
                "done": streamed[-1].done,
                "names": names,
            }}))
            """
        )
        self.assertEqual(code, 0, err.decode())
        result = json.loads(out)
        self.assertTrue(result["response"])
        self.assertEqual(result["eval_count"], 8)
        self.assertEqual(result["parts"], 9)
        self.assertTrue(result["done"])
        self.assertEqual(result["names"], ["llama3:latest"])

        # The engines saw the prompt; the log never did.
        self.assertTrue(any(SECRET.encode() in r.body for r in ollama.requests))
        # Stop it so every log line is flushed, then read them all.
        os.kill(pid, signal.SIGTERM)
        self.assertIn(await protocol.ended, (0, -signal.SIGTERM))
        log_text = protocol.output.decode()
        self.assertNotIn(SECRET, log_text)
        lines = [line for line in log_text.splitlines() if line.strip()]
        self.assertTrue(lines)
        for line in lines:
            record = json.loads(line)
            self.assertIn("message", record)

    async def test_sdks_see_a_cut_stream(self) -> None:
        """
        An engine that dies mid-stream: the openai and ollama SDKs raise a
        clear error (the dialect's error frame) instead of silently ending,
        and the workload says truncated while its state stays completed.
        """
        protocol, _, _, ports = await self.two_facades(
            Behaviour(chunks=8, die_after_chunks=3)
        )
        admin = f"http://127.0.0.1:{ports['admin']}"
        out, err, code = await run_client(
            f"""
            import json, ollama, openai
            client = openai.OpenAI(base_url="http://127.0.0.1:{ports["vllm"]}/v1",
                                   api_key="unused", max_retries=0, timeout=30)
            seen = []
            try:
                for chunk in client.chat.completions.create(
                        model="qwen", stream=True, messages=[]):
                    seen.append(chunk)
                result = {{"openai": "ended silently"}}
            except openai.APIError as e:
                result = {{"openai": e.message, "chunks": len(seen)}}
            try:
                list(ollama.Client(host="http://127.0.0.1:{ports["ollama"]}").chat(
                    model="llama3", stream=True, messages=[]))
                result["ollama"] = "ended silently"
            except ollama.ResponseError as e:
                result["ollama"] = e.error
            print(json.dumps(result))
            """
        )
        self.assertEqual(code, 0, err.decode())
        result = json.loads(out)
        self.assertIn("ended before the response was complete", result["openai"])
        self.assertGreaterEqual(result["chunks"], 1)
        self.assertIn("ended before the response was complete", result["ollama"])
        client = Client(reactor, persistent=False)
        self.addCleanup(client.close)
        _, _, body = await client.request("GET", admin + "/admin/workloads?limit=10")
        terminals = [w["events"][-1] for w in json.loads(body)["workloads"]]
        self.assertEqual(len(terminals), 2, terminals)
        for event in terminals:
            info = event["workloadInfo"]
            self.assertEqual(event["method"], "workload:completed")
            self.assertEqual(
                (info["state"], info.get("truncated")), ("completed", True)
            )
        _, _, metrics = await client.request("GET", admin + "/metrics")
        self.assertIn(b'outcome="truncated"', metrics)

    async def test_bad_config_one_line(self) -> None:
        """
        A bad config exits non-zero with one line naming the key; no
        traceback.
        """
        protocol, _ = await self.start('[dispatch]\nmax_attempts = "five"\n')
        code = await protocol.ended
        self.assertNotEqual(code, 0)
        output = protocol.output.decode()
        self.assertEqual(
            output.strip().splitlines(),
            ['nvproxy: dispatch.max_attempts: must be an integer >= 1, got "five"'],
        )

    async def test_bad_config_every_line(self) -> None:
        """
        Several problems: one line each, and exit status 2.
        """
        protocol, _ = await self.start(
            '[dispatch]\nmax_attempts = "five"\n[limits]\nmax_size = 1\n',
            "--deadline",
            "0",
        )
        code = await protocol.ended
        self.assertEqual(code, 2)
        self.assertEqual(
            protocol.output.decode().strip().splitlines(),
            [
                "nvproxy: limits.max_size: unknown key",
                'nvproxy: dispatch.max_attempts: must be an integer >= 1, got "five"',
                'nvproxy: --deadline: must be greater than 0, got "0"',
            ],
        )

    async def test_unknown_flag_one_line(self) -> None:
        protocol = _Twistd()
        reactor.spawnProcess(
            protocol,
            sys.executable,
            _twistd_argv("--no-such-flag"),
            env=dict(os.environ),
        )
        code = await protocol.ended
        self.assertEqual(code, 2)
        self.assertEqual(
            protocol.output.decode().strip().splitlines(),
            [
                "nvproxy: option --no-such-flag not recognized"
                " (see twistd nvproxy --help)"
            ],
        )

    async def test_broker_link_over_stdio(self) -> None:
        """
        C{--control stdio}: no facade until the broker enables one over
        stdin; ready and workload events come back on stdout; closing stdin
        stops the process.
        """
        fake = FakeEngine("openai", ["m"], reactor)
        await fake.listen(reactor)
        self.addCleanup(fake.stop)
        admin, port = free_port(), free_port()
        config = textwrap.dedent(
            f"""
            [admin]
            listen = "127.0.0.1:{admin}"
            [discovery]
            poll_interval = "100ms"
            [engines.lmstudio]
            backend = "{fake.url}"
            """
        )
        protocol, _ = await self.start(config, "--control", "stdio")
        protocol.transport.write(  # type: ignore[attr-defined]
            b'{"jsonrpc":"2.0","id":1,"method":"facade/enable",'
            b'"params":{"engine":"lmstudio","port":%d}}\n' % port
        )
        await eventually(
            reactor,
            lambda: b'"id":1' in protocol.output,
            attempts=100,
            interval=0.05,
            what="the answer to facade/enable",
        )
        self.assertIn(
            b'"method":"lmstudio:ready","params":{"port":%d}' % port, protocol.output
        )
        await self.wait_for(protocol, f"http://127.0.0.1:{admin}/admin/status")
        client = Client(reactor, persistent=False)
        self.addCleanup(client.close)
        code, _, _ = await client.request(
            "POST",
            f"http://127.0.0.1:{port}/v1/completions",
            data=b'{"model": "m", "prompt": "x"}',
        )
        self.assertEqual(code, 200)
        await eventually(
            reactor,
            lambda: b"workload:completed" in protocol.output,
            attempts=100,
            interval=0.05,
            what="the workload:completed event",
        )
        self.assertIn(b'"method":"workload:completed"', protocol.output)
        protocol.transport.closeStdin()  # type: ignore[attr-defined]
        self.assertIn(await protocol.ended, (0, -signal.SIGTERM))
