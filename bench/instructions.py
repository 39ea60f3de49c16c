"""
Instructions per request, counted by callgrind: nvproxy, Twisted's RPR and
the bare Agent floor in front of the same compiled engine (and, with
C{--only lean} or C{--only facade}, the lean and facade floors of the
C{floor} scenario).

CPU time on a shared machine moves 10-20 % from run to run, which hides a
change of a few per cent.  The number of instructions a proxy process runs
for a fixed number of requests hardly moves (0.2-1 %), so it shows such a
change in one run.  It counts user space only: the kernel's share (system
calls; RPR's new connection per request) is not in it, so it complements
the CPU figures of L{bench.run}, it does not replace them.

Each target runs under C{valgrind --tool=callgrind} with instrumentation off
through start-up and a warm-up; it is switched on for exactly the measured
requests (C{callgrind_control -i on/off}), then the counts are dumped::

    python -m bench.instructions                      # chat c=8, all three
    python -m bench.instructions --route stream --requests 20
    python -m bench.instructions --route paced --concurrency 2 --requests 20
    python -m bench.instructions --only nvproxy --tree ../base   # A/B

C{--tree DIR} runs nvproxy from another checkout (first on C{PYTHONPATH}),
so two versions can be compared in the same minutes; C{--keep DIR} keeps
the dumps for C{callgrind_annotate}.  Under callgrind each
process runs 20-50 times slower; a chat target takes about 20 s.  Needs
C{valgrind} (Debian: C{apt-get install valgrind}) and C{gcc}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import native
from bench.procs import _toml_config

TARGETS = ("nvproxy", "rpr", "agent", "lean", "facade")
DEFAULT_TARGETS = TARGETS[:3]
"""Without C{--only}: nvproxy, RPR and the Agent floor."""
_MODULES = {
    "rpr": "bench.rpr",
    "agent": "bench.agentfloor",
    "lean": "bench.leanfloor",
    "facade": "bench.facadefloor",
}
ROUTES = {
    "chat": ("/api/chat", False),
    "stream": ("/api/chat", True),
    "sse": ("/v1/chat/completions", True),
    "paced": ("/api/chat", True),
}
PACED_CHUNKS, PACED_INTERVAL_MS = 20, 20
"""The C{paced} route: an NDJSON stream of this many tokens this far apart,
so that each reaches the proxy in a read of its own (as a real engine's
tokens do) even under callgrind."""


def engine_args(route: str) -> list[str]:
    """The compiled engine's arguments beyond its port and model, for C{route}."""
    if route == "paced":
        return [
            "--chunks",
            str(PACED_CHUNKS),
            "--interval-ms",
            str(PACED_INTERVAL_MS),
        ]
    return []


