#!/usr/bin/env bash
# Run a benchmark command on the GPU device machine: install the carried wheels (benchmarks/gpu_wheels.sh)
# into /tmp/site, print the versions that matter, then run "$@" with its output also saved under $OUT.
#   bash benchmarks/gpu_run.sh python3 benchmarks/compare_trl.py --gpu --repeats 1
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_run.sh: installing .whl/ failed (run benchmarks/gpu_wheels.sh and carry .whl)"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'PY' || exit 1
import importlib
for name in ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "pyarrow", "fsspec", "huggingface_hub", "regex"):
    module = importlib.import_module(name)
    print(f"{name} {getattr(module, '__version__', '?')}")
import trainers  # noqa: F401  (the project itself imports)
PY
"$@" 2>&1 | tee "${OUT:-/tmp}/bench-$(date +%H%M%S).log"
