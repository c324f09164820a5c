"""Speculative decoding on a compiled plan: decode tokens/s per sequence and per GPU at batches 1,
8, 64 with speculation off, with every draft verified, and with the verify budget chosen per step
from the plan's measured step-time curve (confidence scheduling, spec §5.6).

    python bench/speculative_sm90.py --plan PLAN [--batches 1,8,64] [--p 0.75]
    python bench/speculative_sm90.py --plan TINY_CPU_PLAN --device cpu --batches 1,2   # smoke test

The checkpoint is generated (random weights: the medium model's would not fit the disk), and a
random draft head is almost never right, so the speculative modes run the engine's
fixed-acceptance benchmark mode: each draft is accepted with probability p from a seeded stream
(DeepSeek's chart assumes p = 0.75), and the drafts' confidence rates are p, p^2, ... (what that
mode gives them). The tokens are then not the model's distribution; the step costs are the real
ones: verify buckets, drafts, rollback, sampling.

Warm-up first: the executor captures and times every decode and verify bucket the batches use
(the curve: CudaPlanExecutor.warm_up; on the cpu, the same timing of the padded plan's buckets),
then per batch and mode the prompts are prefilled and a few decode steps run before the timed
ones. Needs a plan compiled with verify buckets for the batches (`deepinfer compile
--verify-batches 1,8,64`, ragged ones like 64x128 too) and a pool holding every batch's sequences
at prompt length plus the generated tokens. Prints a table last; writes JSON to --out (default
$OUT/speculative_sm90.json, else bench/results/speculative_sm90.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from deepinfer.models.checkpoint import GeneratedCheckpoint
from deepinfer.models.tokenizer import Tokenizer
from deepinfer.runtime.engine import LLMEngine
from deepinfer.runtime.plan_executor import PlanExecutor, time_step_buckets, verify_seqs
from deepinfer.runtime.plan_file import load_plan
from deepinfer.runtime.sampling_params import SamplingParams

from runtime_sm90 import gpu_executor, plan_config

MODES = ("off", "all", "confidence")
# per device: prompt tokens, timed decode steps, warm-up decode steps, timed runs per curve point
DEFAULTS = {"cuda": (512, 32, 4, 5), "cpu": (48, 3, 1, 1)}


def cpu_pages(plan: dict, a, max_len: int) -> int:
    """The cpu executor's pool: every sequence of the largest batch at max_len tokens."""
    return -(-max_len // plan["options"]["page_tokens"]) * max(a.batches)


def load_executor(a, cfg, plan: dict, max_len: int):
    """The plan with a generated checkpoint and its step-time curve measured (the warm-up)."""
    if a.device == "cuda":
        ex = gpu_executor(a.plan, a.seed)
        ex.warm_up(max(a.batches), a.reps)
    else:
        # padded to the plan's buckets as a device executor runs them, so steps use its verify buckets
        ex = PlanExecutor(a.plan, checkpoint=GeneratedCheckpoint(cfg, a.seed), config_hash=cfg.config_hash,
                          num_slots=max(a.batches), num_pages=cpu_pages(plan, a, max_len), pad_to_buckets=True)
        ex.step_time_curve = time_step_buckets(ex, max(a.batches), a.reps)
    return ex


def check_fits(plan: dict, a, max_len: int) -> None:
    """Before anything loads: every batch verifies in a verify bucket and runs without preemption."""
    opts, wanted = plan["options"], ",".join(map(str, a.batches))
    if max_len > opts["max_model_len"]:
        sys.exit(f"speculative_sm90: prompt {a.prompt_len} + {max_len - a.prompt_len} generated tokens exceed the "
                 f"plan's max_model_len {opts['max_model_len']}; use a smaller --prompt-len or --steps")
    if not opts.get("verify_drafts"):
        sys.exit(f"speculative_sm90: plan {a.plan} has no verify buckets; compile it with --verify-batches {wanted}")
    pages = opts["num_pages"] - 1 if a.device == "cuda" else cpu_pages(plan, a, max_len)  # (cuda: less the scratch)
    for b in a.batches:
        if b > min(verify_seqs(plan), opts["max_num_seqs"]):
            sys.exit(f"speculative_sm90: batch {b} exceeds the plan's largest verify bucket ({verify_seqs(plan)} "
                     f"sequences) or its max_num_seqs {opts['max_num_seqs']}; compile with --verify-batches {wanted}")
        need = b * -(-max_len // opts["page_tokens"])
        if need > pages:
            sys.exit(f"speculative_sm90: batch {b} at {max_len} tokens needs {need} pages, the plan's pool has "
                     f"{pages}; use a smaller --prompt-len or --steps")


def run_mode(ex, tok, a, mode: str, b: int, prompts, block: int, max_len: int) -> dict:
    """Prefill b prompts, warm up, then time a.steps decode steps of one engine."""
    spec = {"off": {"speculative": 0},
            # an explicit budget of every row: the curve is not consulted
            "all": {"speculative": block, "fixed_acceptance": a.p, "verify_budget": b * (1 + block)},
            "confidence": {"speculative": block, "fixed_acceptance": a.p}}[mode]
    # prefill chunks up to the largest step bucket (a verify step's rows are far fewer)
    largest = max(e["num_tokens"] for e in ex.plan["buckets"]["step"].values())
    engine = LLMEngine(ex, tok, max_num_seqs=b, max_num_batched_tokens=largest, max_model_len=max_len, seed=a.seed,
                       **spec)
    params = SamplingParams(temperature=0, max_tokens=max_len - a.prompt_len, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts[:b]]
    seqs = engine.scheduler.running
    while engine.scheduler.waiting or any(not s.output_token_ids for s in seqs):
        engine.step()
    seqs = list(seqs)
    for _ in range(a.warmup):
        engine.step()
    before, preempted = engine.spec_stats.copy(), engine.scheduler.num_preemptions
    # (with overlap each sequence holds one placeholder at both counts: they cancel)
    tokens = sum(len(s.output_token_ids) for s in seqs)
    t = time.perf_counter()
    for _ in range(a.steps):
        engine.step()
    if a.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    tokens = sum(len(s.output_token_ids) for s in seqs) - tokens
    if engine.scheduler.num_preemptions != preempted or len(engine.scheduler.running) != b:
        raise RuntimeError(f"batch {b} {mode}: a sequence was preempted or finished while timed")
    st = engine.spec_stats.since(before).summary()
    for rid in ids:  # the next engine takes the slots and pages; a step still in flight lands first
        engine.abort_request(rid)
    engine.step()
    return {"batch": b, "mode": mode, "steps": a.steps, "seconds": seconds, "tokens": tokens,
            "step_ms": seconds / a.steps * 1e3, "tok_per_s": tokens / seconds, "tok_per_s_per_seq": tokens / seconds / b,
            "mean_accepted_length": st["mean_accepted_length"], "acceptance_rate": st["acceptance_rate"],
            "verify_rows_per_step": st["verify_rows_per_step"], "draft_time_share": st["draft_time_share"],
            "overlap": engine.overlap}


def table(rows: list[dict]) -> str:
    head = (f"{'batch':>5} {'mode':<10} {'tok/s/seq':>10} {'tok/s/dev':>10} {'step ms':>9} {'accepted':>9} "
            f"{'rows/step':>9} {'draft':>6}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['batch']:>5} {r['mode']:<10} {r['tok_per_s_per_seq']:>10.1f} {r['tok_per_s']:>10.1f} "
                     f"{r['step_ms']:>9.2f} {r['mean_accepted_length']:>9.2f} {r['verify_rows_per_step']:>9.1f} "
                     f"{r['draft_time_share']:>6.0%}")
    return "\n".join(lines)


def batches(text: str) -> list[int]:
    try:
        vals = sorted({int(v) for v in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from None
    if min(vals) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return vals


def probability(text: str) -> float:
    p = float(text)
    if not 0 <= p <= 1:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1], got {text!r}")
    return p


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", required=True, help="a compiled plan with verify buckets for the batches")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a cpu plan, padded to its "
                   "buckets (a smoke test)")
    p.add_argument("--batches", type=batches, default=[1, 8, 64])
    p.add_argument("--p", type=probability, default=0.75, help="fixed acceptance probability of each draft")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--prompt-len", type=int, help="prompt tokens per sequence (default 512; 48 on the cpu)")
    p.add_argument("--steps", type=int, help="timed decode steps per batch and mode (default 32; 3 on the cpu)")
    p.add_argument("--warmup", type=int, help="decode steps before the timed ones (default 4; 1 on the cpu)")
    p.add_argument("--reps", type=int, help="timed runs per bucket of the step-time curve (default 5; 1 on the cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON results (default $OUT/speculative_sm90.json, else bench/results/)")
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes takes a comma-separated subset of {', '.join(MODES)}, got {a.modes!r}")
    for name, default in zip(("prompt_len", "steps", "warmup", "reps"), DEFAULTS[a.device]):
        if getattr(a, name) is None:
            setattr(a, name, default)
        if getattr(a, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU is visible (--device cpu runs a cpu plan)")
    if a.device == "cpu":
        torch.set_num_threads(1)  # a tiny plan's ops gain nothing from intra-op threads, and spinning ones cost
    out = Path(a.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results")
               / "speculative_sm90.json")

    plan, cfg = load_plan(a.plan), plan_config(a.plan)
    block = cfg.dspark_block_size
    # every timed step may emit 1 + block tokens per sequence; none finishes while timed
    max_len = a.prompt_len + (a.warmup + a.steps + 2) * (1 + block)
    check_fits(plan, a, max_len)
    t = time.perf_counter()
    ex = load_executor(a, cfg, plan, max_len)
    load_s = time.perf_counter() - t
    curve = [{"bucket": b, "seqs": s, "rows": r, "ms": sec * 1e3} for b, s, r, sec in ex.step_time_curve]
    print(f"loaded and warmed up in {load_s:.1f} s; step-time curve: "
          + ", ".join(f"{c['bucket']} {c['ms']:.2f} ms" for c in curve), flush=True)
    gen = torch.Generator().manual_seed(a.seed)
    prompts = [torch.randint(3, cfg.vocab_size, (a.prompt_len,), generator=gen).tolist() for _ in range(max(a.batches))]
    tok = Tokenizer()
    res = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "plan": str(a.plan), "model": cfg.model_id, "p": a.p,
           "drafts": block, "prompt_len": a.prompt_len, "load_s": load_s, "curve": curve,
           "graphs": getattr(ex, "graph_status", {}), "rows": [], "errors": []}
    out.parent.mkdir(parents=True, exist_ok=True)
    for b in a.batches:
        for mode in modes:
            try:
                row = run_mode(ex, tok, a, mode, b, prompts, block, max_len)
            except Exception:  # noqa: BLE001  (report it and go on to the next mode, as runtime_sm90 does)
                res["errors"].append({"batch": b, "mode": mode, "error": traceback.format_exc()[-3000:]})
                print(res["errors"][-1]["error"], flush=True)
                out.write_text(json.dumps(res, indent=1))
                continue
            res["rows"].append(row)
            print(f"b{b} {mode}: {row['tok_per_s_per_seq']:.1f} tok/s per sequence, {row['tok_per_s']:.1f} tok/s, "
                  f"{row['step_ms']:.2f} ms/step, accepted length {row['mean_accepted_length']:.2f}, "
                  f"{row['verify_rows_per_step']:.1f} verify rows/step, draft {row['draft_time_share']:.0%}",
                  flush=True)
            out.write_text(json.dumps(res, indent=1))
    print(f"\n{res['model']} on {res['device']}: fixed acceptance p = {a.p}, {block} drafts, prompts of "
          f"{a.prompt_len} tokens, {a.steps} timed steps\n" + table(res["rows"]))
    for e in res["errors"]:
        print(f"b{e['batch']} {e['mode']} failed: {e['error'].strip().splitlines()[-1]}")
    print(f"wrote {out}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
