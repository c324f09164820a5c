"""MoE-dispatch lowering: one `moe_experts` node becomes route-grouping, two grouped GEMMs and a
weighted combine (spec §4.5):

    pairs, offsets = moe_permute(sel)                # (token, lane) pairs grouped by expert
    rows  = moe_gather_rows(xq, pairs)               # their fp8 activations, in expert order
    gu    = grouped_gemm_fp4(rows, w13, offsets)     # w1 and w3 in one GEMM: [gate | up]
    act   = swiglu_weighted_quant_fp8(gu, wt, pairs) # routing weight before w2's quantisation
    y     = grouped_gemm_fp4(act, w2, offsets)
    out   = moe_combine(y, pairs, offsets, sel)      # fp32 sum per token, in expert order

`w13 = concat(w1, w3)` reads only weights, so the plan runs it once at load. With ep > 1 an
all-to-all carries the rows to the rank of their expert and back.
"""
from __future__ import annotations

from ..ir.graph import Graph, Node
from ..ir.registry import get_op
from .rewrite import Context, Rewrite, apply_rules


def _lower(ctx: Context, i: int, ep: int):
    n = ctx.g.nodes[i]
    if n.op != "moe_experts":
        return None
    xq, sel, wt, w1, w3, w2 = n.inputs
    g = ctx.g
    k = g.types[sel].shape[1]
    n_exp = g.types[w1].shape[0]
    base = n.outputs[0]
    name = lambda s: f"{base}.{s}"  # noqa: E731  value names derived from the node they replace
    w13 = f"{w1.rsplit('.', 1)[0]}.w13"
    nodes, types = [], {}

    def add(op, ins, outs, attrs=None):
        node = Node.make(op, ins, outs, attrs)
        for o, t in zip(outs, get_op(op).infer_types([types.get(v) or g.types[v] for v in ins], attrs or {})):
            types[o] = t
        nodes.append(node)

    if w13 not in g.types and not any(w13 in m.outputs for m in ctx.g.nodes):
        add("concat", [w1, w3], [w13], {"axis": 1})
    add("moe_permute", [sel], [name("pairs"), name("offsets")], {"n_experts": n_exp})
    add("moe_gather_rows", [xq, name("pairs")], [name("rows")], {"k": k})
    rows = name("rows")
    if ep > 1:
        add("all_to_all", [rows], [name("rows_ep")], {"ep": ep, "direction": "dispatch"})
        rows = name("rows_ep")
    fmt = {"@operands": n.attr["@operands"]} if "@operands" in n.attr else {}
    add("grouped_gemm_fp4", [rows, w13, name("offsets")], [name("gu")], fmt)
    add("swiglu_weighted_quant_fp8", [name("gu"), wt, name("pairs")], [name("act")],
        {"limit": n.attr["limit"], "k": k})
    add("grouped_gemm_fp4", [name("act"), w2, name("offsets")], [name("y")], fmt)
    y = name("y")
    if ep > 1:
        add("all_to_all", [y], [name("y_ep")], {"ep": ep, "direction": "combine"})
        y = name("y_ep")
    add("moe_combine", [y, name("pairs"), name("offsets"), sel], [base], {"k": k})
    return Rewrite([i], nodes, {k_: v for k_, v in types.items() if k_ != base})


def lower_moe_dispatch(g: Graph, ep: int = 1) -> Graph:
    if ep < 1:
        raise ValueError(f"expert parallelism must be >= 1, got {ep}")
    out = apply_rules(g, [lambda ctx, i: _lower(ctx, i, ep)])
    return out.reordered()
