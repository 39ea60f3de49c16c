"""
The chaos soak: C{python -m bench.soak} (see C{bench/README.rst}).

Starts one engine double per node (L{bench.soak.engine}, each on its own
loopback address), an nvproxy daemon (C{twistd -n nvproxy}) with a llama.cpp
facade in front of them, and drives requests at them from this process while
the doubles inject faults and the nodes stop, hide and come back.  Then it
checks every request (L{bench.soak.checks}) and the daemon for leaks, prints
a summary table and exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.soak.checks import Bounds, Report, check
from bench.soak.client import Answer, Connection, exchange
from bench.soak.engine import FAULTS
from nvproxy.testing.harness import free_port

WARM_MODEL = "soak-warm"
LOG_PROBLEMS = re.compile(r"Unhandled|Traceback|#critical|#error|CRITICAL")


class SoakError(Exception):
    """The setup broke: a process did not start or answer."""


@dataclass
class Settings:
    requests: int = 5000
    concurrency: int = 16
    nodes: int = 3
    seed: int = 0
    disconnect_rate: float = 0.05
    stream_rate: float = 0.5
    max_attempts: int = 5
    deadline: float = 6.0
    dial_timeout: float = 1.0
    header_timeout: float = 1.5
    backoff: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4)
    poll_interval: float = 0.2
    node_chaos: bool = True
    chaos_interval: tuple[float, float] = (0.5, 2.0)
    fd_slack: int = 0  # 0: the node count plus 4
    rss_slack: float = 0.3
    rss_slack_bytes: int = 20 << 20

    @property
    def bounds(self) -> Bounds:
        return Bounds(
            self.max_attempts,
            self.deadline,
            self.dial_timeout,
            self.header_timeout,
            max(self.backoff),
        )


@dataclass
class Leaks:
    baseline: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    status: dict[str, Any] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    log_lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


# -- processes ---------------------------------------------------------------


class Child:
    def __init__(self, name: str, proc: asyncio.subprocess.Process) -> None:
        self.name = name
        self.proc = proc
        self.lines: asyncio.Queue[str] = asyncio.Queue()
        self.pumping: asyncio.Future[None] | None = None

    async def pump(self, log: Path) -> None:
        assert self.proc.stdout is not None
        with log.open("ab") as f:
            while True:
                line = await self.proc.stdout.readline()
                if not line:
                    break
                f.write(line)
                f.flush()
                await self.lines.put(line.decode("utf-8", "replace").strip())

    async def wait_line(self, prefix: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise SoakError(f"{self.name}: no {prefix!r} within {timeout}s")
            try:
                line = await asyncio.wait_for(self.lines.get(), left)
            except TimeoutError:
                continue
            if line.startswith(prefix):
                return line

    async def stop(self, grace: float = 10.0) -> None:
        if self.proc.returncode is not None:
            return
        try:
            self.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            await asyncio.wait_for(self.proc.wait(), grace)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


class EngineProc(Child):
    def __init__(
        self, name: str, proc: asyncio.subprocess.Process, host: str, port: int
    ) -> None:
        super().__init__(name, proc)
        self.host = host
        self.port = port
        self.lock = asyncio.Lock()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def command(self, command: str) -> None:
        assert self.proc.stdin is not None
        async with self.lock:
            self.proc.stdin.write(command.encode() + b"\n")
            await self.proc.stdin.drain()
            await self.wait_line(f"ok {command}", 10.0)

    async def quit(self) -> None:
        if self.proc.returncode is None:
            try:
                await self.command("quit")
                await asyncio.wait_for(self.proc.wait(), 5)
            except (TimeoutError, SoakError, ConnectionError):
                await self.stop()


async def start_engine(
    workdir: Path, node: str, index: int, models: Sequence[str], s: Settings
) -> EngineProc:
    host = f"127.0.0.{11 + index}"
    argv = [
        sys.executable,
        "-m",
        "bench.soak.engine",
        "--host",
        host,
        "--port",
        str(free_port(host)),
        "--node",
        node,
        "--models",
        ",".join(models),
        "--seed",
        str(s.seed),
        "--receipts",
        str(workdir / f"{node}.jsonl"),
        "--header-timeout",
        str(s.header_timeout),
        "--calm",
    ]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=(workdir / f"{node}.err").open("wb"),
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    child = EngineProc(node, proc, host, 0)
    child.pumping = asyncio.ensure_future(child.pump(workdir / f"{node}.out"))
    line = await child.wait_line("listening on ", 20)
    child.port = int(line.rsplit(":", 1)[1])
    return child


def _duration(seconds: float) -> str:
    return json.dumps(f"{round(seconds * 1000)}ms")


def config_text(
    s: Settings, admin: int, facade: int, engines: Sequence[EngineProc], log: Path
) -> str:
    lines = [
        f"node_id = {json.dumps(engines[0].name)}",
        "[admin]",
        f'listen = "127.0.0.1:{admin}"',
        "[dispatch]",
        f"max_attempts = {s.max_attempts}",
        f"deadline = {_duration(s.deadline)}",
        f"dial_timeout = {_duration(s.dial_timeout)}",
        f"response_header_timeout = {_duration(s.header_timeout)}",
        f"backoff = [{', '.join(_duration(b) for b in s.backoff)}]",
        "[discovery]",
        f"poll_interval = {_duration(s.poll_interval)}",
        "[workloads]",
        f"log = {json.dumps(str(log))}",
        "[engines.llamacpp]",
        f"port = {facade}",
        f"backend = {json.dumps(engines[0].url)}",
        "[engines.ollama]",
        "enabled = false",
        "[engines.lmstudio]",
        "enabled = false",
        "[engines.vllm]",
        "enabled = false",
    ]
    for e in engines[1:]:
        lines += [
            "[[nodes]]",
            f"id = {json.dumps(e.name)}",
            f"engines = {{ llamacpp = {json.dumps(e.url)} }}",
        ]
    return "\n".join(lines) + "\n"


async def start_daemon(workdir: Path, config: Path) -> Child:
    state = workdir / "state"
    state.mkdir(exist_ok=True)
    argv = [
        sys.executable,
        "-c",
        "import sys; from twisted.scripts.twistd import run; sys.exit(run())",
        "-n",
        "--pidfile=",
        f"--logfile={workdir / 'nvproxy.log'}",
        "nvproxy",
        "--config",
        str(config),
        "--state-dir",
        str(state),
    ]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    child = Child("nvproxy", proc)
    child.pumping = asyncio.ensure_future(child.pump(workdir / "nvproxy.out"))
    return child


# -- admin -------------------------------------------------------------------


async def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    async def go() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            data = await reader.read()
        finally:
            writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in head.lower():
            out, rest = b"", body
            while rest:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line.split(b";")[0] or b"0", 16)
                if size == 0:
                    break
                out, rest = out + rest[:size], rest[size + 2 :]
            body = out
        return status, body

    return await asyncio.wait_for(go(), timeout)


async def status_of(admin: int) -> dict[str, Any]:
    code, body = await http_get(admin, "/admin/status")
    if code != 200:
        raise SoakError(f"/admin/status answered {code}")
    result: dict[str, Any] = json.loads(body)
    return result


async def gauges_of(admin: int) -> dict[str, float]:
    code, body = await http_get(admin, "/metrics")
    if code != 200:
        raise SoakError(f"/metrics answered {code}")
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith(("nvproxy_inflight_requests", "nvproxy_reservations")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def wait_all_advertised(
    admin: int,
    daemon: Child,
    models: Sequence[str],
    nodes: Sequence[str],
    timeout: float,
) -> dict[str, Any]:
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        if daemon.proc.returncode is not None:
            raise SoakError("nvproxy exited; see nvproxy.log")
        try:
            status = await status_of(admin)
        except (TimeoutError, OSError, SoakError, ValueError) as e:
            last = e
        else:
            last = status.get("nodes")
            seen = status.get("nodes") or {}
            if all(
                set(models) <= set((seen.get(n) or {}).get("llamacpp", []))
                for n in nodes
            ):
                return status
        await asyncio.sleep(0.1)
    raise SoakError(f"nodes not advertised within {timeout}s (last: {last!r})")


# -- load --------------------------------------------------------------------


def plan_for(seed: int, index: int, s: Settings) -> tuple[bool, str | None, float]:
    rng = random.Random(f"{seed}:request:{index}")
    stream = rng.random() < s.stream_rate
    plan: str | None = None
    if rng.random() < s.disconnect_rate:
        plan = "before" if rng.random() < 0.5 else "during"
        if plan == "during":
            stream = True
    return stream, plan, rng.uniform(0.05, 0.8)


async def run_load(
    s: Settings,
    port: int,
    count: int,
    model_of: Any,
    soak_prefix: str,
    answers: list[Answer],
    progress: bool,
) -> None:
    host = f"127.0.0.1:{port}"
    timeout = s.bounds.longest + 10
    counter = iter(range(count))
    started = time.monotonic()

    async def worker(k: int) -> None:
        conn: Connection | None = None
        for index in counter:
            stream, plan, delay = plan_for(s.seed, index, s)
            answer = Answer(
                soak=f"{soak_prefix}{index}",
                index=index,
                worker=k,
                model=model_of(k),
                stream=stream,
                plan=plan,
            )
            if conn is not None and time.monotonic() - conn.last_used > 2.0:
                conn.close()
                conn = None
            if conn is None:
                conn = await Connection.open("127.0.0.1", port)
            await exchange(conn, host, answer, timeout, delay)
            answers.append(answer)
            if answer.disconnected or answer.error or not answer.keep_alive:
                conn.close()
                conn = None
            if answer.disconnected:
                # The next request must not overtake this one on its way in.
                await asyncio.sleep(0.3)
            if progress and len(answers) % 500 == 0:
                rate = len(answers) / (time.monotonic() - started)
                print(f"  {len(answers)} requests, {rate:.0f}/s", flush=True)
        if conn is not None:
            conn.close()

    await asyncio.gather(*(worker(k) for k in range(s.concurrency)))


async def node_chaos(
    engines: Sequence[EngineProc],
    s: Settings,
    stop: asyncio.Event,
    counts: Counter[str],
) -> None:
    rng = random.Random(f"{s.seed}:nodes")
    down: set[str] = set()

    async def episode(e: EngineProc, action: str, seconds: float) -> None:
        down.add(e.name)
        try:
            await e.command(action)
            counts[action] += 1
            try:
                await asyncio.wait_for(stop.wait(), seconds)
            except TimeoutError:
                pass
            await e.command("start" if action == "stop" else "show")
        finally:
            down.discard(e.name)

    tasks: list[asyncio.Future[None]] = []
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(*s.chaos_interval))
        except TimeoutError:
            pass
        if stop.is_set():
            break
        up = [e for e in engines if e.name not in down]
        if len(up) <= 1:
            continue
        e = rng.choice(up)
        action = rng.choice(["stop", "hide"])
        seconds = rng.uniform(0.3, 1.5) if action == "stop" else rng.uniform(0.4, 2.0)
        tasks.append(asyncio.ensure_future(episode(e, action, seconds)))
    await asyncio.gather(*tasks)


# -- leaks -------------------------------------------------------------------


async def settle(engines: Sequence[EngineProc], admin: int) -> dict[str, Any]:
    """Close the engines' idle connections and let the pool notice."""
    for e in engines:
        await e.command("close-idle")
    await asyncio.sleep(0.5)
    return await status_of(admin)


