"""Kernel selection: every node becomes a call of one named codegen template for the target."""
from __future__ import annotations

from ..codegen.target import Target
from ..codegen.template import KernelSpec, select
from ..ir.graph import Graph, Node
from ..ir.verify import VerifyError

VIEW_OPS = {"reshape"}  # layout-only: the output aliases the input's buffer, no kernel runs


def kernel_spec(g: Graph, n: Node, types=None) -> KernelSpec:
    t = types or g.types
    return KernelSpec(n.op, tuple((k, v) for k, v in n.attrs if not k.startswith("@")),
                      tuple(t[v] for v in n.inputs), tuple(t[v] for v in n.outputs))


def select_kernels(g: Graph, target: Target) -> Graph:
    nodes, missing = [], set()
    for n in g.nodes:
        if n.op in VIEW_OPS:
            name = "view"
        else:
            try:
                name = select(target, kernel_spec(g, n)).name
            except LookupError:
                missing.add(n.op)
                continue
        nodes.append(Node.make(n.op, n.inputs, n.outputs, n.attr | {"@kernel": name}))
    if missing:
        raise VerifyError(f"target {target.name}: no template implements {', '.join(sorted(missing))}")
    return g.replace_nodes(nodes)
