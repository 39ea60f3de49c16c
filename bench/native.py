"""
The compiled fake engine and load generator (C{bench/native/*.c}), built
with C{gcc} on first use into a cache dir, and the bench's side of the load
generator: one process per round, whose JSON answer is merged into the
round's L{Samples}.

The cache dir is C{$NVPROXY_BENCH_CACHE}, else C{~/.cache/nvproxy/bench}.
A binary is named after a hash of its source and the compiler flags, so an
edited source is rebuilt and an unchanged one never is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from bench import procs
from bench.load import Samples, Workload
from bench.procs import BenchError

SOURCES = Path(__file__).parent / "native"
PROGRAMS = ("engine", "loadgen")
CFLAGS = ("-O2", "-Wall", "-Wextra", "-std=gnu11")


def cache_dir() -> Path:
    """Where the built programs are kept."""
    configured = os.environ.get("NVPROXY_BENCH_CACHE")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "nvproxy" / "bench"


def compiler() -> str | None:
    """The C compiler: C{$CC}, else C{gcc} on the PATH; None without one."""
    return shutil.which(os.environ.get("CC", "gcc"))


def build(name: str, cache: Path | None = None) -> Path:
    """
    The path of the built program C{name} (one of L{PROGRAMS}), compiling
    it first when needed.  Raises L{BenchError} without a compiler or when
    the compile fails.
    """
    source = SOURCES / f"{name}.c"
    cc = compiler()
    if cc is None:
        raise BenchError("no C compiler (gcc) for the native bench programs")
    digest = hashlib.sha256(source.read_bytes() + " ".join(CFLAGS).encode())
    cache = cache_dir() if cache is None else cache
    binary = cache / f"{name}-{digest.hexdigest()[:16]}"
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    partial = binary.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run(
        [cc, *CFLAGS, "-o", str(partial), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BenchError(f"compiling {source} failed:\n{done.stderr.strip()}")
    partial.replace(binary)  # atomic: a parallel build sees a whole file
    return binary


class _Collect(ProcessProtocol):
    def __init__(self) -> None:
        self.out = bytearray()
        self.err = bytearray()
        self.ended: Deferred[int] = Deferred()

    def outReceived(self, data: bytes) -> None:
        self.out += data

    def errReceived(self, data: bytes) -> None:
        self.err += data

    def processEnded(self, reason: Failure) -> None:
        code = getattr(reason.value, "exitCode", 0)
        self.ended.callback(0 if code is None else int(code))


def merge(samples: Samples, document: dict[str, Any]) -> None:
    """Adds one run of the native load generator to C{samples}."""
    samples.latencies += [us / 1e6 for us in document["lat_us"]]
    samples.ttfbs += [us / 1e6 for us in document["ttfb_us"]]
    samples.delays += [us / 1e6 for us in document["delay_us"]]
    samples.lines += int(document["lines"])
    samples.elapsed += float(document["elapsed"])
    samples.client_cpu += float(document["cpu"])
    samples.connects += int(document["connects"])
    for kind, count in document["error_kinds"].items():
        samples.errors += count
        samples.error_kinds[kind] = samples.error_kinds.get(kind, 0) + count


class NativeLoad:
    """
    The same interface as L{bench.load.LoadGenerator}, one C{loadgen}
    process per round.  Connections are opened at the start of each round
    (so they are not kept between rounds); with C{delays}, the lateness of
    every chunk that carries the engine's send time is recorded.
    """

    def __init__(
        self,
        reactor: Any,
        binary: Path,
        concurrency: int,
        timeout: float = 30.0,
        *,
        delays: bool = False,
    ) -> None:
        self._reactor = reactor
        self._binary = binary
        self.concurrency = concurrency
        self.timeout = timeout
        self.delays = delays

    async def round(
        self,
        url: str,
        workload: Workload,
        duration: float,
        samples: Samples,
        max_requests: int = 0,
    ) -> None:
        """Run for C{duration} seconds (at most C{max_requests} in all)."""
        argv = [
            str(self._binary),
            "--url",
            url,
            "--body",
            workload.body().decode("utf-8"),
            "--concurrency",
            str(self.concurrency),
            "--duration",
            f"{duration:.3f}",
            "--timeout",
            f"{self.timeout:.3f}",
        ]
        if max_requests:
            per_connection = max(1, -(-max_requests // self.concurrency))
            argv += ["--max-requests", str(per_connection)]
        if self.delays:
            argv.append("--delays")
        collect = _Collect()
        self._reactor.spawnProcess(collect, argv[0], argv, env=None)
        code = await collect.ended
        if code != 0:
            raise BenchError(
                f"loadgen exited {code}: {collect.err.decode('utf-8', 'replace')}"
            )
        merge(samples, json.loads(collect.out))

    async def close(self) -> None:
        """Nothing is kept between rounds."""


async def start_engine(
    reactor: Any,
    workdir: Path,
    name: str,
    models: list[str],
    *,
    stream_chunks: int = 200,
    plain_chunks: int = 5,
    interval: float = 0.0,
) -> tuple[procs.Proc, str]:
    """Start the native engine; returns the process and its base URL."""
    argv = [
        str(build("engine")),
        "--port",
        "0",
        "--models",
        ",".join(models),
        "--chunks",
        str(stream_chunks),
        "--plain-chunks",
        str(plain_chunks),
        "--interval-ms",
        f"{interval * 1e3:g}",
    ]
    proc, line = await procs.spawn(reactor, name, argv, workdir, b"listening on ")
    return proc, f"http://{line.rsplit(' ', 1)[-1]}"