async def leak_checks(
    s: Settings, engines: Sequence[EngineProc], admin: int, leaks: Leaks, log: Path
) -> None:
    base = leaks.baseline
    fd_slack = s.fd_slack or len(engines) + 4
    end = time.monotonic() + 20
    status: dict[str, Any] = {}
    while True:
        status = await status_of(admin)
        if status.get("inflight", 0) == 0 or time.monotonic() > end:
            break
        await asyncio.sleep(0.2)
    # Retry for a while: a pooled connection may need a moment to close.
    problems: list[str] = []
    for _ in range(10):
        status = await settle(engines, admin)
        gauges = await gauges_of(admin)
        proc = status.get("process") or {}
        problems = []
        if status.get("inflight"):
            problems.append(f"inflight {status['inflight']}")
        reservations = status.get("reservations") or {}
        if any(reservations.values()):
            problems.append(f"reservations {reservations}")
        loads = status.get("loads") or {}
        if any(v for v in loads.values() if isinstance(v, int | float)):
            problems.append(f"loads {loads}")
        nonzero = {k: v for k, v in gauges.items() if v}
        if nonzero:
            problems.append(f"gauges {nonzero}")
        if proc and base.get("open_fds") is not None:
            if proc["open_fds"] > base["open_fds"] + fd_slack:
                problems.append(
                    f"open fds {proc['open_fds']} (baseline {base['open_fds']}, "
                    f"slack {fd_slack})"
                )
        if proc and base.get("delayed_calls") is not None:
            if proc["delayed_calls"] > base["delayed_calls"] + fd_slack:
                problems.append(
                    f"delayed calls {proc['delayed_calls']} (baseline "
                    f"{base['delayed_calls']}, slack {fd_slack})"
                )
        if proc and base.get("rss_bytes"):
            limit = base["rss_bytes"] + max(
                s.rss_slack * base["rss_bytes"], s.rss_slack_bytes
            )
            if proc["rss_bytes"] > limit:
                problems.append(
                    f"rss {proc['rss_bytes'] >> 20} MiB (baseline "
                    f"{base['rss_bytes'] >> 20} MiB)"
                )
        leaks.after = dict(proc)
        leaks.status = {k: status.get(k) for k in ("inflight", "reservations", "loads")}
        leaks.gauges = gauges
        if not problems:
            break
        await asyncio.sleep(0.5)
    if not base:
        problems.append("no baseline: /admin/status has no 'process'")
    leaks.problems = problems
    text = log.read_text(errors="replace") if log.exists() else ""
    leaks.log_lines = [line for line in text.splitlines() if LOG_PROBLEMS.search(line)]


