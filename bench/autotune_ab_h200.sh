#!/usr/bin/env bash
# The measured autotuner end to end on the H200 machine, in one device call: time the candidates
# built on the compile machine (as scripts/autotune_h200.sh does), write the tuned plan from them with
# `deepinfer autotune PLAN --apply` (no compiler there), then time the untuned and the tuned plan's
# medium steps in the same run (bench/runtime_sm90.py, CUDA graphs), and print both side by side.
#
#   bench/autotune_ab_h200.sh CANDS.tar.xz PLAN.tar.xz [MEASURE_BUDGET_S]
#
# Under $OUT, six files (a device call brings back at most 8: the caller's own count too):
# tuning-sm90.jsonl (the measured rows), measure.log, apply.log, runtime.log and
# runtime_sm90_medium_{untuned,tuned}.json.
set -euo pipefail
cd "$(dirname "$0")/.."
cands=${1:?usage: bench/autotune_ab_h200.sh CANDS.tar.xz PLAN.tar.xz [MEASURE_BUDGET_S]}
plan_tar=${2:?usage: bench/autotune_ab_h200.sh CANDS.tar.xz PLAN.tar.xz [MEASURE_BUDGET_S]}
budget=${3:-240}
. bench/device_env.sh
cdir=$(unpack "$cands" "$work/cands" manifest.json)
plan=$(unpack "$plan_tar" "$work/plan" plan.json)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
# AB_ONLY=NAME,...: measure these templates' instances only (autotune --only)
"$py" -m deepinfer.cli autotune --measure "$cdir" --db "$out/tuning-sm90.jsonl" --budget-s "$budget" --timeout-s 30 \
    ${AB_ONLY:+--only "$AB_ONLY"} \
    2>&1 | tee "$out/measure.log" || echo "autotune_ab_h200: --measure failed (measure.log)"
"$py" -m deepinfer.cli autotune "$plan" --apply "$cdir" --db "$out/tuning-sm90.jsonl" -o "$work/tuned" 2>&1 \
    | tee "$out/apply.log" || echo "autotune_ab_h200: --apply failed (apply.log); timing the untuned plan only"
for which in untuned tuned; do
    p=$plan; [ "$which" = tuned ] && p="$work/tuned"
    [ -f "$p/plan.json" ] || continue
    BENCH_GRAPH_ONLY=1 "$py" bench/runtime_sm90.py --medium-plan "$p" --out "$out/runtime_sm90_medium_$which.json" \
        2>&1 | tee -a "$out/runtime.log" || echo "autotune_ab_h200: the $which plan's bench failed"
done
"$py" - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
import os
rows = {w: json.load(open(f"{out}/runtime_sm90_medium_{w}.json")).get("medium", {})
        if os.path.exists(f"{out}/runtime_sm90_medium_{w}.json") else {} for w in ("untuned", "tuned")}
print(f"{'step':<14} {'untuned':>10} {'tuned':>10} {'speed-up':>9}")
for k, unit in (("prefill_4096", "tok/s"), ("decode_b1", "ms"), ("decode_b8", "ms"), ("decode_b64", "ms")):
    def val(r):
        v = r.get(k, {})
        return v.get("tok_per_s") if unit == "tok/s" else v.get("graph", {}).get("wall_ms")
    a, b = val(rows["untuned"]), val(rows["tuned"])
    if a and b:
        print(f"{k:<14} {a:>10.2f} {b:>10.2f} {(b / a if unit == 'tok/s' else a / b):>8.3f}x  ({unit})")
EOF
