#!/usr/bin/env bash
# Medium plans side by side on the H200 machine, in one device call: each plan's step times
# (bench/runtime_sm90.py, CUDA graphs, its own process, the same generated checkpoint), then each
# plan's decode GPU time by kernel (--profile), optionally every call of the named templates in the
# last plan's decode step against its op's reference (--divergence-medium), and a table last.
#
#   bench/plans_h200.sh [--check TEMPLATES|all] NAME=PLAN.tar.xz[:VAR=VALUE] [...]
#
# VAR=VALUE is set for that plan's runs (DEEPINFER_PDL=0: the same plan with plain launches).
# PLANS_REPEATS=N times every plan in N processes, the plans alternated, and reports each step's
# median (the same plan moves about 4% between processes on the H200: docs/performance.md).
# PLANS_PROFILE=last profiles only the last plan, none none, NAME,NAME those (default: all). CHECK_LENS: the checked
# prompts' lengths, comma-separated (more than 8 prompts: the 64-row decode bucket). CHECK_PREFILL=1:
# the check covers the prefill step too (decode only by default). BENCH_EXPOSED_TOP=N: each decode
# bucket's N kernels charged with the most of the graph step's wall (runtime_sm90.exposed_time).
#
# Under $OUT: runtime_NAME.json and profile_NAME.json per plan, divergence.json with --check, and
# plans.log (everything printed). Keep the plans few: a device call brings back at most 8 files.
set -euo pipefail
cd "$(dirname "$0")/.."
check=""
if [ "${1:-}" = "--check" ]; then check=$2; shift 2; fi
[ $# -ge 1 ] || { echo "usage: bench/plans_h200.sh [--check TEMPLATES] NAME=PLAN.tar.xz ..."; exit 2; }
. bench/device_env.sh
log="$out/plans.log"
names=()
declare -A dirs envs
for arg in "$@"; do
    name=${arg%%=*}
    spec=${arg#*=}
    envs[$name]=""
    if [[ $spec == *:* ]]; then envs[$name]=${spec#*:}; spec=${spec%%:*}; fi
    dirs[$name]=$(unpack "$spec" "$work/$name" plan.json)
    names+=("$name")
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$log" || true
repeats=${PLANS_REPEATS:-1}
for rep in $(seq 1 "$repeats"); do  # plans alternated, so drift over the call reaches each alike
    for name in "${names[@]}"; do
        dest="$out/runtime_$name.json"
        [ "$repeats" -gt 1 ] && dest="$work/runtime_${name}_r$rep.json"
        env BENCH_GRAPH_ONLY=1 ${envs[$name]} "$py" bench/runtime_sm90.py --medium-plan "${dirs[$name]}" --out "$dest" \
            2>&1 | tee -a "$log" || echo "plans_h200: $name's step times failed" | tee -a "$log"
    done
done
if [ "$repeats" -gt 1 ]; then  # one file a plan: each step's median over its processes, every run kept
    "$py" - "$work" "$out" "$repeats" "${names[@]}" <<'MERGE' 2>&1 | tee -a "$log" || echo "plans_h200: the merge failed" | tee -a "$log"
import json, os, statistics, sys
work, out, reps, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
for n in names:
    paths = [f"{work}/runtime_{n}_r{r}.json" for r in range(1, reps + 1)]
    runs = []
    for p in paths:  # a run that failed or was cut off leaves no file, a partial one or an error
        try:
            r = json.load(open(p))
        except (OSError, ValueError):
            continue
        if "decode_b1" in r.get("medium", {}):
            runs.append(r)
    if not runs:
        continue
    merged = runs[0]
    for step, v in merged.get("medium", {}).items():
        if not isinstance(v, dict):
            continue
        vals = [r["medium"].get(step, {}) for r in runs]
        if "tok_per_s" in v:
            v["runs_tok_per_s"] = [x.get("tok_per_s") for x in vals]
            v["tok_per_s"] = statistics.median(x for x in v["runs_tok_per_s"] if x)
        if "wall_ms" in v.get("graph", {}):
            v["graph"]["runs_wall_ms"] = [x.get("graph", {}).get("wall_ms") for x in vals]
            v["graph"]["wall_ms"] = statistics.median(x for x in v["graph"]["runs_wall_ms"] if x)
            v["runs_logits_sha256"] = [x.get("logits_sha256") for x in vals]
    merged["repeats"] = len(runs)
    with open(f"{out}/runtime_{n}.json", "w") as f:
        json.dump(merged, f, indent=1)
    print(n, "runs:", {s: v.get("graph", {}).get("runs_wall_ms", v.get("runs_tok_per_s"))
                       for s, v in merged["medium"].items() if isinstance(v, dict) and ("graph" in v or "tok_per_s" in v)})
MERGE
fi
profiled=("${names[@]}")
case "${PLANS_PROFILE:-all}" in none) profiled=() ;; last) profiled=("${names[-1]}") ;; all) ;;
    *) IFS=, read -r -a profiled <<< "$PLANS_PROFILE" ;; esac