# -- the run -----------------------------------------------------------------


@dataclass
class Result:
    settings: Settings
    workdir: Path
    answers: list[Answer]
    receipts: list[dict[str, Any]]
    node_events: list[dict[str, Any]]
    report: Report
    leaks: Leaks
    elapsed: float
    node_counts: Counter[str]

    @property
    def failed(self) -> bool:
        return bool(
            self.report.violations or self.leaks.problems or self.leaks.log_lines
        )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


async def soak(s: Settings, workdir: Path, progress: bool = True) -> Result:
    node_names = [f"n{i}" for i in range(s.nodes)]
    models = [f"soak-w{k}" for k in range(s.concurrency)] + [WARM_MODEL]
    engines: list[EngineProc] = []
    daemon: Child | None = None
    answers: list[Answer] = []
    leaks = Leaks()
    node_counts: Counter[str] = Counter()
    workload_log = workdir / "workloads.jsonl"
    try:
        for i, name in enumerate(node_names):
            engines.append(await start_engine(workdir, name, i, models, s))
        admin, facade = free_port(), free_port()
        config = workdir / "nvproxy.toml"
        config.write_text(config_text(s, admin, facade, engines, workload_log))
        daemon = await start_daemon(workdir, config)
        await wait_all_advertised(admin, daemon, models, node_names, 30)

        # Warm up without faults, then take the baseline.
        await run_load(
            s, facade, 4 * s.concurrency, lambda k: WARM_MODEL, "warm-", [], False
        )
        baseline = await settle(engines, admin)
        leaks.baseline = dict(baseline.get("process") or {})

        for e in engines:
            await e.command("chaos")
        stop = asyncio.Event()
        chaos = asyncio.ensure_future(
            node_chaos(engines, s, stop, node_counts)
            if s.node_chaos
            else asyncio.sleep(0)
        )
        started = time.monotonic()
        try:
            await run_load(
                s, facade, s.requests, lambda k: f"soak-w{k}", "s", answers, progress
            )
        finally:
            elapsed = time.monotonic() - started
            stop.set()
            await chaos
        for e in engines:
            await e.command("calm")
            await e.command("start")
            await e.command("show")
        await wait_all_advertised(admin, daemon, models, node_names, 20)
        await leak_checks(s, engines, admin, leaks, workdir / "nvproxy.log")
    finally:
        if daemon is not None:
            await daemon.stop()
        for e in engines:
            await e.quit()

    with (workdir / "answers.jsonl").open("w") as f:
        for a in answers:
            f.write(json.dumps(_answer_json(a)) + "\n")
    (workdir / "run.json").write_text(
        json.dumps(
            {
                "settings": asdict(s),
                "leaks": asdict(leaks),
                "elapsed": elapsed,
                "node_counts": dict(node_counts),
            }
        )
    )
    return analyze(workdir)


