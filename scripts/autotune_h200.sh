#!/usr/bin/env bash
# Measured autotuning on the H200 machine in one device call: time a candidates directory built on
# the compile machine (deepinfer autotune PLAN --build-candidates DIR, then
# tar -cJf NAME.tar.xz -C "$(dirname DIR)" "$(basename DIR)") into a tuning database under $OUT, and
# print the default-vs-tuned table. Back on the compile machine, `deepinfer compile ... --tuning-db
# tuning-sm90.jsonl` takes the rows (its toolchain built the kernels).
#
#   scripts/autotune_h200.sh CANDS.tar.xz [BUDGET_S] [TINY_CANDS.tar.xz]
#
# BUDGET_S (default 420): no instance starts after it, so the call ends inside its 10-minute limit;
# the database is saved after each instance, and DB=PATH (a tuning-sm90.jsonl from an earlier call,
# carried in) makes this call skip what that one measured. TINY_CANDS: a small candidates directory
# (the tiny plan's) that the GPU test tests/gpu/test_autotune_measure.py measures first.
set -euo pipefail
cd "$(dirname "$0")/.."
cands=${1:?usage: scripts/autotune_h200.sh CANDS.tar.xz [BUDGET_S] [TINY_CANDS.tar.xz]}
budget=${2:-420}
tiny=${3:-}
out=${OUT:-out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
work=$(mktemp -d)
# this checkout is the package; its folder is not named deepinfer, so import it through a link
mkdir -p "$work/pkg"
ln -s "$PWD" "$work/pkg/deepinfer"
export PYTHONPATH="$work/pkg${PYTHONPATH:+:$PYTHONPATH}"

unpack() {  # tarball, folder -> the candidates directory inside (the one holding manifest.json)
    mkdir -p "$2"
    tar -xJf "$1" -C "$2"
    dirname "$(find "$2" -name manifest.json | head -n 1)"
}

db="$out/tuning-sm90.jsonl"
if [ -n "${DB:-}" ]; then cp "$DB" "$db"; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
if [ -n "$tiny" ]; then
    DEEPINFER_TUNING_CANDIDATES=$(unpack "$tiny" "$work/tiny") \
        "$py" -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_autotune_measure.py 2>&1 | tee "$out/gpu_test.log" \
        || echo "autotune_h200: the GPU test failed (see gpu_test.log); measuring anyway"
fi
dir=$(unpack "$cands" "$work/cands")
"$py" -m deepinfer.cli autotune --measure "$dir" --db "$db" --budget-s "$budget" --timeout-s 30 2>&1 \
    | tee "$out/measure.log"
echo "autotune_h200: rows in $db"
