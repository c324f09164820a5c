"""cpu: every op runs its torch reference (the plan executor calls it); nothing to render or build.
Quantised operands are dequantised by the references."""
from .capacity import no_check
from .manifest import Manifest, Target

TARGET = Target("cpu", "cpu", "x86_64", cores=2)

OPERAND_FORMATS = {"gemm_fp8": "dequantised", "grouped_gemm_fp4": "dequantised", "moe_experts": "dequantised",
                   "grouped_linear": "dequantised", "engram_gather": "dequantised"}

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
    "infer_shapes_final",  # rewrites introduced values: recompute every type before choosing kernels
    "verify_final",
    "select_kernels",  # last: every node becomes one template call, read from the final ops and operand formats
)

MANIFEST = Manifest(TARGET, languages=("torch",), operand_formats=OPERAND_FORMATS, passes=PASSES, check=no_check)
