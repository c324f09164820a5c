"""Quantisation legalisation per target.

The graph already carries the spec's activation quantisation (32-element blocks, ue8m0) as
nodes; this pass checks it is where the spec puts it and records, per quantised-operand node, the
operand format the target's kernels use (its manifest's `operand_formats`, codegen/targets/;
on `moe_experts` it is carried to the grouped GEMMs the MoE lowering makes). The formats never
change values: fp4 e2m1 x ue8m0 is exact in fp8 e4m3 with the same scale, and fp8 x ue8m0 is
exact in bf16."""
from __future__ import annotations

from typing import Mapping

from ..ir.graph import Graph, Node
from ..ir.verify import VerifyError

ACT_QUANT_PRODUCERS = {"quant_fp8", "rms_norm_quant_fp8", "rope_quant_fp8", "swiglu_quant_fp8", "swiglu_gu_quant_fp8",
                       "swiglu_weighted_quant_fp8", "moe_gather_rows", "engram_gather", "ep_dispatch",
                       "hc_collapse_norm_quant_fp8"}


def legalize_quant(g: Graph, formats: Mapping[str, str]) -> Graph:
    """`formats`: op -> how the target's kernels consume its quantised operands."""
    prod = g.producers()
    nodes = []
    for n in g.nodes:
        if n.op in ("gemm_fp8", "grouped_gemm_fp4", "moe_experts"):
            act = n.inputs[0]
            src = g.nodes[prod[act]].op if act in prod else None
            if src not in ACT_QUANT_PRODUCERS:
                raise VerifyError(f"node {n.name}: its fp8 activation comes from {src or 'a leaf'}, not a "
                                  f"32-element activation quantisation")
            blk = g.types[act].block[-1]
            if blk != 32:
                raise VerifyError(f"node {n.name}: activation blocks of {blk}, the spec quantises per 32")
        if n.op in formats:
            n = Node.make(n.op, n.inputs, n.outputs, n.attr | {"@operands": formats[n.op]})
        nodes.append(n)
    return g.replace_nodes(nodes)


def row_weight_scales(g: Graph) -> Graph:
    """Block-scaled (MX) MMAs read one scale per row and 32 K elements; the checkpoint's fp8
    weights carry one per 32x32 block. Each gemm_fp8 weight gets a `row_block_scales` node (the
    same values; it reads only the weight, so the plan runs it once at load)."""
    from ..ir.registry import get_op
    from .rewrite import Rewrite, apply_rules

    made: set[str] = set()

    def rule(ctx, i):
        n = ctx.g.nodes[i]
        if n.op != "gemm_fp8":
            return None
        x, w = n.inputs
        wt = ctx.g.types[w]
        if getattr(wt, "block", None) != (32, 32):
            return None
        rows = f"{w}.rows"
        add, types = [], {}
        if rows not in ctx.g.types and rows not in made:
            made.add(rows)
            add.append(Node.make("row_block_scales", [w], [rows]))
            types[rows] = get_op("row_block_scales").infer_types([wt], {})[0]
        add.append(Node(n.op, (x, rows), n.outputs, n.attrs))
        return Rewrite([i], add, types)

    return apply_rules(g, [rule])
