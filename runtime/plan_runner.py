"""Running a plan's per-step call lists, whatever runs each call.

An executor gives `PlanRunner` one function per (call, bucket): a generated call's host recipe
over the plan's cubins, or the op's torch reference (bucket None: a cpu step at its own shape). The runner builds each bucket's program once (the call
functions in graph order, with the values each call is the last reader of), runs it with values
freed after their last reader (the plan's memory plan assumes it; a 4K-token prefill step holding
every value would need tens of GB), and keeps the state in fixed buffers (a captured CUDA graph
replays into the same addresses).

With `lanes` > 1 (a CUDA device) the calls go onto that many streams: a call continues the stream
of its latest dependency unless another call already did (then it starts a branch on the stream
that has waited longest), and waits on an event of every other stream whose work it needs (its
`deps`, and the earlier readers of memory it writes in place: `after`). Independent chains of a
decode step, such as the shared expert beside the routed experts, then run side by side, and a
CUDA graph captured from it holds them as parallel branches. A value read on a stream other than
its producer's is kept to the end of the step (the allocator would hand its block back to the
producer's stream while the reader still reads it)."""
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
            if any(not 0 <= d < i for d in c.get("after", ())):
                raise PlanError(f"graph {name}: call {i} ({c['op']}) is ordered after a call that does not precede it")
            made.update(c["outputs"])
        for v in (*self.outputs, *self.state_updates.values()):
            if v not in made:
                raise PlanError(f"graph {name}: {v} is an output but no call makes it")


def schedule_lanes(calls: list[dict], lanes: int) -> tuple[list[int], list[list[int]]]:
    """(stream of each call, the calls each one waits for on other streams): see the module's
    docstring. Waits already implied by an earlier wait on the same stream are left out."""
    lane_of: list[int] = []
    waits: list[list[int]] = []
    tail = [-1] * lanes  # the last call put on each stream
    seen = [[-1] * lanes for _ in range(lanes)]  # seen[a][b]: latest call of stream b stream a waited for
    for i, c in enumerate(calls):
        need = set(c["deps"]) | set(c.get("after", ()))
        lane = 0
        if need:
            lane = lane_of[max(need)]
            if lanes > 1 and tail[lane] != max(need):  # the latest dependency's stream went on with another call
                lane = min((x for x in range(lanes) if x != lane), key=lambda x: tail[x])
        latest: dict[int, int] = {}
        for d in need:
            if lane_of[d] != lane:
                latest[lane_of[d]] = max(latest.get(lane_of[d], -1), d)
        w = sorted(d for other, d in latest.items() if d > seen[lane][other])
        for d in w:
            seen[lane][lane_of[d]] = d
        lane_of.append(lane)
        waits.append(w)
        tail[lane] = i
    return lane_of, waits


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
        self._lanes: dict[tuple[str, int], tuple] = {}
        self._streams: list = []
        self.at: tuple[str, int] | None = None  # (graph, node index) of the call running or last run

    def lanes_of(self, graph: str, lanes: int):
        """(stream per call, waits per call, values kept to the step's end, calls others wait for)
        of a graph on `lanes` streams; None where it runs on one: one asked for, or a plan whose
        calls carry no `after` edges (written before they existed: their in-place order is only
        the call order)."""
        g = self.loaded.graphs[graph]
        if lanes < 2 or any("after" not in c for c in g.calls):
            return None
        key = (graph, lanes)
        if key not in self._lanes:
            lane_of, waits = schedule_lanes(g.calls, lanes)
            made = {o: lane_of[i] for i, c in enumerate(g.calls) for o in c["outputs"]}
            shared = {v for i, c in enumerate(g.calls) for v in c["inputs"] if v in made and made[v] != lane_of[i]}
            self._lanes[key] = (lane_of, waits, shared, {d for w in waits for d in w})
        return self._lanes[key]

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

    def run(self, graph: str, bucket: str | None, inputs: dict, trace: dict | None = None, lanes: int = 1) -> dict:
        """One step; `trace`, when given, receives every value by name (compare with
        `ir.interpret(..., trace=)` on the same inputs to find where a kernel departs); `lanes`:
        streams to spread the calls over (CUDA; one with a trace or a debugging hook)."""
        g = self.loaded.graphs[graph]
        vals = dict(inputs)
        vals.update((p, self.params[p]) for p in g.params)
        vals.update((s, self.state[s]) for s in g.state)
        sched = None
        if self.device.type == "cuda" and trace is None and self.after_call is None:
            sched = self.lanes_of(graph, lanes)
        # references create their index tensors with factory calls: on the plan's device
        with torch.device(self.device):
            if sched is None:
                for i, (fn, ins, outs, dead) in enumerate(self.program(graph, bucket)):
                    self.at = (graph, i)
                    vals.update(zip(outs, as_outputs(fn(*(vals[v] for v in ins)))))
                    if self.after_call:
                        self.after_call(graph, bucket, i)
                    if trace is None:
                        for v in dead:
                            vals.pop(v, None)
            else:
                self._run_lanes(graph, bucket, vals, sched)
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

    def _run_lanes(self, graph: str, bucket: str | None, vals: dict, sched) -> None:
        lane_of, waits, shared, recorded = sched
        main = torch.cuda.current_stream(self.device)
        n = max(lane_of) + 1
        while len(self._streams) < n - 1:
            self._streams.append(torch.cuda.Stream(self.device))
        streams = [main, *self._streams[: n - 1]]
        start = torch.cuda.Event()
        start.record(main)
        for s in streams[1:]:
            s.wait_event(start)
        events: dict[int, torch.cuda.Event] = {}
        for i, (fn, ins, outs, dead) in enumerate(self.program(graph, bucket)):
            self.at = (graph, i)
            s = streams[lane_of[i]]
            for d in waits[i]:
                s.wait_event(events[d])
            with torch.cuda.stream(s):
                vals.update(zip(outs, as_outputs(fn(*(vals[v] for v in ins)))))
            if i in recorded:
                events[i] = torch.cuda.Event()
                events[i].record(s)
            for v in dead:
                if v not in shared:
                    vals.pop(v, None)
        for s in streams[1:]:
            main.wait_stream(s)

