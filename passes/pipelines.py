"""One pipeline per target: a flat list of graph passes, each with why it is there and what it
must precede. Bucket specialisation and memory planning follow in the compile driver (they turn
the final graph into per-bucket launch shapes and arenas)."""
from __future__ import annotations

from functools import partial

from ..codegen.target import get_target
from ..ir.verify import verify
from .attention import lower_sparse_attention
from .fuse import fuse, fuse_decode
from .kernels import select_kernels
from .moe import lower_moe_dispatch
from .quant import legalize_quant, row_weight_scales
from .shapes import infer_shapes


def has_generated_template(target: str, op: str) -> bool:
    """A fusion whose fused op has no template but the torch fallback on a device target would
    trade kernels for a slower path; such rules join a pipeline only once a template exists."""
    from ..codegen.template import templates

    return any(op in t.ops and target in t.targets and t.name != "torch_device" for t in templates().values())


def _pipeline(target: str, ep: int = 1, variant: str = "prefill"):
    """`variant` "decode" is the graph of decode buckets (at most block + 1 rows per sequence)."""
    t = get_target(target)
    decode_rules = []
    if variant == "decode" and has_generated_template(target, "rope_quant_fp8_cache_write"):
        # window keys written to the ring before the attention reads it: valid only with few rows per
        # sequence; after fuse, whose rope+quant rule makes the node it matches
        decode_rules.append(("fuse_decode", fuse_decode))
    mx_rules = []
    if target == "ascend950" and has_generated_template(target, "gemm_fp8"):
        # the cube's block-scaled MMA reads per-row weight scales; a load-time repeat of the 32x32
        # block scales, after the MoE lowering (its GEMMs are grouped, fp4) and before the final
        # type check
        mx_rules.append(("row_weight_scales", row_weight_scales))
    return [
        # the builder's graph must be sound before any pass reads it; errors name the node
        ("verify", verify),
        # every later rule reads value types; make them the op rules' output, not the builder's
        ("infer_shapes", infer_shapes),
        # check the spec's activation quantisation and record the target's operand formats;
        # before fusion, which would hide the quantisation nodes it checks
        ("legalize_quant", partial(legalize_quant, target=target)),
        # rule-list fusion (norm+quant, rope+quant, mHC entry, router, swiglu+quant, pooling+norm,
        # indexer); before the lowerings so they see the fused indexer and quantised activations
        ("fuse", fuse),
        *decode_rules,
        # share top-k buffers (REUSE layers) and check each attention against its indexer's cache
        ("lower_sparse_attention", lower_sparse_attention),
        # MoE into permute / grouped GEMMs / combine (+ all-to-all for ep > 1); after fusion so the
        # router's outputs feed it, before kernel selection which needs the grouped GEMMs
        ("lower_moe_dispatch", partial(lower_moe_dispatch, ep=ep)),
        *mx_rules,
        # rewrites introduced values; recompute and verify every type before choosing kernels
        ("infer_shapes_final", infer_shapes),
        ("verify_final", verify),
        # every node becomes a call of one named template of this target; last, as it reads the
        # final ops and their operand formats
        ("select_kernels", partial(select_kernels, target=t)),
    ]


PIPELINES = {name: partial(_pipeline, name) for name in ("cpu", "sm90", "sm100", "ascend950")}


def decode_pipeline_differs(target: str) -> bool:
    return len(PIPELINES[target](variant="decode")) != len(PIPELINES[target](variant="prefill"))
