"""The medium plan's logits on fixed inputs, to compare two runtimes (or two plans) on the H200.

    python bench/logits_probe.py PLAN OUT.npy [--compare OTHER.npy] [--calls OUT.json [--compare-calls OTHER.json]]

One prefill step of four seeded prompts (300-1000 tokens) and three decode steps with fixed
tokens (no sampling, so both sides see the same inputs whatever their logits), on a checkpoint
generated on the GPU from a fixed seed. Uses only the executor API every DeepInfer version since
the CUDA executor has, so the same script runs against an older checkout (PYTHONPATH). With
--compare it prints max |diff| relative to max |logit| and the argmax agreement per step; the
last line is a one-line summary. Files are numpy arrays (no pickle).

--calls: the prefill step once more on a fresh executor, with a fingerprint of every call's
outputs (shape, dtype and two position-weighted integer sums of its bytes, on the GPU), written
as JSON in call order; --compare-calls names the first calls whose outputs differ from another
run's, and whether their inputs were equal there, which tells a call that computes differently
from one that was fed differently."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from deepinfer.models.checkpoint import GeneratedCheckpoint
from deepinfer.models.config import load_config
from deepinfer.runtime.batch import SeqChunk
from deepinfer.runtime.cuda_executor import CudaPlanExecutor


def probe(plan: str, seed: int = 0) -> tuple[np.ndarray, dict]:
    cfg = load_config("v4.1-flash-medium")
    t = time.perf_counter()
    ex = CudaPlanExecutor(plan, checkpoint=GeneratedCheckpoint(cfg, seed, device="cuda"), config_hash=cfg.config_hash)
    load_s = time.perf_counter() - t
    g = torch.Generator().manual_seed(seed)
    lens = (300, 500, 700, 1000)
    pages = [list(range(8 * i, 8 * i + 8)) for i in range(len(lens))]
    chunks = [SeqChunk(i, 0, torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist(), pages[i])
              for i, n in enumerate(lens)]
    out = [ex.step(chunks).float().numpy()]
    for _ in range(3):
        chunks = [SeqChunk(c.slot, c.start + len(c.tokens), [int(torch.randint(3, cfg.vocab_size, (1,), generator=g))],
                           c.pages) for c in chunks]
        out.append(ex.step(chunks).float().numpy())
    return np.stack(out), {"load_s": load_s, "graphs": dict(ex.graph_status)}


def _flat(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if hasattr(x, "data") and hasattr(x, "scale"):  # a QTensor of either tree
        return [x.data, x.scale]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _flat(v)]
    return []


def fingerprint(t: torch.Tensor, chunk: int = 1 << 26) -> list:
    """[shape, dtype, sum of words, position-weighted sum of words]: equal tensors give equal
    prints, and a change of any bit changes the weighted sum (up to a 2^-64 collision). Computed
    in chunks of words, since the state pools are several GB."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    words = b.view(torch.int32)
    s1 = s2 = 0
    for lo in range(0, words.numel(), chunk):
        w = words[lo:lo + chunk].to(torch.int64)
        pos = (torch.arange(lo, lo + w.numel(), device=w.device, dtype=torch.int64) * 2654435761) % 4294967291 + 1
        s1 += int(w.sum())
        s2 = (s2 + int((w * pos).sum())) % (1 << 64)
    return [list(t.shape), str(t.dtype), s1, s2]


def call_prints(plan: str, seed: int = 0) -> list:
    """The probe's prefill step on a fresh executor, fingerprinting every call's outputs."""
    from deepinfer.runtime.batch import bucket_inputs
    from deepinfer.runtime.plan_executor import choose_bucket

    cfg = load_config("v4.1-flash-medium")
    ex = CudaPlanExecutor(plan, checkpoint=GeneratedCheckpoint(cfg, seed, device="cuda"), config_hash=cfg.config_hash,
                          cuda_graphs=False)
    rows: list = []
    orig = ex.runner.call_fn

    def wrapped(call, bucket):
        fn = orig(call, bucket)

        def run(*xs):
            ins = [fingerprint(t) for x in xs for t in _flat(x)]
            out = fn(*xs)
            rows.append({"op": call["op"], "out": call["outputs"][0], "template": call["launch"][bucket].get("template"),
                         "kernel": call["launch"][bucket].get("kernel"), "ins": ins,
                         "outs": [fingerprint(t) for t in _flat(out)]})
            return out
        return run
    ex.runner.call_fn = wrapped
    ex.runner._programs.clear()
    g = torch.Generator().manual_seed(seed)
    lens = (300, 500, 700, 1000)
    pages = [list(range(8 * i, 8 * i + 8)) for i in range(len(lens))]
    chunks = [SeqChunk(i, 0, torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist(), pages[i])
              for i, n in enumerate(lens)]
    graph, bucket = choose_bucket(ex.plan, chunks)
    inputs, _ = bucket_inputs(chunks, ex.plan["buckets"][graph][bucket], ex.num_slots, ex.num_pages,
                              cfg.pad_token_id)
    ex.runner.run(graph, bucket, {k: v.to(ex.device) for k, v in inputs.items()})
    torch.cuda.synchronize()
    return rows


def compare_calls(mine: list, other: list, show: int = 12) -> str:
    differ = [i for i, (a, b) in enumerate(zip(mine, other)) if a["outs"] != b["outs"]]
    for i in differ[:show]:
        a, b = mine[i], other[i]
        print(f"call {i} {a['op']} ({a['out']}, {a['template']} {a['kernel']}): outputs differ; inputs "
              f"{'equal' if a['ins'] == b['ins'] else 'differ'}", flush=True)
    if len(mine) != len(other):
        return f"call lists differ in length: {len(mine)} vs {len(other)}"
    if not differ:
        return f"all {len(mine)} calls give bitwise equal outputs"
    first = mine[differ[0]]
    fed = "equal" if first["ins"] == other[differ[0]]["ins"] else "different"
    return (f"{len(differ)} of {len(mine)} calls differ; the first is call {differ[0]} {first['op']} "
            f"({first['template']}) on {fed} inputs")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("plan")
    p.add_argument("out")
    p.add_argument("--compare")
    p.add_argument("--calls", help="also write per-call fingerprints of the prefill step here (JSON)")
    p.add_argument("--compare-calls", help="per-call fingerprints of another run to compare with")
    p.add_argument("--calls-only", action="store_true", help="skip the logits probe")
    a = p.parse_args(argv)
    if a.calls_only:
        logits = None
    else:
        logits, info = probe(a.plan)
    if logits is not None:
        np.save(a.out, logits)
        print(f"probe: {logits.shape} logits, load {info['load_s']:.1f} s, graphs {info['graphs']}", flush=True)
    if a.compare and logits is not None:
        other = np.load(a.compare)
        rows = []
        for s in range(logits.shape[0]):
            x, y = logits[s].astype(np.float64), other[s].astype(np.float64)
            rel = float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30))
            same = int((x.argmax(-1) == y.argmax(-1)).sum())
            rows.append(f"step {s}: max rel diff {rel:.3e}, argmax same {same}/{x.shape[0]}, "
                        f"bitwise equal {bool(np.array_equal(logits[s], other[s]))}")
            print(rows[-1], flush=True)
        print("compare: " + "; ".join(rows))
    if a.calls:
        import json

        prints = call_prints(a.plan)
        with open(a.calls, "w") as f:
            json.dump(prints, f)
        if a.compare_calls:
            with open(a.compare_calls) as f:
                print("calls: " + compare_calls(prints, json.load(f)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
