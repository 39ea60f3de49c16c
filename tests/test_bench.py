"""
The benchmark's own parts (C{bench/}): the compiled fake engine answered
through the compiled load generator, and the report that puts the reference
proxies beside nvproxy, rendered from fixed numbers.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from twisted.internet import reactor
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase

from bench import discovery_cost, instructions, native, procs, refs, report, run
from bench.load import Samples, Workload, _Body
from nvproxy.testing.harness import Client

_CACHE: list[Path] = []


class NativeProgramTests(TestCase):
    """
    The C engine and load generator, built into a fresh cache dir and run
    as processes on loopback.
    """

    timeout = 60

    def setUp(self) -> None:
        if native.compiler() is None:
            raise SkipTest("no C compiler")
        if not _CACHE:  # one build for the whole class, in a fresh dir
            _CACHE.append(Path(self.mktemp()).resolve())
        self.cache = _CACHE[0]
        self.workdir = Path(self.mktemp())
        self.workdir.mkdir()
        self.engine_bin = native.build("engine", self.cache)
        self.loadgen = native.build("loadgen", self.cache)
        self.client = Client(reactor, persistent=False)

    async def _engine(self) -> str:
        argv = [str(self.engine_bin), "--port", "0", "--models", "m1,m2"]
        argv += ["--chunks", "5", "--plain-chunks", "3"]
        proc, line = await procs.spawn(
            reactor, "engine", argv, self.workdir, b"listening on "
        )
        self.addCleanup(proc.stop, reactor)
        return f"http://{line.rsplit(' ', 1)[-1]}"

    async def _load(
        self, url: str, workload: Workload, requests: int, *, delays: bool = False
    ) -> Samples:
        samples = Samples()
        gen = native.NativeLoad(reactor, self.loadgen, 1, 10.0, delays=delays)
        await gen.round(f"{url}{workload.path}", workload, 5.0, samples, requests)
        return samples

    def test_build_is_cached(self) -> None:
        """A second build of an unchanged source is the same file, not rebuilt."""
        mtime = self.engine_bin.stat().st_mtime_ns
        self.assertEqual(native.build("engine", self.cache), self.engine_bin)
        self.assertEqual(self.engine_bin.stat().st_mtime_ns, mtime)

    async def test_models_and_plain_chat(self) -> None:
        """
        The model list in both dialects, a non-streaming Ollama chat as one
        JSON document, and three of them through the load generator on one
        keep-alive connection.
        """
        url = await self._engine()
        tags = await (await self.client.http.get(f"{url}/api/tags")).json()
        self.assertEqual([m["name"] for m in tags["models"]], ["m1", "m2"])
        models = await (await self.client.http.get(f"{url}/v1/models")).json()
        self.assertEqual([m["id"] for m in models["data"]], ["m1", "m2"])
        workload = Workload("m2", stream=False)
        response = await self.client.http.post(f"{url}/api/chat", workload.body())
        self.assertEqual(response.code, 200)
        body = await response.json()
        self.assertEqual(body["model"], "m2")
        self.assertEqual(body["message"]["content"], "tok0 tok1 tok2 ")
        self.assertIs(body["done"], True)

        samples = await self._load(url, workload, 3)
        self.assertEqual((samples.ok, samples.errors), (3, 0), samples.error_kinds)
        self.assertEqual(samples.connects, 1)
        self.assertEqual(samples.lines, 0)  # one JSON document, no newline
        self.assertTrue(
            all(
                t <= lat
                for t, lat in zip(samples.ttfbs, samples.latencies, strict=True)
            )
        )

    async def test_streams(self) -> None:
        """
        A 5-token NDJSON stream is 6 lines ending with C{done}, a 5-token SSE
        stream is 6 events and C{[DONE]}; the load generator counts them per
        request and records how late each stamped line arrived.
        """
        url = await self._engine()
        ndjson = Workload("m1", stream=True, tokens=5)
        response = await self.client.http.post(f"{url}/api/chat", ndjson.body())
        lines = (await response.content()).decode().splitlines()
        self.assertEqual(
            response.headers.getRawHeaders("content-type"), ["application/x-ndjson"]
        )
        parsed = [json.loads(line) for line in lines]
        self.assertEqual([p["done"] for p in parsed], [False] * 5 + [True])
        self.assertEqual(
            "".join(p["message"]["content"] for p in parsed),
            "tok0 tok1 tok2 tok3 tok4 ",
        )

        samples = await self._load(url, ndjson, 2, delays=True)
        self.assertEqual((samples.ok, samples.errors), (2, 0), samples.error_kinds)
        self.assertEqual(samples.lines, 12)
        self.assertEqual(len(samples.delays), 12)
        self.assertTrue(all(0 <= d < 5 for d in samples.delays), samples.delays)

        sse = Workload("m1", stream=True, api="openai", tokens=5)
        samples = await self._load(url, sse, 2)
        self.assertEqual((samples.ok, samples.errors), (2, 0), samples.error_kinds)
        self.assertEqual(samples.lines, 14)  # 5 tokens, the finish, [DONE]
        self.assertEqual(samples.delays, [])  # not asked for

    async def _through(self, start: Any) -> None:
        """A chat and a 5-token stream through a proxy started by C{start}."""
        url = await self._engine()
        started = await start(reactor, self.workdir, "proxy", url)
        if started is None:
            raise SkipTest("no nginx")
        proc, proxy_url = started
        self.addCleanup(proc.stop, reactor)
        chat = await self._load(proxy_url, Workload("m1", stream=False), 2)
        self.assertEqual((chat.ok, chat.errors), (2, 0), chat.error_kinds)
        stream = await self._load(proxy_url, Workload("m1", True, tokens=5), 2)
        self.assertEqual((stream.ok, stream.errors), (2, 0), stream.error_kinds)
        self.assertEqual(stream.lines, 12)

    async def test_through_rpr(self) -> None:
        """
        Twisted's ReverseProxyResource in front of the engine: its HTTP/1.0
        upstream requests get unframed answers, relayed whole.
        """
        await self._through(refs.start_rpr)

    async def test_through_agent_floor(self) -> None:
        """
        The bare Agent proxy in front of the engine: answers relayed as
        they come, over reused upstream connections.
        """
        await self._through(refs.start_agent_floor)

    async def test_through_lean_floor(self) -> None:
        """
        The Agent floor behind a minimal server: answers relayed in chunks
        as they come, requests on one connection one after the other.
        """
        await self._through(refs.start_lean_floor)

    async def test_through_facade_floor(self) -> None:
        """The Agent floor on nvproxy's server classes in front of the engine."""
        await self._through(refs.start_facade_floor)

    async def test_through_nginx(self) -> None:
        """nginx with the generated config in front of the engine."""
        await self._through(refs.start_nginx)

    async def test_errors_are_counted(self) -> None:
        """A 404 is counted by status, not as a success."""
        url = await self._engine()
        samples = Samples()
        gen = native.NativeLoad(reactor, self.loadgen, 2, 10.0)
        await gen.round(f"{url}/nowhere", Workload("m1", stream=False), 5.0, samples, 2)
        self.assertEqual(samples.ok, 0)
        self.assertEqual(samples.error_kinds, {"HTTP 404": 2})


