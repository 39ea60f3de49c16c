"""
Benchmark nvproxy against its engines, side by side in one run.

    python -m bench.run [--quick] [--only NAME] [--json OUT]

Every fake engine and the nvproxy daemon run in their own processes; this
process is the load generator.  For each scenario the same workload goes to
the fake engine directly and through nvproxy in alternating rounds (ABBA
order, so drift cancels), and the table reports both paths with the ratios
nvproxy/direct and the proxy's CPU time per request and RSS.  See
C{bench/README.rst} for how to read the numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
from attrs import frozen
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import LoopingCall

from bench import native, procs, refs, report
from bench.load import LoadGenerator, Samples, Workload, percentile, perf_now
from bench.native import NativeLoad
from bench.report import DIRECT, NGINX, NVPROXY, RPR
from nvproxy.testing.harness import Client, NotHealthy, free_port, wait_healthy

MODEL = "bench-model"
STREAM_CHUNKS = 200
LOCAL_MODEL = "local-m"  # mtls: only node A's engine has it
REMOTE_MODEL = "remote-m"  # mtls: only node B's engine has it
NODE_A, NODE_B = "node-a", "node-b"


@frozen
class Plan:
    """How long each comparison runs."""

    rounds: int  # measured rounds per path, alternating ABBA
    round_seconds: float
    warmup_seconds: float  # one unmeasured round per path first
    concurrencies: tuple[int, ...] = (1, 32)
    failover_concurrencies: tuple[int, ...] = (1, 32)
    request_timeout: float = 30.0
    # mtls measures three paths for two workloads: shorter, to keep the run short
    mtls_rounds: int = 2
    mtls_round_seconds: float = 1.2
    # stream and stream-sse: 200 chunks back to back
    stream_concurrencies: tuple[int, ...] = (32,)
    # paced: this many streams at once, each chunk this far apart
    paced_concurrency: int = 32
    paced_chunks: int = 20
    paced_interval: float = 0.025
    # open: this many streams opened at once, one request each, held open by
    # a slow engine; rounds of one batch per path
    open_streams: int = 500
    # open-2000: the same with this many streams, one batch per path
    many_streams: int = 2000
    open_chunks: int = 40
    open_interval: float = 0.05
    open_rounds: int = 2
    # wake: a fake vLLM whose /wake_up takes wake_latency and whose weights
    # reload takes wake_rpc_latency, put to sleep wake_rounds times per depth
    wake_rounds: int = 4
    wake_latency: float = 1.0
    wake_rpc_latency: float = 0.2


FULL = Plan(rounds=4, round_seconds=1.2, warmup_seconds=0.3)
QUICK = Plan(
    rounds=2,
    round_seconds=0.3,
    warmup_seconds=0.1,
    mtls_round_seconds=0.3,
    paced_chunks=8,
    open_chunks=10,
    wake_rounds=2,
    wake_latency=0.3,
    wake_rpc_latency=0.05,
)


@frozen
class Path_:
    """One way to reach the engine, measured in its own rounds."""

    name: str
    url: str
    proxied: bool
    before_round: Callable[[], Awaitable[None]] | None = None
    model: str | None = None  # instead of the workload's model
    # the process whose CPU and RSS the path's rows report (a reference
    # proxy); None: the daemon given to compare()
    target: procs.Proc | None = None


@frozen
class Row:
    """One path of one scenario at one concurrency."""

    scenario: str
    concurrency: int
    path: str
    requests: int
    errors: int
    elapsed: float
    rps: float
    p50: float
    p99: float
    ttfb_p50: float
    ttfb_p99: float
    lines_per_request: float
    proxy_cpu_per_request: float | None  # seconds; None on the direct path
    proxy_rss: int | None  # bytes, after the path's last round
    client_cpu_share: float  # load generator CPU seconds / wall seconds
    error_kinds: dict[str, int] = attrs.field(factory=dict)
    # the second daemon (mtls: peer B), over the same rounds; None without one
    peer_cpu_per_request: float | None = None
    peer_rss: int | None = None
    # inference requests (POST /api/chat) each watched engine received during
    # the path's measured rounds; empty when no engine is watched
    engine_requests: dict[str, int] = attrs.field(factory=dict)
    # how late chunks arrived after the engine wrote them (native only)
    delay_p50: float = math.nan
    delay_p99: float = math.nan
    # the measured process's RSS: before the path's warm-up round (started,
    # idle), and the highest sampled (every 20 ms) during a measured round
    rss_base: int | None = None
    rss_peak: int | None = None
    # CPU of the engine process / wall time, when compare() was given it
    engine_cpu_share: float = math.nan
    connects: int = 0


@attrs.define
class Result:
    rows: list[Row] = attrs.field(factory=list)
    notes: list[str] = attrs.field(factory=list)
    problems: list[str] = attrs.field(factory=list)  # failed checks


@frozen
class Context:
    reactor: Any
    plan: Plan
    workdir: Path
    out: TextIO
    # the native load generator; None: the Python one (--python)
    loadgen: Path | None = None

    @property
    def native(self) -> bool:
        return self.loadgen is not None


async def _chat_counts(engines: Mapping[str, str]) -> dict[str, int]:
    return {
        name: (await procs.engine_stats(url)).get("/api/chat", 0)
        for name, url in engines.items()
    }


async def compare(
    ctx: Context,
    scenario: str,
    paths: Sequence[Path_],
    workload: Workload,
    concurrency: int,
    proxy: procs.Proxy | None,
    *,
    peer: procs.Proxy | None = None,
    engines: Mapping[str, str] | None = None,
    plan: Plan | None = None,
    engine: procs.Proc | None = None,
    delays: bool = False,
    max_requests: int = 0,
    python_load: bool = False,
    warmup_concurrency: int | None = None,
) -> list[Row]:
    """
    Run C{workload} over every path in alternating rounds (ABBA...): one
    warm-up round each, then C{plan.rounds} measured rounds each.  CPU and
    RSS are read from each path's C{target}, else C{proxy}, and from
    C{peer}; the inference requests that each of C{engines} (name -> bench
    engine URL) received are counted per path, and the CPU of C{engine}.
    With C{max_requests}, a round ends after that many requests (the warm-up
    after C{warmup_concurrency} requests on as many connections, when given).
    The native load generator is used unless the context has none or
    C{python_load}.
    """
    plan = ctx.plan if plan is None else plan
    engines = engines or {}

    def generator(c: int) -> LoadGenerator | NativeLoad:
        if ctx.loadgen is None or python_load:
            return LoadGenerator(ctx.reactor, perf_now, c, plan.request_timeout)
        return NativeLoad(
            ctx.reactor, ctx.loadgen, c, plan.request_timeout, delays=delays
        )

    gen = generator(concurrency)
    warm_gen = gen if warmup_concurrency is None else generator(warmup_concurrency)
    limit = {"max_requests": max_requests} if max_requests else {}
    warm_limit = limit
    if warmup_concurrency is not None and max_requests:
        warm_limit = {"max_requests": warmup_concurrency}
    samples = {p.name: Samples() for p in paths}
    proxy_cpu = dict.fromkeys(samples, 0.0)
    peer_cpu = dict.fromkeys(samples, 0.0)
    engine_cpu = dict.fromkeys(samples, 0.0)
    served = {name: dict.fromkeys(engines, 0) for name in samples}
    rss: dict[str, int] = {}
    rss_base: dict[str, int] = {}
    rss_peak: dict[str, int] = {}
    peer_rss: dict[str, int] = {}

    def measured(p: Path_) -> procs.Proc | None:
        if p.target is not None:
            return p.target
        return proxy.proc if proxy is not None else None

    def load(p: Path_) -> Workload:
        return workload if p.model is None else attrs.evolve(workload, model=p.model)

    def watch_rss(name: str, proc: procs.Proc) -> LoopingCall:
        def sample() -> None:
            try:
                now = proc.usage().rss
            except OSError:
                return
            rss_peak[name] = max(rss_peak.get(name, 0), now)

        loop = LoopingCall(sample)
        loop.clock = ctx.reactor
        loop.start(0.02, now=True)
        return loop

    try:
        for p in paths:
            if p.before_round is not None:
                await p.before_round()
            warm = measured(p)
            if warm is not None and p.proxied:
                rss_base[p.name] = warm.usage().rss
            await warm_gen.round(
                f"{p.url}{workload.path}",
                load(p),
                plan.warmup_seconds,
                Samples(),
                **warm_limit,
            )
        for r in range(plan.rounds):
            for p in paths if r % 2 == 0 else list(reversed(paths)):
                if p.before_round is not None:
                    await p.before_round()
                counts0 = await _chat_counts(engines)
                target = measured(p)
                daemons = [target] if target is not None else []
                if peer is not None:
                    daemons.append(peer.proc)
                before = [d.usage() for d in daemons]
                engine0 = engine.usage().cpu if engine is not None else 0.0
                sampler = watch_rss(p.name, target) if target is not None else None
                try:
                    await gen.round(
                        f"{p.url}{workload.path}",
                        load(p),
                        plan.round_seconds,
                        samples[p.name],
                        **limit,
                    )
                finally:
                    if sampler is not None:
                        sampler.stop()
                after = [d.usage() for d in daemons]
                if engine is not None:
                    engine_cpu[p.name] += engine.usage().cpu - engine0
                counts1 = await _chat_counts(engines)
                if target is not None:
                    proxy_cpu[p.name] += after[0].cpu - before[0].cpu
                    rss[p.name] = after[0].rss
                if peer is not None:
                    peer_cpu[p.name] += after[-1].cpu - before[-1].cpu
                    peer_rss[p.name] = after[-1].rss
                for name in engines:
                    served[p.name][name] += counts1[name] - counts0[name]
    finally:
        await gen.close()
        if warm_gen is not gen:
            await warm_gen.close()
    rows = []
    for p in paths:
        s = samples[p.name]
        n = s.ok
        rows.append(
            Row(
                scenario=scenario,
                concurrency=concurrency,
                path=p.name,
                requests=n,
                errors=s.errors,
                elapsed=s.elapsed,
                rps=n / s.elapsed if s.elapsed else math.nan,
                p50=percentile(s.latencies, 50),
                p99=percentile(s.latencies, 99),
                ttfb_p50=percentile(s.ttfbs, 50),
                ttfb_p99=percentile(s.ttfbs, 99),
                lines_per_request=s.lines / n if n else math.nan,
                proxy_cpu_per_request=(
                    proxy_cpu[p.name] / n if p.proxied and n else None
                ),
                proxy_rss=rss.get(p.name) if p.proxied else None,
                client_cpu_share=s.client_cpu / s.elapsed if s.elapsed else math.nan,
                error_kinds=dict(s.error_kinds),
                peer_cpu_per_request=(
                    peer_cpu[p.name] / n
                    if peer is not None and p.proxied and n
                    else None
                ),
                peer_rss=peer_rss.get(p.name) if p.proxied else None,
                engine_requests=served[p.name],
                delay_p50=percentile(s.delays, 50),
                delay_p99=percentile(s.delays, 99),
                rss_base=rss_base.get(p.name) if p.proxied else None,
                rss_peak=rss_peak.get(p.name) if p.proxied else None,
                engine_cpu_share=(
                    engine_cpu[p.name] / s.elapsed
                    if engine is not None and s.elapsed
                    else math.nan
                ),
                connects=s.connects,
            )
        )
    return rows


async def _stop_all(ctx: Context, running: Sequence[procs.Proc]) -> None:
    for proc in reversed(running):
        await proc.stop(ctx.reactor)


# -- scenarios ---------------------------------------------------------------------


AGENT = "agent"
LEAN = "lean"
FACADE = "facade"
LABELS = {
    DIRECT: "direct",
    RPR: "Twisted RPR",
    NGINX: "nginx",
    AGENT: "Agent floor",
    LEAN: "lean floor",
    FACADE: "facade floor",
    NVPROXY: "nvproxy",
}


@frozen
class EngineSpec:
    """What the scenario's engine answers: tokens per stream, their pace."""

    stream_chunks: int = STREAM_CHUNKS
    interval: float = 0.0  # seconds between streamed tokens


