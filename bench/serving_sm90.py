"""Two serving features on the medium plan on the H200 (issue #13): batch invariance and the prefix
cache's prefill savings, through the engine (LLMEngine over CudaPlanExecutor, a checkpoint
generated on the GPU).

    python bench/serving_sm90.py [--invariant-plan BI_PLAN] [--plan PLAN] [--out results.json]

Batch invariance (`--invariant-plan`, a plan compiled with --batch-invariant; `--plan` too, to show
what the default plan does in the same run): one request (a 1500-token prompt, 24 greedy tokens
with the top-5 logprobs of each) runs alone with 4096-token steps, inside a batch of 32 requests,
and alone with its prompt in 512-token chunks. Invariance means the three give the same tokens
and bit-identical logprobs.

Prefix cache (`--plan`): 16 requests share a 3072-token prefix, each with its own 128-token tail,
8 greedy tokens each; the first runs alone, then the other 15 together (a shared system prompt
already served once); with and without the cache (exact mode). Reported: the hit rate, the
prefill tokens saved, the wall time of the whole batch either way, and whether the hits gave the
misses' tokens. Prints a short table last.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from deepinfer.models.tokenizer import Tokenizer
from deepinfer.runtime.engine import LLMEngine
from deepinfer.runtime.sampling_params import SamplingParams

from runtime_sm90 import gpu_executor, plan_config, result_header, run_parts

SMOKE = os.environ.get("BENCH_SMOKE_CPU") == "1"  # a tiny cpu plan, shorter prompts: the script's own check
SCALE = 8 if SMOKE else 1


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free():
    """After a part, its executor's 100 GB go before the next loads (a traceback that held it is
    a reference cycle: collected here, not whenever)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def executor(plan: str, seed: int):
    if not SMOKE:
        return gpu_executor(plan, seed)
    from deepinfer.models.checkpoint import GeneratedCheckpoint
    from deepinfer.runtime.plan_executor import PlanExecutor

    cfg = plan_config(plan)
    return PlanExecutor(plan, checkpoint=GeneratedCheckpoint(cfg, seed), config_hash=cfg.config_hash, num_slots=33,
                        num_pages=33 * 3)


def run(ex, requests, max_num_batched_tokens=4096, phases=1, **engine_kw):
    """Each request (prompt ids, SamplingParams) through a fresh engine on `ex`; the outputs in
    request order, the wall time and the engine's stats. `phases` 2: the first request runs to
    its end before the others are added (a prefix it shares with them is then cached)."""
    eng = LLMEngine(ex, Tokenizer(), max_num_seqs=min(64, ex.num_slots), max_num_batched_tokens=max_num_batched_tokens,
                    max_model_len=ex.plan["options"]["max_model_len"], seed=0, **engine_kw)
    done, ids = {}, []
    _sync()
    t = time.perf_counter()
    for part in ([requests[:1], requests[1:]] if phases == 2 else [requests]):
        ids += [eng.add_request(prompt_token_ids=p, params=sp) for p, sp in part]
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
    _sync()
    return [done[i] for i in ids], time.perf_counter() - t, eng.stats()


def _logprobs(out):
    return [sorted((k, v.logprob) for k, v in d.items()) for d in out.outputs[0].logprobs]


