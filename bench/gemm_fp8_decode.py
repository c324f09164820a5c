"""The medium plan's decode fp8 GEMMs (lin8, `gemm_fp8`) on the H200: the wgmma decode program
(tilelang_gemm, sm90's choice) against the warp-MMA one (tilelang_gemm_decode) over a few configs,
each run as a plan runs it (the main kernel, then the split-K combine where it splits), at 1, 8
and 64 rows. Each variant is checked against the op's reference before it is timed (CUDA-graph
replay, median). Per variant and row count the table sums calls x time over the step's calls
(the medium plan's decode step: SHAPES), against the same sum of byte floors at the copy
bandwidth measured in the same run. Not a test; run on the H200:

    LIN8_MMA='[{}, {"NT": 8, "RT": 2}]' python bench/gemm_fp8_decode.py [--rows 1,8,64] [--out F]

LIN8_WGMMA: configs of the wgmma program over its defaults (split_x: the default split times this;
a split is cut to the largest that gives every split whole K tiles). LIN8_WGMMA_OVER: knobs over
the shipped lin8 config (gemm_fp8_default_config), e.g. '[{"stages": 3}]'.
LIN8_TMA=1: the shipped config once more, lowered with TMA copies and warp specialisation (a
producer warpgroup; TileLang's own launcher builds the tensor maps). LIN8_PERSISTENT: knobs of the persistent-grid 64-row program (tilelang_gemm_decode), each over its
chosen config ('[{}]': the chosen one; default none). LIN8_MMA: configs of the warp-MMA program, each over sm90's defaults for it; a config without
split_k takes tilelang_gemm_decode.mma_config's split. LIN8_DQ: configs of block_linear_rows_kernel (the
weight as the MMA's left operand, both operands widened to bf16 in registers; bench/linear_rows_dq.py), e.g.
'[{"BN": 128, "BK": 128, "num_warps": 8, "num_stages": 3}]'; SPLIT 0 (the default) picks the split
from the shape.
"""
import argparse
import dataclasses
import datetime
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ceilings import measure_ceilings  # noqa: E402
import linear_rows_dq  # noqa: E402
from kernels_tilelang import rand_e8m0, rand_fp8, rel_err  # noqa: E402

from deepinfer.codegen.library import tilelang_gemm as tlg  # noqa: E402
from deepinfer.codegen.library import triton_ops  # noqa: E402
from deepinfer.codegen.library import tilelang_gemm_decode as tlgd  # noqa: E402
from deepinfer.codegen.targets import get_target  # noqa: E402
from deepinfer.ir.quant import QTensor  # noqa: E402
from deepinfer.ir.registry import get_op  # noqa: E402

# (N, K, calls in one decode step of the medium plan): counted off its step graph
SHAPES = [(1280, 5120, 40), (32768, 1280, 40), (512, 5120, 43), (5120, 8192, 40), (2304, 5120, 80),
          (5120, 2304, 40), (25600, 6144, 2), (4096, 1280, 8), (5120, 15360, 1)]
if os.environ.get("LIN8_SHAPES"):  # e.g. 5120x8192,1280x5120: these shapes only (ncu runs)
    SHAPES = [sh for sh in SHAPES if f"{sh[0]}x{sh[1]}" in os.environ["LIN8_SHAPES"].split(",")]
ROWS = tlg.DECODE_ROWS
# the pass configs a "tma" variant is lowered with (over tilelang_gemm.PASS_CONFIGS)
TMA_PASS_CONFIGS = {"tl.disable_tma_lower": False, "tl.disable_warp_specialized": False}


def compile_variant(label, prog):
    return tlg.compile_kernel(prog, pass_configs=TMA_PASS_CONFIGS if label.endswith(" tma") else None)


DQ_BASE = {"BN": 128, "BK": 128, "SPLIT": 0, "num_warps": 8, "num_stages": 3}


def dq_config(n, k, knobs):
    """A LIN8_DQ config made whole for one shape: the product's split rule (SPLIT 0) or the knobs'."""
    c = dict(DQ_BASE, **knobs)
    c["SPLIT"] = triton_ops.block_linear_rows(dict(c, WL=1), ROWS, n, k, 1)["SPLIT"]
    return c