async def _start_engine(
    ctx: Context, name: str, spec: EngineSpec
) -> tuple[procs.Proc, str]:
    if ctx.native:
        return await native.start_engine(
            ctx.reactor,
            ctx.workdir,
            name,
            [MODEL],
            stream_chunks=spec.stream_chunks,
            interval=spec.interval,
        )
    return await procs.start_engine(
        ctx.reactor,
        ctx.workdir,
        name,
        [MODEL],
        stream_chunks=spec.stream_chunks,
        chunk_interval=spec.interval,
    )


async def _with_references(
    ctx: Context,
    scenario: str,
    workload: Workload,
    spec: EngineSpec,
    concurrencies: Sequence[int],
    *,
    plan: Plan | None = None,
    delays: bool = False,
    one_request_each: bool = False,
    requests_per_round: Mapping[int, int] | None = None,
    warmup_concurrency: int | None = None,
    floor: bool = False,
) -> Result:
    """
    The same engine reached directly, through Twisted's ReverseProxyResource,
    through nginx (when installed) and through nvproxy, in the same rounds.
    With C{one_request_each}, every connection sends one request per round;
    C{requests_per_round} ends a round at a concurrency after that many
    requests in all.
    With C{floor}, the bare Agent proxy (L{bench.agentfloor}), the same
    behind a minimal server (L{bench.leanfloor}) and on nvproxy's server
    classes (L{bench.facadefloor}) are measured too, and nginx is not.
    """
    running: list[procs.Proc] = []
    result = Result()
    try:
        engine, engine_url = await _start_engine(ctx, f"{scenario}-engine", spec)
        running.append(engine)
        proxy = await procs.start_proxy(
            ctx.reactor, ctx.workdir, engine_url, name=f"{scenario}-nvproxy"
        )
        running.append(proxy.proc)
        rpr, rpr_url = await refs.start_rpr(
            ctx.reactor, ctx.workdir, f"{scenario}-rpr", engine_url
        )
        running.append(rpr)
        paths = [
            Path_(DIRECT, engine_url, proxied=False),
            Path_(RPR, rpr_url, proxied=True, target=rpr),
        ]
        if floor:
            agent, agent_url = await refs.start_agent_floor(
                ctx.reactor, ctx.workdir, f"{scenario}-agent", engine_url
            )
            running.append(agent)
            paths.append(Path_(AGENT, agent_url, proxied=True, target=agent))
            lean, lean_url = await refs.start_lean_floor(
                ctx.reactor, ctx.workdir, f"{scenario}-lean", engine_url
            )
            running.append(lean)
            paths.append(Path_(LEAN, lean_url, proxied=True, target=lean))
            facade, facade_url = await refs.start_facade_floor(
                ctx.reactor, ctx.workdir, f"{scenario}-facade", engine_url
            )
            running.append(facade)
            paths.append(Path_(FACADE, facade_url, proxied=True, target=facade))
        else:
            nginx = await refs.start_nginx(
                ctx.reactor, ctx.workdir, f"{scenario}-nginx", engine_url
            )
            if nginx is None:
                result.notes.append(f"{scenario}: nginx skipped: no nginx binary found")
            else:
                running.append(nginx[0])
                paths.append(Path_(NGINX, nginx[1], proxied=True, target=nginx[0]))
        paths.append(Path_(NVPROXY, proxy.facade, proxied=True))
        for c in concurrencies:
            rows = await compare(
                ctx,
                scenario,
                paths,
                workload,
                c,
                proxy,
                plan=plan,
                engine=engine,
                delays=delays,
                max_requests=(
                    c if one_request_each else (requests_per_round or {}).get(c, 0)
                ),
                warmup_concurrency=warmup_concurrency,
            )
            result.rows += rows
            if not one_request_each:
                result.notes += ceiling_notes(rows)
            _progress(ctx, rows)
    finally:
        await _stop_all(ctx, running)
    return result