def batch_invariance(plan: str, seed: int = 0) -> dict:
    ex = executor(plan, seed)
    vocab = ex.vocab_size
    g = torch.Generator().manual_seed(seed)
    sp = SamplingParams(temperature=0, max_tokens=6 if SMOKE else 24, logprobs=5, ignore_eos=True)
    target = torch.randint(3, vocab, (1500 // SCALE,), generator=g).tolist()
    others = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
              for n in torch.randint(100 // SCALE, 2000 // SCALE, (31,), generator=g)]
    cases = {
        "alone_4096": run(ex, [(target, sp)], 4096),
        "batch32_4096": run(ex, [(p, sp) for p in others[:15]] + [(target, sp)] + [(p, sp) for p in others[15:]], 4096),
        "alone_chunks512": run(ex, [(target, sp)], 512 // SCALE),
    }
    outs = {k: v[0][15 if k.startswith("batch") else 0] for k, v in cases.items()}
    ref = outs["alone_4096"]
    res = {"plan_batch_invariant": bool(ex.plan["options"].get("batch_invariant")), "cases": {}}
    for k, o in outs.items():
        same_tokens = o.outputs[0].token_ids == ref.outputs[0].token_ids
        lp, lr = _logprobs(o), _logprobs(ref)
        diffs = [abs(a[1] - b[1]) for x, y in zip(lp, lr) for a, b in zip(x, y) if a[0] == b[0]]
        res["cases"][k] = {"tokens_identical": same_tokens, "logprobs_identical": lp == lr,
                           "first_token_difference": next((i for i, (a, b) in enumerate(
                               zip(o.outputs[0].token_ids, ref.outputs[0].token_ids)) if a != b), None),
                           "max_logprob_diff": max(diffs) if diffs else None, "wall_s": cases[k][1]}
        print(f"{'invariant' if res['plan_batch_invariant'] else 'default'} plan, {k}: tokens identical "
              f"{same_tokens}, logprobs identical {lp == lr}, max |dlogprob| {res['cases'][k]['max_logprob_diff']}",
              flush=True)
    return res


def prefix_cache(plan: str, seed: int = 0, n: int = 16, prefix_len: int = 384 if SMOKE else 3072,
                 tail: int = 128 // SCALE) -> dict:
    ex = executor(plan, seed)
    g = torch.Generator().manual_seed(seed + 1)
    shared = torch.randint(3, ex.vocab_size, (prefix_len,), generator=g).tolist()
    reqs = [(shared + torch.randint(3, ex.vocab_size, (tail,), generator=g).tolist(),
             SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for _ in range(n)]
    run(ex, reqs[:2], 4096)  # warm-up: every kernel the two runs use is loaded
    res = {"requests": n, "prefix_tokens": prefix_len, "tail_tokens": tail}
    tokens = {}
    for on in (False, True):
        outs, wall, stats = run(ex, reqs, 4096, phases=2, enable_prefix_caching=on)
        key = "cache" if on else "no_cache"
        tokens[key] = [o.outputs[0].token_ids for o in outs]
        res[key] = {"wall_s": wall, "steps": stats["steps"], **({"prefix": stats["prefix"]} if on else {})}
        print(f"prefix cache {'on' if on else 'off'}: {wall:.2f} s for {n} requests, {stats['steps']} steps"
              + (f", {stats['prefix']}" if on else ""), flush=True)
    res["tokens_identical"] = tokens["cache"] == tokens["no_cache"]
    res["speed_up"] = res["no_cache"]["wall_s"] / res["cache"]["wall_s"]
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--invariant-plan", help="a medium plan compiled with --batch-invariant")
    p.add_argument("--plan", help="the default medium plan (prefix cache; batch invariance for comparison)")
    p.add_argument("--parts", default="invariance,prefix", help="comma list of: invariance, prefix")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "serving_sm90.json"))
    a = p.parse_args(argv)
    want = set(a.parts.split(","))
    res = result_header()
    parts = [("invariance_invariant_plan", batch_invariance, a.invariant_plan),
             ("invariance_default_plan", batch_invariance, a.plan), ("prefix_cache", prefix_cache, a.plan)]
    run_parts([p for p in parts if p[0].split("_")[0] in want], res, a.out, after=_free)
    print(f"{'check':<44} {'tokens same':>11} {'logprobs same':>13}")
    for name in ("invariance_invariant_plan", "invariance_default_plan"):
        for k, c in res.get(name, {}).get("cases", {}).items():
            print(f"{name[11:] + ' ' + k:<44} {str(c['tokens_identical']):>11} {str(c['logprobs_identical']):>13}")
    pc = res.get("prefix_cache", {})
    if "cache" in pc:
        print(f"prefix cache: hit rate {pc['cache']['prefix']['hit_rate']:.3f}, "
              f"{pc['cache']['prefix']['prefill_tokens_saved']} prefill tokens saved, {pc['speed_up']:.2f}x faster, "
              f"tokens identical {pc['tokens_identical']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
