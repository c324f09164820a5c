#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the CPU test suite (GPU tests are skipped) in
# DEEPINFER_TEST_WORKERS processes (default 2: most tests are single-threaded builds and interpreter
# runs, so two workers on two cores take about 60% of one worker's time). One intra-op thread a
# process (workers and the subprocesses tests start): torch's default of one a core put two
# spinning threads a worker on two cores, and a tiny-model interpreter test beside another busy
# process took 94 s instead of 51. --dist loadgroup keeps the tests marked with one xdist_group on
# one worker (module fixtures they share); the rest are spread as --dist load spreads them.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest -q -n "${DEEPINFER_TEST_WORKERS:-2}" --dist loadgroup "$@"
