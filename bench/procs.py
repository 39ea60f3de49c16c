"""
The processes a benchmark runs against: fake engines and an nvproxy daemon,
each in its own process, started and stopped over the bench's reactor, and
their CPU time and RSS read from C{/proc}.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import treq
from attrs import frozen
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IProcessTransport
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from nvproxy.testing.harness import NotHealthy, free_port, wait_healthy

_CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    """A process did not start or the setup is broken."""


@frozen
class Usage:
    """CPU seconds (user + system) and resident set size of one process."""

    cpu: float
    rss: int

    @classmethod
    def of(cls, pid: int) -> Usage:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        # fields[0] is the state (field 3 of proc(5)): utime/stime are 14/15.
        ticks = int(fields[11]) + int(fields[12])
        rss = 0
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        return cls(cpu=ticks / _CLK_TCK, rss=rss)


class _Child(ProcessProtocol):
    """Collects output; fires L{ready} on the first line containing a marker."""

    def __init__(self, name: str, marker: bytes | None, log: Path) -> None:
        self.name = name
        self.ready: Deferred[str] = Deferred()
        self.ended: Deferred[None] = Deferred()
        self._marker = marker
        self._buffer = b""
        self._log = log.open("ab")

    def outReceived(self, data: bytes) -> None:
        self._log.write(data)
        if self._marker is None or self.ready.called:
            return
        self._buffer += data
        for line in self._buffer.splitlines():
            if self._marker in line:
                self.ready.callback(line.decode("utf-8", "replace").strip())
                self._buffer = b""
                return
        self._buffer = self._buffer[-4096:]

    def errReceived(self, data: bytes) -> None:
        self._log.write(data)

    def processEnded(self, reason: Failure) -> None:
        self._log.close()
        if self._marker is not None and not self.ready.called:
            self.ready.errback(
                BenchError(f"{self.name} exited before it was ready: {reason.value}")
            )
        self.ended.callback(None)


@attrs.define
class Proc:
    """One child process."""

    name: str
    transport: IProcessTransport
    child: _Child

    @property
    def pid(self) -> int:
        pid = self.transport.pid
        if pid is None:
            raise BenchError(f"{self.name} is not running")
        return int(pid)

    def usage(self) -> Usage:
        return Usage.of(self.pid)

    async def stop(self, reactor: Any, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after C{grace} seconds."""
        if self.child.ended.called:
            return
        self.transport.signalProcess("TERM")
        timer = reactor.callLater(grace, self._kill)
        await self.child.ended
        if timer.active():
            timer.cancel()

    def _kill(self) -> None:
        if not self.child.ended.called:
            self.transport.signalProcess("KILL")


async def spawn(
    reactor: Any,
    name: str,
    argv: Sequence[str],
    workdir: Path,
    marker: bytes | None = None,
    timeout: float = 20.0,
) -> tuple[Proc, str]:
    """
    Start C{argv}; with C{marker}, wait (at most C{timeout}) for an output line
    containing it and return that line.  Output goes to C{workdir/NAME.log}.
    """
    child = _Child(name, marker, workdir / f"{name}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    transport = reactor.spawnProcess(
        child, argv[0], list(argv), env=env, path=os.getcwd()
    )
    proc = Proc(name, transport, child)
    if marker is None:
        return proc, ""
    child.ready.addTimeout(timeout, reactor)
    try:
        line = await child.ready
    except Exception:
        await proc.stop(reactor)
        raise
    return proc, line


async def start_engine(
    reactor: Any,
    workdir: Path,
    name: str,
    models: Sequence[str],
    *,
    chunks: int = 5,
    stream_chunks: int | None = None,
    chunk_interval: float = 0.0,
    refuse: bool = False,
) -> tuple[Proc, str]:
    """Start a L{bench.engine}; returns the process and its base URL."""
    argv = [
        sys.executable,
        "-m",
        "bench.engine",
        "--dialect",
        "ollama",
        "--port",
        "0",
        "--models",
        ",".join(models),
        "--chunks",
        str(chunks),
        "--chunk-interval",
        str(chunk_interval),
    ]
    if stream_chunks is not None:
        argv += ["--stream-chunks", str(stream_chunks)]
    if refuse:
        argv.append("--refuse")
    proc, line = await spawn(reactor, name, argv, workdir, b"listening on ")
    address = line.rsplit(" ", 1)[-1]
    return proc, f"http://{address}"


