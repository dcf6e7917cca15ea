#!/usr/bin/env bash
# Set up (if needed) and run the tests (docs/testing.md):
#   bash scripts/test.sh                 the whole suite: unit, integration, 2-process distributed and vLLM tests
#   bash scripts/test.sh --fast          the fast tier (~5 min): no distributed, vLLM or slow tests but a few smoke
#                                        runs; it needs no vLLM, so its set-up does not install it
#   bash scripts/test.sh [--fast] ARGS   ARGS go to pytest: a file, a test, -x, -k NAME, -m distributed, -n 0 ...
# The whole suite's set-up adds the test tools and vLLM's CPU build (the vLLM tests start a real engine) to the demo's.
# Two pytest-xdist workers (TEST_WORKERS=N for another count; `-n 0` runs in one process, for --pdb), each test file
# whole on one worker (its module fixtures, a vLLM server or a 2-process launch, are built once), one torch thread a
# worker (tests/conftest.py; docs/testing.md).
set -euo pipefail
part=test
for arg in "$@"; do
  if [ "$arg" = --fast ]; then part=dev; fi
done
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" "$part"
# no path among ARGS: pytest runs its testpaths (tests/, pyproject.toml)
python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadfile --durations=15 "$@"