def _row(path: str, scenario: str = "chat", c: int = 32, **fields: Any) -> run.Row:
    values: dict[str, Any] = {
        "scenario": scenario,
        "concurrency": c,
        "path": path,
        "requests": 1000,
        "errors": 0,
        "elapsed": 1.0,
        "rps": 1000.0,
        "p50": 0.001,
        "p99": 0.002,
        "ttfb_p50": 0.001,
        "ttfb_p99": 0.002,
        "lines_per_request": 0.0,
        "proxy_cpu_per_request": None if path == "direct" else 0.0002,
        "proxy_rss": None if path == "direct" else 40 * 2**20,
        "client_cpu_share": 0.5,
    }
    values.update(fields)
    return run.Row(**values)


def _chat_rows() -> list[run.Row]:
    return [
        _row("direct", rps=20000.0, p50=0.0001, engine_cpu_share=0.4),
        _row("rpr", rps=4000.0, p50=0.0004, proxy_cpu_per_request=0.00025),
        _row("nginx", rps=10000.0, p50=0.0002, proxy_cpu_per_request=0.00005),
        _row("nvproxy", rps=2000.0, p50=0.0005, proxy_cpu_per_request=0.0005),
    ]


class ReportTests(SynchronousTestCase):
    """The tables and notes of C{bench.run} from fixed numbers."""

    def test_floor_notes(self) -> None:
        """
        The floor scenario's note puts nvproxy's CPU per request against
        the bare Agent proxy's and RPR's of the same comparison, and splits
        it with the lean and facade floors (no work "beyond" a floor that
        costs more than nvproxy); the floor rows stay out of the summary
        figures.
        """
        rows = [
            _row("direct", scenario="floor-chat"),
            _row("rpr", scenario="floor-chat", proxy_cpu_per_request=0.0008),
            _row("agent", scenario="floor-chat", proxy_cpu_per_request=0.0006),
            _row("lean", scenario="floor-chat", proxy_cpu_per_request=0.0004),
            _row("facade", scenario="floor-chat", proxy_cpu_per_request=0.0005),
            _row("lean", scenario="floor-stream", proxy_cpu_per_request=0.002),
            _row("facade", scenario="floor-stream", proxy_cpu_per_request=0.0025),
            _row("nvproxy", scenario="floor-chat", proxy_cpu_per_request=0.0009),
            _row("nvproxy", scenario="floor-sse", proxy_cpu_per_request=0.001),
            _row("agent", scenario="floor-stream", proxy_cpu_per_request=0.003),
            _row("nvproxy", scenario="floor-stream", proxy_cpu_per_request=0.0015),
        ]
        self.assertEqual(
            run.floor_notes(rows),
            [
                "floor-chat c=32: nvproxy 900 us/request = 1.50x the Agent floor"
                " (600 us); nvproxy's own work 300 us; Agent floor/RPR 0.75,"
                " nvproxy/RPR 1.12; lean floor 400 us (twisted.web's server"
                " side 200 us), nvproxy/lean 2.25; facade floor 500 us"
                " (nvproxy's server side 100 us, its work beyond it 400 us)",
                # below the floor: no "own work" to speak of
                "floor-stream c=32: nvproxy 1500 us/request = 0.50x the Agent"
                " floor (3000 us); lean floor 2000 us (twisted.web's server"
                " side 1000 us), nvproxy/lean 0.75; facade floor 2500 us"
                " (nvproxy's server side 500 us)",
            ],
        )
        self.assertEqual(report.figures(rows), [])
        agent = [
            line
            for line in run.table(rows).splitlines()
            if line.startswith("floor-chat") and " agent " in line
        ]
        self.assertEqual(len(agent), 1)
        self.assertIn(" 600 ", agent[0])
        self.assertIn(" 0.75 ", agent[0])  # its CPU against RPR's

    def test_fleet_notes(self) -> None:
        """
        The fleet scenario's note gives nvproxy's CPU per request by the
        number of owners of the model, against RPR's; the fleet rows stay
        out of the summary figures.
        """
        rows = [
            _row("direct", scenario="fleet", c=1),
            _row("rpr", scenario="fleet", c=1, proxy_cpu_per_request=0.0005),
            _row("nvproxy", scenario="fleet", c=1, proxy_cpu_per_request=0.0004),
            _row("nvproxy+100", scenario="fleet", c=1, proxy_cpu_per_request=0.0006),
            _row("direct", scenario="fleet"),
            _row("nvproxy", scenario="fleet", proxy_cpu_per_request=0.0003),
        ]
        self.assertEqual(
            run.fleet_notes(rows),
            [
                "fleet c=1: nvproxy CPU per request, 1 owner 400 us (0.80x RPR),"
                " 101 owners 600 us (1.20x RPR)",
                "fleet c=32: nvproxy CPU per request, 1 owner 300 us",
            ],
        )
        self.assertEqual(report.figures(rows), [])

    def test_figures_table_columns(self) -> None:
        """
        The figures table has a column for each reference proxy and the
        ratios of nvproxy to direct and to RPR, and of nginx to RPR.
        """
        text = report.figures_table(report.figures(_chat_rows()))
        header = text.splitlines()[0].split("  ")
        self.assertEqual(
            [h.strip() for h in header if h.strip()],
            [
                "figure",
                "direct",
                "Twisted RPR",
                "nginx",
                "nvproxy",
                "nvproxy/direct",
                "nvproxy/RPR",
                "nginx/RPR",
            ],
        )
        cpu = next(line for line in text.splitlines() if "CPU per request" in line)
        # direct has no proxy CPU; 250 / 50 / 500 us; nvproxy/RPR 2x, nginx/RPR 0.2x
        self.assertEqual(
            cpu.split()[-7:], ["-", "250", "50.0", "500", "-", "2.00x", "0.20x"]
        )
        rps = next(line for line in text.splitlines() if "req/s" in line)
        self.assertEqual(
            rps.split()[-7:],
            ["20,000", "4,000", "10,000", "2,000", "0.10x", "0.50x", "2.50x"],
        )

    def test_figures_without_nginx(self) -> None:
        """Without an nginx row its cells are dashes, the rest is unchanged."""
        rows = [r for r in _chat_rows() if r.path != "nginx"]
        text = report.figures_table(report.figures(rows))
        rps = next(line for line in text.splitlines() if "req/s" in line)
        self.assertEqual(
            rps.split()[-7:], ["20,000", "4,000", "-", "2,000", "0.10x", "0.50x", "-"]
        )

    def test_stream_and_open_figures(self) -> None:
        """Chunks per second, CPU per 1,000 streams, RSS per stream."""
        rows = [
            _row("direct", "stream", rps=100.0, lines_per_request=201.0),
            _row(
                "nvproxy",
                "stream",
                rps=50.0,
                lines_per_request=201.0,
                proxy_cpu_per_request=0.002,
            ),
            _row(
                "nvproxy",
                "open",
                500,
                rss_base=60 * 2**20,
                rss_peak=70 * 2**20,
                ttfb_p99=0.25,
            ),
        ]
        figs = {f.label: f.values for f in report.figures(rows)}
        self.assertEqual(
            figs["stream c=32: chunks/s"], {"direct": 20100.0, "nvproxy": 10050.0}
        )
        self.assertAlmostEqual(
            figs["stream c=32: proxy CPU per 1,000 streams"]["nvproxy"], 2.0
        )
        self.assertAlmostEqual(
            figs["open c=500: RSS per stream"]["nvproxy"], 10 * 1024 / 500
        )
        self.assertAlmostEqual(figs["open c=500: TTFB p99"]["nvproxy"], 250.0)
        self.assertNotIn("rpr", figs["open c=500: TTFB p99"])
        self.assertEqual(figs["open c=500: failed streams"], {"nvproxy": 0.0})

    def test_detail_table_ratio_to_rpr(self) -> None:
        """The detail table has every path and nvproxy's CPU over RPR's."""
        text = run.table(_chat_rows())
        lines = text.splitlines()
        header = lines[0].split()
        self.assertIn("rpr", header[header.index("cpu") :])  # "cpu x rpr"
        paths = [line.split()[2] for line in lines[2:]]
        self.assertEqual(paths, ["direct", "rpr", "nginx", "nvproxy"])
        nvproxy = lines[-1]
        self.assertIn(" 500 ", nvproxy)
        self.assertIn(" 2.00 ", nvproxy)  # 500 us / 250 us

    def test_ceiling_note(self) -> None:
        """The ceiling compares direct with the fastest proxy."""
        (note,) = run.ceiling_notes(_chat_rows())
        self.assertIn("direct 20,000 req/s, x2.00 the fastest proxy (nginx", note)
        self.assertIn("load generator used 50% and the engine 40%", note)

    def test_paced_figures(self) -> None:
        """
        Paced chunk delays at both concurrencies; CPU per 1,000 streams only
        at 32 (one stream at a time takes less CPU than /proc's tick).
        """
        rows = [
            _row(path, "paced", c=c, delay_p50=0.0002, delay_p99=0.0005)
            for c in (1, 32)
            for path in ("direct", "rpr", "nvproxy")
        ]
        labels = [f.label for f in report.figures(rows)]
        self.assertEqual(
            labels,
            [
                "paced c=1: chunk delay p50",
                "paced c=1: chunk delay p99",
                "paced c=32: chunk delay p50",
                "paced c=32: chunk delay p99",
                "paced c=32: proxy CPU per 1,000 streams",
            ],
        )

    def test_nan_is_a_dash(self) -> None:
        """A figure a path does not have (NaN) is left out."""
        rows = [_row("direct", "paced", delay_p50=math.nan)]
        labels = [f.label for f in report.figures(rows)]
        self.assertNotIn("paced c=32: chunk delay p50", labels)


