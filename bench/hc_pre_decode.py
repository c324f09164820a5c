"""mHC's entry kernels (hc_pre, hc_mix) at decode rows on the GPU, replayed from CUDA graphs as a
plan runs them: each config checked against its op's reference (triton_check rules) and timed
against its byte floor at the copy bandwidth measured in the same run. Not a test; on the H200:

    HC_CFGS='[{}, {"BK": 32}]' python bench/hc_pre_decode.py --rows 1,8,64 [--ops hc_pre,hc_mix] [--tag new]

HC_CFGS: overrides over the template's default config at each row count ({} is the default).
To compare two versions of the kernels in one call, run it once from each source tree
(PYTHONPATH) with the same --out folder and different --tag: the table is per run, the JSON per tag.
"""
import argparse
import datetime
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ceilings import measure_ceilings  # noqa: E402
from kernels_triton import run_case  # noqa: E402

from deepinfer.codegen.library import triton_ops  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--ops", default="hc_pre,hc_mix")
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "results")))
    args = ap.parse_args()
    import triton

    overrides = json.loads(os.environ.get("HC_CFGS", "[{}]"))
    ceil = measure_ceilings(lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

    def bench(fn):
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")

    rows = []
    for op in args.ops.split(","):
        for n in (int(x) for x in args.rows.split(",")):
            for ov in overrides:
                cfg = {**triton_ops.default_config(op, n), **ov}
                try:
                    row = run_case(op, n, cfg, bench, ceil)
                except Exception as e:  # noqa: BLE001  (reported per case, the run goes on)
                    row = {"op": op, "n": n, "config": cfg, "error": f"{type(e).__name__}: {str(e).strip()[-300:]}"}
                row["override"] = ov
                rows.append(row)
                print({k: v for k, v in row.items() if k != "config"}, flush=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.date.today().isoformat(), "ceilings": ceil, "timing": "cuda graph replay",
           "tag": args.tag, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"hc_pre_decode_{args.tag}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"\n[{args.tag}] copy ceiling {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    print("%-7s %4s %-44s %-6s %8s %8s %6s" % ("op", "rows", "override", "check", "us", "floor", "f/t"))
    for r in rows:
        ok = "time_us" in r
        print("%-7s %4d %-44s %-6s %8s %8s %6s" % (
            r["op"], r["n"], json.dumps(r["override"])[:44], r.get("check", "ERR")[:6],
            "%.2f" % r["time_us"] if ok else "-", "%.2f" % r["floor_us"] if ok else "-",
            "%.3f" % r["floor_over_time"] if ok else "-"))
    return 0 if all(r.get("check") == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
