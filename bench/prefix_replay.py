"""Prefix caching on the tiny model (CPU, graph interpreter): how far bounded SWA replay (spec §7)
moves the logits from exact, and what a page's saved slot state costs.

    PYTHONPATH=... python bench/prefix_replay.py [--out bench/results/prefix_replay_tiny.json]

Each prompt of 300 random tokens (a random checkpoint, seed 0) runs twice through one engine with
prefix caching: the first run misses (its logits are the exact ones, a full prefill) and registers
its pages; the second hits 256 cached tokens. In exact mode the hit restores the slot state saved
with page 1; in bounded mode it recomputes tokens 256 - KEEP .. 255 from a cleared slot (on copies
of the pages they overlap) and then reads the cached pages. For each
mode and KEEP: the largest |logit difference| at the first sampled row and over the decode rows
while both runs' greedy tokens agree, and how many of 32 greedy tokens agree. Also the bytes of one
saved slot state (measured on the tiny model; derived from the state types for the real model)
beside the bytes of a page of compressed KV and index K."""
from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import sys
import time
from pathlib import Path

import torch

from deepinfer.atomic import replace_file
from deepinfer.ir import shapes as sh
from deepinfer.ir.types import QuantType
from deepinfer.llm import LLM
from deepinfer.models.checkpoint import make_checkpoint
from deepinfer.models.config import load_config
from deepinfer.models.deepseek_v41 import PAGE_TOKENS, state_types
from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.runtime.state import saved_bytes, slot_buffers
from deepinfer.version import VERSION

MODEL = "v4.1-flash-tiny"
PROMPT_TOKENS, GEN_TOKENS, PROMPTS = 300, 32, 8


def type_bytes(t, env) -> int:
    parts = (t.data, t.scale) if isinstance(t, QuantType) else (t,)
    n = 0
    for p in parts:
        shape = sh.evaluate(p.storage_shape(), env)
        n += int(torch.tensor(shape).prod()) * torch.empty((), dtype=p.dtype.storage).element_size()
    return n


def state_costs(model: str) -> dict:
    """Bytes of one slot's state (what a page keeps in exact mode) and of one page's compressed KV
    and index K, from the model's state types."""
    types = state_types(load_config(model))
    slots = set(slot_buffers(types))
    env = {"num_slots": 1, "num_pages": 1}
    slot = sum(type_bytes(t, env) for k, t in types.items() if k in slots)
    page = sum(type_bytes(t, env) for k, t in types.items() if k not in slots)
    return {"slot_state_bytes": slot, "paged_kv_bytes_per_page": page, "page_tokens": PAGE_TOKENS}


def recording(engine) -> dict:
    """request id -> the fp32 logits rows the executor returned for it, in order."""
    rows: dict[str, list[torch.Tensor]] = {}
    inner = engine.executor.step

    def step(chunks):
        out = inner(chunks)
        owner = {engine.cache.slot(s.request_id): s.request_id for s in engine.scheduler.running}
        sampled = [c for c in chunks if c.sample]
        for c, row in zip(sampled, out):
            rows.setdefault(owner[c.slot], []).append(row.clone())
        return out

    engine.executor.step = step
    return rows


def run(ckpt, prompts, **prefix) -> dict:
    max_model_len = PROMPT_TOKENS + GEN_TOKENS + 8
    # room for every prompt's cached pages beside the running ones (and bounded replay's copies):
    # no hit is lost to eviction
    pages = 3 * len(prompts) * -(-max_model_len // PAGE_TOKENS)
    llm = LLM(MODEL, ckpt, max_num_seqs=len(prompts), max_model_len=max_model_len, num_pages=pages,
              speculative=0, enable_prefix_caching=True, **prefix)
    rows = recording(llm.engine)
    greedy = SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True)
    outs = {}
    for name in ("miss", "hit"):
        t = time.perf_counter()
        res = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
        outs[name] = {"tokens": [r.token_ids for r in res], "logits": [rows.pop(r.request_id) for r in res],
                      "seconds": time.perf_counter() - t, "prefix": llm.last_run_stats["prefix"]}
    state = next(iter(llm.engine.cache._state.values()), None)
    return outs | {"state_bytes": saved_bytes(state) if state is not None else 0}