@frozen
class Proxy:
    """A running nvproxy daemon with an Ollama facade and the admin API."""

    proc: Proc
    facade: str
    admin: str
    name: str = "nvproxy"
    log: Path | None = None


def _toml_string(text: str) -> str:
    # A JSON string is a valid TOML basic string for everything we write.
    return json.dumps(text)


def _toml_config(
    admin_port: int,
    facade_port: int,
    backend: str,
    nodes: Mapping[str, str],
    node_id: str = "bench",
    cluster_dir: Path | None = None,
    vllm: tuple[int, str, str] | None = None,
    poll_interval: str = "2s",
) -> str:
    lines = [
        f"node_id = {_toml_string(node_id)}",
        "[admin]",
        f'listen = "127.0.0.1:{admin_port}"',
        "[discovery]",
        f"poll_interval = {_toml_string(poll_interval)}",
        "[engines.ollama]",
    ]
    if backend:
        lines += [f"port = {facade_port}", f"backend = {_toml_string(backend)}"]
    else:
        lines.append("enabled = false")
    lines += [
        "[engines.lmstudio]",
        "enabled = false",
        "[engines.llamacpp]",
        "enabled = false",
        "[engines.vllm]",
    ]
    if vllm is None:
        lines.append("enabled = false")
    else:
        # one service that only the benchmark puts to sleep
        port, url, model = vllm
        lines += [
            f"port = {port}",
            "[[engines.vllm.services]]",
            'name = "bench"',
            f"url = {_toml_string(url)}",
            f"model = {_toml_string(model)}",
            'idle_sleep = "0"',
            'idle_offload = "0"',
        ]
    if cluster_dir is not None:
        lines += ["[cluster]", f"dir = {_toml_string(str(cluster_dir))}"]
    for node_id_, url in nodes.items():
        lines += [
            "[[nodes]]",
            f"id = {_toml_string(node_id_)}",
            f"engines = {{ ollama = {_toml_string(url)} }}",
        ]
    return "\n".join(lines) + "\n"


async def launch_proxy(
    reactor: Any,
    workdir: Path,
    backend: str,
    nodes: Mapping[str, str] | None = None,
    name: str = "nvproxy",
    *,
    node_id: str = "bench",
    cluster_dir: Path | None = None,
    facade_port: int | None = None,
    extra_config: str = "",
    vllm: tuple[int, str, str] | None = None,
    poll_interval: str = "2s",
) -> Proxy:
    """
    Start C{twistd -n nvproxy} as node C{node_id} in front of C{backend} and the
    direct C{nodes} (id -> Ollama URL), optionally a cluster member through
    C{cluster_dir}; C{extra_config} is appended to its TOML (e.g. a
    C{[limits]} table).  An empty C{backend} turns the Ollama facade off;
    C{vllm} (facade port, service URL, model) turns the vLLM facade on with
    one service.  Does not wait for it (see L{wait_ready}).
    """
    admin_port = free_port()
    if facade_port is None:
        facade_port = free_port()
    state = Path(tempfile.mkdtemp(prefix="state-", dir=workdir))
    config = workdir / f"{name}.toml"
    config.write_text(
        _toml_config(
            admin_port,
            facade_port,
            backend,
            dict(nodes or {}),
            node_id,
            cluster_dir,
            vllm,
            poll_interval,
        )
        + extra_config
    )
    log = workdir / f"{name}.log"
    argv = [
        sys.executable,
        "-c",
        "import sys; from twisted.scripts.twistd import run; sys.exit(run())",
        "-n",
        "--pidfile=",
        f"--logfile={log}",
        "nvproxy",
        "--config",
        str(config),
        "--state-dir",
        str(state),
    ]
    proc, _ = await spawn(reactor, name, argv, workdir)
    return Proxy(
        proc,
        f"http://127.0.0.1:{facade_port}",
        f"http://127.0.0.1:{admin_port}",
        name,
        log,
    )


