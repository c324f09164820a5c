#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the CPU test suite (GPU tests are skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
exec python -m pytest -q "$@"
