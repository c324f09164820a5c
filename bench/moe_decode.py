"""`grouped_gemm_fp4` at decode on the GPU: the Triton decode template against the TileLang one at
the real MoE widths, in the same run (bench/kernels_triton.py --only grouped_gemm_fp4 runs this).

Cases: batch 1, 8 and 64 tokens, each picking top-k distinct random experts, for both expert GEMMs
(w13: N = 2 * moe_intermediate_size, K = hidden; w2: N = hidden, K = moe_intermediate_size), the
expert count and widths read from a model preset. Each kernel is checked against the op's
reference (fp64 on the GPU, the triton_check bf16 rule) and timed; floor = bytes / copy bandwidth
measured in the same run, bytes = the busy experts' fp4 weights and scales + the fp8 rows and
their scales + the offsets + the bf16 output. --sweep times a grid of (BN, BK, num_warps,
num_stages, SPLIT, WORDS, MX: tl.dot_scaled, F8: fp8 MMAs) for the Triton kernel per case (compiled in parallel first) and reports the best.
"""
import itertools
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# tokens per case (MOE_BATCHES, e.g. "4096" for a prefill step); the sweep's grid (MOE_SWEEP: a
# JSON object of knob -> values replacing these)
BATCHES = tuple(int(b) for b in os.environ.get("MOE_BATCHES", "1,8,64").split(","))
SWEEP = dict(BN=(128, 256), BK=(64, 128), num_warps=(4, 8), num_stages=(3, 4), SPLIT=(1,), WORDS=(0, 1), MX=(0, 1))
SWEEP.update({k: tuple(v) for k, v in json.loads(os.environ.get("MOE_SWEEP", "{}")).items()})
TILELANG = os.environ.get("MOE_TILELANG", "1") != "0"
CONFIG = json.loads(os.environ.get("MOE_CONFIG", "{}"))  # knobs over the template's default (e.g. for ncu)
# configs of the warp-MMA TileLang kernel (tilelang_moe_decode) to time per case: a JSON list of
# knob objects over sm90's defaults ("[]": none, "[{}]": the defaults)
MMA = json.loads(os.environ.get("MOE_MMA", "[]"))


def preset_widths(preset: str) -> dict:
    path = os.path.join(HERE, "..", "models", "presets", preset, "config.json")
    with open(path) as f:
        c = json.load(f)
    t = c.get("text_config", c)
    return {"E": t["n_routed_experts"], "k": t["num_experts_per_tok"], "H": t["hidden_size"],
            "F": t["moe_intermediate_size"]}


def cases(w: dict, seed=0):
    """(label, counts, N, K) per batch and GEMM; counts from one routing draw per batch."""
    from deepinfer.codegen.library.triton_check import routed_counts

    g = torch.Generator().manual_seed(seed)
    out = []
    for b in BATCHES:
        counts = routed_counts(b, w["E"], w["k"], g)
        out.append((f"{'decode' if b <= 64 else 'prefill'} b{b} w13", counts, 2 * w["F"], w["H"]))
        out.append((f"{'decode' if b <= 64 else 'prefill'} b{b} w2", counts, w["H"], w["F"]))
    return out