def variants(n, k):
    """(label, config, [programs]) per variant of one shape: the wgmma program first; a Triton
    variant (label "dq ...") has no programs (linear_rows_dq.run launches it)."""
    t = get_target("sm90")
    c = tlg.gemm_fp8_default_config(t, ROWS, n, k)
    out = [("wgmma", c, [tlg.gemm_fp8_rows_program(n, k, "bfloat16", **c)])]
    if os.environ.get("LIN8_TMA"):
        out.append(("wgmma tma", c, [tlg.gemm_fp8_rows_program(n, k, "bfloat16", **c)]))
    for knobs in json.loads(os.environ.get("LIN8_WGMMA_OVER", "[]")):
        w = dict(c, **knobs)
        out.append(("wgmma shipped " + "".join(f"{a}{b}" for a, b in sorted(knobs.items())), w,
                    [tlg.gemm_fp8_rows_program(n, k, "bfloat16", **w)]))
    c = tlg.gemm_default_config(t, ROWS, n, k)  # LIN8_WGMMA's knobs go over the general GEMM default
    for knobs in json.loads(os.environ.get("LIN8_WGMMA", "[]")):
        w = dict(c, **{a: b for a, b in knobs.items() if a != "split_x"})
        steps = k // w["block_K"]
        want = w["split_k"] * knobs.get("split_x", 1)  # split_x: the default split times this
        w["split_k"] = max(d for d in range(1, want + 1) if steps % d == 0)  # whole K tiles per split
        short = {"block_N": "n", "block_K": "k", "stages": "s", "split_k": "p", "threads": "t", "split_x": "x"}
        out.append(("wgmma " + "".join(f"{short.get(a, a)}{b}" for a, b in sorted(knobs.items())), w,
                    [tlg.gemm_fp8_rows_program(n, k, "bfloat16", **w)]))
    on = dataclasses.replace(t, defaults=dict(t.defaults, tilelang_gemm_fp8_persistent={}))
    for knobs in json.loads(os.environ.get("LIN8_PERSISTENT", "[]")):
        p = tlgd.persistent_config(on, n, k, knobs)  # None: no config fits this shape (reported so)
        out.append(("wgmma persistent" + "".join(f" {a}{b}" for a, b in sorted(knobs.items())), p,
                    [tlgd.gemm_fp8_rows_persistent_program(n, k, "bfloat16", **p)] if p else []))
    for knobs in json.loads(os.environ.get("LIN8_MMA", "[{}]")):
        c = tlgd.mma_config(t, n, k, knobs)
        out.append(("mma " + ",".join(f"{a}{b}" for a, b in sorted(knobs.items())) if knobs else "mma default", c,
                    [tlgd.gemm_fp8_mma_rows_program(n, k, "bfloat16", rows=ROWS, **c)]))
    for knobs in json.loads(os.environ.get("LIN8_DQ", "[]")):
        short = {"BN": "n", "BK": "k", "num_warps": "w", "num_stages": "s", "SPLIT": "p"}
        out.append(("dq " + "".join(f"{short.get(a, a)}{b}" for a, b in sorted(knobs.items())),
                    dq_config(n, k, knobs), []))
    for label, c, progs in out:
        if label.startswith("dq") or c is None:
            continue
        if c["split_k"] > 1 and not tlgd.cluster_split(c):  # a cluster's first CTA adds the partials
            progs.append(tlg.gemm_split_sum_program(n, c["split_k"], ROWS, "bfloat16"))
    return out