def _answer_json(a: Answer) -> dict[str, Any]:
    out = asdict(a)
    out["body"] = a.body.decode("latin-1")
    return out


def analyze(workdir: Path) -> Result:
    """Run the checks over what a run left in C{workdir}."""
    run = json.loads((workdir / "run.json").read_text())
    settings = dict(run["settings"])
    settings["backoff"] = tuple(settings["backoff"])
    settings["chaos_interval"] = tuple(settings["chaos_interval"])
    s = Settings(**settings)
    answers = []
    for entry in _read_jsonl(workdir / "answers.jsonl"):
        entry["body"] = entry["body"].encode("latin-1")
        answers.append(Answer(**entry))
    receipts: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for name in (f"n{i}" for i in range(s.nodes)):
        for entry in _read_jsonl(workdir / f"{name}.jsonl"):
            if entry["kind"] == "receipt" and not entry["soak"].startswith("warm-"):
                receipts.append(entry)
            elif entry["kind"] == "event":
                events.append(entry)
    lines = [
        n
        for n in _read_jsonl(workdir / "workloads.jsonl")
        if n["params"]["workloadInfo"]["model"] != WARM_MODEL
    ]
    report = check(answers, receipts, events, lines, s.bounds)
    leaks = Leaks(**run["leaks"])
    return Result(
        s,
        workdir,
        answers,
        receipts,
        events,
        report,
        leaks,
        run["elapsed"],
        Counter(run["node_counts"]),
    )


