"""End to end on the H200: a medium sm90 plan at every bucket it holds (compile it with
`--decode-batches 1,8,32,64,128 --prefill-tokens 4096,16384`), each decode step against its byte
floor and each prefill step against the fp8 peak, both ceilings measured in the same run. Not a
test; run on the device machine (the checkpoint is generated on the GPU):

    python bench/e2e_medium.py --plan PLAN [--out bench/results/e2e_medium.json]

Decode byte floor (issue #19): the weights a step must read once, attention + router and shared
experts + LM head, plus the routed experts times the share a batch of b rows hits under uniform
routing, 1 - (1 - k/E)^b; at the copy ceiling. Model-bandwidth utilisation is that floor over the
step time; model-FLOP utilisation is the activated FLOPs (modelled: runtime_sm90.prefill_tflop for
prefill, 2 x activated parameters per row for decode) over the step time and the fp8 peak.
Through the engine (`--engine-batches`): b requests of 128 prompt tokens, 64 greedy tokens each,
through LLMEngine on the same executor (the loop LLM.generate runs; the medium checkpoint is
generated on the GPU, so no LLM object can load it from disk): decode tokens/s after every prompt
has its first token, and the device's idle share of that time (1 - the union of the device
events' intervals over the wall, from a second, profiled run).
`bench/plot_performance.py` draws the step times against the floors from this file.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ceilings import measure_ceilings  # noqa: E402
from runtime_sm90 import (_loaded, plan_config, result_header, run_parts, time_decode,  # noqa: E402
                          time_prefill)

from deepinfer.models.sizes import model_sizes  # noqa: E402
from deepinfer.runtime.plan_file import load_plan  # noqa: E402


def decode_floor_bytes(cfg, rows: int) -> float:
    """Bytes a decode step of `rows` rows must read once (module docstring)."""
    s = model_sizes(cfg)
    share = 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** rows
    head = cfg.vocab_size * cfg.hidden_size * 2  # bf16
    return s["bytes_attention"] + s["bytes_router_shared"] + head + s["bytes_routed_experts"] * share


def plan_buckets(plan: dict) -> tuple[list[int], list[int]]:
    """(prefill token counts, decode batch sizes) of the plan's step buckets."""
    pre = sorted(int(k.removeprefix("prefill_t")) for k in plan["buckets"].get("step", {}) if k.startswith("prefill_t"))
    dec = sorted(int(k.removeprefix("decode_b")) for k in plan["buckets"].get("step_decode", {})
                 if k.startswith("decode_b"))
    return pre, dec


