# -*- test-case-name: tests.integration.test_llamacpp -*-
"""
A real llama.cpp C{llama-server} for the integration suite: build and cache
the binary, write a tiny GGUF model, start and stop the server.

Building takes 7-11 minutes on two cores, so it is a separate step run
before trial (C{python -m tests.integration.llamacpp build}, which C{tox -e
real} does); the tests only look the cached binary up with
L{find_llama_server} and skip when it is missing.

The binary comes from the C{llama-cpp-python} sdist, which vendors llama.cpp
under C{vendor/llama.cpp}; only the C{llama-server} target is built. It is
cached under C{~/.cache/nvproxy/llama-server-<version>/llama-server}, keyed by
the pinned sdist version.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IProcessTransport
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from nvproxy.testing.harness import NotHealthy, free_port, wait_healthy

LLAMA_CPP_PYTHON_VERSION = os.environ.get("NVPROXY_LLAMA_CPP_PYTHON_VERSION", "0.3.36")
"""The C{llama-cpp-python} sdist whose vendored llama.cpp is built."""

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # defaults ON and downloads the web UI
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
)


def cache_root() -> str:
    """
    Where built engines are cached: C{$NVPROXY_CACHE_DIR}, else
    C{$XDG_CACHE_HOME/nvproxy}, else C{~/.cache/nvproxy}.
    """
    explicit = os.environ.get("NVPROXY_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "nvproxy")


def llama_server_path(version: str = LLAMA_CPP_PYTHON_VERSION) -> str:
    """The cached binary's path for C{version} (it may not exist yet)."""
    return os.path.join(cache_root(), f"llama-server-{version}", "llama-server")


def find_llama_server() -> str | None:
    """
    The binary to test against: C{$NVPROXY_LLAMA_SERVER} if set, else the
    cached build; C{None} when it is not an executable file.
    """
    path = os.environ.get("NVPROXY_LLAMA_SERVER") or llama_server_path()
    if os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    return None


def _run(argv: list[str], cwd: str | None = None) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, cwd=cwd, check=True)


