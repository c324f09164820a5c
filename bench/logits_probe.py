"""The medium plan's logits on fixed inputs, to compare two runtimes (or two plans) on the H200.

    python bench/logits_probe.py PLAN OUT.npy [--compare OTHER.npy]

One prefill step of four seeded prompts (300-1000 tokens) and three decode steps with fixed
tokens (no sampling, so both sides see the same inputs whatever their logits), on a checkpoint
generated on the GPU from a fixed seed. Uses only the executor API every DeepInfer version since
the CUDA executor has, so the same script runs against an older checkout (PYTHONPATH). With
--compare it prints max |diff| relative to max |logit| and the argmax agreement per step; the
last line is a one-line summary. Files are numpy arrays (no pickle)."""
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("plan")
    p.add_argument("out")
    p.add_argument("--compare")
    a = p.parse_args(argv)
    logits, info = probe(a.plan)
    np.save(a.out, logits)
    print(f"probe: {logits.shape} logits, load {info['load_s']:.1f} s, graphs {info['graphs']}", flush=True)
    if a.compare:
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
