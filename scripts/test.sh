#!/usr/bin/env bash
# Set up (if needed) and run the tests (docs/testing.md):
#   bash scripts/test.sh                 the whole suite: unit, integration, 2-process distributed and vLLM tests
#   bash scripts/test.sh --fast          the fast tier (~7 min): no distributed, vLLM or slow tests but a few smoke
#                                        runs; it needs no vLLM, so its set-up does not install it
#   bash scripts/test.sh [--fast] ARGS   ARGS go to pytest: a file, a test, -x, -k NAME, -m distributed, ...
# The whole suite's set-up adds the test tools and vLLM's CPU build (the vLLM tests start a real engine) to the demo's.
set -euo pipefail
part=test
for arg in "$@"; do
  if [ "$arg" = --fast ]; then part=dev; fi
done
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" "$part"
# no path among ARGS: pytest runs its testpaths (tests/, pyproject.toml)
python -m pytest -q -p no:cacheprovider --durations=15 "$@"
