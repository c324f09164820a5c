"""Kernel selection: every node becomes a call of one named codegen template for the target."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..ir.graph import Graph, Node, freeze
from ..ir.registry import get_op
from ..ir.verify import VerifyError

if TYPE_CHECKING:  # passes import codegen only inside the functions that call it
    from ..codegen.targets import Target
    from ..codegen.template import KernelSpec

VIEW_OPS = {"reshape"}  # layout-only: the output aliases the input's buffer, no kernel runs


def kernel_spec(g: Graph, n: Node, types=None) -> KernelSpec:
    """The call with its op's attributes complete (defaults filled in), as templates read them."""
    from ..codegen.template import KernelSpec

    t = types or g.types
    attrs = get_op(n.op).check_attrs(n.attr)
    return KernelSpec(n.op, tuple(sorted((k, freeze(v)) for k, v in attrs.items())),
                      tuple(t[v] for v in n.inputs), tuple(t[v] for v in n.outputs))


# Templates check static shapes; the graph is still symbolic here, so selection looks at the
# smallest decode step. The driver selects again for every bucket it builds.
PROBE_ENV = {"num_tokens": 1, "num_seqs": 1, "num_samples": 1, "max_pages": 1, "num_slots": 1, "num_pages": 1}


def select_kernels(g: Graph, target: Target) -> Graph:
    from ..codegen.template import select

    nodes, missing = [], set()
    probe = {v: t.subs(PROBE_ENV) for v, t in g.types.items()}
    for n in g.nodes:
        if n.op in VIEW_OPS:
            name = "view"
        else:
            try:
                name = select(target, kernel_spec(g, n, probe)).name
            except LookupError:
                missing.add(n.op)
                continue
        nodes.append(Node.make(n.op, n.inputs, n.outputs, n.attr | {"@kernel": name}))
    if missing:
        raise VerifyError(f"target {target.name}: no template implements {', '.join(sorted(missing))}")
    return g.replace_nodes(nodes)
