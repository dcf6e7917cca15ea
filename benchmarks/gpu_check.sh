#!/usr/bin/env bash
# The prepared GPU check (issue 48), one call on the lent GPU machine: the carried wheels installed by gpu_run.sh,
# then benchmarks/gpu_check.py, whose report lands in $OUT (gpu_check.md, gpu_check.json, one log per part).
# Here first: bash benchmarks/gpu_wheels.sh (carry .whl), and python benchmarks/gpu_check.py --dry-run on CPU.
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -uo pipefail
cd "$(dirname "$0")/.."
exec bash benchmarks/gpu_run.sh python3 benchmarks/gpu_check.py "$@"
