"""The pass pipeline of a target: its manifest (codegen/targets/) lists the passes by name, in
order, with why each is where it is; this module binds each name to its pass and the target's
data. Bucket specialisation and memory planning follow in the compile driver (they turn the final
graph into per-bucket launch shapes and arenas)."""
from __future__ import annotations

from functools import partial

from ..ir.verify import verify
from .attention import lower_sparse_attention
from .fuse import (fuse, fuse_attention_rope, fuse_collapse_norm_quant, fuse_combine_expand, fuse_decode,
                   fuse_decode_linear_quant, fuse_decode_norm, fuse_decode_router_linear, fuse_gate_up_gemms,
                   fuse_moe_shared, split_hc_pre)
from .kernels import select_kernels
from .moe import lower_moe_dispatch, shard_tables
from .quant import legalize_quant, row_weight_scales
from .shapes import infer_shapes

VARIANTS = ("prefill", "decode")
# rules valid only with few rows per sequence: they join the graph of decode buckets alone
DECODE_ONLY = {"fuse_decode", "fuse_decode_norm", "fuse_decode_linear_quant", "fuse_decode_router_linear"}
MULTI_RANK_ONLY = {"shard_tables"}  # one rank holds every table row: nothing to do, no stage to dump
# a rule whose output op has no template but the torch fallback on a device target would trade
# kernels for a slower path: it joins a pipeline only once a generated template of that op exists
# (row_weight_scales: the per-row scales are what the block-scaled fp8 GEMM template reads)
NEEDS_TEMPLATE = {"fuse_decode": "rope_quant_fp8_cache_write",
                  "fuse_decode_norm": "norm_rope_quant_fp8_cache_write",
                  "fuse_decode_linear_quant": "grouped_linear_quant_fp8",
                  "fuse_decode_router_linear": "linear_moe_router", "row_weight_scales": "gemm_fp8",
                  "fuse_moe_shared": "moe_combine_shared", "fuse_gate_up_gemms": "swiglu_gu_quant_fp8",
                  "split_hc_pre": "hc_collapse_norm", "fuse_combine_expand": "moe_combine_hc_expand",
                  "fuse_collapse_norm_quant": "hc_collapse_norm_quant_fp8"}


def has_generated_template(target: str, op: str) -> bool:
    from ..codegen.template import templates

    return any(op in t.ops and target in t.targets and t.name != "torch_device" for t in templates().values())


def _passes(manifest, ep: int, dp: int, redundant: int) -> dict:
    return {
        "verify": verify,
        "infer_shapes": infer_shapes,
        "legalize_quant": partial(legalize_quant, formats=manifest.operand_formats),
        "fuse": fuse,
        "fuse_attention_rope": fuse_attention_rope,
        "fuse_decode": fuse_decode,
        "fuse_decode_norm": fuse_decode_norm,
        "fuse_decode_linear_quant": fuse_decode_linear_quant,
        "fuse_decode_router_linear": fuse_decode_router_linear,
        "lower_sparse_attention": lower_sparse_attention,
        "lower_moe_dispatch": partial(lower_moe_dispatch, ep=ep, dp=dp, redundant=redundant),
        "shard_tables": partial(shard_tables, ep=ep),
        "fuse_moe_shared": fuse_moe_shared,
        "fuse_gate_up_gemms": fuse_gate_up_gemms,
        "split_hc_pre": split_hc_pre,
        "fuse_collapse_norm_quant": fuse_collapse_norm_quant,
        "fuse_combine_expand": fuse_combine_expand,
        "row_weight_scales": row_weight_scales,
        "infer_shapes_final": infer_shapes,
        "verify_final": verify,
        "select_kernels": partial(select_kernels, target=manifest.target),
    }


def pipeline(target: str, ep: int = 1, variant: str = "prefill", dp: int = 1,
             redundant: int = 0) -> list[tuple[str, object]]:
    """The target's (name, pass) list; `variant` "decode" is the graph of decode buckets (at most
    block + 1 rows per sequence)."""
    from ..codegen.targets import get_manifest  # here: passes and codegen never import each other at module level

    if variant not in VARIANTS:
        raise ValueError(f"unknown pipeline variant {variant!r} (known: {', '.join(VARIANTS)})")
    manifest = get_manifest(target)
    bound = _passes(manifest, ep, dp, redundant)
    out = []
    for name in manifest.passes:
        if name not in bound:
            raise ValueError(f"{target}'s manifest lists an unknown pass {name!r}")
        if name in DECODE_ONLY and variant != "decode":
            continue
        if name in MULTI_RANK_ONLY and ep == 1:
            continue
        if name in NEEDS_TEMPLATE and not has_generated_template(target, NEEDS_TEMPLATE[name]):
            continue
        out.append((name, bound[name]))
    return out


def decode_pipeline_differs(target: str) -> bool:
    return len(pipeline(target, variant="decode")) != len(pipeline(target, variant="prefill"))
