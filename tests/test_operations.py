"""
Operations through the README's own commands: C{twistd -n nvproxy --config F}
as a subprocess, stopped by SIGTERM while requests are in flight.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import treq
from attrs import evolve
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import deferLater
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import TestCase
from twisted.web.client import ResponseNeverReceived

from nvproxy.config import Config, ConfigError, ConfigErrors
from nvproxy.logs import current_level, set_level
from nvproxy.ops import OperationError
from nvproxy.testing.fakeengine import Behaviour, FakeEngine
from nvproxy.testing.harness import (
    Client,
    NotHealthy,
    eventually,
    facade_url,
    free_port,
    wait_healthy,
)
from tests.test_e2e import _Twistd, _twistd_argv
from tests.test_forwarding import ProxyTestCase

PROMPT = "PROMPT-CANARY-0c41"


class _Daemon:
    """One twistd nvproxy subprocess with an Ollama and a vLLM facade."""

    def __init__(self, test: TestCase) -> None:
        self.test = test
        self.protocol = _Twistd()
        self.ports = {"ollama": free_port(), "vllm": free_port(), "admin": free_port()}
        self.directory = os.path.abspath(test.mktemp())
        os.makedirs(self.directory)
        self.path = os.path.join(self.directory, "nvproxy.toml")
        self.process: Any = None

    def url(self, engine: str) -> str:
        return f"http://127.0.0.1:{self.ports[engine]}"

    def write(self, ollama: FakeEngine, openai: FakeEngine, extra: str = "") -> None:
        config = f"""
            node_id = "ops"
            {extra}
            [admin]
            listen = "127.0.0.1:{self.ports["admin"]}"
            [discovery]
            poll_interval = "100ms"
            [engines.ollama]
            port = {self.ports["ollama"]}
            backend = "{ollama.url}"
            [engines.vllm]
            port = {self.ports["vllm"]}
            backend = "{openai.url}"
            [engines.lmstudio]
            enabled = false
            [engines.llamacpp]
            enabled = false
        """
        with open(self.path, "w") as f:
            f.write(textwrap.dedent(config))

    async def start(self, *extra: str, twistd: Sequence[str] = ()) -> None:
        argv = _twistd_argv(
            "--config", self.path, "--state-dir", self.directory, *extra
        )
        # twistd's own options come before the plugin's name.
        at = argv.index("nvproxy")
        argv[at:at] = twistd
        self.process = reactor.spawnProcess(
            self.protocol,
            sys.executable,
            argv,
            env=dict(os.environ),
            path=self.directory,
        )

        async def stop() -> None:
            if not self.protocol.ended.called:
                self.process.signalProcess(signal.SIGKILL)
                await self.protocol.ended

        self.test.addCleanup(lambda: Deferred.fromCoroutine(stop()))

        def up(code: int, body: bytes) -> bool:
            return code == 200 and len(json.loads(body)["nodes"]) > 0

        try:
            await wait_healthy(
                reactor,
                f"http://127.0.0.1:{self.ports['admin']}/admin/status",
                within=20.0,
                alive=lambda: not self.protocol.ended.called,
                healthy=up,
            )
        except NotHealthy:
            self.test.fail(f"nvproxy did not come up:\n{self.output}")

    def signal(self, number: int = signal.SIGTERM) -> None:
        self.process.signalProcess(number)

    @property
    def output(self) -> str:
        return self.protocol.output.decode()


async def _engines(
    test: TestCase, ollama_behaviour: Behaviour, openai_behaviour: Behaviour
) -> tuple[FakeEngine, FakeEngine]:
    ollama = FakeEngine("ollama", ["llama3:latest"], reactor)
    ollama.default = ollama_behaviour
    await ollama.listen(reactor)
    test.addCleanup(ollama.stop)
    openai = FakeEngine("openai", ["qwen"], reactor)
    openai.default = openai_behaviour
    await openai.listen(reactor)
    test.addCleanup(openai.stop)
    return ollama, openai


def _chat(model: str) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": PROMPT}]}
    ).encode()


class ShutdownTests(TestCase):
    timeout = 60

    async def test_drain(self) -> None:
        """
        SIGTERM closes the ports at once, answers the request still held
        before commit with 503 and Retry-After in the engine's dialect, lets
        the committed stream finish, and exits with status 0.
        """
        ollama, openai = await _engines(
            self,
            Behaviour(chunks=8, chunk_interval=0.1),
            Behaviour(latency=20.0),
        )
        daemon = _Daemon(self)
        events = os.path.join(daemon.directory, "workloads.jsonl")
        daemon.write(ollama, openai, f'[workloads]\nlog = "{events}"')
        await daemon.start()
        client = Client(reactor)
        self.addCleanup(client.close)
        streaming = await client.http.post(
            daemon.url("ollama") + "/api/chat", data=_chat("llama3")
        )
        self.assertEqual(streaming.code, 200)
        held = Deferred.fromCoroutine(
            client.request(
                "POST",
                daemon.url("vllm") + "/v1/chat/completions?key=QUERY-CANARY",
                data=_chat("qwen"),
                headers={
                    "Content-Type": "application/json",
                    "Authorization": "Bearer KEY-CANARY",
                },
            )
        )
        await eventually(
            reactor,
            lambda: any(r.model == "qwen" for r in openai.requests),
            what="the held request",
        )
        daemon.signal()
        try:
            code, headers, body = await held
        except Exception as e:
            await daemon.protocol.ended
            self.fail(repr(e) + daemon.output)
        self.assertEqual(code, 503)
        self.assertEqual(headers.getRawHeaders("Retry-After"), ["5"])
        self.assertIn("shutting down", json.loads(body)["error"]["message"])
        # No new connection while draining: refused, or (when it reached the
        # kernel's backlog in the turn the port was closing) reset unserved;
        # the access lines below show it was never served.
        with self.assertRaises((ConnectionRefusedError, ResponseNeverReceived)):
            await Client(reactor, persistent=False).request(
                "GET", daemon.url("ollama") + "/api/tags"
            )
        lines = (await treq.content(streaming)).decode().splitlines()
        self.assertEqual(len(lines), 9)
        self.assertTrue(json.loads(lines[-1])["done"])
        self.assertEqual(await daemon.protocol.ended, 0)
        output = daemon.output
        self.assertIn("drain ended (every request finished)", output)
        # One access line per request, metadata only (§9).
        access = [line for line in output.splitlines() if "[nvproxy.access#" in line]
        self.assertEqual(len(access), 2, output)
        self.assertRegex(
            access[0],
            r"\] POST /v1/chat/completions 503 engine=vllm model=qwen node=None"
            r" attempts=1 ttfb_ms=\d+ duration_ms=\d+ bytes=\d+ outcome=finished"
            r" request_id=[0-9a-f]{32}$",
        )
        self.assertRegex(
            access[1],
            r"\] POST /api/chat 200 engine=ollama model=llama3:latest node=ops"
            r" attempts=1 ttfb_ms=\d+ duration_ms=\d+ bytes=\d+ outcome=finished"
            r" request_id=[0-9a-f]{32}$",
        )
        for secret in (PROMPT, "QUERY-CANARY", "KEY-CANARY"):
            self.assertNotIn(secret, output)
        # Listeners say when they start and stop, by name; no object reprs.
        self.assertIn("Ollama facade stopped listening on 127.0.0.1:", output)
        self.assertNotIn(" object at 0x", output)
        self.assertNotIn("starting on", output)
        # The workload events say what happened to each.
        with open(events) as f:
            infos = [json.loads(line)["params"]["workloadInfo"] for line in f]
        final = {info["model"]: info["state"] for info in infos}
        self.assertEqual(final, {"qwen": "cancelled", "llama3:latest": "completed"})

    async def test_second_sigterm(self) -> None:
        """
        A second SIGTERM ends the drain at once: the long stream is cut and
        the daemon exits with status 0 well before the grace.
        """
        ollama, openai = await _engines(
            self, Behaviour(chunks=200, chunk_interval=0.1), Behaviour()
        )
        daemon = _Daemon(self)
        daemon.write(ollama, openai)
        await daemon.start()
        client = Client(reactor)
        self.addCleanup(client.close)
        streaming = await client.http.post(
            daemon.url("ollama") + "/api/chat", data=_chat("llama3")
        )
        self.assertEqual(streaming.code, 200)
        daemon.signal()
        await eventually(reactor, lambda: "draining" in daemon.output, what="the drain")
        started = reactor.seconds()
        daemon.signal()
        self.assertEqual(await daemon.protocol.ended, 0)
        self.assertLess(reactor.seconds() - started, 5)
        self.assertIn("drain ended (second signal)", daemon.output)
        content = await treq.content(streaming).addErrback(lambda f: b"")
        self.assertLess(len(content.splitlines()), 200)


async def _ctl(daemon: _Daemon | None, *argv: str) -> tuple[int, str, str]:
    admin = "127.0.0.1:1" if daemon is None else f"127.0.0.1:{daemon.ports['admin']}"
    out, err, code = await getProcessOutputAndValue(
        sys.executable,
        ["-m", "nvproxy.ctl", "--admin", admin, *argv],
        env=dict(os.environ),
    )
    return int(code), out.decode(), err.decode()


class ReloadTests(TestCase):
    timeout = 60
    maxDiff = None

    async def test_sighup(self) -> None:
        """
        SIGHUP adds a node, changes a limit and rebinds a port for new
        requests; then an invalid file is refused, logged, and the daemon
        keeps serving on the config in force.  nvproxyctl shows it.
        """
        ollama, openai = await _engines(self, Behaviour(), Behaviour())
        other = FakeEngine("ollama", ["mistral:latest"], reactor)
        await other.listen(reactor)
        self.addCleanup(other.stop)
        daemon = _Daemon(self)
        daemon.write(ollama, openai)
        await daemon.start()
        client = Client(reactor, persistent=False)
        self.addCleanup(client.close)
        old_port = daemon.ports["ollama"]

        code, out, err = await _ctl(daemon, "status")
        self.assertEqual((code, err), (0, ""))
        ports = daemon.ports
        self.assertEqual(
            out,
            textwrap.dedent(
                f"""\
                node ops: 0 in flight
                discovery: mesh

                facades:
                ENGINE  PORT   LISTENING  ERROR  SELECTED
                ollama  {ports["ollama"]:<5}  yes        -      -
                vllm    {ports["vllm"]:<5}  yes        -      -

                nodes:
                NODE  ENGINE  MODELS
                ops   ollama  llama3:latest
                ops   vllm    qwen

                readiness:
                NODE  ENGINE  MODEL          READINESS  WAKE EST.  DRAINING
                ops   ollama  llama3:latest  awake      -          no
                ops   vllm    qwen           awake      -          no

                reservations:
                NODE  RESERVED
                ops   0
                """
            ),
        )
        code, out, _ = await _ctl(daemon, "--json", "status")
        self.assertEqual(code, 0)
        self.assertEqual(
            json.loads(out)["nodes"],
            {"ops": {"ollama": ["llama3:latest"], "vllm": ["qwen"]}},
        )

        new_port = free_port()
        daemon.ports["ollama"] = new_port
        daemon.write(
            ollama,
            openai,
            f"""
            [limits]
            max_request_line = "1KiB"
            [[nodes]]
            id = "gpu-2"
            engines = {{ ollama = "{other.url}" }}
            """,
        )
        daemon.signal(signal.SIGHUP)
        await eventually(
            reactor,
            lambda: "configuration reloaded" in daemon.output,
            what="the reload",
        )
        self.assertIn("changed limits, engines.ollama.port, nodes", daemon.output)
        url = daemon.url("ollama")
        code, _, _ = await client.request("GET", url + "/api/" + "x" * 1100)
        self.assertEqual(code, 414)
        with self.assertRaises(ConnectionRefusedError):
            await client.request("GET", f"http://127.0.0.1:{old_port}/api/tags")

        async def mistral() -> int:
            code, _, _ = await client.request(
                "POST",
                url + "/api/generate",
                data=json.dumps({"model": "mistral", "prompt": "hi"}).encode(),
            )
            return code

        for _ in range(50):
            if await mistral() == 200:
                break
            await deferLater(reactor, 0.1, lambda: None)
        self.assertEqual(await mistral(), 200)

        with open(daemon.path, "a") as f:
            f.write("[dispatch]\nmax_attempts = 0\n")
        code, out, err = await _ctl(daemon, "reload")
        self.assertEqual((code, out), (1, ""))
        self.assertEqual(
            err,
            "nvproxyctl: configuration refused\n"
            "nvproxyctl: dispatch.max_attempts: must be an integer >= 1, got 0\n",
        )
        daemon.signal(signal.SIGHUP)
        await eventually(
            reactor,
            lambda: daemon.output.count("reload refused") == 2,
            what="the refused reload",
        )
        self.assertEqual(await mistral(), 200)

    async def test_ctl_without_daemon(self) -> None:
        """
        No daemon: one clear line, exit code 2, no traceback.
        """
        code, out, err = await _ctl(None, "status")
        self.assertEqual((code, out), (2, ""))
        self.assertEqual(len(err.splitlines()), 1)
        self.assertIn("cannot reach the admin API at 127.0.0.1:1", err)


class LogFileTests(TestCase):
    timeout = 30

    async def test_logfile_reopened_on_sigusr1(self) -> None:
        """
        With twistd's C{--logfile}, the log goes to the file; after logrotate
        moved it, SIGUSR1 makes nvproxy write to a new file of that name.
        """
        ollama, openai = await _engines(self, Behaviour(), Behaviour())
        daemon = _Daemon(self)
        daemon.write(ollama, openai)
        path = os.path.join(daemon.directory, "nvproxy.log")
        await daemon.start(twistd=["--logfile", path])
        os.rename(path, path + ".1")
        daemon.signal(signal.SIGUSR1)
        await eventually(
            reactor, lambda: os.path.exists(path), what="the reopened log file"
        )
        client = Client(reactor, persistent=False)
        self.addCleanup(client.close)
        code, _, _ = await client.request("GET", daemon.url("ollama") + "/api/tags")
        self.assertEqual(code, 200)
        daemon.signal()
        self.assertEqual(await daemon.protocol.ended, 0)
        with open(path + ".1") as f:
            rotated = f.read()
        with open(path) as f:
            current = f.read()
        self.assertIn("Ollama facade listening on", rotated)
        self.assertIn("log files reopened (SIGUSR1)", current)
        self.assertRegex(current, r"GET /api/tags 200 engine=ollama ")


class CheckTests(TestCase):
    timeout = 30

    async def test_check(self) -> None:
        """
        C{twistd nvproxy --config F --check} and C{nvproxyctl check-config F}:
        every problem on its own line and a non-zero status; nothing starts.
        """
        directory = self.mktemp()
        os.makedirs(directory)
        good = os.path.join(directory, "good.toml")
        bad = os.path.join(directory, "bad.toml")
        with open(good, "w") as f:
            f.write('node_id = "x"\n[admin]\nenabled = false\n')
        with open(bad, "w") as f:
            f.write("[dispatch]\nmax_attempts = 0\n[engines.ollama]\nprot = 1\n")
        problems = [
            "dispatch.max_attempts: must be an integer >= 1, got 0",
            "engines.ollama.prot: unknown key",
        ]
        out, err, code = await getProcessOutputAndValue(
            sys.executable,
            _twistd_argv("--config", good, "--check")[1:],
            env=dict(os.environ),
        )
        self.assertEqual((code, err), (0, b""))
        self.assertIn(b"configuration OK", out)
        out, err, code = await getProcessOutputAndValue(
            sys.executable,
            _twistd_argv("--config", bad, "--check")[1:],
            env=dict(os.environ),
        )
        self.assertEqual(code, 2)
        self.assertEqual(err.decode().splitlines(), [f"nvproxy: {p}" for p in problems])
        code, out, err = await _ctl(None, "check-config", good)
        self.assertEqual((code, out, err), (0, f"{good}: configuration OK\n", ""))
        code, out, err = await _ctl(None, "check-config", bad)
        self.assertEqual(code, 1)
        self.assertEqual(err.splitlines(), [f"nvproxyctl: {p}" for p in problems])


class InProcessReloadTests(ProxyTestCase):
    """The reload's effects on each component, in process (no subprocess)."""

    async def test_components_take_the_new_config(self) -> None:
        fake = await self.engine("ollama", ["m:latest"])
        proxy = await self.proxy({"ollama": fake.url})
        config = proxy.config
        new = evolve(
            config,
            dispatch=evolve(
                config.dispatch, policy=evolve(config.dispatch.policy, max_attempts=2)
            ),
            limits=evolve(config.limits, max_body=1024, max_connections=7),
            shutdown_grace=3.0,
            log_access=False,
            log_level="warn",
            state_dir=config.state_dir + "-moved",
        )
        loads = [new]
        proxy.enable_reload(lambda: loads[0])
        self.addCleanup(lambda: set_level("info"))
        result = await proxy.ops.reload()
        self.assertEqual(
            result,
            {
                "reloaded": True,
                "changed": [
                    "log_level",
                    "log.access",
                    "dispatch",
                    "limits",
                    "shutdown.grace",
                ],
                "restart_required": ["state_dir"],
            },
        )
        site = proxy.sites["ollama"]
        self.assertEqual(
            (site.max_body, site.max_connections, site.access_log), (1024, 7, False)
        )
        self.assertEqual(proxy.shutdown.grace, 3.0)
        self.assertEqual(current_level(), "warn")
        self.assertEqual(proxy.config.state_dir, config.state_dir)
        # A refused file changes nothing.

        def refuse() -> Config:
            raise ConfigErrors([ConfigError("limits.max_body", "must be a size")])

        proxy.enable_reload(refuse)
        with self.assertRaises(OperationError) as caught:
            await proxy.ops.reload()
        self.assertEqual(caught.exception.status, 400)
        self.assertEqual(
            caught.exception.details, {"errors": ["limits.max_body: must be a size"]}
        )
        self.assertEqual(site.max_body, 1024)

    async def test_engine_disabled_then_enabled(self) -> None:
        fake = await self.engine("ollama", ["m:latest"])
        proxy = await self.proxy({"ollama": fake.url})
        config = proxy.config
        off = dict(config.engines)
        off["ollama"] = evolve(off["ollama"], enabled=False)
        loads = [evolve(config, engines=off)]
        proxy.enable_reload(lambda: loads[0])
        result = await proxy.ops.reload()
        self.assertEqual(result["changed"], ["engines.ollama.enabled"])
        self.assertNotIn("ollama", proxy.listeners)
        loads[0] = config
        result = await proxy.ops.reload()
        self.assertEqual(result["changed"], ["engines.ollama.enabled"])
        self.assertIsNotNone(proxy.listeners["ollama"].listening)


