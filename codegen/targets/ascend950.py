"""ascend950: TileLang-Ascend (AscendC) kernels, built with bisheng where it is on PATH, else
kept as checked sources (`unbuilt`); fp8 GEMMs on the cube's block-scaled (MX) MMA."""
from .capacity import ascend_check
from .manifest import Manifest, Target

# L1 is 512 KiB per AI core: TileLang-Ascend's scheduler limit (auto_schedule.cc GetL1MemoryLimit) and
# CANN catlass's Ascend 950 MX fp4 example ("512KiB L1")
TARGET = Target(
    "ascend950", "ascend", "dav-3510", cores=64, ub_bytes=248 * 1024, l1_bytes=512 * 1024,
    l0a_bytes=64 * 1024, l0b_bytes=64 * 1024, l0c_bytes=256 * 1024, hbm_bytes_per_s=1.6e12,
    peak_flops={"bf16": 500e12, "fp8": 1000e12},
)

# the cube's MX MMA pairs fp8 with fp8 or fp4 with fp4, never fp8 rows with fp4 experts, and the
# UB -> L1 path carries 16/32-bit types only: both expert operands widen to bf16 on the vector core
# (codegen/library/ascend_moe.py says where the formats are documented)
OPERAND_FORMATS = {"gemm_fp8": "mxfp8 (weight scales per row at load)",
                   "grouped_gemm_fp4": "fp8 rows, fp4 weights -> bf16 in the vector prologue",
                   "moe_experts": "fp8 rows, fp4 weights -> bf16 in the vector prologue",
                   "grouped_linear": "fp8 weight -> bf16 in the vector prologue", "engram_gather": "fp8->bf16"}

PASSES = (
    "verify",  # the builder's graph must be sound before any pass reads it; errors name the node
    "infer_shapes",  # every later rule reads value types: the op rules' output, not the builder's
    "legalize_quant",  # checks activation quantisation, records OPERAND_FORMATS; before fuse hides the quant nodes
    "fuse",  # rule-list fusion; before the lowerings so they see the fused indexer and quantised activations
    "fuse_decode",  # decode graphs: window keys written before attention reads them; after fuse makes rope+quant
    "lower_sparse_attention",  # shares top-k buffers (REUSE layers), checks attentions against their indexers
    "lower_moe_dispatch",  # after fuse (router outputs feed it), before selection (needs the grouped GEMMs)
    "shard_tables",  # with ep > 1: Engram tables split by rows over the ranks (no-op otherwise)
    # the cube's MX MMA reads per-row weight scales: a load-time repeat of the 32x32 block scales;
    # after the MoE lowering (its GEMMs are grouped, fp4), before the final type check
    "row_weight_scales",
    "infer_shapes_final",  # rewrites introduced values: recompute every type before choosing kernels
    "verify_final",
    "select_kernels",  # last: every node becomes one template call, read from the final ops and operand formats
)

MANIFEST = Manifest(TARGET, languages=("ascendc",), operand_formats=OPERAND_FORMATS, passes=PASSES,
                    check=ascend_check(TARGET))
