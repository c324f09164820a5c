#!/usr/bin/env bash
# The plans a device session's A/B calls take (bench/plans_h200.sh, bench/e2e_medium.py,
# bench/gpu_tests_h200.sh), built here by bench/variant_plan.sh into OUT_DIR/NAME.tar.xz, one after
# another (each takes minutes on two cores; a fresh checkout's first build takes longest). The knobs
# that stay off in main until timed are named once, here:
#
#   bench/plan_set.sh OUT_DIR [NAME ...]      (default: every variant below)
#
#   main      this checkout as it is (the RoPE folded into the attention and wo_a at prefill on bf16
#             MMAs are on in main since the twenty-fifth session, the prefill MoE GEMM on bf16 MMAs
#             since the twenty-seventh)
#   skip      the prefill MoE GEMM's warpgroups past their expert's end skip their MMAs (skip_empty)
#   wsoff     the prefill sparse attention back on one program for all roles (main takes the
#             program with its roles apart, tilelang_attention prefill_ws, since the thirtieth session)
#   kwoff     the decode attention's keys widened a value at a time again (main reads them a word at
#             a time, tilelang_attention kwords, since the thirty-first session)
#   bfg       the prefill fp8 linears on bf16 MMAs (tilelang_gemm_fp8_bf16)
#   bfp       prefill sparse attention's top-k blocks pipelined (tilelang_attention prefill_stages 2)
#   rows1     the prefill row kernels back on one row a program (triton_ops.rows_per_program; wo_a's
#             output quantisation, inside grouped_linear's launches, keeps 4)
#   all       skip + bfg + bfp
#   tmal      wo_a's bf16 program lowered with TMA copies from a producer warpgroup (the tma knob)
#   alltma    all, the two bf16 linear programs lowered with TMA copies
#   e2e       main with bench/e2e_medium.py's buckets; e2eall: all with them
#   e2esrows  e2e with the decode linears' K split up to 128 rows (split_rows: b128's router and
#             wo_a in 64-row tiles, not 4 and 256 unsplit programs)
#   small     tiny + smooth plans of main; smallall: of all
#   base@REV  main at commit REV (a git worktree beside this checkout)
#
# VARIANT_MODEL=bench/configs/medium20 builds each on the medium widths with 20 layers (fits an H100).
set -uo pipefail
out=$(realpath -m "$1"); shift
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
rows='{"block_M": 128, "block_N": 128, "block_K": 64, "stages": 4, "threads": 256}'
skip=('tilelang_grouped_gemm_fp4_bf16={"skip_empty": 1}')
wsoff=('tilelang_attention={"prefill_ws": 0}')
kwoff=('tilelang_attention={"kwords": 0}')
bfg=("tilelang_gemm_fp8_bf16=$rows")
bfp=('tilelang_attention={"prefill_stages": 2}')
all=("${skip[@]}" "${bfg[@]}" "${bfp[@]}")
tmal=('tilelang_grouped_linear_bf16={"tma": 1}')
alltma=("${all[@]}")
for key in tilelang_grouped_linear_bf16 tilelang_gemm_fp8_bf16; do  # (the MoE program takes no tma knob)
    alltma+=("$key={\"tma\": 1}")
done
srows=()
for op in linear linear_moe_router grouped_linear_quant_fp8; do
    srows+=("triton_$op={\"split_rows\": 128}")
done
rows1=()
for op in swiglu_quant_fp8 swiglu_gu_quant_fp8 swiglu_weighted_quant_fp8 moe_gather_rows quant_fp8; do
    rows1+=("triton_$op={\"ROWS\": 1}")
done
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(main skip bfg bfp rows1 all e2e small smallall)
vp="$root/bench/variant_plan.sh"
for name in "${names[@]}"; do
    t0=$(date +%s)
    case $name in
        main) "$vp" main "$out" ;;
        skip|wsoff|kwoff|bfg|bfp|rows1|all|tmal|alltma) unset -n args; declare -n args=$name; "$vp" "$name" "$out" "${args[@]}" ;;
        e2e) VARIANT_E2E=1 "$vp" e2e "$out" ;;
        e2eall) VARIANT_E2E=1 "$vp" e2eall "$out" "${all[@]}" ;;
        e2esrows) VARIANT_E2E=1 "$vp" e2esrows "$out" "${srows[@]}" ;;
        small) VARIANT_SMALL=1 "$vp" small "$out" ;;
        smallall) VARIANT_SMALL=1 "$vp" smallall "$out" "${all[@]}" ;;
        base@*) rev=${name#base@}; wt="$root/../plan-base-$rev"
                [ -d "$wt" ] || git -C "$root" worktree add -q "$wt" "$rev"
                VARIANT_SRC="$wt" "$vp" "base-$rev" "$out" ;;
        *) echo "plan_set: unknown variant $name" >&2; continue ;;
    esac > "$out/$name.build.log" 2>&1
    echo "$name: rc $? in $(( $(date +%s) - t0 )) s; $(grep -h 'kernels per step' "$out/$name.build.log" | cut -c1-160)"
done