class DiscoveryCostTests(SynchronousTestCase):
    def test_figures_of_a_small_fleet(self) -> None:
        """
        Ten nodes: the mesh asks 2 (N - 1) questions per node per interval;
        an etcd change is one put and one event per node, and applying it
        takes a node some CPU.
        """
        self.assertEqual(discovery_cost.mesh(10)["requests_per_node_per_interval"], 18)
        etcd = discovery_cost.etcd(10)
        self.assertEqual(etcd["fleet_requests_per_change"], 1)
        self.assertEqual(etcd["events_per_node_per_change"], 1.0)
        self.assertGreater(etcd["cpu_ms_per_node_per_change_applied"], 0)


class InstructionsTests(SynchronousTestCase):
    def test_totals_of_every_dump(self) -> None:
        """The start-up dump (instrumentation off) and the measured one."""
        work = Path(self.mktemp())
        work.mkdir()
        (work / "nvproxy.callgrind").write_text("events: Ir\ntotals: 0\n")
        (work / "nvproxy.callgrind.1").write_text(
            "events: Ir\nfl=x\n1 5\ntotals: 1234567\n"
        )
        (work / "rpr.callgrind.1").write_text("totals: 99\n")
        self.assertEqual(
            instructions.instructions_in(work, "nvproxy.callgrind"), 1234567
        )

    def test_proxy_exiting_before_it_listens(self) -> None:
        """
        A proxy that exits before it answers (twistd without the plugin)
        fails the wait at once with the end of its error output, instead of
        the wait running out minutes later.
        """
        work = Path(self.mktemp())
        work.mkdir()
        errors = work / "nvproxy.output"
        errors.write_text("start\nUsage: twistd [options]\nUnknown command: nvproxy\n")
        process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
        process.wait()
        with self.assertRaises(SystemExit) as raised:
            instructions._wait_listening(1, 600, process, errors)
        message = str(raised.exception.code)
        self.assertIn("status 1", message)
        self.assertIn("Unknown command: nvproxy", message)

    def test_reference_commands(self) -> None:
        """
        Each reference target runs its own module in front of the engine;
        without C{--only} the floors of the floor scenario are left out.
        """
        work = Path(self.mktemp())
        for target, module in [
            ("rpr", "bench.rpr"),
            ("agent", "bench.agentfloor"),
            ("lean", "bench.leanfloor"),
            ("facade", "bench.facadefloor"),
        ]:
            self.assertEqual(
                instructions._command(target, work, 8001, 9001),
                ["-m", module, "--port", "8001", "--upstream", "127.0.0.1:9001"],
            )
        self.assertEqual(instructions.DEFAULT_TARGETS, ("nvproxy", "rpr", "agent"))

    def test_paced_route_sends_tokens_apart(self) -> None:
        """
        The paced route streams NDJSON tokens far enough apart for each to
        be a read of its own; the other routes use the engine's defaults.
        """
        self.assertEqual(instructions.ROUTES["paced"], ("/api/chat", True))
        self.assertEqual(
            instructions.engine_args("paced"), ["--chunks", "20", "--interval-ms", "20"]
        )
        self.assertEqual(instructions.engine_args("stream"), [])

    def test_without_valgrind(self) -> None:
        self.patch(instructions.shutil, "which", lambda name: None)
        self.assertEqual(instructions.main([]), 2)