def engine_decode(ex, cfg, b: int, g: torch.Generator, prompt_len: int = 128, tokens: int = 64,
                  early: bool = False) -> dict:
    """Decode through the engine (module docstring): tokens/s and the device's idle share. `early`:
    with the executor's early-submitted steps (`feed_steps`), else without them, whatever the
    executor's default; the row keeps the tokens so that the caller can compare them with the
    plain engine's."""
    from runtime_sm90 import _trace_events, exposed_time
    from torch.profiler import ProfilerActivity, profile

    from deepinfer.models.tokenizer import Tokenizer
    from deepinfer.runtime.engine import LLMEngine
    from deepinfer.runtime.sampling_params import SamplingParams

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [torch.randint(3, cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(b)]

    def run(profiled: bool):
        prev, ex.feed_steps = getattr(ex, "feed_steps", False), early
        try:
            return engine_run(profiled)
        finally:
            ex.feed_steps = prev

    def engine_run(profiled: bool):
        eng = LLMEngine(ex, Tokenizer(), max_num_seqs=b, max_num_batched_tokens=4096,
                        max_model_len=ex.plan["options"]["max_model_len"], seed=0, speculative=0)
        seqs = [s for p in prompts for s in eng.request_samples(eng.add_request(prompt_token_ids=p, params=sp))]
        steps = 0
        while not all(s.output_token_ids for s in seqs):  # the prefills: until every request has a token
            eng.step()
        sync()
        acts = [ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]
        with profile(activities=acts) if profiled else contextlib.nullcontext() as prof:
            t = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
                steps += 1
            sync()
            wall = time.perf_counter() - t
        return wall, steps, sum(len(s.output_token_ids) for s in seqs) - b, prof, [s.output_token_ids for s in seqs]

    wall, steps, toks, _, ids = run(False)
    pwall, _, _, prof, _ = run(True)
    busy = exposed_time(_trace_events(prof), 1, 0)["busy_us"] * 1e-6
    row = {"requests": b, "decode_tokens": toks, "steps": steps, "wall_s": wall, "tok_per_s": toks / wall,
           "ms_per_step": wall / steps * 1e3, "profiled_wall_s": pwall, "gpu_busy_s": busy,
           "idle_share": 1 - busy / pwall, "early_submit": early, "token_ids": ids}
    print(f"engine b{b}{' early' if early else ''}: {toks} decode tokens in {steps} steps, {wall * 1e3 / steps:.2f} ms a step, "
          f"{toks / wall:.0f} tok/s; device idle {row['idle_share']:.1%} of the profiled run", flush=True)
    return row


def e2e(plan_dir: str, seed: int = 0, engine_batches: tuple[int, ...] = (), engine_early: bool = False) -> dict:
    import triton

    cfg = plan_config(plan_dir)
    plan = load_plan(plan_dir)
    prefills, batches = plan_buckets(plan)
    ceil = measure_ceilings(lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    print("ceilings: copy %.2f TB/s, bf16 %.0f TFLOP/s, fp8 %.0f TFLOP/s" % (
        ceil["copy_bytes_per_s"] / 1e12, ceil["bf16_flops"] / 1e12, ceil["fp8_flops"] / 1e12), flush=True)
    torch.cuda.empty_cache()
    out = {"ceilings": ceil, "model": plan["model"]["id"]}
    ex = _loaded(plan_dir, seed, out)
    g = torch.Generator().manual_seed(seed)
    for t in prefills:
        row = time_prefill(ex, cfg, t, g, plan["options"]["page_tokens"])
        row["mfu_fp8"] = row["tflop_per_s"] * 1e12 / ceil["fp8_flops"]
        out[f"prefill_{t}"] = row
    out["prefill_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    act = 2 * model_sizes(cfg)["params_activated"]
    for b in batches:
        pages = min(9, plan["options"]["num_pages"] // b)
        row = time_decode(ex, cfg, b, g, pages, plan["options"]["page_tokens"])
        fb = decode_floor_bytes(cfg, b)
        wall = row["graph"]["wall_ms"] * 1e-3
        row.update(floor_bytes=fb, floor_ms=fb / ceil["copy_bytes_per_s"] * 1e3,
                   x_floor=wall / (fb / ceil["copy_bytes_per_s"]), mbu=fb / wall / ceil["copy_bytes_per_s"],
                   mfu_fp8=act * b / wall / ceil["fp8_flops"], tok_per_s=b / wall)
        if "greedy_wall_ms" in row["graph"]:  # a greedy batch's step: argmax ids back, not logits
            row["x_floor_greedy"] = row["graph"]["greedy_wall_ms"] * 1e-3 / (fb / ceil["copy_bytes_per_s"])
        out[f"decode_b{b}"] = row
    out["graphs"] = ex.graph_status
    for b in engine_batches:
        state = g.get_state()  # the early run decodes the same prompts
        out[f"engine_b{b}"] = engine_decode(ex, cfg, b, g)
        if engine_early:
            g.set_state(state)
            row = out[f"engine_early_b{b}"] = engine_decode(ex, cfg, b, g, early=True)
            row["tokens_equal"] = row["token_ids"] == out[f"engine_b{b}"]["token_ids"]
            print(f"engine b{b} early: tokens equal to the plain engine's: {row['tokens_equal']}", flush=True)
    return out


def table(m: dict) -> str:
    lines = [f"{'step':<14}{'time':>12}{'floor':>10}{'x floor':>9}{'MBU':>7}{'MFU fp8':>9}{'tok/s':>10}"
             f"{'greedy':>12}{'x floor':>9}"]
    for k, v in m.items():
        if k.startswith("prefill_") and isinstance(v, dict):
            lines.append(f"{k:<14}{v['wall_s'] * 1e3:>9.1f} ms{'-':>10}{'-':>9}{'-':>7}{v['mfu_fp8']:>9.3f}"
                         f"{v['tok_per_s']:>10.0f}")
        elif k.startswith("decode_b") and isinstance(v, dict):
            greedy = (f"{v['graph']['greedy_wall_ms']:>9.2f} ms{v['x_floor_greedy']:>9.2f}"
                      if "x_floor_greedy" in v else "")
            lines.append(f"{k:<14}{v['graph']['wall_ms']:>9.2f} ms{v['floor_ms']:>7.2f} ms{v['x_floor']:>9.2f}"
                         f"{v['mbu']:>7.3f}{v['mfu_fp8']:>9.4f}{v['tok_per_s']:>10.0f}{greedy}")
        elif k.startswith("engine_") and isinstance(v, dict):
            same = "" if "tokens_equal" not in v else f", tokens equal: {v['tokens_equal']}"
            lines.append(f"{k:<14}{v['ms_per_step']:>9.2f} ms{'-':>10}{'-':>9}{'-':>7}{'-':>9}{v['tok_per_s']:>10.0f}"
                         f"   idle {v['idle_share']:.1%}{same}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True)
    p.add_argument("--engine-batches", default="", help="comma list: decode through the engine at these batches")
    p.add_argument("--engine-early", action="store_true",
                   help="also decode through the engine with early-submitted steps (DEEPINFER_EARLY_SUBMIT)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "e2e_medium.json"))
    a = p.parse_args(argv)
    res = result_header()
    eb = tuple(int(x) for x in a.engine_batches.split(",") if x)
    run_parts((("medium", lambda pl: e2e(pl, engine_batches=eb, engine_early=a.engine_early), a.plan),), res, a.out)
    if "ceilings" in res.get("medium", {}):
        print(table(res["medium"]))
    return 0 if "error" not in res.get("medium", {}) else 1


if __name__ == "__main__":
    sys.exit(main())
