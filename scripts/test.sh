#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the CPU test suite (GPU tests are skipped) in
# DEEPINFER_TEST_WORKERS processes (default 2: most tests are single-threaded builds and interpreter
# runs, so two workers on two cores take about 60% of one worker's time).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
exec python -m pytest -q -n "${DEEPINFER_TEST_WORKERS:-2}" "$@"
