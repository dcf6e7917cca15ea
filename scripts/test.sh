#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit, integration, and 2-process distributed tests on CPU.
# The set-up adds the test tools and vLLM's CPU build (the vLLM tests start a real engine) to the demo's.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" test
python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
