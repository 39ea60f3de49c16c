"""
README's quick start works as written: the block between the C{quick start
demo} markers of C{README.rst} is run verbatim by C{bash}, in a directory
whose C{.venv} is this test environment, next to a running C{twistd -n
nvproxy}, and its output must show the chat answered and the workload
completed.

The block uses the engines' usual ports (Ollama 11434, its facade 11435, the
admin API 8010).  When one of them is taken on this machine, every port
number of the block is swapped for a free one before it runs; nothing else is
changed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from nvproxy.testing.harness import Client, NotHealthy, free_port, wait_healthy

ROOT = Path(__file__).parent.parent
README = ROOT / "README.rst"
BEGIN = ".. quick start demo:"
END = ".. end of quick start demo"
ENGINE_PORT, FACADE_PORT, ADMIN_PORT = 11434, 11435, 8010
MODEL = "llama3:latest"


def demo_commands(text: str) -> list[str]:
    """The commands of the literal block between the demo markers."""
    start = text.index(BEGIN)
    lines = text[start : text.index(END, start)].splitlines()
    opening = next(i for i, line in enumerate(lines) if line.endswith("::"))
    commands: list[str] = []
    for line in lines[opening + 1 :]:
        if line.startswith("    "):
            commands.append(line[4:])
        elif line.strip() and commands:
            break
    return commands


def taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


class _Process(ProcessProtocol):
    def __init__(self) -> None:
        self.out = bytearray()
        self.err = bytearray()
        self.ended: Deferred[int] = Deferred()

    def outReceived(self, data: bytes) -> None:
        self.out += data

    def errReceived(self, data: bytes) -> None:
        self.err += data

    def processEnded(self, reason: Failure) -> None:
        code = 0
        if reason.check(ProcessTerminated):
            value = reason.value
            code = value.exitCode if value.exitCode is not None else -value.signal
        elif not reason.check(ProcessDone):
            code = -1
        self.ended.callback(code)


class DemoBlockTests(SynchronousTestCase):
    def test_block_found(self) -> None:
        """
        The block starts the fake engine on Ollama's port, asks the facade
        with curl and lists the workloads: what the issue promises.
        """
        commands = demo_commands(README.read_text())
        self.assertTrue(commands[0].startswith(".venv/bin/python -m nvproxy.testing"))
        self.assertIn(f"--port {ENGINE_PORT}", commands[0])
        self.assertTrue(any(c.startswith("curl ") for c in commands))
        self.assertIn(".venv/bin/nvproxyctl workloads", commands)

    def test_block_follows_first_command(self) -> None:
        """README's first command is still the one that installs and runs."""
        text = README.read_text()
        first = next(
            line.strip() for line in text.splitlines() if line.startswith("    ")
        )
        self.assertEqual(
            first,
            "python3 -m venv .venv && .venv/bin/pip install . &&"
            " .venv/bin/twistd -n nvproxy",
        )
        self.assertLess(text.index(first), text.index(BEGIN))


class QuickStartTests(TestCase):
    timeout = 90

    async def test_quick_start(self) -> None:
        curl, bash, setsid = (shutil.which(n) for n in ("curl", "bash", "setsid"))
        if curl is None or bash is None:
            raise self.skipTest("needs curl and bash")
        script = "\n".join(demo_commands(README.read_text()))
        ports = (ENGINE_PORT, FACADE_PORT, ADMIN_PORT)
        if any(taken(p) for p in ports):
            ports = (free_port(), free_port(), free_port())
            script = script.replace(str(ENGINE_PORT), str(ports[0]))
            script = script.replace(str(FACADE_PORT), str(ports[1]))
        engine, facade, admin = ports

        directory = Path(self.mktemp()).absolute()
        (directory / "home").mkdir(parents=True)
        (directory / ".venv").symlink_to(Path(sys.executable).parent.parent)
        config = directory / "nvproxy.toml"
        config.write_text(
            '[discovery]\npoll_interval = "500ms"\n'
            "[engines.ollama]\n"
            f"port = {facade}\n"
            f'backend = "http://127.0.0.1:{engine}"\n'
            "[engines.lmstudio]\nenabled = false\n"
            "[engines.llamacpp]\nenabled = false\n"
            "[engines.vllm]\nenabled = false\n"
        )
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("NVPROXY_") and k != "XDG_STATE_HOME"
        }
        env.update(HOME=str(directory / "home"), NVPROXY_ADMIN=f"127.0.0.1:{admin}")

        daemon = _Process()
        twistd = str(directory / ".venv" / "bin" / "twistd")
        argv = [twistd, "-n", "--pidfile=", "nvproxy", "--config", str(config)]
        process = reactor.spawnProcess(
            daemon, twistd, argv, env=env, path=str(directory)
        )

        async def stop() -> None:
            if not daemon.ended.called:
                process.signalProcess(signal.SIGTERM)
                await daemon.ended

        self.addCleanup(lambda: Deferred.fromCoroutine(stop()))
        try:
            await wait_healthy(
                reactor,
                f"http://127.0.0.1:{admin}/admin/status",
                within=30.0,
                alive=lambda: not daemon.ended.called,
            )
        except NotHealthy as e:
            self.fail(f"nvproxy did not come up ({e}):\n{daemon.out.decode()}")

        # Its own session, so a timeout can end the background fake too.
        demo = _Process()
        argv = [bash, "-c", script]
        if setsid is not None:
            argv = [setsid, *argv]
        shell = reactor.spawnProcess(demo, argv[0], argv, env=env, path=str(directory))

        def kill() -> None:
            if setsid is not None:
                os.killpg(shell.pid, signal.SIGKILL)
            else:
                shell.signalProcess(signal.SIGKILL)

        timer = reactor.callLater(60, kill)
        code = await demo.ended
        if timer.active():
            timer.cancel()
        out = demo.out.decode()
        report = f"exit {code}\nstdout:\n{out}\nstderr:\n{demo.err.decode()}"
        self.assertEqual(code, 0, report)

        self.assertIn(f"listening on 127.0.0.1:{engine}", out, report)
        at = out.index('{"model"')
        answer, end = json.JSONDecoder().raw_decode(out, at)
        self.assertEqual(answer["message"]["content"], "Hello from the fake engine")
        self.assertIs(answer["done"], True)
        # nvproxyctl's layout may change; what it must name may not.
        listing = out[end:]
        for word in ("ollama", MODEL, "completed"):
            self.assertIn(word, listing, report)

        client = Client(reactor, persistent=False)
        self.addCleanup(client.close)
        response = await client.http.get(f"http://127.0.0.1:{admin}/admin/workloads")
        (workload,) = json.loads(await treq.content(response))["workloads"]
        info = workload["workloadInfo"]
        self.assertEqual(
            (info["engine"], info["model"], info["state"]),
            ("ollama", MODEL, "completed"),
        )
        self.assertEqual(info["stats"]["completionTokens"], 5)
