"""MoE-dispatch lowering: one `moe_experts` node becomes route-grouping, two grouped GEMMs and a
weighted combine (spec §4.5):

    pairs, offsets = moe_permute(sel)                # (token, lane) pairs grouped by expert
    rows  = moe_gather_rows(xq, pairs)               # their fp8 activations, in expert order
    gu    = grouped_gemm_fp4(rows, w13, offsets)     # w1 and w3 in one GEMM: [gate | up]
    act   = swiglu_weighted_quant_fp8(gu, wt, pairs) # routing weight before w2's quantisation
    y     = grouped_gemm_fp4(act, w2, offsets)
    out   = moe_combine(y, pairs, offsets, sel)      # fp32 sum per token, in expert order

`w13 = concat(w1, w3)` reads only weights, so the plan runs it once at load.

With ep > 1 the graph is one rank's (ir/ops/expert_parallel.py has the layout): its expert weights
are its S = P / ep slots (P = experts + redundant replicas, rounded up to divide by ep), the param
`<layer>.ffn.expert_slots` [P] names the logical expert of every slot (the placement EPLB
changes), and the grouped GEMMs run between an exchange of rows and one of outputs:

    rows_ep, wt_ep, pairs_ep, offsets_ep, counts = ep_dispatch(rows, wt, pairs, offsets, slots)
    gu  = grouped_gemm_fp4(rows_ep, w13, offsets_ep) ...  (weighted SwiGLU with k = 1, w2 GEMM)
    y_own = ep_combine(y, counts, slots, pairs)           # back in this rank's expert order
    out   = moe_combine(y_own, pairs, offsets, sel)       # the same fp32 sum as in one process
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import dtypes as dt
from ..ir.graph import Graph, Node
from ..ir.ops.expert_parallel import SLOTS_SUFFIX, initial_slots, table_rows_per_rank
from ..ir.registry import get_op
from ..ir.types import TensorType
from .rewrite import Context, Rewrite, apply_rules



@dataclass(frozen=True)
class ExpertLayout:
    """How a plan spreads over ranks: `ep` ranks hold the experts, in `dp` attention groups
    (dp divides ep), with `redundant` extra expert slots per MoE layer for EPLB replicas."""

    ep: int = 1
    dp: int = 1
    redundant: int = 0

    def __post_init__(self):
        if self.ep < 1 or self.dp < 1 or self.ep % self.dp or self.redundant < 0:
            raise ValueError(f"a layout needs ep >= 1, dp dividing ep and redundant >= 0, got ep={self.ep} "
                             f"dp={self.dp} redundant={self.redundant}")
        if self.ep == 1 and self.redundant:
            raise ValueError("redundant expert slots need ep > 1 (one rank already holds every expert)")

    def num_slots(self, n_experts: int) -> int:
        """Physical slots: experts + redundant, rounded up so every rank holds as many (spec §11)."""
        return -(-(n_experts + self.redundant) // self.ep) * self.ep

    def initial_slots(self, n_experts: int) -> list[int]:
        return initial_slots(n_experts, self.num_slots(n_experts))

    def record(self) -> dict:
        return {"world_size": self.ep, "ep": self.ep, "dp": self.dp, "redundant_experts": self.redundant,
                "attention": "data-parallel" if self.dp == self.ep else
                ("replicated" if self.dp == 1 else f"{self.dp} data-parallel groups of {self.ep // self.dp}"),
                "exchange": "none" if self.ep == 1 else "all-gather" if self.dp == 1 else "all-to-all"}


def expert_param_prefix(w1: str) -> str:
    """`layers.3.ffn.experts.w1` -> `layers.3.ffn`: the MoE block a stacked expert weight belongs to."""
    return w1.rsplit(".experts.", 1)[0]


def _lower(ctx: Context, i: int, layout: ExpertLayout, n_logical: dict[str, int]):
    n = ctx.g.nodes[i]
    if n.op != "moe_experts":
        return None
    xq, sel, wt, w1, w3, w2 = n.inputs
    g = ctx.g
    k = g.types[sel].shape[1]
    n_exp = n_logical.get(expert_param_prefix(w1), g.types[w1].shape[0])  # a sharded graph's w1 holds its slots
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
    offsets, weights, pairs, lanes = name("offsets"), wt, name("pairs"), k
    if layout.ep > 1:
        ex = {"ep": layout.ep, "dp": layout.dp}
        slots = expert_param_prefix(w1) + SLOTS_SUFFIX
        add("ep_dispatch", [rows, wt, pairs, offsets, slots],
            [name("rows_ep"), name("wt_ep"), name("pairs_ep"), name("offsets_ep"), name("counts")], ex)
        rows, weights, pairs, offsets, lanes = name("rows_ep"), name("wt_ep"), name("pairs_ep"), name("offsets_ep"), 1
    fmt = {"@operands": n.attr["@operands"]} if "@operands" in n.attr else {}
    add("grouped_gemm_fp4", [rows, w13, offsets], [name("gu")], fmt)
    add("swiglu_weighted_quant_fp8", [name("gu"), weights, pairs], [name("act")],
        {"limit": n.attr["limit"], "k": lanes})
    add("grouped_gemm_fp4", [name("act"), w2, offsets], [name("y")], fmt)
    y = name("y")
    if layout.ep > 1:
        add("ep_combine", [y, name("counts"), slots, name("pairs")], [name("y_own")], ex)
        y = name("y_own")
    add("moe_combine", [y, name("pairs"), name("offsets"), sel], [base], {"k": k})
    return Rewrite([i], nodes, {k_: v for k_, v in types.items() if k_ != base})


def _shard_experts(g: Graph, layout: ExpertLayout, n_logical: dict[str, int]) -> Graph:
    """One rank's graph: its expert weights hold its slots, and each MoE block gets its placement
    (`n_logical` receives each block's logical expert count)."""
    g = g.copy()
    for n in g.nodes:
        if n.op != "moe_experts":
            continue
        slots = expert_param_prefix(n.inputs[3]) + SLOTS_SUFFIX
        if slots in g.types:
            continue
        n_logical[slots[: -len(SLOTS_SUFFIX)]] = g.types[n.inputs[3]].shape[0]
        n_slots = layout.num_slots(g.types[n.inputs[3]].shape[0])
        for w in n.inputs[3:]:
            t = g.types[w]
            g.types[w] = type(t)(TensorType(t.data.dtype, (n_slots // layout.ep, *t.data.shape[1:])),
                                 TensorType(t.scale.dtype, (n_slots // layout.ep, *t.scale.shape[1:])), t.block)
        g.add_param(slots, TensorType(dt.i32, (n_slots,)))
    return g


def shard_tables(g: Graph, ep: int = 1) -> Graph:
    """With ep > 1 each rank holds 1/ep of every Engram table's rows (the tables are 40% of the
    real model: replicated they alone would not fit one GPU), and gathers the rows it needs from
    their owners (`engram_gather_sharded`)."""
    if ep == 1:
        return g
    nodes, types = [], {}
    for n in g.nodes:
        if n.op == "engram_gather":
            table = n.inputs[1]
            t = g.types[table]
            rows = t.data.shape[0]
            per = table_rows_per_rank(rows, ep)
            types[table] = type(t)(TensorType(t.data.dtype, (per, t.data.shape[1])),
                                   TensorType(t.scale.dtype, (per, t.scale.shape[1])), t.block)
            n = Node.make("engram_gather_sharded", n.inputs, n.outputs, {"ranks": ep, "rows": rows})
        nodes.append(n)
    out = g.replace_nodes(nodes)
    out.types.update(types)
    return out


def lower_moe_dispatch(g: Graph, ep: int = 1, dp: int = 1, redundant: int = 0) -> Graph:
    layout = ExpertLayout(ep, dp, redundant)
    n_logical: dict[str, int] = {}
    if ep > 1:
        g = _shard_experts(g, layout, n_logical)
    out = apply_rules(g, [lambda ctx, i: _lower(ctx, i, layout, n_logical)])
    return out.reordered()