async def scenario_chat(ctx: Context) -> Result:
    """Non-streaming Ollama chat (5 tokens in one JSON body), c=1 and c=32."""
    return await _with_references(
        ctx,
        "chat",
        Workload(MODEL, stream=False),
        EngineSpec(),
        ctx.plan.concurrencies,
    )


async def scenario_stream(ctx: Context) -> Result:
    """Streaming Ollama chat: STREAM_CHUNKS NDJSON lines back to back."""
    return await _with_references(
        ctx,
        "stream",
        Workload(MODEL, stream=True, tokens=STREAM_CHUNKS),
        EngineSpec(),
        ctx.plan.stream_concurrencies,
    )


async def scenario_stream_sse(ctx: Context) -> Result:
    """Streaming OpenAI chat: STREAM_CHUNKS SSE events back to back."""
    return await _with_references(
        ctx,
        "stream-sse",
        Workload(MODEL, stream=True, api="openai", tokens=STREAM_CHUNKS),
        EngineSpec(),
        ctx.plan.stream_concurrencies,
    )


async def scenario_floor(ctx: Context) -> Result:
    """
    Where nvproxy's CPU goes: chat (c=1, c=32) and both stream dialects
    (c=32) through RPR, the bare Agent proxy and nvproxy, in the same
    rounds.  Not in the default run (it repeats what chat and stream
    measure); C{--only floor}.
    """
    result = Result()
    for scenario, workload, concurrencies in (
        ("floor-chat", Workload(MODEL, stream=False), ctx.plan.concurrencies),
        (
            "floor-stream",
            Workload(MODEL, stream=True, tokens=STREAM_CHUNKS),
            ctx.plan.stream_concurrencies,
        ),
        (
            "floor-sse",
            Workload(MODEL, stream=True, api="openai", tokens=STREAM_CHUNKS),
            ctx.plan.stream_concurrencies,
        ),
    ):
        part = await _with_references(
            ctx, scenario, workload, EngineSpec(), concurrencies, floor=True
        )
        result.rows += part.rows
        result.notes += part.notes
    for note in floor_notes(result.rows):
        ctx.out.write(f"  {note}\n")
        result.notes.append(note)
    return result


FLEET_SIZES = (100, 1000)
"""The fleets of the C{fleet} scenario: this many more owners of the model."""


async def scenario_fleet(ctx: Context) -> Result:
    """
    What routing costs as a fleet grows: chat (c=1, c=32) through RPR and
    through nvproxy with the model on this node alone, then with
    L{FLEET_SIZES} more owners.  Every owner is a direct node whose URL is
    the same engine, so only nvproxy's routing (the snapshot's owners, the
    round's order and reservation, the targets) grows with the fleet.  Not
    in the default run; C{--only fleet}.
    """
    running: list[procs.Proc] = []
    result = Result()
    try:
        engine, engine_url = await _start_engine(ctx, "fleet-engine", EngineSpec())
        running.append(engine)
        rpr, rpr_url = await refs.start_rpr(
            ctx.reactor, ctx.workdir, "fleet-rpr", engine_url
        )
        running.append(rpr)
        paths = [
            Path_(DIRECT, engine_url, proxied=False),
            Path_(RPR, rpr_url, proxied=True, target=rpr),
        ]
        for size in (0, *FLEET_SIZES):
            nodes = {f"fleet-{i:04d}": engine_url for i in range(size)}
            # Polled once at start: a poll of the whole fleet inside a
            # round would be counted as routing.
            proxy = await procs.launch_proxy(
                ctx.reactor,
                ctx.workdir,
                engine_url,
                nodes,
                f"fleet-nvproxy-{size}",
                poll_interval="1h",
            )
            running.append(proxy.proc)
            await procs.wait_ready(
                ctx.reactor, proxy, dict.fromkeys({"bench", *nodes}, ""), 60
            )
            name = NVPROXY if not size else f"{NVPROXY}+{size}"
            paths.append(Path_(name, proxy.facade, proxied=True, target=proxy.proc))
        for c in ctx.plan.concurrencies:
            rows = await compare(
                ctx, "fleet", paths, Workload(MODEL, stream=False), c, None
            )
            result.rows += rows
            _progress(ctx, rows)
        for note in fleet_notes(result.rows):
            ctx.out.write(f"  {note}\n")
            result.notes.append(note)
    finally:
        await _stop_all(ctx, running)
    return result