class InProcessDrainMetricsTests(ProxyTestCase):
    """Workload events and metrics stay exact through a drain."""

    async def test_counts_through_the_drain(self) -> None:
        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        ollama, openai = await _engines(
            self,
            Behaviour(chunks=6, chunk_interval=0.05),
            Behaviour(latency=20.0),
        )
        proxy = await self.proxy({"ollama": ollama.url, "vllm": openai.url})
        proxy.shutdown.grace = 10.0
        streaming = await self.client.http.post(
            facade_url(proxy, "ollama") + "/api/chat", data=_chat("llama3")
        )
        self.assertEqual(streaming.code, 200)
        held = Deferred.fromCoroutine(
            self.client.request(
                "POST",
                facade_url(proxy, "vllm") + "/v1/chat/completions",
                data=_chat("qwen"),
                headers={"Content-Type": "application/json"},
            )
        )
        await eventually(
            reactor,
            lambda: any(r.model == "qwen" for r in openai.requests),
            what="the held request",
        )
        stopped = proxy.stopService()
        code, _, _ = await held
        self.assertEqual(code, 503)
        lines = (await treq.content(streaming)).decode().splitlines()
        self.assertTrue(json.loads(lines[-1])["done"])
        await stopped
        requests: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(
            generate_latest(proxy.registry).decode()
        ):
            for sample in family.samples:
                if sample.name == "nvproxy_requests_total":
                    key = (sample.labels["engine"], sample.labels["outcome"])
                    requests[key] = requests.get(key, 0) + sample.value
                if sample.name == "nvproxy_inflight_requests":
                    self.assertEqual(sample.value, 0, sample.labels)
        # one each, no more, and the same in both: the committed stream
        # completed, the held one (answered 503) ended cancelled
        states = {
            (w["engine"], w["state"])
            for w in (
                entry["events"][-1]["workloadInfo"]
                for entry in proxy.ops.recent_workloads(10)
            )
        }
        self.assertEqual(
            requests, {("ollama", "completed"): 1, ("vllm", "cancelled"): 1}
        )
        self.assertEqual(states, {("ollama", "completed"), ("vllm", "cancelled")})