class PythonLoadTests(SynchronousTestCase):
    def test_lines_are_non_empty_lines(self) -> None:
        """
        The Python load generator counts lines as the native one does: an
        SSE event's blank separator is not a line, even split across reads.
        """
        body = _Body(lambda: 0.0)
        for part in (b"data: a\n", b"\ndata: b\n\n", b"data: [DONE]\n\n"):
            body.dataReceived(part)
        self.assertEqual(body.lines, 3)
        ndjson = _Body(lambda: 0.0)
        ndjson.dataReceived(b'{"a":1}\n{"b"')
        ndjson.dataReceived(b":2}\n")
        self.assertEqual(ndjson.lines, 2)


class NginxConfigTests(SynchronousTestCase):
    def test_streaming_settings(self) -> None:
        """Unbuffered, HTTP/1.1 with a keep-alive pool, logs in the work dir."""
        text = refs.nginx_config(Path("/w"), 8080, "http://127.0.0.1:9000")
        for wanted in (
            "daemon off;",
            "proxy_buffering off;",
            "proxy_http_version 1.1;",
            'proxy_set_header Connection "";',
            "server 127.0.0.1:9000;",
            "keepalive 600;",
            "listen 127.0.0.1:8080",
            "error_log /w/nginx-error.log",
        ):
            self.assertIn(wanted, text)


