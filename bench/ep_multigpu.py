"""Expert parallelism on several GPUs (issue #16): one process a GPU under torchrun, or one process
for the single-GPU run of the same model, which is also the greedy tokens' reference. Not a test;
run on a multi-GPU device machine (the CPU path, gloo, is what tests/test_distributed.py runs):

    torchrun --nproc-per-node N bench/ep_multigpu.py --plan PLAN_EP --weights CKPT --out EP.json
    python bench/ep_multigpu.py --plan PLAN --weights CKPT --out ONE.json
    python bench/ep_multigpu.py --compare ONE.json EP.json

Rank 0 (the only one past LLM's constructor: the others serve it there) first generates the check
prompts greedily (their token ids go into the file; --compare says whether two runs agree token
for token), then, per --batches b, b requests for every attention group (dp of them: b a rank
with data-parallel attention), --prompt-len random tokens each (drawn from --skew distinct ids
where given: a skewed mix, most rows routed to the same experts), --tokens greedy tokens each:
the decode's tokens/s after every request has its first token, per GPU, and with --profile the
share of rank 0's device time in NCCL kernels (the exchanges; CUDA only). Where the plan has
several ranks, each batch also records the busiest rank's expert rows over the mean under the
current placement (eplb.imbalance over the load window) and the rebalances so far: EPLB on or
off is DEEPINFER_EPLB_INTERVAL (0 = off) in the environment.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

# NVLink multicast stays off on the lent machines (the device tool's KINDS.md): set before any
# process group exists, whatever the launching environment says
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

import torch  # noqa: E402

CHECK_LEN = 48


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(n: int, length: int, vocab: int, g: torch.Generator, skew: int = 0) -> list[list[int]]:
    """n prompts of `length` token ids in [3, vocab); with `skew`, drawn from that many ids only."""
    if skew:
        pool = torch.randint(3, vocab, (skew,), generator=g)
        return [pool[torch.randint(0, skew, (length,), generator=g)].tolist() for _ in range(n)]
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _imbalance(ex) -> dict:
    """The busiest rank's rows over the mean, summed over every MoE block's load window, under the
    placement now and under the plan's first one; {} on a single-process executor."""
    from deepinfer.ir.ops.expert_parallel import initial_slots
    from deepinfer.runtime.eplb import rank_loads

    load = getattr(ex, "load", None)
    if load is None:
        return {}
    shard, ranks = ex.runner.shard, ex.group.world
    now = first = mean = 0.0
    for prefix, b in shard.blocks.items():
        h = load.history(prefix)
        if not len(h):
            continue
        cur = rank_loads(h, shard.placements[prefix], ranks)
        init = rank_loads(h, initial_slots(b["experts"], b["slots"]), ranks)
        now += float(cur.max(dim=1).values.sum())
        first += float(init.max(dim=1).values.sum())
        mean += float(cur.mean(dim=1).sum())
    if not mean:
        return {}
    return {"imbalance": now / mean, "imbalance_first_placement": first / mean,
            "rebalances": ex.num_rebalances}


def _nccl_share(prof) -> float:
    """NCCL kernels' share of the device time the profile saw (kernels only)."""
    total = nccl = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total += e.device_time
            nccl += e.device_time if "nccl" in e.name.lower() else 0.0
    return nccl / total if total else 0.0


def decode_run(llm, prompts: list[list[int]], tokens: int, profiled: bool) -> dict:
    """The requests through the LLM's engine: the prefills until each has its first token, then
    the decode, timed (and profiled where asked and CUDA is there)."""
    from deepinfer import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    seqs = [s for p in prompts for s in eng.request_samples(eng.add_request(prompt_token_ids=p, params=sp))]
    t0 = time.perf_counter()
    while not all(s.output_token_ids for s in seqs):
        eng.step()
    _sync()
    prefill_s = time.perf_counter() - t0
    steps = 0
    use_prof = profiled and torch.cuda.is_available()
    if use_prof:
        from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) if use_prof else contextlib.nullcontext() as prof:
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        _sync()
        wall = time.perf_counter() - t
    toks = sum(len(s.output_token_ids) for s in seqs) - len(seqs)
    row = {"requests": len(prompts), "prefill_s": prefill_s, "decode_tokens": toks, "steps": steps, "wall_s": wall,
           "tok_per_s": toks / wall if wall else 0.0, "ms_per_step": wall / steps * 1e3 if steps else 0.0}
    if use_prof:
        row["nccl_share"] = _nccl_share(prof)
    return row


def run(args) -> dict | None:
    from deepinfer import LLM, SamplingParams

    llm = LLM(plan=args.plan, weights=args.weights, speculative=0, seed=0)  # ranks > 0 serve rank 0 in here
    ex = llm.engine.executor
    world = getattr(getattr(ex, "group", None), "world", 1)
    groups = getattr(ex, "groups", 1)
    vocab = llm.engine.executor.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    check = _prompts(args.check_prompts, CHECK_LEN, vocab, g)
    outs = llm.generate([{"prompt_token_ids": p} for p in check],
                        SamplingParams(temperature=0, max_tokens=args.check_tokens, ignore_eos=True), use_tqdm=False)
    res = {"plan": os.path.abspath(args.plan), "world_size": world, "attention_groups": groups,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "eplb_interval": int(os.environ.get("DEEPINFER_EPLB_INTERVAL", "0") or 0), "skew": args.skew,
           "tokens": [o.token_ids for o in outs], "batches": []}
    for b in args.batches:
        prompts = _prompts(b * groups, args.prompt_len, vocab, g, args.skew)
        row = dict(decode_run(llm, prompts, args.tokens, args.profile), per_rank=b)
        row["tok_per_s_per_gpu"] = row["tok_per_s"] / world
        row.update(_imbalance(ex))
        res["batches"].append(row)
        print(f"b{b} a rank x {groups} group(s): {row['decode_tokens']} decode tokens, {row['ms_per_step']:.2f} ms "
              f"a step, {row['tok_per_s_per_gpu']:.1f} tok/s per GPU"
              + (f", NCCL {row['nccl_share']:.1%} of the device time" if "nccl_share" in row else "")
              + (f", busiest rank {row['imbalance']:.2f}x the mean" if "imbalance" in row else ""), flush=True)
    return res


def compare(a: str, b: str) -> int:
    ra, rb = (json.load(open(p)) for p in (a, b))
    same = sum(x == y for x, y in zip(ra["tokens"], rb["tokens"]))
    n = max(len(ra["tokens"]), len(rb["tokens"]))
    print(f"greedy tokens: {same} of {n} prompts equal ({ra['world_size']} vs {rb['world_size']} processes)")
    return 0 if same == n else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan")
    p.add_argument("--weights")
    p.add_argument("--out", help="rank 0's results as JSON")
    p.add_argument("--batches", default="64,256", help="requests a rank's attention group runs at once (comma list)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens a request")
    p.add_argument("--skew", type=int, default=0, help="prompts drawn from this many token ids (0: the vocabulary)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-prompts", type=int, default=8, help=f"prompts of {CHECK_LEN} tokens whose greedy tokens "
                   "are kept for --compare")
    p.add_argument("--check-tokens", type=int, default=16, help="greedy tokens of each check prompt")
    p.add_argument("--profile", action="store_true", help="NCCL's share of rank 0's device time (CUDA)")
    p.add_argument("--compare", nargs=2, metavar="JSON", help="whether two runs' greedy tokens agree")
    a = p.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    if not (a.plan and a.weights):
        p.error("--plan and --weights are needed (or --compare A.json B.json)")
    a.batches = [int(v) for v in a.batches.split(",")]
    res = run(a)
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