# -- the table ---------------------------------------------------------------


def summary(result: Result) -> str:
    r, s = result.report, result.settings
    out: list[str] = []

    def section(title: str, rows: Sequence[tuple[str, Any]]) -> None:
        out.append(title)
        width = max([len(k) for k, _ in rows] + [10])
        for key, value in rows:
            out.append(f"  {key:<{width}}  {value}")

    n = len(result.answers)
    section(
        f"chaos soak: seed {s.seed}, {n} requests, {s.nodes} nodes, "
        f"concurrency {s.concurrency}",
        [
            ("duration", f"{result.elapsed:.1f} s"),
            ("requests/s", f"{n / result.elapsed:.1f}" if result.elapsed else "-"),
            ("receipts", len(result.receipts)),
            ("dispatches", r.dispatches),
            ("retries", max(0, r.dispatches - n)),
            (
                "client disconnects",
                sum(1 for a in result.answers if a.disconnected),
            ),
        ],
    )
    section("requests by outcome", sorted(r.outcomes.items(), key=lambda kv: -kv[1]))
    section("terminal workload states", sorted(r.states.items()))
    faults = Counter(rec["fault"] for rec in result.receipts)
    section(
        "faults injected (per receipt)",
        [(name, faults.get(name, 0)) for name, _ in FAULTS]
        + [(f"node {k}", v) for k, v in sorted(result.node_counts.items())],
    )
    if r.excused:
        section("tolerated (not violations)", sorted(r.excused.items()))
    kinds = Counter(v.kind for v in r.violations)
    section(
        "violations by kind",
        sorted(kinds.items()) or [("none", 0)],
    )
    leaks = result.leaks
    base, after = leaks.baseline, leaks.after
    rows: list[tuple[str, Any]] = []
    for key in ("open_fds", "delayed_calls", "rss_bytes"):
        b, a = base.get(key), after.get(key)
        if key == "rss_bytes" and b and a:
            rows.append(("rss MiB", f"{b / 2**20:.1f} -> {a / 2**20:.1f}"))
        else:
            rows.append((key, f"{b} -> {a}"))
    rows.append(("status", json.dumps(leaks.status, sort_keys=True)))
    rows.append(("gauges", json.dumps(leaks.gauges, sort_keys=True)))
    rows.append(("log problems", len(leaks.log_lines)))
    rows.append(("leak problems", "; ".join(leaks.problems) or "none"))
    section("after the run (baseline -> after)", rows)
    if r.violations:
        out.append("violations (first 3 of each kind):")
        shown: Counter[str] = Counter()
        for v in r.violations:
            if shown[v.kind] < 3:
                shown[v.kind] += 1
                out.append(f"  [{v.kind}] {v.soak}: {v.detail}")
    for line in leaks.log_lines[:10]:
        out.append(f"  [log] {line[:300]}")
    out.append("RESULT: " + ("FAIL" if result.failed else "PASS"))
    return "\n".join(out)


