"""The verifier: run between passes; every error names the node it is about.

Checks: each value defined once and before use; no cycles; every op known and its attributes
valid; output types equal to what the op's shape/dtype rule gives; every state buffer written at
most once per step, and never read through its old version after that write (the write is in
place on a device); graph outputs defined.
"""
from __future__ import annotations

import networkx as nx

from . import shapes as sh
from .graph import Graph
from .registry import ShapeError, get_op
from .types import QuantType, TensorType


class VerifyError(ValueError):
    """The graph breaks an IR rule; the message names the node."""


def _types_equal(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, QuantType):
        return a.block == b.block and _types_equal(a.data, b.data) and _types_equal(a.scale, b.scale)
    assert isinstance(a, TensorType)
    return (a.dtype == b.dtype and a.rank == b.rank
            and all(sh.equal(x, y) for x, y in zip(a.shape, b.shape)))


def verify(g: Graph) -> Graph:
    """Raise VerifyError on the first broken rule; return the graph so passes can chain it."""
    leaves = g.inputs + g.params + g.state
    if len(set(leaves)) != len(leaves):
        dup = next(v for v in leaves if leaves.count(v) > 1)
        raise VerifyError(f"graph {g.name}: leaf %{dup} is declared twice")
    defined = set(leaves)
    for n in g.nodes:
        where = f"node {n.name}"
        try:
            opdef = get_op(n.op)
        except KeyError:
            raise VerifyError(f"{where}: unknown op {n.op!r}") from None
        for v in n.inputs:
            if v not in defined:
                _check_cycles(g)  # a value defined later: name the cycle if that is why
                raise VerifyError(f"{where}: input %{v} is used before it is defined")
        for o in n.outputs:
            if o in defined:
                raise VerifyError(f"{where}: value %{o} is defined twice")
            if o not in g.types:
                raise VerifyError(f"{where}: output %{o} has no type")
        try:
            want = opdef.infer_types([g.types[v] for v in n.inputs], n.attr)
        except ShapeError as e:
            raise VerifyError(f"{where}: {e}") from None
        if len(want) != len(n.outputs):
            raise VerifyError(f"{where}: {n.op} gives {len(want)} outputs, node has {len(n.outputs)}")
        for o, t in zip(n.outputs, want):
            if not _types_equal(g.types[o], t):
                raise VerifyError(f"{where}: %{o} is typed {g.types[o]} but {n.op} gives {t}")
        defined.update(n.outputs)
    _check_state(g)
    for o in g.outputs:
        if o not in defined:
            raise VerifyError(f"graph {g.name}: output %{o} is not defined")
    return g


def _check_cycles(g: Graph) -> None:
    dfg = nx.DiGraph()
    prod = g.producers()
    for i, n in enumerate(g.nodes):
        dfg.add_node(i)
        for v in n.inputs:
            if v in prod:
                dfg.add_edge(prod[v], i)
    try:
        cycle = nx.find_cycle(dfg)
    except nx.NetworkXNoCycle:
        return
    names = " -> ".join(g.nodes[a].name for a, _ in cycle)
    raise VerifyError(f"node {g.nodes[cycle[0][0]].name}: dataflow cycle {names}")


def _check_state(g: Graph) -> None:
    for root, w, writers, readers in g.stale_reads():
        if len(writers) > 1:
            raise VerifyError(f"node {g.nodes[writers[1]].name}: state %{root} is written a second time "
                              f"this step (first by {g.nodes[writers[0]].name})")
        late = [j for j in readers if j > w]
        if late:
            j = min(late)
            raise VerifyError(f"node {g.nodes[j].name}: reads %{readers[j]} after "
                              f"{g.nodes[w].name} overwrote state %{root} in place")