for name in "${profiled[@]}"; do
    env ${envs[$name]} "$py" bench/runtime_sm90.py --medium-plan "${dirs[$name]}" --profile --out "$out/profile_$name.json" 2>&1 \
        | tail -n 40 | tee -a "$log" || echo "plans_h200: $name's profile failed" | tee -a "$log"
done
if [ -n "$check" ]; then
    last=${names[-1]}
    only=(--only-templates "$check")
    [ "$check" = all ] && only=()
    decode_only=--decode-only
    [ -n "${CHECK_PREFILL:-}" ] && decode_only=""
    env ${envs[$last]} "$py" bench/runtime_sm90.py --medium-plan "${dirs[$last]}" --divergence-medium $decode_only \
        "${only[@]}" ${CHECK_LENS:+--check-lens "$CHECK_LENS"} --out "$out/divergence.json" 2>&1 | tail -n 30 | tee -a "$log" \
        || echo "plans_h200: the per-call check failed" | tee -a "$log"
fi
"$py" - "$out" "${names[@]}" <<'EOF'
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
def load(kind, n):
    p = f"{out}/{kind}_{n}.json"
    return json.load(open(p)) if os.path.exists(p) else {}
rows = {n: load("runtime", n).get("medium", {}) for n in names}
print(f"{'step':<14}" + "".join(f"{n:>14}" for n in names) + "   (last / first)")
prefills = sorted({k for r in rows.values() for k, v in r.items() if k.startswith("prefill_") and isinstance(v, dict)},
                  key=lambda k: int(k[8:]))  # every prefill bucket the plans have
for k, unit in [(k, "tok/s") for k in prefills] + [("decode_b1", "ms"), ("decode_b8", "ms"), ("decode_b64", "ms")]:
    def val(r):
        v = r.get(k, {})
        return v.get("tok_per_s") if unit == "tok/s" else v.get("graph", {}).get("wall_ms")
    vals = [val(rows[n]) for n in names]
    cells = "".join(f"{v:>14.2f}" if v else f"{'-':>14}" for v in vals)
    ratio = ""
    if vals[0] and vals[-1]:
        ratio = f"   {(vals[-1] / vals[0] if unit == 'tok/s' else vals[0] / vals[-1]):.3f}x faster"
    print(f"{k:<14}{cells}{ratio}  ({unit})")
for b in (1, 8, 64):  # bit-equal logits digests (every distinct one over repeats), argmax agreement with the first plan
    first = rows[names[0]].get(f"decode_b{b}", {})
    def digests(r):
        return "/".join(dict.fromkeys(r.get("runs_logits_sha256") or [r.get("logits_sha256", "-")]))
    print(f"decode_b{b} logits " + ", ".join(
        f"{n} {digests(rows[n].get(f'decode_b{b}', {}))} argmax="
        f"{sum(x == y for x, y in zip(rows[n].get(f'decode_b{b}', {}).get('argmax', []), first.get('argmax', [])))}"
        f"/{len(first.get('argmax', []))}" for n in names))
for n in names:
    prof = load("profile", n).get("medium_profile", {})
    for b, v in prof.items():
        top = ", ".join(f"{t['name'][:28]} {t['ms_per_step']:.2f}" for t in v.get("top", [])[:8])
        print(f"{n} {b}: GPU {v.get('gpu_ms', 0):.2f} ms; {top}")
        for t in v.get("by_launch", [])[:14]:
            print(f"    {t['ms_per_step']:7.2f} ms {t['calls_per_step']:5.0f}x {t['us_per_call']:8.1f} us  {t['name']}")
EOF
