#!/usr/bin/env bash
# The prepared GPU check (issue 48), one call on the lent GPU machine: the carried wheels installed by gpu_run.sh,
# then benchmarks/gpu_check.py, whose report lands in $OUT (gpu_check.md, gpu_check.json, one log per part).
# Here first: bash benchmarks/gpu_wheels.sh (carry .whl), and python benchmarks/gpu_check.py --dry-run on CPU.
# Two calls of at most 6 minutes each (benchmarks/gpu_check.py's docstring), the first the one that matters most:
#   run(command="bash benchmarks/gpu_check.sh --parts runs head rows", carry=[".whl"], timeout_s=380)
#   run(command="bash benchmarks/gpu_check.sh --parts templates profile sync", carry=[".whl"], timeout_s=380)
set -uo pipefail
cd "$(dirname "$0")/.."
exec bash benchmarks/gpu_run.sh python3 benchmarks/gpu_check.py "$@"
