"""`Node` and `Graph`: a step of a model as a list of op applications over named values.

A graph has four kinds of leaf values: inputs (per step: token ids, positions, metadata), params
(weights), state (caches read and written every step) and node outputs. Nodes are kept in program
order; a node that writes a state buffer in place (its op declares `inplace`) produces a new value
that aliases the buffer, and the buffer's content after the step is the last such value.

Equality and hashing are structural (names, types, ops, attrs, order) and cheap: one tuple.
`to_networkx()` gives the dataflow view as a networkx graph; `topo_order()` sorts the nodes directly.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import networkx as nx

from .registry import get_op
from .types import Type


def freeze(v: Any) -> Any:
    """Attribute values are JSON-like; lists become tuples so nodes hash."""
    if isinstance(v, (list, tuple)):
        return tuple(freeze(x) for x in v)
    if isinstance(v, dict):
        raise TypeError("attribute values cannot be dicts")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"attribute value of type {type(v).__name__} is not allowed")


@dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...] = ()  # sorted (name, value) pairs

    @staticmethod
    def make(op: str, inputs: Sequence[str], outputs: Sequence[str], attrs: Mapping[str, Any] | None = None):
        return Node(op, tuple(inputs), tuple(outputs), tuple(sorted((k, freeze(v)) for k, v in (attrs or {}).items())))

    @property
    def attr(self) -> dict[str, Any]:
        return dict(self.attrs)

    @property
    def name(self) -> str:
        """How errors refer to the node: by its first output."""
        return f"%{self.outputs[0]} = {self.op}(...)" if self.outputs else f"{self.op}(...)"


@dataclass(eq=False)
class Graph:
    name: str
    types: dict[str, Type] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    state: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    _counter: Any = field(default_factory=itertools.count, repr=False)

    # ---- building -----------------------------------------------------------------------------
    def _declare(self, kind: list[str], name: str, type_: Type) -> str:
        if name in self.types:
            raise ValueError(f"value %{name} is defined twice")
        self.types[name] = type_
        kind.append(name)
        return name

    def add_input(self, name: str, type_: Type) -> str:
        return self._declare(self.inputs, name, type_)

    def add_param(self, name: str, type_: Type) -> str:
        return self._declare(self.params, name, type_)

    def add_state(self, name: str, type_: Type) -> str:
        return self._declare(self.state, name, type_)

    def fresh(self, hint: str = "t") -> str:
        while True:
            n = f"{hint}{next(self._counter)}"
            if n not in self.types:
                return n

    def add(self, op: str, inputs: Sequence[str], attrs: Mapping[str, Any] | None = None,
            names: Sequence[str] | None = None, types: Sequence[Type] | None = None) -> list[str]:
        """Append a node; output types come from the op's shape rule unless given."""
        opdef = get_op(op)
        for i in inputs:
            if i not in self.types:
                raise ValueError(f"{op}: input %{i} is not defined")
        if types is None:
            types = opdef.infer_types([self.types[i] for i in inputs], attrs or {})
        if names is None:
            names = [self.fresh() for _ in types]
        if len(names) != len(types):
            raise ValueError(f"{op}: {len(names)} output names for {len(types)} outputs")
        for n, t in zip(names, types):
            if n in self.types:
                raise ValueError(f"value %{n} is defined twice")
            self.types[n] = t
        self.nodes.append(Node.make(op, inputs, names, attrs))
        return list(names)

    def add1(self, op: str, *inputs: str, name: str | None = None, **attrs) -> str:
        """Append a single-output node (the common case) and return its output name."""
        return self.add(op, inputs, attrs, names=[name] if name else None)[0]

    def set_outputs(self, *names: str) -> None:
        self.outputs = list(names)

    # ---- structure ----------------------------------------------------------------------------
    def key(self) -> tuple:
        def typed(names):
            return tuple((n, str(self.types[n])) for n in names)

        node_types = tuple(tuple(str(self.types.get(o)) for o in n.outputs) for n in self.nodes)
        return (self.name, typed(self.inputs), typed(self.params), typed(self.state), tuple(self.outputs),
                tuple(self.nodes), node_types)

    def __eq__(self, other) -> bool:
        return isinstance(other, Graph) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def producers(self) -> dict[str, int]:
        """value name -> index of the node that defines it."""
        return {o: i for i, n in enumerate(self.nodes) for o in n.outputs}

    def users(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            for v in n.inputs:
                out.setdefault(v, []).append(i)
        return out

    def state_root(self, value: str, _prod: dict | None = None) -> str | None:
        """The state buffer a value aliases (through in-place writes), or None."""
        prod = self.producers() if _prod is None else _prod
        seen = set()
        while value not in self.state:
            i = prod.get(value)
            if i is None or value in seen:
                return None
            seen.add(value)
            node = self.nodes[i]
            alias = get_op(node.op).inplace.get(node.outputs.index(value))
            if alias is None:
                return None
            value = node.inputs[alias]
        return value

    def state_roots(self) -> dict[str, str]:
        """value -> the state buffer it aliases, for every typed value that aliases one: state_root
        of each, with the chains shared (one walk a value, not one a value and buffer)."""
        prod, state = self.producers(), set(self.state)
        memo: dict[str, str | None] = {}
        for start in self.types:
            value, path = start, []
            while value not in memo:
                if value in state:
                    memo[value] = value
                    break
                i = prod.get(value)
                if i is None or value in path:
                    memo[value] = None
                    break
                path.append(value)
                node = self.nodes[i]
                alias = get_op(node.op).inplace.get(node.outputs.index(value))
                if alias is None:
                    memo[value] = None
                    break
                value = node.inputs[alias]
            for v in path:
                memo[v] = memo[value]
        return {v: r for v, r in memo.items() if r is not None}

    def stale_reads(self) -> list[tuple[str, int, list[int], dict[int, str]]]:
        """Per state buffer written in place, in state_writes' order: (buffer, its first writer,
        every writer, reader node -> a value of the buffer's old version that node reads)."""
        prod, roots = self.producers(), self.state_roots()
        writes = self.state_writes()
        first = {root: ws[0] for root, ws in writes.items()}
        readers: dict[str, dict[int, str]] = {root: {} for root in writes}
        for i, n in enumerate(self.nodes):
            for v in n.inputs:
                root = roots.get(v)
                if root in first and (v not in prod or prod[v] < first[root]):
                    readers[root].setdefault(i, v)
        return [(root, first[root], ws, readers[root]) for root, ws in writes.items()]

    def state_writes(self) -> dict[str, list[int]]:
        """state buffer -> indices of the nodes that write it in place."""
        prod = self.producers()
        out: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            for _, in_idx in get_op(n.op).inplace.items():
                root = self.state_root(n.inputs[in_idx], prod)
                if root is not None:
                    out.setdefault(root, []).append(i)
        return out

    def state_updates(self) -> dict[str, str]:
        """state buffer -> the value holding its content at the end of the step."""
        out = {}
        for root, idxs in self.state_writes().items():
            node = self.nodes[idxs[-1]]
            opdef = get_op(node.op)
            for o, in_idx in opdef.inplace.items():
                if self.state_root(node.inputs[in_idx]) == root:
                    out[root] = node.outputs[o]
        return out

    def to_networkx(self) -> nx.MultiDiGraph:
        """Dataflow view: one vertex per node (its index), one edge per value passed, keyed by name.

        Leaf values (inputs, params, state) are vertices named by the value, so liveness and
        matching can see them too.
        """
        g = nx.MultiDiGraph()
        prod = self.producers()
        for leaf in itertools.chain(self.inputs, self.params, self.state):
            g.add_node(leaf, kind="leaf")
        for i, n in enumerate(self.nodes):
            g.add_node(i, kind="node", op=n.op)
            for v in n.inputs:
                g.add_edge(prod.get(v, v), i, key=v)
        return g

    def state_order_edges(self) -> list[tuple[int, int]]:
        """(reader, writer) pairs: a node reading a state buffer's old version must run before the
        node that overwrites it in place (not a dataflow edge, so sorting must add it)."""
        return [(i, w) for _, w, _, readers in self.stale_reads() for i in sorted(readers) if i != w]

    def topo_order(self) -> list[int]:
        """Node indices in dataflow order with the state reads before their in-place writes (Kahn's
        algorithm, the lowest index first among the ready nodes: an already-ordered graph keeps its
        order). ValueError on a cycle."""
        prod = self.producers()
        succ: list[list[int]] = [[] for _ in self.nodes]
        indeg = [0] * len(self.nodes)
        edges = [(prod[v], i) for i, n in enumerate(self.nodes) for v in n.inputs if v in prod]
        for a, b in itertools.chain(edges, self.state_order_edges()):
            succ[a].append(b)
            indeg[b] += 1
        ready = [i for i, d in enumerate(indeg) if d == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for j in succ[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(ready, j)
        if len(order) != len(self.nodes):
            stuck = next(n.name for i, n in enumerate(self.nodes) if indeg[i])
            raise ValueError(f"graph {self.name}: no order exists (a cycle through node {stuck})")
        return order

    def liveness(self) -> dict[str, tuple[int, int]]:
        """value -> (index of defining node or -1 for leaves, index of last use; outputs live to the end)."""
        end = len(self.nodes)
        live: dict[str, tuple[int, int]] = {}
        for leaf in itertools.chain(self.inputs, self.params, self.state):
            live[leaf] = (-1, -1)
        for i, n in enumerate(self.nodes):
            for o in n.outputs:
                live[o] = (i, i)
            for v in n.inputs:
                start, _ = live.get(v, (-1, -1))
                live[v] = (start, i)
        for v in itertools.chain(self.outputs, self.state_updates().values()):
            if v in live:
                live[v] = (live[v][0], end)
        return live

    def match_chains(self, ops: Sequence[str], *, sole_user: bool = True) -> list[tuple[int, ...]]:
        """Node-index chains n0 -> n1 -> ... whose ops are `ops`, each feeding the next through its
        first output (the shape every fusion rule matches); with `sole_user`, inner values have no
        other consumer and are not graph outputs."""
        users = self.users()
        outs = set(self.outputs)
        found = []
        for i, n in enumerate(self.nodes):
            if n.op != ops[0]:
                continue
            chain = [i]
            while len(chain) < len(ops):
                v = self.nodes[chain[-1]].outputs[0]
                nxt = [u for u in users.get(v, []) if self.nodes[u].op == ops[len(chain)]]
                if not nxt or (sole_user and (len(users.get(v, [])) != 1 or v in outs)):
                    break
                chain.append(nxt[0])
            if len(chain) == len(ops):
                found.append(tuple(chain))
        return found

    def op_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.op] = out.get(n.op, 0) + 1
        return dict(sorted(out.items()))

    def reordered(self) -> "Graph":
        """A copy with nodes in a topological order that keeps state reads before their in-place
        writes and otherwise keeps the current order."""
        return self.replace_nodes([self.nodes[i] for i in self.topo_order()])

    def copy(self) -> "Graph":
        g = Graph(self.name, dict(self.types), list(self.inputs), list(self.params), list(self.state),
                  list(self.outputs), list(self.nodes))
        return g

    def replace_nodes(self, nodes: Iterable[Node]) -> "Graph":
        """A copy with another node list (types of vanished values dropped)."""
        g = self.copy()
        g.nodes = list(nodes)
        keep = set(g.inputs) | set(g.params) | set(g.state) | {o for n in g.nodes for o in n.outputs}
        g.types = {k: v for k, v in g.types.items() if k in keep}
        return g