class ChartTests(SynchronousTestCase):
    def test_chart_or_reason(self) -> None:
        """A PNG when matplotlib is installed, else a reason naming it."""
        out = Path(self.mktemp()) / "chart.png"
        why_not = report.chart(report.figures(_chat_rows()), out, "test")
        if why_not is not None:
            self.assertIn("matplotlib", why_not)
            return
        self.assertEqual(out.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")


class WakeScenarioTests(TestCase):
    """
    The wake scenario end to end, shortened: a fake vLLM process behind a
    real nvproxy, put to sleep at each depth and woken by one request.
    """

    timeout = 90

    async def test_wake_figures(self) -> None:
        import io

        workdir = Path(self.mktemp())
        workdir.mkdir()
        plan = run.Plan(
            rounds=1,
            round_seconds=0.1,
            warmup_seconds=0.0,
            wake_rounds=1,
            wake_latency=0.2,
            wake_rpc_latency=0.05,
        )
        out = io.StringIO()
        result = await run.scenario_wake(run.Context(reactor, plan, workdir, out))
        self.assertEqual(result.problems, [])
        woken = [n for n in result.notes if n.startswith("wake from level")]
        self.assertEqual(len(woken), 2, result.notes)
        for depth, note in zip((1, 2), woken, strict=True):
            self.assertIn(f"level {depth} (scripted 0.25 s", note)
            self.assertIn("over 1 wakes", note)
