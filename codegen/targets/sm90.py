"""sm90 (H100/H200): TileLang kernels through nvcc and Triton AOT kernels, fp4 MoE weights
widened to fp8 in the GEMM prologue."""
from .capacity import cuda_check
from .manifest import Manifest, Target

TARGET = Target(
    "sm90", "cuda", "sm_90a", cores=132, smem_bytes=227 * 1024, hbm_bytes_per_s=4.8e12,
    peak_flops={"bf16": 989e12, "fp8": 1979e12, "f32": 67e12},
    defaults={
        # prefill_overlap: each 32-deep block's wgmma issued before the block before it is scaled
        # (kept with the split prefill mix below: docs/performance.md, twentieth session)
        "tilelang_gemm": {"decode_block_K": 128, "prefill_block_N": 128, "prefill_overlap": 1},
        "tilelang_grouped_gemm_fp4": {
            "decode": {"block_M": 64, "block_N": 64, "block_K": 128, "stages": 4, "threads": 128},
            "prefill": {"block_M": 128, "block_N": 128, "block_K": 128, "stages": 3, "threads": 256},
        },
        # prefill_ws: unsplit sparse calls on the program with its roles apart (a producer
        # warpgroup gathers and widens the key rows; tilelang_sparse_prefill): the medium 4K call
        # 1.52x the single-role program's on an H100, checked in the plan (docs/performance.md,
        # twenty-ninth and thirtieth sessions)
        "tilelang_attention": {"min_splits": 1, "prefill_ws": 1, "kwords": 1},
        # the decode linears' K split from the shape (block_linear_split), not a fixed 8: the
        # router's 3 tiles of 32 split 16 ways (b1 1.9% faster on an H100, medium widths on 20
        # layers; docs/performance.md, twenty-sixth session)
        "triton_linear": {"decode_split": 0},
        "triton_linear_moe_router": {"decode_split": 0},
        # the prefill mix GEMM on its split path: the unsplit 16-row program spills at 255 registers
        # (docs/performance.md, nineteenth and twentieth sessions); 3 stages: the 4K call 439 ->
        # 334 us on an H100, 199 registers and no spills from Triton 3.9 (twenty-eighth session).
        # prefill_wide: from 2048 rows, 128-row blocks 8 deep (176 registers, no spills), the mix
        # weight read from L2 8x fewer times: prefill 2K 1.007x, 4K 1.009x on an H100, 512 rows
        # kept on 16-row blocks for their programs' count (thirty-fifth session)
        # X2: the dots as two tf32 MMAs over the weight's high part and remainder (166 registers
        # at 512 rows, 118 in the wide blocks, from 199 / 176): prefill 4K 1.016x on an H100 (both
        # processes ahead), its calls within their check (fortieth session)
        "triton_hc_mix": {"prefill": {"SPLIT": 8, "BM": 16, "BK": 32, "num_stages": 3, "num_warps": 4, "X2": 1},
                          "prefill_wide": {"min_rows": 2048, "BM": 128, "BK": 8, "num_warps": 8}},
        # decode lin8 stays on the TileLang program: on Triton's dot_scaled (decode_rows 64) the
        # medium plan's decode step was no faster at b1 / b8 and 1.43x slower at b64 on the H200
        # (docs/performance.md, eighth session); decode_rows N > 0 hands rows <= N to it
        "triton_gemm_fp8": {"decode_rows": 0},
        # the MoE GEMM at up to this many rows (a decode step of one sequence: 6) on the CUDA
        # cores (triton_ops.MOE_GEMV; docs/performance.md, ninth session); prefill-sized calls on
        # tl.dot_scaled too (triton_ops.MOE_PREFILL; sixteenth session)
        "triton_grouped_gemm_fp4": {"gemv_rows": 8, "prefill": 1},
        # decode MoE GEMM on warp MMAs (tilelang_moe_decode); 64-row CTAs, 4 warps over K, the
        # weight tile and x's rows (XS) three steps ahead in shared memory, CTAs over the experts
        # with rows where those are few (ACT) (docs/performance.md, tenth to twelfth sessions)
        "tilelang_grouped_gemm_fp4_mma": {"RT": 4, "WK": 4, "KU": 2, "STAGES": 3, "NT": 1, "XS": 1, "ACT": 1},
        # decode lin8 of at most 8 rows on warp MMAs (tilelang_gemm_decode): 32-row CTAs, K split
        # up to 4 CTAs per SM; 64-row calls stay on the wgmma program (docs/performance.md,
        # eleventh and thirteenth sessions)
        "tilelang_gemm_fp8_mma": {"RT": 2, "WK": 4, "KU": 2, "STAGES": 3, "NT": 1, "CTAS": 4},
        # wo_a at prefill on bf16 wgmma (tilelang_prefill_bf16): prefill 1.07x on an H100 (the
        # medium widths on 20 layers); the fp8-linear bf16 program lost there and stays off
        # (docs/performance.md, twenty-fifth session). Its weight scales read once before the K
        # loop: the 4K call 809 -> 761 us on an H100 (twenty-eighth session)
        "tilelang_grouped_linear_bf16": {"block_M": 128, "block_N": 128, "block_K": 64, "stages": 4, "threads": 256,
                                         "scales_once": 1},
        # the prefill MoE GEMM on bf16 wgmma (tilelang_moe_prefill), the weight widened into the
        # register operand, each step's MMAs in flight while the next is widened (inflight), an
        # expert's last tile on the narrowest of 64, 128, 192, 256 rows (ragged): the medium 4K's
        # w13 / w2 1.24x / 1.19x the shared-memory program's, prefill 4K 1.073x, 2K 1.085x on an
        # H100 (medium widths on 20 layers; docs/performance.md, twenty-seventh and
        # thirty-sixth sessions)
        "tilelang_grouped_gemm_fp4_bf16": {"block_M": 256, "block_N": 128, "block_K": 64, "stages": 4, "threads": 256,
                                           "rs": 1, "inflight": 1, "ragged": 64},
        # the prefill fp8 linears on the same in-flight loop over their e4m3 weight widened to bf16
        # (tilelang_prefill_bf16.rows_inflight_program): 1.44x / 1.33x sm90's fp8 program on wo_b /
        # wq_b at 256 rows on the H200 (thirty-eighth session); medium20 prefill 4K 1.057x, 2K
        # 1.028x on an H100, every call within its check (fortieth session). min_rows 0: every
        # prefill-sized call (the 512-row bucket's step times spread 25% between processes)
        "tilelang_gemm_fp8_bf16": {"block_M": 256, "block_N": 128, "block_K": 64, "stages": 4, "threads": 256,
                                   "inflight": 1, "min_rows": 0},
    },
)

