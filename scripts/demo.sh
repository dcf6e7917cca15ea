#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default (tiny model built offline, generated data;
# no network, no GPU needed).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
python examples/grpo_arithmetic.py "$@"
