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
its producer's is freed only once its producer's stream has waited for those readers
(`cross_stream_frees`): the allocator hands a freed block back to the stream that allocated it,
which must not reuse it while another stream still reads it."""
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


def cross_stream_frees(calls: list[dict], lane_of: list[int], waits: list[list[int]],
                       keep: set[str]) -> tuple[dict[str, int], set[str]]:
    """For values read on a stream other than the one that made them: (value -> the call after
    which it may be freed: the first call of its producer's stream, at or after its last reader
    there, by which that stream has waited for its last reader on every other stream; values with
    no such call, or whose memory other values share (views, in-place writes), are kept to the
    step's end: the second set). Values in `keep` are never freed."""
    lanes = max(lane_of) + 1
    seen = [[-1] * lanes for _ in range(lanes)]
    seen_after = []  # per call: what its stream has waited for of every stream, after it
    for i, w in enumerate(waits):
        for d in w:
            seen[lane_of[i]][lane_of[d]] = max(seen[lane_of[i]][lane_of[d]], d)
        seen_after.append(list(seen[lane_of[i]]))
    aliased = {v for c in calls if c["kernel"] == "view" or c.get("after") for v in (*c["inputs"], *c["outputs"])}
    made = {o: i for i, c in enumerate(calls) for o in c["outputs"]}
    readers: dict[str, list[int]] = {}
    for i, c in enumerate(calls):
        for v in c["inputs"]:
            readers.setdefault(v, []).append(i)
    on_lane = [[i for i, x in enumerate(lane_of) if x == lane] for lane in range(lanes)]
    free_at, kept = {}, set()
    for v, p in made.items():
        own = lane_of[p]
        other: dict[int, int] = {}
        for r in readers.get(v, ()):
            if lane_of[r] != own:
                other[lane_of[r]] = max(other.get(lane_of[r], -1), r)
        if not other or v in keep:
            continue
        if v in aliased:
            kept.add(v)
            continue
        last_own = max([r for r in readers[v] if lane_of[r] == own] + [p])
        j = next((j for j in on_lane[own] if j >= last_own and all(seen_after[j][x] >= r for x, r in other.items())),
                 None)
        if j is None:
            kept.add(v)
        else:
            free_at[v] = j
    return free_at, kept


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
        """(stream per call, waits per call, values read across streams (their frees are the next
        item's), the cross-stream values each call frees, the calls others wait for with their
        events) of a graph on `lanes` streams; None where it runs on one: one asked for, or a plan
        whose calls carry no `after` edges (written before they existed: their in-place order is
        only the call order)."""
        g = self.loaded.graphs[graph]
        if lanes < 2 or any("after" not in c for c in g.calls):
            return None
        key = (graph, lanes)
        if key not in self._lanes:
            lane_of, waits = schedule_lanes(g.calls, lanes)
            keep = set(g.outputs) | set(g.params) | set(g.state) | set(g.state_updates.values())
            free_at, kept = cross_stream_frees(g.calls, lane_of, waits, keep)
            frees: list[list[str]] = [[] for _ in g.calls]
            for v, j in free_at.items():
                frees[j].append(v)
            # events made once and recorded again each step (fewer host calls in eager steps)
            events = {d: torch.cuda.Event() for w in waits for d in w}
            self._lanes[key] = (lane_of, waits, kept | set(free_at), frees, events)
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
        lane_of, waits, crossing, frees, events = sched
        main = torch.cuda.current_stream(self.device)
        n = max(lane_of) + 1
        while len(self._streams) < n - 1:
            self._streams.append(torch.cuda.Stream(self.device))
        streams = [main, *self._streams[: n - 1]]
        start = torch.cuda.Event()
        start.record(main)
        for s in streams[1:]:
            s.wait_event(start)
        try:
            for i, (fn, ins, outs, dead) in enumerate(self.program(graph, bucket)):
                self.at = (graph, i)
                s = streams[lane_of[i]]
                for d in waits[i]:
                    s.wait_event(events[d])
                with torch.cuda.stream(s):
                    vals.update(zip(outs, as_outputs(fn(*(vals[v] for v in ins)))))
                if i in events:
                    events[i].record(s)
                for v in dead:
                    if v not in crossing:
                        vals.pop(v, None)
                for v in frees[i]:
                    vals.pop(v, None)
        finally:
            # joined even when a call fails: a capture must end with every stream it forked joined
            for s in streams[1:]:
                main.wait_stream(s)

