"""Running a plan's per-step call lists, whatever runs each call.

An executor gives `PlanRunner` one function per (call, bucket): a generated call's host recipe
over the plan's cubins, or the op's torch reference (bucket None: a cpu step at its own shape). The runner builds each bucket's program once (the call
functions in graph order, with the values each call is the last reader of), runs it with values
freed after their last reader (the plan's memory plan assumes it; a 4K-token prefill step holding
every value would need tens of GB), and keeps the state in fixed buffers (a captured CUDA graph
replays into the same addresses)."""
from __future__ import annotations

from typing import Callable

import torch

from ..ir.quant import QTensor
from .plan_file import PlanError


class PlanGraph:
    """One graph of a plan as plan.json records it: the step's inputs, the params and state its
    calls read, the value that holds each state buffer at the end of the step, the outputs, and
    the calls in order, each with its inputs, outputs and the calls it depends on."""

    def __init__(self, name: str, rec: dict):
        self.name = name
        self.inputs = list(rec["inputs"])
        self.params, self.state, self.outputs = list(rec["params"]), list(rec["state"]), list(rec["outputs"])
        self.state_updates = dict(rec["state_updates"])
        self.calls = rec["calls"]
        given = set(self.inputs) | set(self.params) | set(self.state)
        made = set(given)
        for i, c in enumerate(self.calls):
            if any(not 0 <= d < i for d in c["deps"]):
                raise PlanError(f"graph {name}: call {i} ({c['op']}) depends on a call that does not precede it")
            from_deps = {o for d in c["deps"] for o in self.calls[d]["outputs"]}
            missing = [v for v in c["inputs"] if v not in given and v not in from_deps]
            if missing:
                raise PlanError(f"graph {name}: call {i} ({c['op']}) reads {', '.join(missing)}, which neither "
                                "its dependencies nor the step provide")
            made.update(c["outputs"])
        for v in (*self.outputs, *self.state_updates.values()):
            if v not in made:
                raise PlanError(f"graph {name}: {v} is an output but no call makes it")


def as_outputs(out) -> tuple:
    """A reference's result as one value per node output."""
    return tuple(out) if isinstance(out, tuple) and not isinstance(out, QTensor) else (out,)


class PlanRunner:
    def __init__(self, loaded, params: dict, state: dict, call_fn: Callable[[dict, str], Callable],
                 device: torch.device, after_call: Callable[[str, str, int], None] | None = None):
        """`call_fn(call, bucket)` -> (inputs) -> the op's outputs; `after_call(graph, bucket, i)`
        runs after every call (a debugging hook)."""
        self.loaded, self.params, self.state = loaded, params, state
        self.call_fn, self.device, self.after_call = call_fn, device, after_call
        self._programs: dict[tuple[str, str], list] = {}
        self.at: tuple[str, int] | None = None  # (graph, node index) of the call running or last run

    def program(self, graph: str, bucket: str | None) -> list:
        """[(fn, input names, output names, names dead after it)] in call order."""
        key = (graph, bucket)
        if key not in self._programs:
            g = self.loaded.graphs[graph]
            keep = set(g.outputs) | set(g.params) | set(g.state) | set(g.state_updates.values())
            last = {}
            for i, c in enumerate(g.calls):
                for v in (*c["inputs"], *c["outputs"]):
                    last[v] = i
            dead = [[] for _ in g.calls]
            for v, i in last.items():
                if v not in keep:
                    dead[i].append(v)
            self._programs[key] = [(self.call_fn(c, bucket), c["inputs"], c["outputs"], dead[i])
                                   for i, c in enumerate(g.calls)]
        return self._programs[key]

    def run(self, graph: str, bucket: str | None, inputs: dict, trace: dict | None = None) -> dict:
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
                vals.update(zip(outs, as_outputs(fn(*(vals[v] for v in ins)))))
                if self.after_call:
                    self.after_call(graph, bucket, i)
                if trace is None:
                    for v in dead:
                        vals.pop(v, None)
        for root, v in g.state_updates.items():
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
