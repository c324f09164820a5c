#!/usr/bin/env bash
# Nsight Compute on the decode kernels furthest from their floors, in isolation (no plan, no
# checkpoint: bench/kernels_triton.py builds real-width inputs and JIT-compiles with the device's
# Triton), one report per kernel under $OUT. The in-plan run under ncu spends its time generating
# the 100 GB checkpoint; this one starts profiling within seconds.
#
#   bench/ncu_kernels.sh [CASES...]     CASE = op:kernel-regex:size, size as kernels_triton.py names it
#                                       (grouped_gemm_fp4: the batch, as moe_decode.py's MOE_BATCHES)
#
# Default cases: hc_pre's split and finishing kernels at b1, the MoE GEMM at b1 and b64, wo_a.
set -uo pipefail
cd "$(dirname "$0")"
out=${OUT:-out}
mkdir -p "$out"
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(
    "hc_pre:hc_mix_split_kernel:decode b1" "hc_pre:hc_pre_kernel:decode b1"
    "grouped_gemm_fp4:grouped_gemm_fp4_kernel:1" "grouped_gemm_fp4:grouped_gemm_fp4_kernel:64"
    "grouped_linear:block_linear_mx_kernel:decode b1")
for c in "${cases[@]}"; do
    IFS=: read -r op regex size <<< "$c"
    tag="${op}_${regex%%_kernel*}_${size// /}"
    args=(--only "$op" --sizes "$size")
    [ "$op" = grouped_gemm_fp4 ] && { export MOE_BATCHES=$size; args=(--only "$op"); }
    # the first matching launch is the reference check's: skip it, profile the next two
    timeout 150 ncu -k "regex:$regex" --launch-skip 1 --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        python kernels_triton.py "${args[@]}" --no-peer --out "/tmp/ncu_$tag.json" \
        > "$out/ncu_$tag.txt" 2>&1
    echo "ncu $tag: rc $? ($(grep -c 'Section: ' "$out/ncu_$tag.txt") sections)"
    grep -E "^\s+(Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per Thread|Grid Size|Block Size)\b" \
        "$out/ncu_$tag.txt" | head -16
done
