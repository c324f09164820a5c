"""One rewriter for rule lists (tinygrad style): a rule looks at one node, the root of its
pattern, and returns a `Rewrite` or None. The rewriter applies every non-overlapping match of a
sweep, restores a valid order, and sweeps again until nothing matches."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..ir.graph import Graph, Node
from ..ir.types import Type


@dataclass
class Rewrite:
    remove: list[int]  # indices of the nodes the pattern covers
    add: list[Node]  # their replacement, placed where the root was
    types: dict[str, Type] = field(default_factory=dict)  # types of values the replacement introduces


class Context:
    """What rules look at: the graph, and def-use maps of the current sweep."""

    def __init__(self, g: Graph, **extra):
        self.g = g
        self.prod = g.producers()
        self.users = g.users()
        self.outputs = set(g.outputs)
        self.__dict__.update(extra)

    def node_of(self, value: str) -> tuple[int, Node] | tuple[None, None]:
        i = self.prod.get(value)
        return (i, self.g.nodes[i]) if i is not None else (None, None)

    def sole_user(self, value: str, user: int) -> bool:
        """`value` feeds only node `user` and is not a graph output, so it can vanish in a fusion."""
        return self.users.get(value, []) == [user] and value not in self.outputs

    def producer_op(self, value: str, op: str):
        """(index, node) of `value`'s producer if it is an `op` node, else (None, None)."""
        i, n = self.node_of(value)
        return (i, n) if n is not None and n.op == op else (None, None)


Rule = Callable[[Context, int], "Rewrite | None"]


def apply_rules(g: Graph, rules: Sequence[Rule], max_sweeps: int = 16, **extra) -> Graph:
    for _ in range(max_sweeps):
        ctx = Context(g, **extra)
        taken: set[int] = set()
        placed: dict[int, list[Node]] = {}  # root index -> replacement nodes
        drop: set[int] = set()
        new_types: dict[str, Type] = {}
        for i in range(len(g.nodes)):
            if i in taken:
                continue
            for rule in rules:
                m = rule(ctx, i)
                if m is None or taken.intersection(m.remove):
                    continue
                taken.update(m.remove)
                drop.update(m.remove)
                placed[max(m.remove)] = m.add
                new_types.update(m.types)
                break
        if not placed:
            return g
        nodes = []
        for i, n in enumerate(g.nodes):
            if i in placed:
                nodes += placed[i]
            elif i not in drop:
                nodes.append(n)
        out = g.replace_nodes(nodes)
        out.types.update(new_types)
        g = out.reordered()
    raise RuntimeError(f"rewrites did not settle after {max_sweeps} sweeps")
