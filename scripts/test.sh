#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit, integration, and 2-process distributed tests on CPU.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
