"""Compiled sm90 plans on the H200: the tiny plan teacher-forced against the CPU reference, and the
medium plan's step times with a checkpoint generated on the GPU.

    python bench/runtime_sm90.py --tiny-plan PLAN --medium-plan PLAN [--out results.json]

Tiny: the reference (the graph interpreter on the CPU, which equals tests/reference/) greedily
continues four prompts; the GPU plan runs the same steps fed the reference's tokens. Per step:
max and mean relative error of the logits, and whether the top-1 token agrees wherever the
reference's top-1 margin exceeds the row's error. Medium: prefill tokens/s of one 4K-token step
and decode step times at batch 1, 8, 64 (positions ~1K), with CUDA graphs and without; the
device's idle time per step is wall time minus the time the GPU spent on the step.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback

import torch

from deepinfer.codegen.library.triton_check import judge
from deepinfer.ir.quant import QTensor
from deepinfer.models.checkpoint import GeneratedCheckpoint
from deepinfer.models.config import load_config
from deepinfer.models.deepseek_v41 import build_model, load_params
from deepinfer.runtime.batch import SeqChunk
from deepinfer.runtime.cuda_executor import CudaPlanExecutor
from deepinfer.runtime.executor import InterpreterExecutor


def plan_config(plan: str):
    """The model config a plan was compiled for (its config.json as the plan records it)."""
    from deepinfer.models.config import config_from_dict
    from deepinfer.runtime.plan_file import load_plan

    model = load_plan(plan)["model"]
    return config_from_dict(model["config"], model_id=model["id"])


def gpu_executor(plan: str, seed: int = 0, **kwargs) -> CudaPlanExecutor:
    """The plan on the GPU with a checkpoint of its model generated there (the medium model's
    would not fit the disk)."""
    cfg = plan_config(plan)
    return CudaPlanExecutor(plan, checkpoint=GeneratedCheckpoint(cfg, seed, device="cuda"),
                            config_hash=cfg.config_hash, **kwargs)


def tiny(plan: str, steps: int = 40, seed: int = 11) -> dict:
    cfg = load_config("v4.1-flash-tiny")
    program = build_model(cfg)
    torch.manual_seed(seed)
    ref = InterpreterExecutor(program, load_params(program, GeneratedCheckpoint(cfg, seed)), num_slots=4, num_pages=8)
    t = time.perf_counter()
    gpu = CudaPlanExecutor(plan, checkpoint=GeneratedCheckpoint(cfg, seed), config_hash=cfg.config_hash)
    load_s = time.perf_counter() - t
    lens = (37, 90, 150, 200)
    prompts = [torch.randint(3, cfg.vocab_size, (n,)).tolist() for n in lens]
    pages = [[2 * i, 2 * i + 1] for i in range(4)]
    chunks = [SeqChunk(i, 0, p, pages[i]) for i, p in enumerate(prompts)]
    rows = []
    agree = checked = 0
    for s in range(steps):
        r = ref.step(chunks).double()
        g = gpu.step(chunks).double()
        err = (g - r).abs()
        row_err = err.amax(-1)
        top2 = r.topk(2, -1)
        margin = top2.values[:, 0] - top2.values[:, 1]
        same = g.argmax(-1) == top2.indices[:, 0]
        decisive = margin > 2 * row_err
        checked += int(decisive.sum())
        agree += int((same & decisive).sum())
        rows.append({"step": s, "rows": sum(len(c.tokens) for c in chunks),
                     "max_rel": float(err.max() / r.abs().max()), "mean_rel": float(err.mean() / r.abs().mean()),
                     "top1_same": int(same.sum()), "decisive": int(decisive.sum()),
                     "decisive_disagree": int((decisive & ~same).sum())})
        nxt = top2.indices[:, 0].tolist()  # teacher forcing: the reference's tokens
        chunks = [SeqChunk(c.slot, c.start + len(c.tokens), [t], c.pages) for c, t in zip(chunks, nxt)]
    return {"load_s": load_s, "steps": rows, "max_rel": max(x["max_rel"] for x in rows),
            "mean_rel": sum(x["mean_rel"] for x in rows) / len(rows), "decisive_rows": checked,
            "decisive_agree": agree, "graphs": gpu.graph_status}


def _cpu(v):
    if isinstance(v, QTensor):
        return QTensor(v.data.cpu().clone(), v.scale.cpu().clone())
    return v.cpu().clone() if isinstance(v, torch.Tensor) else v


def local_check(plan: str, seed: int = 11, preset: str = "v4.1-flash-tiny", ref_device: str = "cpu",
                lens=(37, 90, 150, 200), only: frozenset | None = None, check_prefill: bool = True) -> dict:
    """Every call of a plan on the GPU against its op's reference fed the GPU's own inputs (a copy
    taken before the call): errors stay local to the call instead of compounding through the
    layers. One prefill step and one decode step. The tiny plan's references run on the CPU; the
    medium plan's on the GPU (`ref_device`), whose references are the torch_device calls' own.
    `only`: check the calls of these templates (the others run unchecked: the medium plan's
    every call takes minutes of host-side comparisons); `check_prefill` False: the prefill step
    runs unchecked and only the decode step's calls are compared."""
    from deepinfer.ir.registry import get_op
    from deepinfer.runtime.batch import bucket_inputs
    from deepinfer.runtime.plan_executor import choose_bucket

    cfg = load_config(preset) if preset else plan_config(plan)
    ckpt = GeneratedCheckpoint(cfg, seed, device="cuda" if ref_device == "cuda" else "cpu")
    gpu = CudaPlanExecutor(plan, checkpoint=ckpt, config_hash=cfg.config_hash, cuda_graphs=False)
    torch.manual_seed(seed)
    per_seq = -(-max(lens) // 128) + 1
    chunks = [SeqChunk(i, 0, torch.randint(3, cfg.vocab_size, (n,)).tolist(), list(range(per_seq * i, per_seq * (i + 1))))
              for i, n in enumerate(lens)]
    to_ref = _cpu if ref_device == "cpu" else _clone_dev
    per_template: dict = {}
    failures = []
    t0 = time.perf_counter()
    for step in range(2):
        graph, bucket = choose_bucket(gpu.plan, chunks)
        inputs, _ = bucket_inputs(chunks, gpu.plan["buckets"][graph][bucket], gpu.num_slots, gpu.num_pages,
                                  cfg.pad_token_id)
        g = gpu.loaded.graphs[graph]
        vals = {k: v.cuda() for k, v in inputs.items()}
        vals.update((p, gpu.params[p]) for p in g.params)
        vals.update((s, gpu.state[s]) for s in g.state)
        for call, (fn, ins, outs, dead) in zip(g.calls, gpu.runner.program(graph, bucket)):
            tmpl = call["launch"][bucket].get("template") or "view"
            xs = [vals[i] for i in ins]
            checked = (only is None or tmpl in only) and (check_prefill or step > 0)
            xs_ref = [to_ref(x) for x in xs] if checked else None
            with torch.device(gpu.device):
                res = fn(*xs)
            res = res if isinstance(res, tuple) and not isinstance(res, QTensor) else (res,)
            if not checked:
                vals.update(zip(outs, res))
                for v in dead:
                    if v != g.outputs[0]:
                        vals.pop(v, None)
                continue
            op = get_op(call["op"])
            with torch.device(ref_device):
                ref = op.ref(*xs_ref, **op.check_attrs(call["attrs"]))
            if ref_device == "cpu":
                ref = tuple(_cpu(r) for r in ref) if isinstance(ref, tuple) and not isinstance(ref, QTensor) else _cpu(ref)
            ok, what = judge(call["op"], tmpl, res if len(res) > 1 else res[0], ref, [_cpu(x) for x in xs_ref[:3]],
                             op.check_attrs(call["attrs"]))
            row = per_template.setdefault(tmpl, {"calls": 0, "pass": 0, "worst": ""})
            row["calls"] += 1
            done = sum(r["calls"] for r in per_template.values())
            if done % 20 == 0:  # a medium prefill's checks take minutes: show they progress
                print(f"  {done} calls checked, {len(failures)} failed, {time.perf_counter() - t0:.0f} s", flush=True)
            row["pass"] += ok
            if not ok:
                failures.append({"step": bucket, "node": call["outputs"][0], "template": tmpl, "why": what})
                row["worst"] = what
            elif "max rel" in what:
                prev = float(row["worst"].split()[-1]) if row["worst"].startswith("max rel") else -1
                if float(what.split()[-1]) > prev:
                    row["worst"] = what
            vals.update(zip(outs, res))
            del xs_ref, ref
            for v in dead:
                if v != g.outputs[0]:
                    vals.pop(v, None)
        print(f"step {step} ({bucket}): checked {sum(r['calls'] for r in per_template.values())} calls so far, "
              f"{len(failures)} failed", flush=True)
        logits = vals[g.outputs[0]][: len(chunks)]
        chunks = [SeqChunk(c.slot, c.start + len(c.tokens), [int(t)], c.pages)
                  for c, t in zip(chunks, logits.argmax(-1).tolist())]
    for f in failures[:30]:
        print("FAIL", f, flush=True)
    for t, r in sorted(per_template.items()):
        print(f"{t:40s} {r['pass']:4d}/{r['calls']:<4d} {r['worst']}", flush=True)
    return {"preset": preset, "ref_device": ref_device, "per_template": per_template, "failures": failures[:200]}


def _clone_dev(v):
    if isinstance(v, QTensor):
        return QTensor(v.data.clone(), v.scale.clone())
    return v.clone() if isinstance(v, torch.Tensor) else v


def noise_floor(steps: int = 40, seed: int = 11, share: float = 0.01) -> dict:
    """How far the tiny model's logits move when the reference itself is nudged by one bf16 ulp in
    `share` of the embedding table's values (the size of difference fp32-accumulating kernels
    make at a rounding boundary), teacher-forced over the same steps as `tiny`. CPU only."""
    cfg = load_config("v4.1-flash-tiny")
    program = build_model(cfg)
    params = load_params(program, GeneratedCheckpoint(cfg, seed))
    nudged = dict(params)
    e = params["embed.weight"]
    g = torch.Generator().manual_seed(seed)
    pick = torch.rand(e.shape, generator=g) < share
    # one ulp away from zero: the next bf16 bit pattern up in magnitude
    nudged["embed.weight"] = (e.view(torch.int16) + pick.to(torch.int16)).view(torch.bfloat16)
    a = InterpreterExecutor(program, params, num_slots=4, num_pages=8)
    b = InterpreterExecutor(program, nudged, num_slots=4, num_pages=8)
    torch.manual_seed(seed)
    prompts = [torch.randint(3, cfg.vocab_size, (n,)).tolist() for n in (37, 90, 150, 200)]
    chunks = [SeqChunk(i, 0, p, [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]
    rows = []
    for s in range(steps):
        r, x = a.step(chunks).double(), b.step(chunks).double()
        err = (x - r).abs()
        rows.append({"max_rel": float(err.max() / r.abs().max()), "mean_rel": float(err.mean() / r.abs().mean()),
                     "top1_same": int((x.argmax(-1) == r.argmax(-1)).sum())})
        chunks = [SeqChunk(c.slot, c.start + len(c.tokens), [t], c.pages) for c, t in zip(chunks, r.argmax(-1).tolist())]
    out = {"share": share, "max_rel": max(r["max_rel"] for r in rows),
           "mean_rel": sum(r["mean_rel"] for r in rows) / steps,
           "top1_same": sum(r["top1_same"] for r in rows), "rows": 4 * steps}
    print(f"noise floor (1 bf16 ulp on {share:.0%} of the embedding): max rel {out['max_rel']:.2e}, mean rel "
          f"{out['mean_rel']:.2e}, top-1 same on {out['top1_same']}/{out['rows']} rows", flush=True)
    return out


def _timed(ex, chunks, reps, argmax: bool = False):
    """(wall s, device s) per step, median of reps; `argmax`: the step of an all-greedy batch (the
    rows' argmax ids come back, not their logits: LLMEngine._argmax_only)."""
    walls, devs = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        ex.step(chunks, argmax=True) if argmax else ex.step(chunks)  # ends on the host: a sync
        b.record()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
        devs.append(a.elapsed_time(b) / 1e3)
    walls.sort()
    devs.sort()
    return walls[len(walls) // 2], devs[len(devs) // 2]


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _trace_events(prof) -> list:
    """The profiler trace's device events (kernels, copies, fills)."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    return [ev for ev in trace.get("traceEvents", []) if ev.get("cat") in GPU_CATS and "dur" in ev]


def exposed_time(events: list, steps: int, top: int) -> dict:
    """Where the wall goes when kernels overlap (programmatic dependent launch starts a kernel
    while its predecessor runs; two streams run side by side): events in order of their start,
    each charged with the part of its interval past the latest end before it. The charges add up
    to the union of the intervals (the GPU's busy time); a kernel that waited on its predecessor
    is charged only from that predecessor's end, its share of the critical path, and one hidden
    under another's interval is charged nothing. Per (kernel, grid), per step, in microseconds;
    `kernel_sum_us` is the plain sum of durations, which overlap. `gaps`: the idle intervals inside
    a step (no event running), each charged to the pair (the event whose end opened it -> the one
    that closed it); a gap after a device-to-host copy (a step's logits) is the host's, between
    steps, and not counted."""
    from collections import defaultdict

    def key(ev):
        grid = ev.get("args", {}).get("grid")
        return f"{ev['name'][:60]} grid={grid}" if grid is not None else ev["name"][:60]

    acc = defaultdict(lambda: [0.0, 0.0, 0])
    gaps = defaultdict(lambda: [0.0, 0])
    frontier, last = float("-inf"), None  # the latest end, and the event it belongs to
    for ev in sorted(events, key=lambda e: e["ts"]):
        end = ev["ts"] + ev["dur"]
        if last is not None and ev["ts"] > frontier and "DtoH" not in last["name"] and "Device -> " not in last["name"]:
            g = gaps[f"{key(last)} -> {key(ev)}"]
            g[0] += ev["ts"] - frontier
            g[1] += 1
        add = max(0.0, end - max(frontier, ev["ts"]))
        if end > frontier:
            frontier, last = end, ev
        a = acc[key(ev)]
        a[0] += add
        a[1] += ev["dur"]
        a[2] += 1
    busy = sum(v[0] for v in acc.values())
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])[:top]
    return {"busy_us": busy / steps, "kernel_sum_us": sum(v[1] for v in acc.values()) / steps,
            "top": [{"name": k, "exposed_us": v[0] / steps, "sum_us": v[1] / steps, "calls": v[2] / steps}
                    for k, v in rows],
            "gap_us": sum(v[0] for v in gaps.values()) / steps,
            "gaps": [{"pair": k, "gap_us": v[0] / steps, "count": v[1] / steps}
                     for k, v in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]]}


def _busy(ex, chunks, reps, top: int = 0):
    """GPU busy time per step (the union of the device events' intervals: the rest of the wall is
    idle) and, with `top`, the events with the most exposed time (exposed_time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            ex.step(chunks)
        torch.cuda.synchronize()
    return exposed_time(_trace_events(prof), reps, top)


class _PageableLogits:
    """The step result as it was before pinned copies (BENCH_PAGEABLE_LOGITS=1): a device copy of
    the logits, then a blocking copy into pageable host memory when asked for. For the same-run
    comparison only."""

    def __init__(self, logits):
        self.logits = logits.to(torch.float32, copy=True)

    def result(self):
        return self.logits.cpu()


def prefill_tflop(cfg, tokens: int) -> float:
    """Activated TFLOP of a `tokens`-token prefill (modelled, per token and layer): the attention
    projections, the routed and shared experts and the router, attention over index_topk +
    window keys (QK and PV), the mHC mixes, and the index layers' query projection and scores over
    the step's mean causal length at ratio 4; the LM head of the last row. Against the fp8 peak it
    gives the prefill's model-FLOP utilisation (issue #19's prefill aim)."""
    h, heads, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    f, k = cfg.moe_intermediate_size, cfg.num_experts_per_tok
    proj = (h * cfg.q_lora_rank + cfg.q_lora_rank * heads * d + h * d
            + heads * d * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * h)
    experts = (k + cfg.n_shared_experts) * 3 * h * f + h * cfg.n_routed_experts
    attn = heads * d * (cfg.index_topk + cfg.sliding_window) * 2
    mix = cfg.hc_mult * h * (2 * cfg.hc_mult + cfg.hc_mult ** 2)
    index = (cfg.q_lora_rank + tokens // 8) * cfg.index_n_heads * cfg.index_head_dim
    macs = (proj + experts + attn + mix) * cfg.num_hidden_layers * tokens
    macs += index * len(cfg.index_source_layer_ids) * tokens + h * cfg.vocab_size
    return 2 * macs / 1e12


def time_prefill(ex, cfg, tokens: int, g: torch.Generator, page_tokens: int = 128) -> dict:
    """One prompt of `tokens` random tokens prefilled in one step (warmed up once, then timed)."""
    prompt = torch.randint(3, cfg.vocab_size, (tokens,), generator=g).tolist()
    pre = [SeqChunk(0, 0, prompt, list(range(-(-tokens // page_tokens))))]
    ex.step(pre)
    w, d = _timed(ex, pre, 1)
    tf = prefill_tflop(cfg, tokens)
    print(f"prefill {tokens}: {w * 1e3:.1f} ms wall, {tokens / w:.0f} tok/s, {tf / w:.0f} TFLOP/s on {tf:.1f} "
          "activated TFLOP (modelled)", flush=True)
    return {"wall_s": w, "device_s": d, "tok_per_s": tokens / w, "activated_tflop": tf, "tflop_per_s": tf / w}


def prefill_lengths(plan: dict) -> list[int]:
    """The prompt lengths a medium run times: one filling each prefill bucket of the plan (a prompt
    that fills a bucket exactly needs no padding sequence), so a plan built with short buckets
    (bench/variant_plan.sh's VARIANT_BUCKETS) shows what a config does to short prefills too."""
    kinds = plan["bucket_kinds"]
    return sorted(e["num_tokens"] for b, e in plan["buckets"]["step"].items() if kinds.get(b, "prefill") == "prefill")


def time_decode(ex, cfg, b: int, g: torch.Generator, pages: int = 9, page_tokens: int = 128) -> dict:
    """A decode step of b sequences at position (pages - 1) * page_tokens (1024 with the default 9
    pages), with CUDA graphs (and eagerly unless BENCH_GRAPH_ONLY): wall, device and GPU-busy time,
    the logits' digest and argmax."""
    pos = (pages - 1) * page_tokens
    chunks = [SeqChunk(i, pos, [int(torch.randint(3, cfg.vocab_size, (1,), generator=g))],
                       list(range(pages * i, pages * i + pages))) for i in range(b)]
    row = {"position": pos}
    for mode, reps in (("graph", 10), ("eager", 5))[: 1 if os.environ.get("BENCH_GRAPH_ONLY") else 2]:
        ex.cuda_graphs = mode == "graph"
        ex.step(chunks)  # capture / warm-up
        w, d = _timed(ex, chunks, reps)
        # before the profiled steps: torch ops run slower in a process after a profiler session
        greedy = _timed(ex, chunks, reps, argmax=True)[0] if getattr(ex, "argmax_steps", False) else None
        ex_t = _busy(ex, chunks, 3, top=int(os.environ.get("BENCH_EXPOSED_TOP", "0")) if mode == "graph" else 0)
        busy = ex_t["busy_us"] / 1e6
        row[mode] = {"wall_ms": w * 1e3, "device_ms": d * 1e3, "gpu_busy_ms": busy * 1e3,
                     "idle_ms": (w - busy) * 1e3, "kernel_sum_ms": ex_t["kernel_sum_us"] / 1e3}
        if greedy is not None:
            row[mode]["greedy_wall_ms"] = greedy * 1e3
        if ex_t["top"]:
            row[mode]["exposed_top"] = ex_t["top"]
        greedy = f", {row[mode]['greedy_wall_ms']:.2f} ms greedy" if "greedy_wall_ms" in row[mode] else ""
        print(f"decode b{b} {mode}: {w * 1e3:.2f} ms wall{greedy}, GPU busy {busy * 1e3:.2f} ms "
              f"({ex.graph_status.get(f'decode_b{b}', '')[:120]})", flush=True)
        for r in ex_t["top"]:
            print(f"  {r['exposed_us']:8.1f} us exposed {r['sum_us']:8.1f} us summed {r['calls']:5.0f}x  {r['name']}",
                  flush=True)
        if ex_t["top"]:
            row[mode]["gap_us"], row[mode]["gaps"] = ex_t["gap_us"], ex_t["gaps"]
            print(f"  idle inside the step: {ex_t['gap_us']:.1f} us", flush=True)
            for r in ex_t["gaps"]:
                print(f"  {r['gap_us']:8.1f} us idle {r['count']:5.0f}x  {r['pair'][:150]}", flush=True)
    # what the step computed: equal digests mean bit-equal logits (the same plan launched two
    # ways, e.g. DEEPINFER_PDL=0 against PDL), the argmax what another plan should agree with
    lg = ex.step(chunks).float()
    row["logits_sha256"] = hashlib.sha256(lg.contiguous().numpy().tobytes()).hexdigest()[:16]
    row["argmax"] = lg.argmax(-1).tolist()
    return row


def _loaded(plan: str, seed: int, out: dict):
    t = time.perf_counter()
    ex = gpu_executor(plan, seed)
    torch.cuda.synchronize()
    out["load_s"] = time.perf_counter() - t
    out["gpu_mem_gb"] = torch.cuda.memory_allocated() / 1e9
    print(f"medium loaded in {out['load_s']:.1f} s, {out['gpu_mem_gb']:.1f} GB on the GPU", flush=True)
    return ex


def medium(plan: str, seed: int = 0) -> dict:
    cfg = plan_config(plan)
    out = {}
    if os.environ.get("BENCH_PAGEABLE_LOGITS") == "1":
        from deepinfer.runtime import cuda_executor

        cuda_executor._Pending = _PageableLogits
        out["logits_copy"] = "pageable"
    ex = _loaded(plan, seed, out)
    g = torch.Generator().manual_seed(seed)
    for tokens in prefill_lengths(ex.plan):
        out[f"prefill_{tokens}"] = time_prefill(ex, cfg, tokens, g)
    out["prefill_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    for b in (1, 8, 64):
        out[f"decode_b{b}"] = time_decode(ex, cfg, b, g)
    out["graphs"] = ex.graph_status
    return out


def medium_profile(plan: str, seed: int = 0, top: int = 12) -> dict:
    """Where a medium step's GPU time goes: the kernels (and torch-reference ops) with the most GPU
    time in a 4096-token prefill and at decode batch 1, 8 and 64, from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    ex = gpu_executor(plan, seed, cuda_graphs=False)
    out = {}
    prompt = torch.randint(3, plan_config(plan).vocab_size, (4096,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    steps = {"prefill_4096": ([SeqChunk(0, 0, prompt, list(range(32)))], 1)}
    for b in (1, 8, 64):
        steps[f"decode_b{b}"] = ([SeqChunk(i, 1024, [5 + i], list(range(9 * i, 9 * i + 9))) for i in range(b)], 3)
    for name, (chunks, n) in steps.items():
        ex.step(chunks)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                ex.step(chunks)
            torch.cuda.synchronize()
        rows = sorted((e for e in prof.key_averages() if e.device_type.name == "CUDA"),
                      key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in rows) / n
        out[name] = {"gpu_ms": total / 1e3, "top": [
            {"name": e.key[:90], "ms_per_step": e.device_time_total / n / 1e3, "calls_per_step": e.count / n}
            for e in rows[:top]], "by_launch": _by_launch(prof, n, 3 * top)}
        print(f"{name}: GPU {total / 1e3:.1f} ms per step", flush=True)
        for r in out[name]["top"]:
            print(f"  {r['ms_per_step']:8.2f} ms  {r['calls_per_step']:6.0f}x  {r['name']}", flush=True)
    return out


def _by_launch(prof, steps: int, top: int) -> list:
    """GPU time per (kernel, grid): one kernel name serves calls of many shapes (every block
    linear is block_linear_mx_kernel), and the grid tells them apart. From the profiler's trace."""
    from collections import defaultdict

    acc = defaultdict(lambda: [0.0, 0])
    for ev in _trace_events(prof):
        if ev.get("cat") != "kernel":
            continue
        key = f"{ev['name'][:60]} grid={ev.get('args', {}).get('grid')}"
        acc[key][0] += ev.get("dur", 0.0)
        acc[key][1] += 1
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": k, "us_per_call": v[0] / v[1], "ms_per_step": v[0] / steps / 1e3, "calls_per_step": v[1] / steps}
            for k, v in rows]


def result_header() -> dict:
    """What every bench result file starts with: the GPU, torch, the date."""
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}


def run_parts(parts, res: dict, out: str, after=None) -> None:
    """Each (name, fn, plan) with a plan: res[name] = fn(plan), or the traceback's tail where it
    raised (the run goes on to the next part); `after()` once each part is done; the results file
    rewritten after every part, so a call cut short keeps what finished."""
    for name, fn, plan in parts:
        if not plan:
            continue
        try:
            res[name] = fn(plan)
        except Exception:  # noqa: BLE001  (report and go on to the next part)
            res[name] = {"error": traceback.format_exc()[-3000:]}
            print(res[name]["error"], flush=True)
        if after is not None:
            after()
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny-plan")
    p.add_argument("--medium-plan")
    p.add_argument("--profile", action="store_true", help="only: the medium plan's prefill and decode GPU time by kernel")
    p.add_argument("--noise-floor", action="store_true", help="only: the CPU reference against itself nudged by 1 ulp")
    p.add_argument("--divergence", action="store_true", help="only: every call of the tiny plan against its reference on the GPU's own inputs")
    p.add_argument("--divergence-medium", action="store_true",
                   help="only: every call of the medium plan against its reference (on the GPU) on the GPU's own inputs")
    p.add_argument("--decode-only", action="store_true", help="--divergence-medium: check the decode step only")
    p.add_argument("--only-templates", help="--divergence-medium: check these templates' calls only (comma list)")
    p.add_argument("--check-lens", default="300,500,700,1000",
                   help="--divergence-medium: the prompts' lengths (more than 8 take the 64-row decode bucket)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "runtime_sm90.json"))
    a = p.parse_args(argv)
    res = result_header()
    parts = (("tiny", tiny, a.tiny_plan), ("medium", medium, a.medium_plan))
    if a.profile:
        parts = (("medium_profile", medium_profile, a.medium_plan),)
    elif a.noise_floor:
        parts = (("noise_floor", lambda _: noise_floor(), "cpu"),)
    elif a.divergence_medium:
        only = frozenset(a.only_templates.split(",")) if a.only_templates else None
        lens = tuple(int(x) for x in a.check_lens.split(","))
        parts = (("local_medium", lambda pl: local_check(pl, 0, None, "cuda", lens,
                                                         only, not a.decode_only), a.medium_plan),)
    elif a.divergence:
        parts = (("local", local_check, a.tiny_plan),) + parts
    run_parts(parts, res, a.out)
    t = res.get("tiny", {})
    if "steps" in t:
        print(f"tiny: max rel {t['max_rel']:.2e} mean rel {t['mean_rel']:.2e}; top-1 agrees on "
              f"{t['decisive_agree']}/{t['decisive_rows']} decisive rows; graphs {t['graphs']}")
    m = res.get("medium", {})
    if "decode_b1" in m:
        print("medium: " + "; ".join(f"prefill {k[8:]} {v['tok_per_s']:.0f} tok/s" for k, v in m.items()
                                     if k.startswith("prefill_") and isinstance(v, dict)) + "; " + "; ".join(
            f"b{b} " + ", ".join(f"{mode} {r['wall_ms']:.2f} ms" for mode, r in m[f"decode_b{b}"].items()
                                 if isinstance(r, dict))
            for b in (1, 8, 64) if f"decode_b{b}" in m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
