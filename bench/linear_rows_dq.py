"""block_linear_rows_kernel (the block linear's WL: all decode rows in one tile, the weight as the
MMA's left operand, its codes widened to bf16 with their scale in registers) over a config sweep
at the medium plan's wo_a (grouped_linear: bf16 rows, fp8 weight with 32x32 ue8m0 blocks) and LM
head (linear: bf16 rows and weight, fp32 output), against the plan's own template at the same
shape. The fourteenth session's experiment, before the kernel became the default for these calls.

Each variant is checked against the op's reference (codegen/library/triton_check.py) before it is
timed (CUDA-graph replay, median), against the floor at the copy ceiling of the same run and
against the plan's own template at the same shape. Not a test; run on the H200:

    python bench/linear_rows_dq.py [--rows 64] [--cases wo_a,head] [--out linear_rows_dq.json]

lin8's shapes run in bench/gemm_fp8_decode.py (LIN8_DQ), against the wgmma program.

On the CPU, `TRITON_INTERPRET=1 python bench/linear_rows_dq.py --interpret` checks the kernel on
small shapes against torch.
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

from deepinfer.codegen.library.triton_kernels import block_linear_rows_kernel, split_sum_kernel  # noqa: E402


def run(x, sx, w, sw, y, part, n, G, KG, NG, cfg):
    """Launch the product (and the split's sum) for rows x [n, G*KG] into y [n, G*NG]."""
    xq, wq = sx is not None, sw is not None
    grid = (G * NG // cfg["BN"], cfg["SPLIT"])
    block_linear_rows_kernel[grid](x, sx if xq else x, w, sw if wq else w, y, part if cfg["SPLIT"] > 1 else y, n,
                                   G, KG, NG, KG // 32, xq, wq, cfg["BR"], cfg["BN"], cfg["BK"], cfg["SPLIT"],
                                   os.environ.get("TRITON_INTERPRET") == "1",
                                   num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg["SPLIT"] > 1:
        total = n * G * NG
        split_sum_kernel[(triton.cdiv(total, 1024),)](part, y, total, cfg["SPLIT"], 1024, num_warps=4)


def _e8m0(b):
    return torch.exp2(b.float() - 127)


def reference(x, sx, w, sw, G, KG, NG):
    n = x.shape[0]
    xf = x.view(torch.float8_e4m3fn).float() * _e8m0(sx).repeat_interleave(32, 1) if sx is not None else x.float()
    if sw is not None:
        wf = w.view(torch.float8_e4m3fn).float() * _e8m0(sw).repeat_interleave(32, 0).repeat_interleave(32, 1)
    else:
        wf = w.float()
    xg = xf.view(n, G, KG)
    wg = wf.view(G, NG, KG)
    return torch.einsum("ngk,gck->ngc", xg, wg).reshape(n, G * NG)


def make(n, G, KG, NG, xq, wq, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if xq:
        x = (torch.randn(n, G * KG, generator=g) * 8).to(torch.float8_e4m3fn).view(torch.uint8)
        sx = torch.randint(120, 130, (n, G * KG // 32), generator=g, dtype=torch.uint8)
    else:
        x, sx = torch.randn(n, G * KG, generator=g).to(torch.bfloat16), None
    if wq:
        w = (torch.randn(G * NG, KG, generator=g) * 8).to(torch.float8_e4m3fn).view(torch.uint8)
        sw = torch.randint(115, 125, (G * NG // 32, KG // 32), generator=g, dtype=torch.uint8)
    else:
        w, sw = (torch.randn(G * NG, KG, generator=g) * 0.05).to(torch.bfloat16), None
    mv = [t.to(device) if t is not None else None for t in (x, sx, w, sw)]
    return mv


# (G, KG, NG, XQ, WQ, calls per step, the plan's op and its triton_check dims): lin8's shapes are
# bench/gemm_fp8_decode.py's (LIN8_DQ), against the wgmma program
CASES = {
    "wo_a 8x1024x4096": (8, 4096, 1024, False, True, 40, "grouped_linear", {}),
    "head 129280x5120": (1, 5120, 129280, False, False, 1, "linear", {"E": 129280}),
}
# (BN, BK, warps, stages), each at the split that keeps the programs within CAP
SHAPES = [(128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 4), (128, 64, 4, 4), (256, 64, 8, 4), (256, 128, 8, 3)]
CAPS = (264, 528)


def out_dtype(label):
    return torch.float32 if CASES[label][6] == "linear" else torch.bfloat16  # the head's logits are fp32


def split_for(n, k, bn, bk, cap):
    return max(s for s in (1, 2, 4, 8, 16) if s == 1 or (k % (s * bk) == 0 and n // bn * s <= cap))


def configs(n, K, N):
    br = max(16, triton.next_power_of_2(n))
    out = []
    for (bn, bk, warps, stages), cap in itertools.product(SHAPES, CAPS):
        if N % bn or K % bk:
            continue
        c = dict(BR=br, BN=bn, BK=bk, SPLIT=split_for(N, K, bn, bk, cap), num_warps=warps, num_stages=stages)
        if c not in out:
            out.append(c)
    return out


def _warm(job):
    label, n = job
    G, KG, NG, xq, wq = CASES[label][:5]
    try:
        x, sx, w, sw = make(n, G, KG, NG, xq, wq, "cuda")
        y = torch.empty(n, G * NG, dtype=out_dtype(label), device="cuda")
        part = torch.empty(16, n, G * NG, dtype=torch.float32, device="cuda")
        for cfg in configs(n, KG, G * NG):
            run(x, sx, w, sw, y, part, n, G, KG, NG, cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001  (the main process reports per config)
        return f"{type(e).__name__}: {str(e)[-300:]}"


def interpret_check() -> int:
    bad = 0
    for (G, KG, NG, xq, wq), n in itertools.product([(1, 256, 128, True, True), (2, 128, 64, False, True),
                                                     (1, 128, 64, False, False)], (1, 5)):
        x, sx, w, sw = make(n, G, KG, NG, xq, wq, "cpu")
        for cfg in (dict(BR=16, BN=64, BK=64, SPLIT=1, num_warps=4, num_stages=1),
                    dict(BR=16, BN=64, BK=64, SPLIT=2, num_warps=4, num_stages=1)):
            if KG % (cfg["SPLIT"] * cfg["BK"]):
                continue
            y = torch.empty(n, G * NG, dtype=torch.float32)
            part = torch.empty(cfg["SPLIT"], n, G * NG, dtype=torch.float32)
            run(x, sx, w, sw, y, part, n, G, KG, NG, cfg)
            ref = reference(x, sx, w, sw, G, KG, NG)
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            print(G, KG, NG, xq, wq, n, cfg["SPLIT"], f"rel {err:.2e}")
            bad += err > 1e-5
    return int(bad > 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64")
    ap.add_argument("--cases", default="")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "linear_rows_dq.json"))
    a = ap.parse_args()
    if a.interpret:
        return interpret_check()
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from ceilings import measure_ceilings
    from kernels_triton import run_case

    from deepinfer.codegen.library import triton_check

    want = [c for c in a.cases.split(",") if c]
    labels = [lb for lb in CASES if not want or any(lb.startswith(c) for c in want)]
    rows = [int(r) for r in a.rows.split(",")]
    jobs = [(lb, n) for lb in labels for n in rows]
    with ProcessPoolExecutor(min(a.workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as ex:
        for e in {e for e in ex.map(_warm, jobs) if e}:
            print("warm-up:", e, flush=True)

    def eager(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def graphs(fn):
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")

    ceil = measure_ceilings(eager)
    bw = ceil["copy_bytes_per_s"]
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.date.today().isoformat(), "ceilings": ceil, "rows": []}
    table = []
    saved = dict(triton_check.REAL)
    for label, n in jobs:
        G, KG, NG, xq, wq, calls, op, dims = CASES[label]
        triton_check.REAL.clear()
        triton_check.REAL.update(saved, **dims)
        try:  # the plan's template at its default config, in the same run
            plan = run_case(op, n, None, graphs, ceil)
        except Exception as e:  # noqa: BLE001
            plan = {"error": f"{type(e).__name__}: {str(e)[-200:]}"}
        plan.update(case=label, variant="plan")
        res["rows"].append(plan)
        x, sx, w, sw = make(n, G, KG, NG, xq, wq, "cuda")
        ref = reference(x, sx, w, sw, G, KG, NG)
        nbytes = sum(t.numel() * t.element_size() for t in (x, sx, w, sw) if t is not None) + \
            n * G * NG * out_dtype(label).itemsize
        floor_us = nbytes / bw * 1e6
        y = torch.empty(n, G * NG, dtype=out_dtype(label), device="cuda")
        part = torch.empty(16, n, G * NG, dtype=torch.float32, device="cuda")
        best = None
        for cfg in configs(n, KG, G * NG):
            row = {"case": label, "n": n, "variant": "dq", "config": cfg, "floor_us": floor_us}
            try:
                run(x, sx, w, sw, y, part, n, G, KG, NG, cfg)
                torch.cuda.synchronize()
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                row.update(max_rel=err, check="pass" if err <= 1e-2 else "fail")
                if err <= 1e-2:
                    row["time_us"] = graphs(lambda: run(x, sx, w, sw, y, part, n, G, KG, NG, cfg)) * 1e3
            except Exception as e:  # noqa: BLE001  (reported per config, the run goes on)
                row["error"] = f"{type(e).__name__}: {str(e).strip()[-300:]}"
            res["rows"].append(row)
            print({k: v for k, v in row.items() if k != "floor_us"}, flush=True)
            if "time_us" in row and (best is None or row["time_us"] < best["time_us"]):
                best = row
        table.append((label, n, floor_us, plan, best))
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    triton_check.REAL.clear()
    triton_check.REAL.update(saved)
    print(f"{'case':<20}{'rows':>5}{'floor us':>10}{'plan us':>10}{'dq us':>10}{'plan/dq':>9}  best dq config")
    for label, n, fl, plan, best in table:
        pt, bt = plan.get("time_us"), best["time_us"] if best else None
        print(f"{label:<20}{n:>5}{fl:>10.1f}{pt or 0:>10.1f}{bt or 0:>10.1f}"
              f"{(pt / bt if pt and bt else 0):>9.2f}  {best['config'] if best else plan.get('error', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