async def wait_ready(
    reactor: Any,
    proxy: Proxy,
    want: Mapping[str, str],
    timeout: float = 20.0,
) -> dict[str, Any]:
    """
    Wait until the admin status of C{proxy} shows every node of C{want}
    advertising the given Ollama model (an empty model: any model; Ollama
    names without a tag are listed with C{:latest}), and
    return that status.  Stops the daemon and raises L{BenchError} on timeout.
    """
    seen: list[dict[str, Any]] = []

    def ready(code: int, body: bytes) -> bool:
        if code != 200:
            return False
        try:
            status: dict[str, Any] = json.loads(body)
        except ValueError:
            return False
        seen[:] = [status]
        nodes_seen: dict[str, dict[str, list[str]]] = status.get("nodes") or {}
        return all(
            (nodes_seen.get(node) or {}).get("ollama")
            and (
                not model
                or {model, f"{model}:latest"} & set(nodes_seen[node]["ollama"])
            )
            for node, model in want.items()
        )

    try:
        await wait_healthy(
            reactor,
            f"{proxy.admin}/admin/status",
            within=timeout,
            alive=lambda: not proxy.proc.child.ended.called,
            healthy=ready,
        )
    except NotHealthy as e:
        if e.exited:
            raise BenchError(f"{proxy.name} exited; see {proxy.log}") from None
        await proxy.proc.stop(reactor)
        last = seen[0] if seen else e.last
        raise BenchError(
            f"{proxy.name} not ready in {timeout}s (last: {last!r})"
        ) from None
    return seen[0]


async def start_proxy(
    reactor: Any,
    workdir: Path,
    backend: str,
    nodes: Mapping[str, str] | None = None,
    timeout: float = 20.0,
    name: str = "nvproxy",
) -> Proxy:
    """
    Start C{twistd -n nvproxy} in front of C{backend} (node C{bench}) and the
    direct C{nodes} (id -> Ollama URL); returns once every node advertises
    models on the admin status.
    """
    nodes = dict(nodes or {})
    proxy = await launch_proxy(reactor, workdir, backend, nodes, name)
    await wait_ready(reactor, proxy, dict.fromkeys({"bench", *nodes}, ""), timeout)
    return proxy


def init_cluster(
    reactor: Any, workdir: Path, facade_ports: Mapping[str, int]
) -> dict[str, Path]:
    """
    A cluster dir per node id of C{facade_ports} (node id -> its Ollama facade
    port on 127.0.0.1), each with its own identity and every other node
    pinned as a peer.  Returns node id -> cluster dir.
    """
    from nvproxy.cluster import ClusterDir, Peer

    dirs = {node: ClusterDir(workdir / f"cluster-{node}") for node in facade_ports}
    fingerprints = {node: d.init(node, reactor).fingerprint for node, d in dirs.items()}
    for node, d in dirs.items():
        for other, port in facade_ports.items():
            if other != node:
                d.add_peer(
                    Peer(other, "127.0.0.1", fingerprints[other], {"ollama": port})
                )
    return {node: d.path for node, d in dirs.items()}


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def connected_ports(targets: Mapping[str, tuple[int, int]]) -> dict[str, set[int]]:
    """
    For each name -> (C{port}, C{pid}) of C{targets}: the local ports of the
    established IPv4 TCP connections of process C{pid} whose remote end is
    C{port} (the client ends of its connections to a server on C{port}).

    Reads C{/proc/net/tcp} once, which takes milliseconds of kernel time
    however few sockets there are: call it from another process
    (L{bench.sampler}), and not often.
    """
    inodes = {name: _socket_inodes(pid) for name, (_, pid) in targets.items()}
    found: dict[str, set[int]] = {name: set() for name in targets}
    try:
        with open("/proc/net/tcp") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        # sl local_address rem_address st ... uid timeout inode
        if len(fields) < 10 or fields[3] != "01":  # ESTABLISHED
            continue
        remote_port = int(fields[2].rsplit(":", 1)[1], 16)
        for name, (port, _) in targets.items():
            if remote_port == port and fields[9] in inodes[name]:
                found[name].add(int(fields[1].rsplit(":", 1)[1], 16))
    return found


async def select(proxy: Proxy, node: str | None) -> None:
    """Pin the Ollama facade to C{node} (None clears the pin)."""
    url = f"{proxy.admin}/admin/engines/ollama/select"
    if node is None:
        response = await treq.delete(url, timeout=5)
    else:
        response = await treq.put(url, json={"node": node}, timeout=5)
    await treq.content(response)
    if response.code != 200:
        raise BenchError(f"select {node!r}: HTTP {response.code}")


async def engine_stats(url: str) -> dict[str, int]:
    """The per-path request counts of a L{bench.engine}."""
    response = await treq.get(f"{url}/bench/stats", timeout=5)
    counts: dict[str, int] = await response.json()
    return counts