OPERAND_FORMATS = {"gemm_fp8": "fp8", "grouped_gemm_fp4": "fp4->fp8 in prologue", "moe_experts": "fp4->fp8 in prologue",
                   "grouped_linear": "bf16", "engram_gather": "fp8"}

PASSES = (
    "verify",  # the builder's graph must be sound before any pass reads it; errors name the node
    "infer_shapes",  # every later rule reads value types: the op rules' output, not the builder's
    "legalize_quant",  # checks activation quantisation, records OPERAND_FORMATS; before fuse hides the quant nodes
    "fuse",  # rule-list fusion; before the lowerings so they see the fused indexer and quantised activations
    "fuse_decode",  # decode graphs: window keys written before attention reads them; after fuse makes rope+quant
    "fuse_decode_norm",  # decode graphs: the keys' RMSNorm into that write; after fuse_decode makes it
    "fuse_decode_linear_quant",  # decode graphs: wo_a's quantisation into its K-split sum; after legalize_quant
    "fuse_decode_router_linear",  # decode graphs: the gate GEMM's K-split sum in the router; after fuse makes it
    "lower_sparse_attention",  # shares top-k buffers (REUSE layers), checks attentions against their indexers
    "lower_moe_dispatch",  # after fuse (router outputs feed it), before selection (needs the grouped GEMMs)
    "shard_tables",  # with ep > 1: Engram tables split by rows over the ranks (no-op otherwise)
    "fuse_moe_shared",  # after lower_moe_dispatch makes the combine it fuses the shared expert's add into
    "fuse_gate_up_gemms",  # the shared expert's w1 and w3 GEMMs as one; after fuse makes swiglu_quant_fp8
    "split_hc_pre",  # mHC mixes apart from the normalised input, for the runtime's second stream; after fuse
    "fuse_collapse_norm_quant",  # that input and its fp8 quantisation in one call; after split_hc_pre makes it
    "fuse_combine_expand",  # the MoE combine into the hc_expand reading it; after fuse_moe_shared makes that combine
    "fuse_attention_rope",  # q's RoPE and the output's inverse RoPE inside the attention; after lower_sparse_attention
    "infer_shapes_final",  # rewrites introduced values: recompute every type before choosing kernels
    "verify_final",
    "select_kernels",  # last: every node becomes one template call, read from the final ops and operand formats
)

MANIFEST = Manifest(TARGET, languages=("cuda", "triton"), operand_formats=OPERAND_FORMATS, passes=PASSES,
                    check=cuda_check(TARGET))
