"""The fused indexer (triton_indexer_topk) on the GPU at the medium plan's shapes (sm90 plans
compiled with --max-model-len 8192: 4096 entries a row at ratio 2, 8192 at ratio 1) against the
torch fallback it replaces (the op's reference on the device, torch_device). Each case: both
outputs compared exactly, then both timed (do_bench medians; the Triton launcher also replayed
from a CUDA graph, as a plan's decode steps run). Not a test; run on the H200:

    python bench/indexer_topk.py [--rows 1,8,64,4096] [--out $OUT/indexer_topk.json]
"""
import argparse
import json
import os

import torch

from deepinfer.codegen.library import triton_check, triton_launchers, triton_ops
from deepinfer.ir.quant import QTensor
from deepinfer.ir.registry import get_op

CAPS = {"indexer_topk": 4096, "indexer_topk_pool": 8192, "indexer_topk_cand": 8192}


def _clone(v):
    return QTensor(v.data.clone(), v.scale.clone()) if isinstance(v, QTensor) else v.clone()


def main():
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64,4096")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "indexer_topk.json"))
    ap.add_argument("--no-ref-time", action="store_true", help="skip timing the torch fallback")
    args = ap.parse_args()
    rows = []
    for case, cap in CAPS.items():
        for n in (int(x) for x in args.rows.split(",")):
            g = torch.Generator().manual_seed(n)
            ins, attrs = triton_check.indexer_case(case, triton_check.REAL, n, "cuda", g, cap=cap)
            cfg = triton_ops.default_config("indexer_topk", n)
            kw = triton_ops.launch_attrs("indexer_topk", attrs)

            def run():
                return triton_launchers.launch_indexer_topk(*ins, **kw, cfg=cfg)

            def ref():  # as the plan runner calls a torch_device reference: under the device
                with torch.device("cuda"):
                    return get_op("indexer_topk").ref(*[_clone(v) for v in ins], **attrs)
            got, want = run(), ref()
            why = triton_check.compare_exact(tuple(got) if isinstance(got, tuple) else got,
                                             tuple(want) if isinstance(want, tuple) else want)
            row = {"case": case, "rows": n, "cap": cap, "check": "pass" if why is None else "FAIL: " + why,
                   "triton_us": 1e3 * triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median"),
                   "triton_graph_us": 1e3 * triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median")}
            if not args.no_ref_time:
                row["torch_us"] = 1e3 * triton.testing.do_bench(ref, warmup=2, rep=20, return_mode="median")
            rows.append(row)
            print(row, flush=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0 if all(r["check"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
