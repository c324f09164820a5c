"""Is a medium plan's decode step deterministic? The same step (runtime_sm90.medium's chunks:
`--batch` sequences at 1025 tokens, after its 4096-token prefill) run `--repeats` times eagerly
and from a CUDA graph, with PDL and with plain launches; prints the logits digest of every run
and, for runs that differ from the first, the rows that differ and by how much. Not a test; run
on the H200:

    python bench/decode_repeat.py PLAN [--batch 64] [--repeats 4]
"""
import argparse
import hashlib
import sys

import torch

from deepinfer.runtime.batch import SeqChunk
from deepinfer.runtime.cuda_driver import pdl_launches

from runtime_sm90 import gpu_executor, plan_config


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    cfg = plan_config(a.plan)
    ex = gpu_executor(a.plan, 0)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size, (4096,), generator=g).tolist()
    ex.step([SeqChunk(0, 0, prompt, list(range(32)))])
    chunks = [SeqChunk(i, 1024, [int(torch.randint(3, cfg.vocab_size, (1,), generator=g))],
                       list(range(9 * i, 9 * i + 9))) for i in range(a.batch)]
    first, digests = None, {}
    for graphs in (False, True):
        for pdl in (True, False):
            ex.cuda_graphs = graphs
            with pdl_launches(pdl):
                for r in range(a.repeats):
                    lg = ex.step(chunks).float().clone()
                    d = hashlib.sha256(lg.contiguous().numpy().tobytes()).hexdigest()[:16]
                    digests[d] = digests.get(d, 0) + 1
                    line = f"graphs={int(graphs)} pdl={int(pdl)} run {r}: {d}"
                    if first is None:
                        first = lg
                    elif not torch.equal(lg, first):
                        diff = (lg - first).abs().amax(-1)
                        rows = diff.nonzero().flatten().tolist()
                        line += f"  rows {rows[:8]}{'...' if len(rows) > 8 else ''} max |diff| {diff.max():.3e}"
                    print(line, flush=True)
    print(f"{len(digests)} distinct digests over {sum(digests.values())} steps: {digests}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
