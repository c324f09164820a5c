"""The decode GEMMs of the medium plan on the H200 (JIT, the device's Triton): lin8 (gemm_fp8) on
block_linear_mx_kernel (tl.dot_scaled), wo_a (grouped_linear) and the fp32-compute linear (the
LM head, the router) with MX on and off, over a few tile / split / stage configs at decode rows.
Each config is checked against its op's reference (codegen/library/triton_check.py) before it is
timed (CUDA-graph replay of the call, median); floor = bytes / the copy ceiling of the same run.
Not a test; run on the H200:

    python bench/decode_linear.py [--rows 1,64] [--out decode_linear.json]

Prints, per case, the default config's time and the fastest config, against the floor.
"""
import argparse
import datetime
import itertools
import json
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ceilings import measure_ceilings  # noqa: E402
from kernels_triton import run_case  # noqa: E402

from deepinfer.codegen.library import triton_check, triton_ops  # noqa: E402

# (label, op, dims over triton_check.REAL): the medium plan's decode calls with the most weight bytes
CASES = [
    ("lin8 5120x8192", "gemm_fp8", {"F": 5120, "H": 8192}),
    ("lin8 32768x1280", "gemm_fp8", {"F": 32768, "H": 1280}),
    ("lin8 2304x5120", "gemm_fp8", {"F": 2304, "H": 5120}),
    ("lin8 512x5120", "gemm_fp8", {"F": 512, "H": 5120}),
    ("wo_a 8x1024x4096", "grouped_linear", {}),
    ("lm head 129280x5120", "linear", {"E": 129280}),
]
SWEEP = {"BN": (32, 64, 128), "SPLIT": (0, 4), "num_stages": (4,)}
SWEEP.update({k: tuple(v) for k, v in json.loads(os.environ.get("LIN_SWEEP", "{}")).items()})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "decode_linear.json"))
    args = ap.parse_args()

    def eager(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def graphs(fn):
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")

    ceil = measure_ceilings(eager)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.date.today().isoformat(), "ceilings": ceil, "rows": []}
    saved = dict(triton_check.REAL)
    table = []
    for (label, op, dims), n in itertools.product(CASES, [int(r) for r in args.rows.split(",")]):
        triton_check.REAL.clear()
        triton_check.REAL.update(saved, **dims)
        base = triton_ops.default_config(op, n)
        # lin8: dot_scaled (MX) or one fp8 MMA per 32-deep block (F8); the others: MX off / on
        variants = ((1, 0), (1, 1)) if op == "gemm_fp8" else ((0, 0), (1, 0))
        tiles = sorted({16, base["BM"]})
        configs = [dict(base)] + [dict(base, MX=mx, F8=f8, BM=bm, BN=bn, SPLIT=s, num_stages=st)
                                  for mx, f8 in variants for bm in tiles
                                  for bn, s, st in itertools.product(*SWEEP.values())]
        best = {}
        for i, cfg in enumerate(configs):
            try:
                row = run_case(op, n, cfg, graphs, ceil)
            except Exception as e:  # noqa: BLE001  (reported per config, the run goes on)
                row = {"op": op, "n": n, "config": cfg, "error": f"{type(e).__name__}: {str(e).strip()[-200:]}"}
            row.update(case=label, default=i == 0)
            res["rows"].append(row)
            ok = "time_us" in row and row.get("check") == "pass"
            if ok:
                key = "default" if i == 0 else "F8" if cfg.get("F8") else f"MX{cfg.get('MX', 0)}"
                if key not in best or row["time_us"] < best[key]["time_us"]:
                    best[key] = row
            elif "check" in row or "error" in row:
                print(label, n, cfg, row.get("check") or row.get("error"), flush=True)
        table.append((label, n, best))
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    triton_check.REAL.clear()
    triton_check.REAL.update(saved)
    print(f"{'case':<22}{'rows':>5}{'floor us':>10}{'default us':>12}{'best MX0 us':>13}{'best MX1 us':>13}"
          f"{'best F8 us':>13}  best config")
    for label, n, best in table:
        d = best.get("default", {})
        cells = [f"{best[k]['time_us']:>13.1f}" if k in best else f"{'-':>13}" for k in ("MX0", "MX1", "F8")]
        win = min((r for k, r in best.items() if k != "default"), key=lambda r: r["time_us"], default=None)
        cfg = {k: win["config"].get(k) for k in ("MX", "F8", "BM", "BN", "SPLIT", "num_stages")} if win else {}
        print(f"{label:<22}{n:>5}{d.get('floor_us', 0):>10.1f}{d.get('time_us', 0):>12.1f}{''.join(cells)}  {cfg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