def fleet_notes(rows: Sequence[Row]) -> list[str]:
    """nvproxy's CPU per request by fleet size, and against RPR's."""
    notes = []
    for c in sorted({r.concurrency for r in rows}):
        cpu = {
            r.path: r.proxy_cpu_per_request
            for r in rows
            if r.concurrency == c and r.proxy_cpu_per_request is not None
        }
        floor = cpu.get(RPR)
        parts = []
        for path, value in cpu.items():
            if path == RPR or value is None:
                continue
            owners = 1 + int(path.partition("+")[2] or 0)
            ratio = f" ({_ratio(value, floor)}x RPR)" if floor else ""
            noun = "owner" if owners == 1 else "owners"
            parts.append(f"{owners} {noun} {value * 1e6:.0f} us{ratio}")
        if parts:
            notes.append(f"fleet c={c}: nvproxy CPU per request, " + ", ".join(parts))
    return notes


def floor_notes(rows: Sequence[Row]) -> list[str]:
    """
    nvproxy's proxy CPU per request against the Agent floor's and RPR's;
    what twisted.web's server side costs the floor (Agent floor minus lean
    floor) and nvproxy's (facade floor minus lean floor), and nvproxy's
    work beyond its server side (nvproxy minus facade floor).
    """
    cpu = {
        (r.scenario, r.concurrency, r.path): r.proxy_cpu_per_request
        for r in rows
        if r.proxy_cpu_per_request
    }
    notes = []
    for scenario, c, path in cpu:
        if path != NVPROXY or (scenario, c, AGENT) not in cpu:
            continue
        ours, floor = cpu[scenario, c, NVPROXY], cpu[scenario, c, AGENT]
        text = (
            f"{scenario} c={c}: nvproxy {ours * 1e6:.0f} us/request ="
            f" {ours / floor:.2f}x the Agent floor ({floor * 1e6:.0f} us)"
        )
        if ours >= floor:
            text += f"; nvproxy's own work {(ours - floor) * 1e6:.0f} us"
        rpr = cpu.get((scenario, c, RPR))
        if rpr is not None:
            text += f"; Agent floor/RPR {floor / rpr:.2f}, nvproxy/RPR {ours / rpr:.2f}"
        lean = cpu.get((scenario, c, LEAN))
        if lean is not None:
            text += (
                f"; lean floor {lean * 1e6:.0f} us (twisted.web's server side"
                f" {(floor - lean) * 1e6:.0f} us), nvproxy/lean {ours / lean:.2f}"
            )
            facade = cpu.get((scenario, c, FACADE))
            if facade is not None:
                text += (
                    f"; facade floor {facade * 1e6:.0f} us (nvproxy's server side"
                    f" {(facade - lean) * 1e6:.0f} us"
                )
                if ours >= facade:
                    text += f", its work beyond it {(ours - facade) * 1e6:.0f} us"
                text += ")"
        notes.append(text)
    return notes


