"""Running a plan's per-step call lists, whatever runs each call.

An executor gives `PlanRunner` one function per (call, bucket): a cubin launch, a Triton
launcher, or the op's torch reference. The runner builds each bucket's program once (the call
functions in graph order, with the values each call is the last reader of), runs it with values
freed after their last reader (the plan's memory plan assumes it; a 4K-token prefill step holding
every value would need tens of GB), and keeps the state in fixed buffers (a captured CUDA graph
replays into the same addresses)."""
from __future__ import annotations

from typing import Callable

import torch

from ..ir.quant import QTensor
from ..ir.types import QuantType


def as_outputs(out, types: list) -> tuple:
    """A call's result as one value per node output: Triton launchers return a quantised value as
    its (data, scale) pair, the references as a QTensor."""
    flat = list(out) if isinstance(out, tuple) and not isinstance(out, QTensor) else [out]
    res = []
    for t in types:
        v = flat.pop(0)
        if isinstance(t, QuantType) and not isinstance(v, QTensor):
            v = QTensor(v, flat.pop(0))
        res.append(v)
    if flat:
        raise ValueError(f"a call returned {len(flat)} values more than its {len(types)} outputs")
    return tuple(res)


class PlanRunner:
    def __init__(self, loaded, params: dict, state: dict, call_fn: Callable[[dict, str], Callable],
                 device: torch.device, after_call: Callable[[str, str, int], None] | None = None):
        """`call_fn(call, bucket)` -> (inputs) -> the op's outputs; `after_call(graph, bucket, i)`
        runs after every call (a debugging hook)."""
        self.loaded, self.params, self.state = loaded, params, state
        self.call_fn, self.device, self.after_call = call_fn, device, after_call
        self._programs: dict[tuple[str, str], list] = {}
        self.at: tuple[str, int] | None = None  # (graph, node index) of the call running or last run

    def program(self, graph: str, bucket: str) -> list:
        """[(fn, input names, output names, names dead after it)] in graph order."""
        key = (graph, bucket)
        if key not in self._programs:
            g = self.loaded.graphs[graph]
            calls = {tuple(c["outputs"]): c for c in self.loaded.plan["graphs"][graph]["calls"]}
            keep = set(g.outputs) | set(g.params) | set(g.state) | set(g.state_updates().values())
            last = {}
            for i, n in enumerate(g.nodes):
                for v in (*n.inputs, *n.outputs):
                    last[v] = i
            dead = [[] for _ in g.nodes]
            for v, i in last.items():
                if v not in keep:
                    dead[i].append(v)
            prog = []
            for i, n in enumerate(g.nodes):
                fn = self.call_fn(calls[tuple(n.outputs)], bucket)
                types = [g.types[o] for o in n.outputs]
                prog.append(((lambda f, ts: lambda *xs: as_outputs(f(*xs), ts))(fn, types), n.inputs, n.outputs,
                             dead[i]))
            self._programs[key] = prog
        return self._programs[key]

    def run(self, graph: str, bucket: str, inputs: dict, trace: dict | None = None) -> dict:
        """One step; `trace`, when given, receives every value by name (compare with
        `ir.interpret(..., trace=)` on the same inputs to find where a kernel departs)."""
        g = self.loaded.graphs[graph]
        vals = dict(inputs)
        vals.update((p, self.params[p]) for p in g.params)
        vals.update((s, self.state[s]) for s in g.state)
        # references create their index tensors with factory calls: on the plan's device
        with torch.device(self.device):
            for i, (fn, ins, outs, dead) in enumerate(self.program(graph, bucket)):
                self.at = (graph, i)
                vals.update(zip(outs, fn(*(vals[v] for v in ins))))
                if self.after_call:
                    self.after_call(graph, bucket, i)
                if trace is None:
                    for v in dead:
                        vals.pop(v, None)
        for root, v in g.state_updates().items():
            new, buf = vals[v], self.state[root]
            if isinstance(buf, QTensor):
                if new.data is not buf.data:
                    buf.data.copy_(new.data)
                    buf.scale.copy_(new.scale)
            elif new is not buf:
                buf.copy_(new)
        if trace is not None:
            trace.update(vals)
        return {o: vals[o] for o in g.outputs}