def floor_bytes(counts, n, k) -> int:
    mtot, active = sum(counts), sum(1 for c in counts if c)
    return active * n * (k // 2 + k // 32) + mtot * (k + k // 32) + 4 * (len(counts) + 1) + 2 * mtot * n


def triton_config(mtot: int, over=None) -> dict:
    from deepinfer.codegen.library import triton_ops

    return dict(triton_ops.default_config("grouped_gemm_fp4", mtot), **{**CONFIG, **(over or {})})


def sweep_configs(mtot: int):
    names = list(SWEEP)
    for vals in itertools.product(*(SWEEP[n] for n in names)):
        c = dict(zip(names, vals))
        mx, f8 = c.get("MX"), c.get("F8")
        # MX and F8 ignore WORDS (F8 also MX); the fp16 widening keeps its registers at 4 warps
        if (mx or f8) and c.get("WORDS") or mx and f8 or not (mx or f8) and c["num_warps"] != 4:
            continue
        yield triton_config(mtot, c)


def _warm(job):
    """Compile one Triton config in a worker (into the shared on-disk cache): dtypes stand in for
    tensors (Triton's warm-up specialises them as 16-byte aligned, as torch allocates)."""
    from deepinfer.codegen.library.triton_kernels import grouped_gemm_fp4_kernel

    mtot, n, k, e, cfg = job
    a = min(e, mtot)
    try:
        split = cfg.get("SPLIT", 1)
        grouped_gemm_fp4_kernel.warmup(torch.int16, torch.uint8, torch.uint8, torch.uint8, torch.int32,
                                       torch.bfloat16, torch.float32 if split > 1 else torch.bfloat16, MTOT=mtot,
                                       N=n, K=k, E=e, A=a, EP=1 << (e - 1).bit_length(), BM=cfg["BM"],
                                       BN=cfg["BN"], BK=cfg["BK"], SPLIT=split, WORDS=cfg.get("WORDS", 0),
                                       MX=cfg.get("MX", 0), F8=cfg.get("F8", 0), ASM=1, GEMV=cfg.get("GEMV", 0),
                                       num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], grid=(-(-n // cfg["BN"]), a + 1, split))
        return None
    except Exception as e:  # noqa: BLE001  (reported when the main process runs it)
        return f"{type(e).__name__}: {e}"[-200:]


def reference(ins, mtot, n, e):
    """The op's reference on the GPU: expert by expert, fp64 products and sums, bf16 out."""
    from deepinfer.ir import numerics as nm
    from deepinfer.ir import quant as q

    x, w, offs = ins
    xf = q.dequant_fp8_32(x)
    out = torch.zeros(mtot, n, device=xf.device, dtype=torch.bfloat16)
    o = offs.tolist()
    for i in range(e):
        if o[i + 1] > o[i]:
            out[o[i]:o[i + 1]] = nm.mm32(xf[o[i]:o[i + 1]], q.dequant_fp4_weight(w.data[i], w.scale[i])).bfloat16()
    return out


def run(args, bench, ceil) -> dict:
    from deepinfer.codegen.library import triton_check, triton_launchers
    from deepinfer.codegen.targets import get_target

    w = preset_widths(args.preset)
    all_cases = cases(w)
    if args.sweep:  # compile every config of every case in parallel before anything is timed
        from concurrent.futures import ProcessPoolExecutor
        import multiprocessing as mp

        jobs = [(sum(c), n, k, w["E"], cfg) for _, c, n, k in all_cases for cfg in sweep_configs(sum(c))]
        with ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as ex:
            fails = [f for f in ex.map(_warm, jobs) if f]
        print(f"sweep: compiled {len(jobs)} configs, {len(fails)} failed", flush=True)
    target = get_target("sm90" if torch.cuda.get_device_capability()[0] == 9 else "sm100")
    rows = []
    for label, counts, n, k in all_cases:
        mtot, e = sum(counts), w["E"]
        ins = triton_check.grouped_fp4_inputs(counts, n, k, "cuda", seed=mtot)
        want = reference(ins, mtot, n, e)
        b = floor_bytes(counts, n, k)
        floor_us = b / ceil["copy_bytes_per_s"] * 1e6
        row = {"case": label, "rows": mtot, "experts": e, "active": sum(1 for c in counts if c), "N": n, "K": k,
               "bytes": b, "floor_us": floor_us}

        def timed(fn, what, cfg):
            try:
                got = fn()
                why = triton_check.compare_rounded(got, want)
                t = bench(fn) * 1e3
                return {"config": cfg, "check": "pass" if why is None else "FAIL: " + why, "time_us": t,
                        "floor_over_time": floor_us / t, "tflops": 2 * mtot * n * k / t / 1e6}
            except Exception as ex:  # noqa: BLE001  (reported per kernel, the run goes on)
                return {"config": cfg, "error": f"{type(ex).__name__}: {str(ex).strip()[-300:]}"}

        cfg = triton_config(mtot)
        row["triton"] = timed(lambda: triton_launchers.launch_grouped_gemm_fp4(*ins, cfg=cfg), "triton", cfg)
        row["tilelang"] = tilelang_row(target, ins, mtot, n, k, e, timed) if TILELANG else None
        row["mma"] = [mma_row(ins, mtot, n, k, e, c, timed) for c in MMA]
        if args.sweep:
            pts = []
            for c in sweep_configs(mtot):
                pts.append(timed(lambda c=c: triton_launchers.launch_grouped_gemm_fp4(*ins, cfg=c), "triton", c))
            ok = [p for p in pts if p.get("check") == "pass"]
            row["sweep"] = pts
            row["sweep_best"] = min(ok, key=lambda p: p["time_us"]) if ok else None
        rows.append(row)
        print(summary_line(row), flush=True)
        ins = want = None  # free the case's GPU tensors before the next one
        torch.cuda.empty_cache()
    return {"preset": args.preset, "widths": w, "rows": rows}


def tilelang_row(target, ins, mtot, n, k, e, timed) -> dict:
    """The TileLang template's time on the same case (MOE_TILELANG=0 skips it, and its compile)."""
    from deepinfer.codegen.library import tilelang_gemm as tlg
    from deepinfer.codegen.library import tilelang_moe as tlm

    tl_cfg = tlm.moe_default_config(target, mtot, n, k, e)
    try:
        kern = tlg.compile_kernel(tlm.grouped_gemm_fp4_program(mtot, n, k, e, **tl_cfg))
        x, wq, offs = ins

        def tilelang():
            out = torch.zeros(mtot, n, device="cuda", dtype=torch.bfloat16)
            kern(x.data, x.scale.view(torch.uint8), wq.data, wq.scale.view(torch.uint8), offs, out)
            return out
        return timed(tilelang, "tilelang", tl_cfg)
    except Exception as ex:  # noqa: BLE001
        return {"config": tl_cfg, "error": f"{type(ex).__name__}: {str(ex).strip()[-300:]}"}


def mma_row(ins, mtot, n, k, e, cfg, timed) -> dict:
    """The warp-MMA TileLang kernel on the same case (zeroed output, as its host makes: the kernel
    writes the routed rows)."""
    from deepinfer.codegen.library import tilelang_gemm as tlg
    from deepinfer.codegen.library import tilelang_moe_decode as tlmd
    from deepinfer.codegen.targets import get_target

    cfg = dict(get_target("sm90").defaults["tilelang_grouped_gemm_fp4_mma"], **cfg)
    try:
        kern = tlg.compile_kernel(tlmd.grouped_gemm_fp4_mma_program(mtot, n, k, e, **cfg))
        x, wq, offs = ins
        xv, sxv = x.data.view(torch.uint8).view(torch.uint64), x.scale.view(torch.uint8)
        wv, swv = wq.data.view(torch.uint32), wq.scale.view(torch.uint8)

        def mma():
            out = torch.zeros(mtot, n, device="cuda", dtype=torch.bfloat16)
            kern(xv, sxv, wv, swv, offs, out)
            return out
        return timed(mma, "mma", cfg)
    except Exception as ex:  # noqa: BLE001
        return {"config": cfg, "error": f"{type(ex).__name__}: {str(ex).strip()[-300:]}"}


def summary_line(r) -> str:
    def part(name, p):
        if p is None:
            return f"{name} -"
        if "error" in p:
            return f"{name} ERR {p['error'][:80]}"
        return f"{name} {p['check'][:4]} {p['time_us']:.1f} us f/t {p['floor_over_time']:.3f} {p['tflops']:.0f} TFLOP/s"
    s = (f"{r['case']:<16} rows {r['rows']:>4} active {r['active']:>3} N {r['N']} K {r['K']} floor "
         f"{r['floor_us']:.1f} us | {part('triton', r['triton'])} | {part('tilelang', r['tilelang'])}")
    for p in r.get("mma", ()):
        s += " | " + part("mma " + json.dumps(p["config"], separators=(",", ":")), p)
    if "sweep_best" in r:
        b = r["sweep_best"]
        s += " | best " + ("-" if b is None else "%s %.1f us f/t %.3f %.0f TFLOP/s" % (
            {k: b["config"][k] for k in SWEEP}, b["time_us"], b["floor_over_time"], b["tflops"]))
    return s


def dry_run(args) -> dict:
    """The cases, their bytes and the configs each kernel would run, without a GPU: routing,
    the launch each config renders (the Triton template's launch description), the TileLang
    program's config."""
    from deepinfer.codegen.library import tilelang_moe as tlm
    from deepinfer.codegen.library import triton_ops
    from deepinfer.codegen.targets import get_target
    from deepinfer.codegen.template import KernelSpec
    from deepinfer.ir import dtypes as dt
    from deepinfer.ir.types import TensorType, quantized

    w = preset_widths(args.preset)
    out = []
    for label, counts, n, k in cases(w):
        mtot, e = sum(counts), w["E"]
        spec = KernelSpec("grouped_gemm_fp4", (), (quantized("fp8e4m3", (mtot, k), "e8m0", (1, 32)),
                                                   quantized("fp4e2m1", (e, n, k), "e8m0", (1, 1, 32)),
                                                   TensorType(dt.i32, (e + 1,))), (TensorType(dt.bf16, (mtot, n)),))
        t = get_target("sm90")
        tpl = triton_ops.TEMPLATES_BY_OP["grouped_gemm_fp4"]
        # (prefill row counts run TileLang in a plan; the bench times the Triton kernel there too)
        assert tpl.supports(t, spec) or mtot > 32 * e, f"{label}: the Triton template does not take {spec.key()}"
        grids = {json.dumps({kk: c[kk] for kk in SWEEP}): tpl.render(t, spec, c).meta["kernels"][0]["grid"]
                 for c in (sweep_configs(mtot) if args.sweep else [triton_config(mtot)])}
        row = {"case": label, "rows": mtot, "active": sum(1 for c in counts if c), "N": n, "K": k,
               "bytes": floor_bytes(counts, n, k), "triton": triton_config(mtot),
               "tilelang": tlm.moe_default_config(t, mtot, n, k, e), "configs": len(grids),
               "default_grid": tpl.render(t, spec, triton_config(mtot)).meta["kernels"][0]["grid"]}
        out.append(row)
        print(row, flush=True)
    return {"preset": args.preset, "widths": w, "dry_run": out}
