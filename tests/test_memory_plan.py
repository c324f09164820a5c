"""The arena plan of every bucket of the tiny model (cpu and sm90 graphs, after their pipelines,
with the driver's buckets and pool) is sound: buffers whose lifetimes overlap never share bytes,
each buffer holds its value, starts on an ALIGN boundary and lies below the peak. Kernels are
neither rendered nor built; the plan needs only the final graphs."""
from functools import lru_cache

import pytest

from deepinfer.ir import shapes as sh
from deepinfer.ir.registry import get_op
from deepinfer.models.deepseek_v41 import PAGE_TOKENS, build_model
from deepinfer.passes.driver import CompileOptions, load_time_nodes, run_pipeline
from deepinfer.passes.kernels import VIEW_OPS
from deepinfer.passes.memory import ALIGN, plan_memory
from deepinfer.passes.pipelines import decode_pipeline_differs
from deepinfer.passes.shapes import default_buckets


@lru_cache(maxsize=None)
def bucket_graphs(target: str):
    """[(graph name, bucket, graph, env, resident)] as compile_model plans them."""
    opts = CompileOptions(target, max_model_len=1024)
    prog = build_model("v4.1-flash-tiny")
    split = decode_pipeline_differs(target)
    graphs = {"step": run_pipeline(prog.step, target), "draft": run_pipeline(prog.draft, target)}
    if split:
        graphs["step_decode"] = run_pipeline(prog.step, target, variant="decode")
    max_pages = -(-opts.max_model_len // PAGE_TOKENS)
    decode = (1, 8, 64)
    buckets = default_buckets(opts.max_num_seqs, decode=decode, prefill=(512, 2048))
    pool = opts.pool(max_pages)
    envs = {"step": {b.name: b.env(max_pages) | pool for b in buckets if not (split and b.kind == "decode")},
            "step_decode": {b.name: b.env(max_pages) | pool for b in buckets if b.kind == "decode"},
            "draft": {f"draft_b{b}": {"num_seqs": b, "max_pages": max_pages} | pool for b in decode}}
    out = []
    for name, g in graphs.items():
        resident = {o for i in load_time_nodes(g) for o in g.nodes[i].outputs}
        out += [(name, b, g, env, resident) for b, env in envs[name].items()]
    return out


def value_bytes(t, env) -> int:
    """Bytes of a value's storage (data and scale), unpadded."""
    total = 0
    for p in ((t.data, t.scale) if hasattr(t, "scale") else (t,)):
        n = 1
        for d in sh.evaluate(p.storage_shape(), env):
            n *= d
        total += n * p.dtype.storage.itemsize
    return total


def lifetimes(g, resident) -> dict[str, tuple[int, int]]:
    """Arena value -> [definition, last use of it or of any view / in-place alias of it]."""
    root: dict[str, str] = {}
    for n in g.nodes:
        pairs = [(0, 0)] if n.op in VIEW_OPS else []
        for o, i in (*pairs, *get_op(n.op).inplace.items()):
            root[n.outputs[o]] = root.get(n.inputs[i], n.inputs[i])
    live = g.liveness()
    made = g.producers()
    span = {v: list(live[v]) for v in live if v in made and v not in root and v not in resident}
    for v, (_, last) in live.items():
        r = root.get(v, v)
        if r in span:
            span[r][1] = max(span[r][1], last)
    return {v: tuple(s) for v, s in span.items()}


def plan_problems(g, env, resident, planner=plan_memory) -> list[str]:
    plan = planner(g, env, resident)
    bufs, peak = plan["buffers"], plan["peak_bytes"]
    span = lifetimes(g, resident)
    bad = [f"%{v} has no buffer" for v in span if v not in bufs]
    for v, (off, size) in bufs.items():
        if size < value_bytes(g.types[v], env):
            bad.append(f"%{v}: {size} bytes for a {value_bytes(g.types[v], env)}-byte value")
        if off % ALIGN:
            bad.append(f"%{v}: offset {off} is not {ALIGN}-aligned")
        if off + size > peak:
            bad.append(f"%{v}: ends at {off + size}, past the peak {peak}")
    # sweep in offset order: any two buffers that overlap in bytes must not be alive together
    items = sorted((off, off + size, v) for v, (off, size) in bufs.items() if v in span and size)
    for k, (lo, hi, v) in enumerate(items):
        for lo2, hi2, w in items[k + 1:]:
            if lo2 >= hi:
                break
            (a, b), (c, d) = span[v], span[w]
            if a <= d and c <= b:
                bad.append(f"%{v} [{lo}, {hi}) and %{w} [{lo2}, {hi2}) overlap while both are alive")
    return bad


@pytest.mark.parametrize("target", ["cpu", "sm90"])
def test_live_buffers_never_overlap(target):
    cases = bucket_graphs(target)
    assert {c[0] for c in cases} >= {"step", "draft"} and len(cases) >= 6
    for name, bucket, g, env, resident in cases:
        problems = plan_problems(g, env, resident)
        assert not problems, f"{target} {name} {bucket}: " + "; ".join(problems[:5])


def test_the_check_catches_a_planner_that_stacks_everything_at_zero():
    def at_zero(g, env, resident):
        plan = plan_memory(g, env, resident)
        return plan | {"buffers": {v: [0, size] for v, (_, size) in plan["buffers"].items()}}

    _, _, g, env, resident = bucket_graphs("cpu")[0]
    problems = plan_problems(g, env, resident, planner=at_zero)
    assert any("overlap while both are alive" in p for p in problems)
