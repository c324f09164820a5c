#!/usr/bin/env bash
# The fuzz tests at the issue's full counts (CI runs fewer, with fixed inputs): 10,000 mutated
# inputs for each of the IR text parser, the config reader and the plan loader, 1,000 random
# request streams for the scheduler; fresh random inputs each run.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
DEEPINFER_FUZZ_FULL=1 exec python -m pytest -q -p no:cacheprovider tests/test_fuzz_inputs.py \
    "tests/test_runtime_scheduler.py::test_random_request_streams_end_every_request_and_leak_nothing" "$@"
