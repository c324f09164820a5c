"""Decode steps of a medium plan for Nsight Compute: the plan on the GPU with its generated
checkpoint, then `--steps` eager decode steps at `--batch` sequences of 1025 tokens. Not a test;
run on the H200 under ncu, filtering the kernels to look at, e.g.:

    ncu -k regex:'hc_mix_split|gemm_fp8_kernel' --launch-skip 40 --launch-count 4 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section WarpStateStats python bench/ncu_decode.py PLAN --batch 1

The warm-up step comes first, so --launch-skip passes its launches of the filtered kernels.
With the medium checkpoint resident (103 GB), ncu's kernel replay backs up device memory for
every pass of every profiled launch: keep --launch-count and the sections few (eight launches
with six sections ran past a 400 s limit on the H200), or profile the kernel in isolation
(bench/ncu_kernels.sh).
"""
import argparse
import sys

import torch

from deepinfer.runtime.batch import SeqChunk

from runtime_sm90 import gpu_executor


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("plan")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args()
    ex = gpu_executor(a.plan, 0, cuda_graphs=False)
    chunks = [SeqChunk(i, 1024, [5 + i], list(range(9 * i, 9 * i + 9))) for i in range(a.batch)]
    for _ in range(a.steps):
        ex.step(chunks)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
