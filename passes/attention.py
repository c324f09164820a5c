"""Sparse-attention lowering checks and sharing.

The builder already emits one sparse-attention call per layer (window ring + compressed cache by
top-k + sink) and the indexer as scoring / candidate / top-k calls. This pass makes sharing
explicit and checks it: identical pure computations are merged (so a REUSE layer can only ever
share its owner's top-k buffer, never recompute it), every sparse attention reads the compressed
cache its top-k list was computed against, and each attention call is annotated with the layer
whose list it reuses."""
from __future__ import annotations

from ..ir.graph import Graph, Node
from ..ir.registry import get_op
from ..ir.verify import VerifyError


def dedupe_common_subexpressions(g: Graph) -> Graph:
    """Merge nodes with the same op, inputs and attributes (pure ops only: not state writes)."""
    seen: dict[tuple, Node] = {}
    rename: dict[str, str] = {}
    nodes = []
    for n in g.nodes:
        n = Node.make(n.op, [rename.get(v, v) for v in n.inputs], n.outputs, n.attr)
        key = (n.op, n.inputs, n.attrs)
        if not get_op(n.op).inplace and key in seen:
            for a, b in zip(n.outputs, seen[key].outputs):
                rename[a] = b
            continue
        seen[key] = n
        nodes.append(n)
    out = g.replace_nodes(nodes)
    out.outputs = [rename.get(o, o) for o in g.outputs]
    return out


def _owner(g: Graph, value: str) -> str | None:
    root = g.state_root(value)
    return root.split(".", 1)[1] if root else None


def lower_sparse_attention(g: Graph) -> Graph:
    g = dedupe_common_subexpressions(g)
    prod = g.producers()
    first_user: dict[str, int] = {}
    nodes = []
    for i, n in enumerate(g.nodes):
        if n.op == "sparse_attn":
            ckv, top = n.inputs[3], n.inputs[4]
            src = g.nodes[prod[top]] if top in prod else None
            if src is None or src.op not in ("indexer_topk", "topk_select"):
                raise VerifyError(f"node {n.name}: its top-k list does not come from an indexer")
            if src.op == "indexer_topk" and _owner(g, src.inputs[2]) != _owner(g, ckv):
                raise VerifyError(f"node {n.name}: reads compressed cache of layer {_owner(g, ckv)} with a top-k "
                                  f"list scored against layer {_owner(g, src.inputs[2])}")
            if top in first_user:
                n = Node.make(n.op, n.inputs, n.outputs, n.attr | {"@shares_topk_of": first_user[top]})
            else:
                first_user[top] = i
        nodes.append(n)
    return g.replace_nodes(nodes)
