"""sm100 (B200): TileLang kernels through nvcc and Triton AOT kernels; the fp8 GEMMs and the fp4
MoE weights go to the native block-scaled MMA. Its default tiles are narrower than sm90's where
ptxas reports spills."""
from .capacity import cuda_check
from .manifest import Manifest, Target
from .sm90 import PASSES as SM90_PASSES

TARGET = Target(
    "sm100", "cuda", "sm_100a", cores=148, smem_bytes=227 * 1024, hbm_bytes_per_s=8.0e12,
    peak_flops={"bf16": 2250e12, "fp8": 4500e12, "fp4": 9000e12, "f32": 80e12},
    # tcgen05.mma kind::mxf8f6f4: e4m3 x e2m1 operands with ue8m0 scales per 32 K, 128-row tiles
    features=("tcgen05_mxf8f6f4",),
    defaults={
        # gemm_fp8 runs on the block-scaled tcgen05 MMA (no tile knobs of its own); these are for the
        # promotion program that serves K not a multiple of 128. There: decode 128-deep K steps spill
        # (ptxas: 255 registers, 8 bytes, 3 or 4 stages), 64-deep ones do not (224 registers);
        # prefill 128x128 tiles spill (255 registers, 24 bytes), 128x64 not
        "tilelang_gemm": {"decode_block_K": 64, "prefill_block_N": 64},
        # the widening program (N not a multiple of 128) keeps the fp4->fp8 tile and the
        # accumulator in registers: the sm90 tiles spill here (255 registers, 16-72 bytes), these not
        "tilelang_grouped_gemm_fp4": {
            "decode": {"block_M": 64, "block_N": 32, "block_K": 64, "stages": 4, "threads": 128},
            "prefill": {"block_M": 128, "block_N": 64, "block_K": 64, "stages": 3, "threads": 256},
        },
        # the unsplit program spills (255 registers, 52-104 bytes); split in 2 or 3 it does not
        "tilelang_attention": {"min_splits": 2},
    },
)

OPERAND_FORMATS = {"gemm_fp8": "fp8", "grouped_gemm_fp4": "fp4", "moe_experts": "fp4", "grouped_linear": "bf16",
                   "engram_gather": "fp8"}

# sm90's pipeline (the CUDA targets differ in their kernels, not their passes), less the RoPE folded
# into the attention: that was timed on Hopper only
PASSES = tuple(p for p in SM90_PASSES if p != "fuse_attention_rope")

MANIFEST = Manifest(TARGET, languages=("cuda", "triton"), operand_formats=OPERAND_FORMATS, passes=PASSES,
                    check=cuda_check(TARGET))