def to_json(result: Result) -> dict[str, Any]:
    r = result.report
    return {
        "settings": {
            k: v for k, v in asdict(result.settings).items() if k != "chaos_interval"
        },
        "requests": len(result.answers),
        "elapsed": result.elapsed,
        "receipts": len(result.receipts),
        "dispatches": r.dispatches,
        "outcomes": dict(r.outcomes),
        "states": dict(r.states),
        "faults": dict(Counter(rec["fault"] for rec in result.receipts)),
        "node_events": dict(result.node_counts),
        "excused": dict(r.excused),
        "violations": [asdict(v) for v in r.violations],
        "leaks": asdict(result.leaks),
        "failed": result.failed,
        "workdir": str(result.workdir),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description="Chaos soak: faults and node churn under load, every "
        "request checked against spec §5.4; exit 1 on any violation.",
    )
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--seed", type=int, default=None, help="default: random, printed")
    p.add_argument("--disconnect-rate", type=float, default=0.05)
    p.add_argument("--header-timeout", type=float, default=1.5)
    p.add_argument("--deadline", type=float, default=6.0)
    p.add_argument(
        "--no-node-chaos", action="store_true", help="nodes never stop or hide"
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--recheck",
        metavar="WORKDIR",
        help="run the checks again over a kept work dir, without a new run",
    )
    args = p.parse_args(argv)
    if args.recheck:
        result = analyze(Path(args.recheck))
        print(summary(result), flush=True)
        return 1 if result.failed else 0
    if args.nodes < 1 or args.nodes > 200 or args.concurrency < 1 or args.requests < 1:
        p.error("--nodes 1..200, --concurrency and --requests >= 1")
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    s = Settings(
        requests=args.requests,
        concurrency=args.concurrency,
        nodes=args.nodes,
        seed=seed,
        disconnect_rate=args.disconnect_rate,
        header_timeout=args.header_timeout,
        deadline=args.deadline,
        node_chaos=not args.no_node_chaos,
    )
    workdir = Path(tempfile.mkdtemp(prefix="nvproxy-soak-"))
    print(
        f"chaos soak: seed {seed} (--seed {seed} reproduces the faults), "
        f"work dir {workdir}",
        flush=True,
    )
    try:
        result = asyncio.run(soak(s, workdir, progress=not args.quiet))
    except SoakError as e:
        print(f"soak could not run: {e}; logs in {workdir}", file=sys.stderr)
        return 2
    print(summary(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(result), indent=1, default=str))
    if result.failed or args.keep:
        print(f"work dir kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if result.failed else 0
