#!/usr/bin/env bash
# A medium sm90 plan of this checkout with sm90's defaults (or pass list) edited, for A/B runs on the
# H200 (bench/plans_h200.sh): the knobs that stay off in main until timed are turned on here.
#
#   bench/variant_plan.sh NAME OUT_DIR [KEY=JSON ...] [+PASS ...]
#
# KEY=JSON updates sm90's defaults entry KEY with the JSON object (a new entry if absent);
# +PASS adds a pass after fuse_collapse_norm_quant. Writes OUT_DIR/NAME.tar.xz (carry it in the
# device call's out/); with VARIANT_SMALL=1, the tiny and smooth plans bench/gpu_tests_h200.sh takes
# instead of the medium one; with VARIANT_E2E=1, the medium plan with bench/e2e_medium.py's buckets
# (decode 1, 8, 32, 64, 128; prefill 4096 and 16384); VARIANT_BUCKETS: the compile's bucket options
# instead (e.g. "--max-num-seqs 64 --decode-batches 1,8,64 --prefill-tokens 512,2048,4096
# --max-model-len 8192": bench/runtime_sm90.py times every prefill bucket). VARIANT_MODEL: the model instead of the medium
# preset (bench/configs/medium20: its widths on 20 layers, 63 GB, which an 80 GB H100 holds: A/B runs
# when no H200 comes). VARIANT_SRC: the checkout to build from (default: this one). Examples (docs/performance.md, nineteenth and twentieth sessions):
#   bench/variant_plan.sh f16 out/p 'tilelang_grouped_gemm_fp4_mma={"F16": 1}'
#   bench/variant_plan.sh noov out/p 'tilelang_gemm={"prefill_overlap": 0}'
set -euo pipefail
name=$1; out=$(realpath -m "$2"); shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
root=$(cd "${VARIANT_SRC:-$here}" && pwd)
model=${VARIANT_MODEL:-v4.1-flash-medium}
[ -d "$model" ] && model=$(realpath "$model")  # the compile runs in a scratch folder
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/pkg/deepinfer" "$out"
(cd "$root" && git ls-files -z | xargs -0 -I{} cp --parents {} "$work/pkg/deepinfer/")
python3 - "$work/pkg/deepinfer/codegen/targets/sm90.py" "$@" <<'PY'
import json, re, sys
path, edits = sys.argv[1], sys.argv[2:]
s = open(path).read()
for e in edits:
    if e.startswith("+"):
        anchor = '    "fuse_collapse_norm_quant",'
        line = next(ln for ln in s.splitlines() if ln.startswith(anchor))
        s = s.replace(line, line + f'\n    "{e[1:]}",', 1)
        continue
    key, val = e.split("=", 1)
    m = re.search(r'"%s": (\{[^\n]*\}),\n' % re.escape(key), s)
    try:  # a one-line entry is edited in place
        d = json.loads(m.group(1)) if m else None
    except json.JSONDecodeError:  # an entry over several lines: the appended one replaces it whole
        d = None
    if d is not None:
        d.update(json.loads(val))
        s = s[:m.start(1)] + json.dumps(d) + s[m.end(1):]
    else:
        s = s.replace("\n    },\n)", '\n        "%s": %s,\n    },\n)' % (key, json.dumps(json.loads(val))), 1)
open(path, "w").write(s)
PY
py=${PYTHON:-$here/.venv/bin/python}
if [ -n "${VARIANT_SMALL:-}" ]; then  # the tiny and smooth plans bench/gpu_tests_h200.sh takes
    for model in tiny smooth; do
        (cd "$work" && PYTHONPATH="$work/pkg" "$py" -m deepinfer compile --model "v4.1-flash-$model" --target sm90 \
            --max-model-len 2048 --max-num-seqs 8 --decode-batches 1,2,4,8 --prefill-tokens 512 --tuning-db none \
            -o "$work/$model" | tail -2)
    done
    tar -cJf "$out/$name.tar.xz" -C "$work" tiny smooth
else
    buckets=(--max-num-seqs 64 --decode-batches 1,8,64 --prefill-tokens 4096 --max-model-len 8192)
    [ -n "${VARIANT_E2E:-}" ] && buckets=(--max-num-seqs 128 --decode-batches 1,8,32,64,128 --prefill-tokens 4096,16384
                                          --max-model-len 20480)
    [ -n "${VARIANT_BUCKETS:-}" ] && read -r -a buckets <<< "$VARIANT_BUCKETS"
    (cd "$work" && PYTHONPATH="$work/pkg" "$py" -m deepinfer compile --model "$model" --target sm90 \
        "${buckets[@]}" --tuning-db none \
        -o "$work/plan_$name" | tail -4)
    tar -cJf "$out/$name.tar.xz" -C "$work" "plan_$name"
fi
echo "$out/$name.tar.xz"
