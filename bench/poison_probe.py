"""Does a medium plan's decode step read memory no call wrote? Every buffer the host recipes
allocate starts as NaN (DEEPINFER_POISON=1: floats NaN, fp8 codes and scales 0xFF); the step of
`--batch` sequences (decode_repeat.py's: after a 4096-token prefill) runs eagerly with every value
traced, and the first calls whose outputs hold NaN in the rows of real sequences are printed,
with their rows. A plan whose kernels read only what was written shows none. Byte buffers (packed
fp4 codes, scales) are not judged: 0xFF is a valid pair of fp4 codes. Not a test; run on the
H200:

    python bench/poison_probe.py PLAN [--batch 64]
"""
import argparse
import os
import sys

os.environ["DEEPINFER_POISON"] = "1"

import torch  # noqa: E402

from deepinfer.ir.quant import QTensor  # noqa: E402
from deepinfer.runtime.batch import SeqChunk, bucket_inputs  # noqa: E402
from deepinfer.runtime.plan_executor import choose_bucket  # noqa: E402

from runtime_sm90 import gpu_executor, plan_config  # noqa: E402


def bad_rows(v, rows: int):
    """Rows (first axis, below `rows`) of a value holding NaN / 0xFF codes; None if not a tensor."""
    parts = (v.data, v.scale) if isinstance(v, QTensor) else (v,)
    out = set()
    for t in parts:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] < rows:
            continue
        x = t[:rows]
        if x.dtype.is_floating_point and x.element_size() > 1:
            m = torch.isnan(x.float())
        elif x.dtype.is_floating_point:  # fp8 e4m3: 0xFF is NaN, never a quantised value
            m = x.view(torch.uint8) == 0xFF
        else:  # bytes: packed fp4 codes make 0xFF (two -6.0s), so a poisoned byte cannot be told apart
            continue
        out |= set(m.reshape(rows, -1).any(-1).nonzero().flatten().tolist())
    return sorted(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    cfg = plan_config(a.plan)
    ex = gpu_executor(a.plan, 0)
    ex.cuda_graphs = False
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size, (4096,), generator=g).tolist()
    ex.step([SeqChunk(0, 0, prompt, list(range(32)))])
    chunks = [SeqChunk(i, 1024, [int(torch.randint(3, cfg.vocab_size, (1,), generator=g))],
                       list(range(9 * i, 9 * i + 9))) for i in range(a.batch)]
    graph, bucket = choose_bucket(ex.plan, chunks)
    inputs, n = bucket_inputs(chunks, ex.plan["buckets"][graph][bucket], ex.num_slots, ex.num_pages, cfg.pad_token_id)
    trace = {}
    out = ex.runner.run(graph, bucket, {k: v.to(ex.device) for k, v in inputs.items()}, trace=trace)
    torch.cuda.synchronize()
    print(f"{bucket}: logits rows with NaN: {bad_rows(out['logits'], n)}")
    shown = 0
    for i, c in enumerate(ex.loaded.graphs[graph].calls):
        for o in c["outputs"]:
            rows = bad_rows(trace.get(o), n) if o in trace else []
            if rows and shown < 12:
                tmpl = c["launch"][bucket].get("template")
                print(f"call {i} {c['op']} ({tmpl}) -> {o}: NaN / 0xFF in rows {rows[:10]}{'...' if len(rows) > 10 else ''}"
                      f" ({len(rows)} of {n})")
                shown += 1
    print("none" if not shown else f"{shown} shown")
    return 0


if __name__ == "__main__":
    sys.exit(main())