def _warm(args):
    si, vi, rows_list = args
    try:
        n, k = SHAPES[si][:2]
        label, c, progs = variants(n, k)[vi]
        for p in progs:
            compile_variant(label, p)
        if c is None:
            return None
        for m in rows_list if label.startswith("dq") else ():  # Triton specialises the row count
            x = {"A": rand_fp8(m, k), "SA": rand_e8m0(m, k // 32), "B": rand_fp8(n, k),
                 "SB": rand_e8m0(-(-n // 32), k // 32)}
            run([], c, "dq", x, n)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported again by the main process
        return f"{type(e).__name__}: {e}"


def run(kernels, c, mma, x, n):
    a, b = x["A"], x["B"]
    if mma == "dq":
        m, k = a.shape
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        part = torch.empty(c["SPLIT"], m, n, device="cuda", dtype=torch.float32) if c["SPLIT"] > 1 else out
        linear_rows_dq.run(a.view(torch.uint8), x["SA"], b.view(torch.uint8), x["SB"], out, part, m, 1, k, n,
                           dict(c, BR=max(16, 1 << (m - 1).bit_length())))
        return out
    if mma:  # the warp-MMA program reads both operands as 32-bit words
        a, b = a.view(torch.uint8).view(torch.uint32), b.view(torch.uint8).view(torch.uint32)
    sa, sb = x["SA"], x["SB"]
    if c.get("words"):  # the scales as 32-bit words (tilelang_gemm.scale_operands)
        sa, sb = sa.view(torch.uint32), sb.view(torch.uint32)
    out = torch.empty(x["A"].shape[0], n, device="cuda", dtype=torch.bfloat16)
    if c["split_k"] > 1:
        p = torch.empty(c["split_k"], ROWS, n, device="cuda", dtype=torch.float32)
        if tlgd.cluster_split(c):
            kernels[0](a, sa, b, sb, out, p)
        else:
            kernels[0](a, sa, b, sb, p)
            kernels[1](p, out)
    else:
        kernels[0](a, sa, b, sb, out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gemm_fp8_decode.json"))
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    args = ap.parse_args()
    import triton

    t0 = time.time()
    nv = len(variants(*SHAPES[0][:2]))
    rows_list = [int(r) for r in args.rows.split(",")]
    jobs = [(si, vi, rows_list) for si in range(len(SHAPES)) for vi in range(nv)]
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        errors = sorted({e for e in ex.map(_warm, jobs) if e})
    print(f"compiled {len(jobs)} variants in {time.time() - t0:.0f} s", flush=True)
    for e in errors[:3]:  # the main process compiles these again, and reports per variant
        print("warm-up:", e[-300:], flush=True)
    ceil = measure_ceilings(lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    bw = ceil["copy_bytes_per_s"]
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.date.today().isoformat(), "ceilings": ceil, "rows": []}
    step = {}  # (variant, rows) -> [sum calls x time us, sum calls x floor us, all passed]
    torch.manual_seed(1234)
    for n, k, calls in SHAPES:
        for label, c, progs in variants(n, k):
            if c is None:
                print(f"{n}x{k} {label}: no config fits", flush=True)
                res["rows"].append({"shape": [n, k], "variant": label, "status": "no-config"})
                step.setdefault((label, 64), [0.0, 0.0, True])[2] = False
                continue
            try:
                kernels = [compile_variant(label, p) for p in progs]
                kind = "dq" if label.startswith("dq") else not label.startswith("wgmma")
            except Exception as e:
                print(f"{n}x{k} {label}: build error {type(e).__name__}: {str(e)[-300:]}", flush=True)
                res["rows"].append({"shape": [n, k], "variant": label, "config": c, "status": "build-error"})
                continue
            for m in rows_list:
                x = {"A": rand_fp8(m, k), "SA": rand_e8m0(m, k // 32), "B": rand_fp8(n, k),
                     "SB": rand_e8m0(-(-n // 32), k // 32)}
                row = {"shape": [n, k], "rows": m, "calls": calls, "variant": label, "config": c}
                try:
                    out = run(kernels, c, kind, x, n)
                    ref = get_op("gemm_fp8").ref(QTensor(x["A"], x["SA"]), QTensor(x["B"], x["SB"]), out_dtype="f32")
                    mx, _ = rel_err(out.float(), ref.float())
                    t = triton.testing.do_bench_cudagraph(lambda: run(kernels, c, kind, x, n), rep=100,
                                                          return_mode="median") * 1e3
                    floor = (n * k * (1 + 1 / 1024) + m * k * 33 / 32 + m * n * 2) / bw * 1e6
                    row.update(status="pass" if mx <= 1e-2 else "FAIL", max_rel=mx, time_us=t, floor_us=floor)
                except Exception as e:
                    row.update(status="run-error", error=f"{type(e).__name__}: {str(e)[-300:]}")
                res["rows"].append(row)
                print({a: b for a, b in row.items() if a != "config"}, flush=True)
                s = step.setdefault((label, m), [0.0, 0.0, True])
                if "time_us" in row:
                    s[0] += calls * row["time_us"]
                    s[1] += calls * row["floor_us"]
                s[2] = s[2] and row["status"] == "pass"
    res["step"] = [{"variant": v, "rows": m, "step_us": s[0], "floor_us": s[1], "all_pass": s[2]}
                   for (v, m), s in step.items()]
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nmedium decode step's lin8 calls (copy {bw / 1e12:.2f} TB/s)")
    print(f"{'variant':<28} {'rows':>4} {'step ms':>8} {'floor ms':>8} {'f/t':>5} {'check':>6}")
    for r in res["step"]:
        print(f"{r['variant'][:28]:<28} {r['rows']:>4} {r['step_us'] / 1e3:>8.3f} {r['floor_us'] / 1e3:>8.3f} "
              f"{r['floor_us'] / max(r['step_us'], 1e-9):>5.2f} {'pass' if r['all_pass'] else 'FAIL':>6}")
    print(f"\n{'shape':<12} {'rows':>4} " + " ".join(f"{v[:14]:>14}" for v, _, _ in variants(*SHAPES[0][:2])))
    for n, k, _ in SHAPES:
        for m in rows_list:
            ts = {r["variant"]: r.get("time_us") for r in res["rows"] if r["shape"] == [n, k] and r.get("rows") == m}
            print(f"{n}x{k:<7} {m:>4} " + " ".join(f"{ts[v]:>14.1f}" if ts.get(v) else f"{'-':>14}"
                                                    for v, _, _ in variants(*SHAPES[0][:2])))
    return 0 if all(r["all_pass"] for r in res["step"]) else 1


if __name__ == "__main__":
    sys.exit(main())
