#!/usr/bin/env bash
# Issue #19's evidence in one device call on the H200 (`needs_h200`: the 40-layer plan does not fit
# an H100): the GPU suite's plan tests and the smooth-preset test on the tiny and smooth plans
# (bench/gpu_tests_h200.sh), then the 40-layer medium plan end to end against its floors at every
# bucket, and through the engine at b1 and b64 with early-submitted steps (bench/e2e_medium.py).
# Both plans are built here beforehand: `bench/plan_set.sh OUT e2e small`. Carry the two tarballs
# and .whl/ (the tokenizer wheels; .devpack is not needed and does not fit beside them).
#
#   bench/issue19_h200.sh E2E.tar.xz SMALL.tar.xz
#
# Under $OUT: gpu_tests.log, e2e_medium.json and e2e_medium.log; the e2e table printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: bench/issue19_h200.sh E2E.tar.xz SMALL.tar.xz"; exit 2; }
bash bench/gpu_tests_h200.sh "$2"
. bench/device_env.sh
plan=$(unpack "$1" "$work/e2e" plan.json)
t0=$(date +%s)
"$py" bench/e2e_medium.py --plan "$plan" --engine-batches 1,64 --engine-early --out "$out/e2e_medium.json" \
    > "$out/e2e_medium.log" 2>&1
echo "e2e: rc $? in $(( $(date +%s) - t0 )) s"
tail -n 30 "$out/e2e_medium.log"