def ensure_llama_server(
    version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2, force: bool = False
) -> str:
    """
    Download the C{llama-cpp-python} sdist, build C{llama-server} from its
    vendored llama.cpp and install it atomically into the cache; return its
    path. A cached binary is returned as is unless C{force}.
    """
    target = llama_server_path(version)
    if not force and os.path.isfile(target) and os.access(target, os.X_OK):
        print(f"cached: {target}", flush=True)
        return target
    if shutil.which("cmake") is None:
        raise SystemExit("building llama-server needs cmake and a C++ compiler")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nvproxy-llama-build-") as work:
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={version}",
                "-d",
                work,
            ]
        )
        (sdist,) = glob.glob(os.path.join(work, "llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        (source,) = glob.glob(
            os.path.join(work, "llama_cpp_python-*", "vendor", "llama.cpp")
        )
        build = os.path.join(work, "build")
        _run(["cmake", "-S", source, "-B", build, *CMAKE_FLAGS])
        _run(
            [
                "cmake",
                "--build",
                build,
                "--config",
                "Release",
                "--target",
                "llama-server",
                f"-j{jobs}",
            ]
        )
        (binary,) = glob.glob(os.path.join(build, "bin", "llama-server"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        partial = target + ".partial"
        shutil.copy2(binary, partial)
        os.replace(partial, target)
    print(f"built {target} in {time.monotonic() - started:.0f} s", flush=True)
    return target


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n'"
    " + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, so C{/v1/chat/completions} works without C{--chat-template}."""

SPACE = "\u2581"
"""SentencePiece's word-boundary marker, which the tokenizer puts for a space."""


def write_tiny_model(path: str, seed: int = 1234) -> str:
    """
    Write a tiny llama-architecture GGUF (2 layers, n_embd 64, F32, random
    weights, about 0.5 MB) to C{path} and return C{path}.

    The vocabulary is SentencePiece-style: C{<unk>}, C{<s>}, C{</s>}, the 256
    byte-fallback tokens (so any UTF-8 prompt tokenizes), printable ASCII and
    the C{▁} space marker.

    Random weights would sample end-of-generation and raw byte tokens at
    random.  To make the output printable and always run to C{max_tokens},
    residual dimension 0 is held constant: every embedding carries +C there,
    and the attention-output and FFN-down weights write nothing into it, so
    after the final RMS norm it is large and positive; every token that is
    not printable text gets a strongly negative output weight on it.

    Needs the C{gguf} and C{numpy} packages (imported here, so the default
    suite runs without them).
    """
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    n_embd, n_ff, n_layer, n_head, n_ctx = 64, 128, 2, 4, 2048

    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [
        gguf.TokenType.UNKNOWN,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
    ]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    first_text = len(tokens)
    tokens += [SPACE, *(chr(c) for c in range(0x21, 0x7F))]
    types += [gguf.TokenType.NORMAL] * (len(tokens) - first_text)
    n_vocab = len(tokens)
    scores = [0.0] * first_text + [-float(i) for i in range(n_vocab - first_text)]

    def weights(*shape: int, scale: float = 0.02) -> Any:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    constant = 1.0
    embeddings = weights(n_vocab, n_embd)
    embeddings[:, 0] = constant
    output = weights(n_vocab, n_embd, scale=0.5)
    output[:, 0] = 0.0
    output[:first_text, 0] = -100.0  # never <unk>, <s>, </s> or a raw byte
    ones = np.ones(n_embd, dtype=np.float32)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("nvproxy-tiny")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    # numpy shapes are (rows, columns) = ggml's (ne1, ne0): (out, in).
    writer.add_tensor("token_embd.weight", embeddings)
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", output)
    for i in range(n_layer):
        attn_output = weights(n_embd, n_embd)
        attn_output[0, :] = 0.0  # writes nothing into the constant dimension
        ffn_down = weights(n_embd, n_ff)
        ffn_down[0, :] = 0.0
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.attn_q.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", attn_output)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", ffn_down)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class LlamaServerFailed(Exception):
    """C{llama-server} exited or never became healthy; carries its output."""


class _ServerProcess(ProcessProtocol):
    def __init__(self) -> None:
        self.output = bytearray()
        self.exited = False
        self._waiting: list[Deferred[None]] = []

    def outReceived(self, data: bytes) -> None:
        self.output += data

    errReceived = outReceived

    def processEnded(self, reason: Failure) -> None:
        self.exited = True
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            d.callback(None)

    def ended(self) -> Deferred[None]:
        """Fires once the process has exited."""
        if self.exited:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._waiting.append(d)
        return d


class LlamaServer:
    """
    A running C{llama-server}, from L{start_llama_server}.

    @ivar url: its base URL on loopback.
    """

    def __init__(
        self,
        reactor: Any,
        process: _ServerProcess,
        transport: IProcessTransport,
        url: str,
    ) -> None:
        self._reactor = reactor
        self._process = process
        self._transport = transport
        self.url = url

    @property
    def output(self) -> str:
        """Everything it printed so far (stdout and stderr)."""
        return self._process.output.decode("utf-8", "replace")

    def _signal(self, name: str) -> None:
        try:
            self._transport.signalProcess(name)
        except ProcessExitedAlready:
            pass

    async def _stop(self, grace: float) -> None:
        if self._process.exited:
            return
        self._signal("TERM")
        killer = self._reactor.callLater(grace, self._signal, "KILL")
        try:
            await self._process.ended()
        finally:
            if killer.active():
                killer.cancel()

    def kill(self) -> Deferred[None]:
        """SIGKILL: the engine dies mid-answer; fires once it exited."""
        self._signal("KILL")
        return self._process.ended()

    def stop(self, grace: float = 10.0) -> Deferred[None]:
        """
        SIGTERM, then SIGKILL after C{grace} seconds; fires once it exited.
        """
        return Deferred.fromCoroutine(self._stop(grace))


async def start_llama_server(
    reactor: Any,
    binary: str,
    model: str,
    *,
    alias: str = "tiny",
    ready_timeout: float = 30.0,
    extra: tuple[str, ...] = (),
) -> LlamaServer:
    """
    Start C{binary} serving C{model} on a free loopback port and wait (at
    most C{ready_timeout} seconds) until C{GET /health} answers 200.  On
    failure the process is stopped and L{LlamaServerFailed} carries its
    output.
    """
    port = free_port()
    argv = [
        binary,
        "-m",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        "2048",
        "-np",
        "2",
        "-t",
        "2",
        "--alias",
        alias,
        *extra,
    ]
    process = _ServerProcess()
    # A clean environment: llama-server reads LLAMA_ARG_* variables.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    transport = reactor.spawnProcess(process, binary, argv, env=env)
    server = LlamaServer(reactor, process, transport, f"http://127.0.0.1:{port}")
    try:
        await wait_healthy(
            reactor,
            server.url + "/health",
            within=ready_timeout,
            interval=0.05,
            alive=lambda: not process.exited,
        )
    except NotHealthy as e:
        await server.stop()
        if e.exited:
            raise LlamaServerFailed(f"llama-server exited:\n{server.output}") from None
        raise LlamaServerFailed(
            f"llama-server not healthy after {ready_timeout} s:\n{server.output}"
        ) from None
    except BaseException:
        await server.stop()
        raise
    return server


def main(argv: list[str]) -> int:
    """C{python -m tests.integration.llamacpp build [--force]}."""
    if not argv or argv[0] != "build":
        print(__doc__)
        print("usage: python -m tests.integration.llamacpp build [--force]")
        return 2
    ensure_llama_server(force="--force" in argv[1:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
