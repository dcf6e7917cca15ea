#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default (tiny model built offline, generated data;
# no network, no GPU needed). Installs only what the demo uses: torch and the project (no test tools, no vLLM).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" demo
python examples/grpo_arithmetic.py "$@"