MODEL = "bench-model"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_listening(
    port: int, timeout: float, process: subprocess.Popen[bytes], errors: Path
) -> None:
    """
    Wait for C{port} to answer; fail at once, with the end of what
    C{process} wrote to C{errors}, when it exits first (twistd without the
    nvproxy plugin on its path, say) instead of waiting out C{timeout}.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            said = errors.read_text(errors="replace").splitlines()
            # (not valgrind's own lines, "==PID== ...")
            tail = [line for line in said if line and not line.startswith("==")][-5:]
            raise SystemExit(
                f"the proxy exited with status {process.returncode} before"
                f" answering on port {port}:\n" + "\n".join(tail)
            )
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/api/tags", timeout=5
            ) as answer:
                answer.read()
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"nothing answered on port {port} within {timeout:.0f}s")


def _command(target: str, work: Path, port: int, upstream: int) -> list[str]:
    if target == "nvproxy":
        config = work / "nvproxy.toml"
        config.write_text(
            _toml_config(_free_port(), port, f"http://127.0.0.1:{upstream}", {})
        )
        twistd = shutil.which("twistd")
        if twistd is None:
            raise SystemExit("twistd is not on the PATH: install the project first")
        return [twistd, "-n", "--pidfile=", "nvproxy", "--config", str(config)]
    module = _MODULES[target]
    return ["-m", module, "--port", str(port), "--upstream", f"127.0.0.1:{upstream}"]


def measure(
    target: str,
    route: str,
    concurrency: int,
    requests: int,
    tree: str | None,
    work: Path,
) -> tuple[int, int]:
    """Run C{target} under callgrind; (requests served, instructions)."""
    engine_bin, loadgen = native.build("engine"), native.build("loadgen")
    upstream, port = _free_port(), _free_port()
    command = _command(target, work, port, upstream)  # may exit: before spawning
    engine = subprocess.Popen(
        [
            str(engine_bin),
            "--port",
            str(upstream),
            "--models",
            MODEL,
            *engine_args(route),
        ],
        stdout=subprocess.DEVNULL,
    )
    out = work / f"{target}.callgrind"
    errors = work / f"{target}.output"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(tree).resolve()), env.get("PYTHONPATH")])
        )
    with errors.open("wb") as output:  # (the child keeps its own copy)
        proxy = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}",
                sys.executable,
                *command,
            ],
            env=env,
            stdout=output,  # (twistd's usage errors go to stdout)
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_listening(port, 180, proxy, errors)
        path, stream = ROUTES[route]
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "stream": stream,
            }
        )

        def load(per_connection: int) -> int:
            done = subprocess.run(
                [
                    str(loadgen),
                    "--url",
                    f"http://127.0.0.1:{port}{path}",
                    "--body",
                    body,
                    "--concurrency",
                    str(concurrency),
                    "--max-requests",
                    str(per_connection),
                    "--duration",
                    "600",
                    "--timeout",
                    "120",
                ],
                check=True,
                capture_output=True,
            )
            served: int = json.loads(done.stdout)["ok"]
            return served

        load(max(2, requests // 5))  # warm-up: pool, caches, first imports

        def control(*flags: str) -> None:
            subprocess.run(
                ["callgrind_control", *flags, str(proxy.pid)],
                check=True,
                capture_output=True,
            )

        control("-i", "on")
        served = load(requests)
        control("-i", "off")
        control("-d")
    finally:
        proxy.terminate()
        engine.terminate()
        proxy.wait(60)
        engine.wait(10)
    return served, instructions_in(work, out.name)


def instructions_in(work: Path, name: str) -> int:
    """The instructions counted in callgrind's dumps C{name}, C{name.1}, ..."""
    total = 0
    for dump in work.glob(f"{name}*"):
        for line in dump.read_text().splitlines():
            if line.startswith("totals:"):
                total += int(line.split()[1])
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--route", choices=sorted(ROUTES), default="chat")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--requests", type=int, default=50, help="measured requests per connection"
    )
    parser.add_argument("--only", action="append", choices=TARGETS)
    parser.add_argument("--tree", help="run nvproxy from this checkout")
    parser.add_argument(
        "--keep",
        metavar="DIR",
        help="write the callgrind dumps to DIR and keep them (callgrind_annotate)",
    )
    args = parser.parse_args(argv)
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"{tool} not found (Debian: apt-get install valgrind)")
            return 2
    results: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        if args.keep:
            work = args.keep
            Path(work).mkdir(parents=True, exist_ok=True)
        else:
            work = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="nvproxy-instr-")
            )
        for target in args.only or DEFAULT_TARGETS:
            served, total = measure(
                target,
                args.route,
                args.concurrency,
                args.requests,
                args.tree,
                Path(work),
            )
            if served == 0:
                print(f"{target}: no request served")
                return 1
            results[target] = total / served
            print(
                f"{target:8s} {args.route} c={args.concurrency}:"
                f" {total / served / 1e6:.3f}M instructions per request"
                f" ({served} requests)",
                flush=True,
            )
    for reference in ("rpr", "agent", "lean", "facade"):
        if "nvproxy" in results and reference in results:
            print(
                f"nvproxy/{reference}: {results['nvproxy'] / results[reference]:.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