async def scenario_paced(ctx: Context) -> Result:
    """
    Paced streams: C{paced_chunks} tokens each, C{paced_interval} apart; how
    late each chunk arrives.  One stream at a time (each chunk arrives
    alone: what the proxy adds to a chunk), then C{paced_concurrency} at
    once (their chunks arrive together: a chunk also waits for the others).
    """
    plan = ctx.plan
    # One stream at a time, a round is as many whole streams as fit in it
    # (not one more, which would run past the round).
    fit = int(plan.round_seconds // (plan.paced_chunks * plan.paced_interval))
    return await _with_references(
        ctx,
        "paced",
        Workload(MODEL, stream=True, tokens=plan.paced_chunks),
        EngineSpec(plan.paced_chunks, plan.paced_interval),
        (1, plan.paced_concurrency),
        delays=True,
        requests_per_round={1: max(1, fit)},
    )


async def scenario_open(ctx: Context, streams: int = 0, rounds: int = 0) -> Result:
    """
    C{open_streams} streams opened at once, each one request held open by a
    slow engine (C{open_chunks} tokens C{open_interval} apart): the proxy's
    RSS before and at the peak, the time to first byte and how many streams
    failed.
    """
    plan = ctx.plan
    batches = attrs.evolve(plan, rounds=rounds or plan.open_rounds, round_seconds=0.05)
    return await _with_references(
        ctx,
        "open",
        Workload(MODEL, stream=True, tokens=plan.open_chunks),
        EngineSpec(plan.open_chunks, plan.open_interval),
        (streams or plan.open_streams,),
        plan=attrs.evolve(batches, warmup_seconds=0.05),
        one_request_each=True,
        warmup_concurrency=50,
    )


async def scenario_open_many(ctx: Context) -> Result:
    """
    C{open}, with C{many_streams} streams at once and one batch per path:
    that many work (listen backlog, descriptors), and what they cost.
    """
    return await scenario_open(ctx, ctx.plan.many_streams, rounds=1)


async def scenario_failover(ctx: Context) -> Result:
    """
    Two owners of the model: node C{gpu-2} advertises it but resets every
    inference connection, node C{bench} is healthy.  The same proxy is pinned
    to C{bench} (healthy only) or to C{gpu-2} (every request fails over)
    round by round, with the direct path alongside.
    """
    running: list[procs.Proc] = []
    result = Result()
    try:
        healthy, healthy_url = await procs.start_engine(
            ctx.reactor, ctx.workdir, "failover-engine", [MODEL]
        )
        running.append(healthy)
        broken, broken_url = await procs.start_engine(
            ctx.reactor, ctx.workdir, "failover-refusing", [MODEL], refuse=True
        )
        running.append(broken)
        proxy = await procs.start_proxy(
            ctx.reactor,
            ctx.workdir,
            healthy_url,
            nodes={"gpu-2": broken_url},
            name="failover-nvproxy",
        )
        running.append(proxy.proc)

        def pin(node: str) -> Callable[[], Awaitable[None]]:
            return lambda: procs.select(proxy, node)

        url = proxy.facade
        paths = [
            Path_("direct", healthy_url, proxied=False),
            Path_("nvproxy", url, proxied=True, before_round=pin("bench")),
            Path_("nvproxy+failover", url, proxied=True, before_round=pin("gpu-2")),
        ]
        workload = Workload(MODEL, stream=False)
        for c in ctx.plan.failover_concurrencies:
            before = (await procs.engine_stats(broken_url)).get("/api/chat", 0)
            rows = await compare(ctx, "failover", paths, workload, c, proxy)
            resets = (await procs.engine_stats(broken_url)).get("/api/chat", 0) - before
            result.rows += rows
            _progress(ctx, rows)
            healthy_row, failover_row = rows[1], rows[2]
            added = failover_row.ttfb_p50 - healthy_row.ttfb_p50
            result.notes.append(
                f"failover c={c}: added TTFB p50 {added * 1e3:+.2f} ms"
                f" (x{_ratio(failover_row.ttfb_p50, healthy_row.ttfb_p50)}),"
                f" p99 {(failover_row.ttfb_p99 - healthy_row.ttfb_p99) * 1e3:+.2f} ms"
                f" (x{_ratio(failover_row.ttfb_p99, healthy_row.ttfb_p99)});"
                f" CPU/request"
                f" {_us(failover_row.proxy_cpu_per_request)} vs"
                f" {_us(healthy_row.proxy_cpu_per_request)} us;"
                f" gpu-2 reset {resets} inference connections"
                f" ({'>=' if resets >= failover_row.requests else 'FEWER THAN'}"
                f" the {failover_row.requests} measured failover requests;"
                " the rest are warm-up)"
            )
        await procs.select(proxy, None)
    finally:
        await _stop_all(ctx, running)
    return result


def _cluster_available() -> bool:
    try:
        from nvproxy import cluster, config
    except ImportError:
        return False
    fields = attrs.fields_dict(config.Config) if attrs.has(config.Config) else {}
    return "cluster_dir" in fields and hasattr(cluster, "ClusterDir")


@attrs.define
class _Seen:
    initial: set[int] = attrs.field(factory=set)
    seen: set[int] = attrs.field(factory=set)
    most: int = 0

    def describe(self) -> str:
        return (
            f"{len(self.initial)} open at the start,"
            f" {len(self.seen - self.initial)} new,"
            f" at most {self.most} open at once"
        )


class _SamplerProtocol(ProcessProtocol):
    """
    Reads the sampler's JSON lines; each becomes a call to C{on_sample}.
    """

    def __init__(self, on_sample: Callable[[dict[str, set[int]]], None]) -> None:
        self._on_sample = on_sample
        self._buffer = b""
        self.first: Deferred[None] = Deferred()
        self.ended: Deferred[None] = Deferred()

    def outReceived(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            sample = {k: set(v) for k, v in json.loads(line).items()}
            self._on_sample(sample)
            if not self.first.called:
                self.first.callback(None)

    def processEnded(self, reason: Any) -> None:
        if not self.first.called:
            self.first.errback(reason)
        self.ended.callback(None)


@attrs.define
class ConnectionWatch:
    """
    Samples, every C{interval} seconds while started, the established
    connections of each name -> (C{port}, C{pid}) of C{targets}: how many were
    open at the start, how many new ones were seen and the most open at once.
    A pool that keeps its connections alive opens about as many as it ever
    needs at once, and none once it has them.  Sampling reads
    C{/proc/net/tcp}, a few ms of kernel time, so it runs in a separate
    process (L{bench.sampler}) and the load generator's reactor never
    stalls; a connection that opens and closes between two samples is
    missed, but a pool that churned would show many.
    """

    reactor: Any
    targets: Mapping[str, tuple[int, int]]
    interval: float = 0.25
    seen: dict[str, _Seen] = attrs.field(factory=dict)
    _process: Any = None
    _protocol: _SamplerProtocol | None = None

    def _merge(self, now: dict[str, set[int]]) -> None:
        if not self.seen:
            self.seen = {
                name: _Seen(set(ports), set(ports), len(ports))
                for name, ports in now.items()
            }
            return
        for name, ports in now.items():
            seen = self.seen[name]
            seen.seen |= ports
            seen.most = max(seen.most, len(ports))

    async def start(self) -> None:
        self._protocol = _SamplerProtocol(self._merge)
        self._process = self.reactor.spawnProcess(
            self._protocol,
            sys.executable,
            [
                sys.executable,
                "-m",
                "bench.sampler",
                str(self.interval),
                json.dumps(dict(self.targets)),
            ],
            env=None,
        )
        await self._protocol.first

    async def stop(self) -> None:
        if self._protocol is not None and not self._protocol.ended.called:
            self._process.signalProcess("TERM")
            await self._protocol.ended
        self._protocol = self._process = None

    def describe(self, name: str) -> str:
        return self.seen[name].describe()


async def scenario_mtls(ctx: Context) -> Result:
    """
    Node A forwards to peer B over mutual TLS, B to its engine: two daemons,
    each with an Ollama facade and a cluster dir pinning the other.  A's own
    engine has L{LOCAL_MODEL}, B's engine (only B's backend) L{REMOTE_MODEL}.
    Three paths in the same rounds: A's engine directly, A -> engine
    (L{LOCAL_MODEL} through A) and A -> B -> engine (L{REMOTE_MODEL} through
    A); non-streaming and streaming.  Both engines count the requests they
    serve per round, which checks that every A -> B -> engine request reached
    B's engine and no other.
    """
    if not _cluster_available():
        return Result(
            notes=["mtls: skipped: the cluster option ([cluster] dir) is not available"]
        )
    running: list[procs.Proc] = []
    result = Result()
    reactor = ctx.reactor
    try:
        engine_a, engine_a_url = await procs.start_engine(
            reactor,
            ctx.workdir,
            "mtls-engine-a",
            [LOCAL_MODEL],
            stream_chunks=STREAM_CHUNKS,
        )
        running.append(engine_a)
        engine_b, engine_b_url = await procs.start_engine(
            reactor,
            ctx.workdir,
            "mtls-engine-b",
            [REMOTE_MODEL],
            stream_chunks=STREAM_CHUNKS,
        )
        running.append(engine_b)
        facade_ports = {NODE_A: free_port(), NODE_B: free_port()}
        dirs = procs.init_cluster(reactor, ctx.workdir, facade_ports)
        daemons = {}
        for node, backend in ((NODE_A, engine_a_url), (NODE_B, engine_b_url)):
            daemons[node] = await procs.launch_proxy(
                reactor,
                ctx.workdir,
                backend,
                name=f"mtls-nvproxy-{node[-1]}",
                node_id=node,
                cluster_dir=dirs[node],
                facade_port=facade_ports[node],
            )
            running.append(daemons[node].proc)
        a, b = daemons[NODE_A], daemons[NODE_B]
        await procs.wait_ready(reactor, b, {NODE_B: REMOTE_MODEL})
        await procs.wait_ready(reactor, a, {NODE_A: LOCAL_MODEL, NODE_B: REMOTE_MODEL})
        plan = attrs.evolve(
            ctx.plan,
            rounds=ctx.plan.mtls_rounds,
            round_seconds=ctx.plan.mtls_round_seconds,
        )
        url = a.facade
        paths = [
            Path_("direct", engine_a_url, proxied=False),
            Path_("A->engine", url, proxied=True),
            Path_("A->B->engine", url, proxied=True, model=REMOTE_MODEL),
        ]
        engines = {"A": engine_a_url, "B": engine_b_url}
        watch = ConnectionWatch(
            reactor,
            {
                "A->B": (facade_ports[NODE_B], a.proc.pid),
                "B->engine": (_port_of(engine_b_url), b.proc.pid),
            },
        )
        for scenario, stream in (("mtls", False), ("mtls-stream", True)):
            workload = Workload(LOCAL_MODEL, stream=stream)
            for c in ctx.plan.concurrencies:
                await watch.start()
                try:
                    rows = await compare(
                        ctx,
                        scenario,
                        paths,
                        workload,
                        c,
                        a,
                        peer=b,
                        engines=engines,
                        plan=plan,
                    )
                finally:
                    await watch.stop()
                result.rows += rows
                _progress(ctx, rows)
                _mtls_notes(result, rows, watch)
    finally:
        await _stop_all(ctx, running)
    return result


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def _mtls_notes(
    result: Result,
    rows: Sequence[Row],
    watch: ConnectionWatch,
) -> None:
    """The cost of the mTLS hop, and the check of who served what."""
    by_path = {r.path: r for r in rows}
    direct, local, remote = (
        by_path["direct"],
        by_path["A->engine"],
        by_path["A->B->engine"],
    )
    label = f"{remote.scenario} c={remote.concurrency}"
    a_cpu, a_local_cpu = remote.proxy_cpu_per_request, local.proxy_cpu_per_request
    b_cpu = remote.peer_cpu_per_request
    total = None if a_cpu is None or b_cpu is None else a_cpu + b_cpu
    result.notes.append(
        f"{label}: the mTLS hop (A->B->engine vs A->engine) adds"
        f" p50 TTFB {(remote.ttfb_p50 - local.ttfb_p50) * 1e3:+.2f} ms"
        f" (p99 {(remote.ttfb_p99 - local.ttfb_p99) * 1e3:+.2f} ms),"
        f" p50 latency {(remote.p50 - local.p50) * 1e3:+.2f} ms;"
        f" ratios rps x{_ratio(remote.rps, local.rps)},"
        f" lat x{_ratio(remote.p50, local.p50)},"
        f" ttfb x{_ratio(remote.ttfb_p50, local.ttfb_p50)}"
        f" (vs direct: x{_ratio(remote.rps, direct.rps)},"
        f" x{_ratio(remote.p50, direct.p50)},"
        f" x{_ratio(remote.ttfb_p50, direct.ttfb_p50)});"
        f" CPU/request A {_us(a_cpu)} + B {_us(b_cpu)} = {_us(total)} us"
        f" vs A alone {_us(a_local_cpu)} us"
    )
    if remote.scenario.endswith("stream"):
        result.notes.append(
            f"{label}: chunks/request direct {_lines(direct)},"
            f" A->engine {_lines(local)}, A->B->engine {_lines(remote)}"
        )
    checks = []
    for row, mine, other in ((remote, "B", "A"), (local, "A", "B"), (direct, "A", "B")):
        sent = row.requests + row.errors
        got, stray = row.engine_requests.get(mine, 0), row.engine_requests.get(other, 0)
        ok = got == sent and stray == 0
        checks.append(
            f"{row.path}: engine {mine} served {got}/{sent}, engine {other} {stray}"
            + ("" if ok else " MISMATCH")
        )
        if not ok:
            result.problems.append(
                f"{label} {row.path}: {sent} requests sent in measured rounds,"
                f" engine {mine} served {got}, engine {other} {stray}"
            )
    result.notes.append(f"{label}: measured requests per engine: " + "; ".join(checks))
    result.notes.append(
        f"{label}: connections (warm-up included) A->B facade (mTLS):"
        f" {watch.describe('A->B')}; B->engine: {watch.describe('B->engine')}"
    )


WAKE_TARGET = 0.050
"""Seconds a woken request's first byte may come after the scripted wake."""


async def scenario_wake(ctx: Context) -> Result:
    """
    A request arriving at a sleeping vLLM service: the time from sending it
    to its first body byte, against the fake's scripted wake sequence
    (C{/wake_up} after C{wake_latency}, the weights reload after
    C{wake_rpc_latency}: nvproxy reloads after every wake, never trusting a
    half-awake engine).  The service is put to sleep through nvproxy's admin
    API before each request, C{wake_rounds} times at each depth.
    """
    plan = ctx.plan
    result = Result()
    running: list[procs.Proc] = []
    try:
        fake, line = await procs.spawn(
            ctx.reactor,
            "wake-vllm",
            [
                sys.executable,
                "-m",
                "bench.fakevllm",
                "--model",
                MODEL,
                "--wake-latency",
                f"{plan.wake_latency}",
                "--rpc-latency",
                f"{plan.wake_rpc_latency}",
            ],
            ctx.workdir,
            b"listening on ",
        )
        running.append(fake)
        engine_url = f"http://{line.rsplit(' ', 1)[-1]}"
        port = free_port()
        proxy = await procs.launch_proxy(
            ctx.reactor,
            ctx.workdir,
            "",
            name="wake-nvproxy",
            vllm=(port, engine_url, MODEL),
        )
        running.append(proxy.proc)
        facade = f"http://127.0.0.1:{port}"
        try:
            await wait_healthy(
                ctx.reactor,
                f"{facade}/v1/models",
                within=20.0,
                alive=lambda: not proxy.proc.child.ended.called,
                healthy=lambda code, body: code == 200 and MODEL.encode() in body,
            )
        except NotHealthy as e:
            raise procs.BenchError(f"wake-nvproxy not ready: {e}") from None
        load = LoadGenerator(ctx.reactor, perf_now, 1, timeout=30.0)
        admin = Client(ctx.reactor, persistent=False)
        body = Workload(MODEL, stream=True, api="openai").body()
        chat = "/v1/chat/completions"
        awake: dict[str, Samples] = {}
        for name, base in (("direct", engine_url), ("nvproxy", facade)):
            awake[name] = Samples()
            for _ in range(5):
                await load.one(f"{base}{chat}".encode(), body, awake[name])
        scripted = plan.wake_latency + plan.wake_rpc_latency
        for depth in (1, 2):
            woken = Samples()
            for _ in range(plan.wake_rounds):
                code, _, _ = await admin.request(
                    "POST", f"{proxy.admin}/admin/sleep/bench?level={depth}"
                )
                if code != 200:
                    result.problems.append(f"wake: sleep at level {depth}: {code}")
                    continue
                await load.one(f"{facade}{chat}".encode(), body, woken)
            if woken.errors:
                result.problems.append(
                    f"wake: level {depth}: {woken.errors} request(s) failed"
                    f" {woken.error_kinds}"
                )
            if not woken.ttfbs:
                continue
            added = [t - scripted for t in woken.ttfbs]
            worst = max(added)
            verdict = "met" if worst <= WAKE_TARGET else "not met"
            result.notes.append(
                f"wake from level {depth} (scripted {scripted:.2f} s: /wake_up"
                f" {plan.wake_latency:.2f} s + reload {plan.wake_rpc_latency:.2f} s):"
                f" first byte after {percentile(woken.ttfbs, 50):.3f} s p50 over"
                f" {len(added)} wakes, +{percentile(added, 50) * 1e3:.0f} ms p50,"
                f" +{worst * 1e3:.0f} ms max (target +{WAKE_TARGET * 1e3:.0f} ms:"
                f" {verdict}); each, in order: "
                + ", ".join(f"+{a * 1e3:.0f}" for a in added)
                + " ms"
            )
        result.notes.append(
            "wake: awake, the same request's first byte after"
            f" {percentile(awake['direct'].ttfbs, 50) * 1e3:.1f} ms direct,"
            f" {percentile(awake['nvproxy'].ttfbs, 50) * 1e3:.1f} ms through nvproxy"
        )
        await load.close()
        await admin.close()
    finally:
        await _stop_all(ctx, running)
    for note in result.notes:
        ctx.out.write(f"  {note}\n")
    return result


def settle_heap() -> None:
    """
    Collect this process's garbage and move what survives out of the cyclic
    collector's reach before a scenario: the samples of the scenarios before
    it (millions of figures in lists) would otherwise be walked by every
    full collection, a pause of tens of milliseconds inside a measured
    request of the Python load generator (the first wake of the C{wake}
    scenario was late by one such pause).
    """
    gc.collect()
    gc.freeze()


SCENARIOS: dict[str, Callable[[Context], Awaitable[Result]]] = {
    "chat": scenario_chat,
    "stream": scenario_stream,
    "stream-sse": scenario_stream_sse,
    "paced": scenario_paced,
    "open": scenario_open,
    "open-2000": scenario_open_many,
    "failover": scenario_failover,
    "mtls": scenario_mtls,
    "wake": scenario_wake,
}
#: scenarios run only when named with --only
EXTRA_SCENARIOS: dict[str, Callable[[Context], Awaitable[Result]]] = {
    "floor": scenario_floor,
    "fleet": scenario_fleet,
}


# -- report ------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.2f}"


def _us(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e6:.0f}"


def _ratio(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b) or b == 0:
        return "-"
    return f"{a / b:.2f}"


def _cpu_ratio(row: Row, rpr: Row | None) -> str:
    if rpr is None or rpr is row:
        return ""
    mine, floor = row.proxy_cpu_per_request, rpr.proxy_cpu_per_request
    if mine is None or floor is None:
        return "-"
    return _ratio(mine, floor)


def ceiling_notes(rows: Sequence[Row]) -> list[str]:
    """
    How far the direct path (engine and load generator alone) is above the
    fastest proxy of the same comparison, and how busy each of the two was
    during the direct rounds: the bench's ceiling.
    """
    by_path = {r.path: r for r in rows}
    direct = by_path.get(DIRECT)
    proxies = [r for r in rows if r.path != DIRECT and r.rps == r.rps]
    if direct is None or not proxies:
        return []
    streamed = direct.lines_per_request > 1.5
    unit = "chunks/s" if streamed else "req/s"

    def rate(r: Row) -> float:
        return r.rps * r.lines_per_request if streamed else r.rps

    best = max(proxies, key=rate)
    engine = (
        "-" if math.isnan(direct.engine_cpu_share) else f"{direct.engine_cpu_share:.0%}"
    )
    return [
        f"ceiling {direct.scenario} c={direct.concurrency}: direct"
        f" {rate(direct):,.0f} {unit}, x{_ratio(rate(direct), rate(best))} the"
        f" fastest proxy ({LABELS.get(best.path, best.path)}, {rate(best):,.0f});"
        f" during direct rounds the load generator used"
        f" {direct.client_cpu_share:.0%} and the engine {engine} of one core"
    ]


_HEADER = (
    "scenario",
    "c",
    "path",
    "req/s",
    "p50 ms",
    "p99 ms",
    "ttfb50",
    "ttfb99",
    "rps x",
    "lat x",
    "ttfb x",
    "+p50 ms",
    "cpu us/req",
    "cpu x rpr",
    "peer us/req",
    "rss MB",
    "gen cpu",
    "err",
)


def _cells(row: Row, base: Row | None, rpr: Row | None = None) -> tuple[str, ...]:
    ratios = ("", "", "", "")
    if base is not None and base is not row:
        ratios = (
            _ratio(row.rps, base.rps),
            _ratio(row.p50, base.p50),
            _ratio(row.ttfb_p50, base.ttfb_p50),
            f"{(row.p50 - base.p50) * 1e3:+.2f}",
        )
    return (
        row.scenario,
        str(row.concurrency),
        row.path,
        f"{row.rps:.0f}",
        _ms(row.p50),
        _ms(row.p99),
        _ms(row.ttfb_p50),
        _ms(row.ttfb_p99),
        *ratios,
        _us(row.proxy_cpu_per_request),
        _cpu_ratio(row, rpr),
        _us(row.peer_cpu_per_request),
        "-" if row.proxy_rss is None else f"{row.proxy_rss / 2**20:.1f}",
        f"{row.client_cpu_share:.0%}",
        str(row.errors),
    )


def table(rows: Sequence[Row]) -> str:
    """
    The rows as a text table; ratios are against the direct row above, and
    C{cpu x rpr} against the Twisted RPR row of the same comparison.
    """
    lines: list[tuple[str, ...]] = [_HEADER]
    base: Row | None = None
    rpr: Row | None = None
    for row in rows:
        if row.path == DIRECT:
            base, rpr = row, None
        elif row.path == RPR:
            rpr = row
        lines.append(_cells(row, base, rpr))
    widths = [max(len(line[i]) for line in lines) for i in range(len(_HEADER))]
    text = []
    for n, line in enumerate(lines):
        cells = [
            cell.ljust(w) if i < 3 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        text.append("  ".join(cells).rstrip())
        if n == 0:
            text.append("  ".join("-" * w for w in widths))
    return "\n".join(text)


def chunk_costs(rows: Sequence[Row]) -> list[str]:
    """Proxy CPU per relayed stream chunk, gross and net of a chat request."""
    notes = []
    chat = {
        r.concurrency: r for r in rows if r.scenario == "chat" and r.path == "nvproxy"
    }
    direct = {
        r.concurrency: r for r in rows if r.scenario == "stream" and r.path == "direct"
    }
    for r in rows:
        if r.scenario != "stream" or r.path != "nvproxy":
            continue
        if r.proxy_cpu_per_request is None or not r.lines_per_request > 0:
            continue
        gross = r.proxy_cpu_per_request / r.lines_per_request
        text = (
            f"stream c={r.concurrency}: {r.lines_per_request:.0f} chunks/request"
            f" (direct {_lines(direct.get(r.concurrency))}),"
            f" proxy CPU {gross * 1e6:.1f} us/chunk gross"
        )
        base = chat.get(r.concurrency)
        if base is not None and base.proxy_cpu_per_request is not None:
            net = (
                r.proxy_cpu_per_request - base.proxy_cpu_per_request
            ) / r.lines_per_request
            text += f", {net * 1e6:.1f} us/chunk net of a non-streaming request"
        notes.append(text)
    return notes


def _lines(row: Row | None) -> str:
    return "-" if row is None else f"{row.lines_per_request:.0f}"


def _progress(ctx: Context, rows: Sequence[Row]) -> None:
    for row in rows:
        ctx.out.write(
            f"  {row.scenario} c={row.concurrency} {row.path}: {row.rps:.0f} req/s,"
            f" p50 {_ms(row.p50)} ms, {row.requests} requests, {row.errors} errors\n"
        )
    ctx.out.flush()


def _json_row(row: Row) -> dict[str, Any]:
    data = attrs.asdict(row)
    return {
        k: (None if isinstance(v, float) and math.isnan(v) else v)
        for k, v in data.items()
    }


# -- command line --------------------------------------------------------------------


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="Benchmark nvproxy against direct access to fake engines.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a few seconds per scenario (smoke test)"
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted({*SCENARIOS, *EXTRA_SCENARIOS}),
        metavar="NAME",
        help="run only this scenario (repeatable): "
        f"{', '.join(SCENARIOS)}; not in the default run:"
        f" {', '.join(EXTRA_SCENARIOS)}",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument(
        "--keep", action="store_true", help="keep the work dir (configs and logs)"
    )
    parser.add_argument(
        "--python",
        action="store_true",
        help="use the Python fake engine and load generator instead of the"
        " compiled ones (no gcc needed; they cap the throughput much lower)",
    )
    parser.add_argument(
        "--chart",
        metavar="PNG",
        default="bench-results.png",
        help="write the figures as a PNG chart (needs matplotlib, the 'bench'"
        " extra; default %(default)s)",
    )
    parser.add_argument("--no-chart", action="store_true", help="no chart")
    return parser.parse_args(argv)


def _raise_fd_limit() -> None:
    """Soft open-files limit up to the hard one: 500 open streams need 1,000+."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 65536 if hard == resource.RLIM_INFINITY else hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def run(reactor: Any, args: argparse.Namespace, out: TextIO) -> int:
    plan = QUICK if args.quick else FULL
    _raise_fd_limit()
    loadgen = None
    if not args.python:
        try:
            native.build("engine")
            loadgen = native.build("loadgen")
        except procs.BenchError as e:
            out.write(
                f"{e}\nrun with --python for the Python engine and load generator\n"
            )
            return 2
        out.write(f"native engine and load generator: {loadgen.parent}\n")
    workdir = Path(tempfile.mkdtemp(prefix="nvproxy-bench-"))
    ctx = Context(reactor, plan, workdir, out, loadgen)
    names = args.only or list(SCENARIOS)
    total = Result()
    started = perf_now()
    failed = False
    try:
        for name in names:
            out.write(f"== {name}\n")
            out.flush()
            settle_heap()
            began = perf_now()
            try:
                result = await {**SCENARIOS, **EXTRA_SCENARIOS}[name](ctx)
            except procs.BenchError as e:
                out.write(f"  {name} failed: {e}\n")
                failed = True
                continue
            out.write(f"  {name}: {perf_now() - began:.0f} s\n")
            total.rows += result.rows
            total.notes += result.notes
            for problem in result.problems:
                out.write(f"  {name} check failed: {problem}\n")
                failed = True
    finally:
        if failed or args.keep:
            out.write(f"work dir kept: {workdir}\n")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    notes = chunk_costs(total.rows) + total.notes
    kind = "quick" if args.quick else "full"
    tools = "Python" if args.python else "native"
    out.write("\n" + table(total.rows) + "\n\n")
    for note in notes:
        out.write(f"* {note}\n")
    figs = report.figures(total.rows)
    if figs:
        out.write("\nmedians and percentiles over all measured rounds:\n\n")
        out.write(report.figures_table(figs) + "\n")
    out.write(
        f"\n{kind} run, {tools} engine and load generator,"
        f" {perf_now() - started:.0f} s;"
        " ratios are against the direct row above (rps x: throughput, lat x:"
        " p50 latency, ttfb x: p50 time to first byte); cpu x rpr: CPU per"
        " request over Twisted RPR's; peer us/req: CPU of the second daemon"
        " (mtls: B)\n"
    )
    if figs and not args.no_chart:
        title = f"nvproxy bench, {kind} run, {tools} engine and load generator"
        why_not = report.chart(figs, Path(args.chart), title)
        if why_not is None:
            out.write(f"chart: {args.chart}\n")
        else:
            out.write(f"chart skipped: {why_not}\n")
    if args.json:
        document = {
            "plan": attrs.asdict(plan),
            "native": not args.python,
            "rows": [_json_row(r) for r in total.rows],
            "figures": [attrs.asdict(f) for f in figs],
            "notes": notes,
        }
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    # A reference proxy that drops some of 2,000 streams is a figure, not
    # a failed run; nvproxy or the engine dropping one is.
    errors = sum(r.errors for r in total.rows if r.path in (DIRECT, NVPROXY))
    return 1 if failed or errors else 0


def main(argv: Sequence[str] | None = None) -> None:
    from twisted.internet.task import react

    args = _parse(sys.argv[1:] if argv is None else argv)

    def go(reactor: Any) -> Deferred[None]:
        async def body() -> None:
            code = await run(reactor, args, sys.stdout)
            if code:
                raise SystemExit(code)

        return Deferred.fromCoroutine(body())

    react(go)


if __name__ == "__main__":
    main()