def compare(outs: dict) -> dict:
    per = []
    for tm, th, lm, lh in zip(outs["miss"]["tokens"], outs["hit"]["tokens"], outs["miss"]["logits"],
                              outs["hit"]["logits"]):
        agree = next((i for i, (a, b) in enumerate(zip(tm, th)) if a != b), len(tm))
        # row i is the logits after token i-1: equal inputs while the tokens before it agree
        same_input = min(agree + 1, len(lm))
        diffs = [float((a - b).abs().max()) for a, b in zip(lm[:same_input], lh[:same_input])]
        per.append({"first_row_max_abs_diff": diffs[0], "max_abs_diff_while_tokens_agree": max(diffs),
                    "max_abs_logit": float(lm[0].abs().max()), "greedy_tokens_agree": agree,
                    "first_token_agrees": tm[0] == th[0]})
    return {"prompts": per,
            "first_row_max_abs_diff": max(p["first_row_max_abs_diff"] for p in per),
            "max_abs_diff_while_tokens_agree": max(p["max_abs_diff_while_tokens_agree"] for p in per),
            "greedy_tokens_agree_min": min(p["greedy_tokens_agree"] for p in per),
            "greedy_tokens_agree_mean": sum(p["greedy_tokens_agree"] for p in per) / len(per),
            "miss_seconds": outs["miss"]["seconds"], "hit_seconds": outs["hit"]["seconds"],
            "hit": outs["hit"]["prefix"]}


def measure(ckpt: str, prompts: list, prefix: dict) -> tuple[dict, int]:
    torch.set_num_threads(1)
    outs = run(ckpt, prompts, **prefix)
    return compare(outs), outs["state_bytes"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/prefix_replay_tiny.json")
    ap.add_argument("--ckpt", default="/tmp/deepinfer-prefix-bench-ckpt")
    ap.add_argument("--keep", default="22,64,140", help="bounded replay KEEP values")
    ap.add_argument("--jobs", type=int, default=1, help="modes measured at once, one process each")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ckpt = args.ckpt if Path(args.ckpt, "config.json").exists() else make_checkpoint(MODEL, args.ckpt, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 129280, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(PROMPTS)]
    modes = {"exact": {}} | {f"bounded_keep{k}": {"swa_replay": "bounded", "swa_replay_keep": int(k)}
                             for k in args.keep.split(",")}
    report = {"model": MODEL, "checkpoint": "random, seed 0", "prompt_tokens": PROMPT_TOKENS,
              "hit_tokens_per_prompt": PROMPT_TOKENS // PAGE_TOKENS * PAGE_TOKENS, "greedy_tokens": GEN_TOKENS,
              "prompts": PROMPTS, "executor": "graph interpreter (CPU)", "deepinfer": VERSION,
              "torch": torch.__version__, "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "command": " ".join(["python"] + sys.argv),
              "modes": {}, "saved_state": {"tiny": state_costs(MODEL), "real": state_costs("v4.1-flash")}}
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        results = pool.starmap(measure, [(str(ckpt), prompts, prefix) for prefix in modes.values()])
    for name, (m, state_bytes) in zip(modes, results):
        report["modes"][name] = m
        if name == "exact":
            report["saved_state"]["tiny"]["measured_slot_state_bytes"] = state_bytes
        print(f"{name:18s} first-row max |diff| {m['first_row_max_abs_diff']:.3g}  max |diff| while greedy agrees "
              f"{m['max_abs_diff_while_tokens_agree']:.3g}  greedy tokens agreeing of {GEN_TOKENS}: min "
              f"{m['greedy_tokens_agree_min']}, mean {m['greedy_tokens_agree_mean']:.1f}  prefill saved "
              f"{m['hit']['prefill_tokens_saved']} of {m['hit']['query_tokens']} tokens", flush=True)
    for model, c in report["saved_state"].items():
        print(f"{model}: a saved slot state {c['slot_state_bytes']} B, a page of compressed KV + index K "
              f"{c['paged_kv_bytes_per_page']} B ({c['page_tokens']} tokens)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    replace_file(args.out, (json.dumps(report, indent=1) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
