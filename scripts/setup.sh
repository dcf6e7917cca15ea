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
  touch "$stamp"
fi
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
