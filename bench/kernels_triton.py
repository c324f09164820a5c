"""Triton templates on the GPU at V4.1-Flash decode (batch 1, 64) and prefill (4096 tokens) shapes:
each checked against its op's reference (codegen/library/triton_check.py rules), then timed
against its byte floor at the copy bandwidth measured in the same run, and, where DeepSeek's
TileKernels has the same kernel, against TileKernels at the same shapes in the same run
(bench/tilekernels_peer.py says what each pairing covers). Not a test; run on the H200:

    python bench/kernels_triton.py --out bench/results/triton_h200.json [--only OP] [--no-check]
    python bench/kernels_triton.py --only grouped_gemm_fp4 [--sweep] [--dry-run]   (bench/moe_decode.py:
        the decode MoE GEMM against the TileLang template; JSON to $OUT/moe_decode.json when OUT is set)

Floor = bytes moved / copy bandwidth, with each input read once and each output written once;
gathers and cache writes count only the rows they touch. "floor/time" 1.0 = at the floor.
"""
import argparse
import datetime
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

from ceilings import measure_ceilings  # noqa: E402

from deepinfer.codegen.library import triton_check, triton_ops  # noqa: E402
from deepinfer.codegen.targets import get_target  # noqa: E402
from deepinfer.ir.quant import QTensor  # noqa: E402

SIZES = {"decode b1": 1, "decode b64": 64, "prefill 4K": 4096}
# gathers read only the rows they hand out; cache writes touch only the rows they write
GATHERS = {"embedding", "gather_rows", "moe_gather_rows", "engram_gather"}
CACHE_WRITES = {"swa_write", "compress_state_write", "engram_hist_write", "compressed_write"}


def _bytes(v) -> int:
    if isinstance(v, QTensor):
        return _bytes(v.data) + _bytes(v.scale)
    if isinstance(v, (tuple, list)):
        return sum(_bytes(x) for x in v)
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def moved_bytes(op: str, ins, out) -> int:
    if op in GATHERS:  # the rows handed out, read once and written once, and the indices
        return 2 * _bytes(out) + _bytes(ins[0] if op == "embedding" else ins[1])
    if op in CACHE_WRITES:  # the new rows and their metadata are read, the rows written once
        new = sum(_bytes(v) for v in ins[1:] if not (isinstance(v, torch.Tensor) and v.dtype in (torch.int32,)))
        meta = sum(_bytes(v) for v in ins[1:] if isinstance(v, torch.Tensor) and v.dtype == torch.int32)
        return 2 * new + meta
    return _bytes(list(ins)) + _bytes(out)


launcher = triton_check.launcher
# the configs an sm90 plan runs (the target's own defaults over the templates', e.g. the prefill
# mix's split): a sweep's rows and its default row are then what the plan would launch
TARGET = get_target("sm90")


# TRITON_DIMS: widths over triton_check.REAL for every case, e.g. '{"index_cap_fixed": 10240}' (the
# indexer's entries a row at a 20K-token model length)
DIMS = dict(triton_check.REAL, **json.loads(os.environ.get("TRITON_DIMS", "{}")))


def run_case(op, n, cfg, bench, ceil, check=True):
    ref_op = triton_check.case_op(op)
    ins, attrs = triton_check.make_case(op, DIMS, n, "cuda", seed=n)
    cfg = dict(cfg or triton_ops.default_config(ref_op, n, TARGET))
    kw = triton_ops.launch_attrs(ref_op, attrs)
    row = {"op": op, "n": n, "config": cfg}
    if check:
        why = triton_check.check(op, launcher(op), DIMS, n, device="cuda", cfg=cfg, seed=n)
        row["check"] = "pass" if why is None else "FAIL: " + why
    fresh = [QTensor(v.data.clone(), v.scale.clone()) if isinstance(v, QTensor) else
             (v.clone() if isinstance(v, torch.Tensor) else v) for v in ins]
    out = launcher(op)(*fresh, **kw, cfg=cfg)
    t = bench(lambda: launcher(op)(*fresh, **kw, cfg=cfg))
    b = moved_bytes(op, ins, out)
    floor = b / ceil["copy_bytes_per_s"]
    row.update(time_us=t * 1e3, bytes=b, floor_us=floor * 1e6, floor_over_time=floor / (t * 1e-3))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results", "triton_h200.json"))
    ap.add_argument("--only", default="", help="comma-separated ops")
    ap.add_argument("--no-check", action="store_true", help="time only (tests/gpu/test_triton_ops.py checks)")
    ap.add_argument("--sizes", default=",".join(SIZES), help="comma-separated cases of: " + ", ".join(SIZES))
    ap.add_argument("--no-peer", action="store_true", help="skip the TileKernels comparison")
    ap.add_argument("--graphs", action="store_true",
                    help="time each launch replayed from a CUDA graph (as a plan's decode steps run), "
                         "which takes the host's launch cost out of microsecond kernels")
    ap.add_argument("--sweep", action="store_true", help="grouped_gemm_fp4: time a grid of Triton configs per case")
    ap.add_argument("--dry-run", action="store_true", help="grouped_gemm_fp4: build the cases on the CPU only")
    ap.add_argument("--preset", default="v4.1-flash", help="grouped_gemm_fp4: the model preset giving the widths")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    args = ap.parse_args()
    sizes = {k: SIZES[k] for k in args.sizes.split(",")}
    if args.only == "grouped_gemm_fp4":
        return moe_main(args)
    import triton

    def eager(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def bench(fn):
        if args.graphs:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        return eager(fn)

    if not args.no_peer:  # TileKernels compiles on first use: in parallel, before anything is timed
        import tilekernels_peer

        for m in tilekernels_peer.warm(args.only.split(",") if args.only else tilekernels_peer.COVERED):
            print("peer warm-up:", m, flush=True)
    ceil = measure_ceilings(eager)  # a 1 GiB copy replayed from a graph reads slower (2.8 TB/s on the H200)
    ops = args.only.split(",") if args.only else triton_check.CASES
    rows = []
    for op in ops:
        for label, n in sizes.items():
            try:
                row = run_case(op, n, None, bench, ceil, check=not args.no_check)
            except Exception as e:  # noqa: BLE001  (reported per case, the run goes on)
                row = {"op": op, "n": n, "error": f"{type(e).__name__}: {str(e).strip()[-300:]}"}
            row["case"] = label
            rows.append(row)
            print({k: v for k, v in row.items() if k != "config"}, flush=True)
    # TRITON_CONFIGS: {"op": [config, ...]}, each config over the op's default at every size, e.g.
    # '{"hc_mix": [{"SPLIT": 8, "BM": 16, "BK": 32, "num_stages": 2}]}' (a sweep of a target's settings)
    for op, cfgs in json.loads(os.environ.get("TRITON_CONFIGS", "{}")).items():
        for label, n in sizes.items():
            for over in cfgs:
                cfg = dict(triton_ops.default_config(triton_check.case_op(op), n, TARGET), **over)
                try:
                    row = run_case(op, n, cfg, bench, ceil, check=not args.no_check)
                except Exception as e:  # noqa: BLE001
                    row = {"op": op, "n": n, "config": cfg, "error": f"{type(e).__name__}: {str(e).strip()[-300:]}"}
                row["case"] = label + " " + "".join(f"{a}{b}" for a, b in sorted(over.items()))
                rows.append(row)
                print({k: v for k, v in row.items() if k != "config"}, flush=True)
    # hc_pre's split-K knob at each size: the default is chosen from these times
    splits = []
    if "hc_pre" in ops:
        base = triton_ops.default_config("hc_pre", None, TARGET)
        for label, n in sizes.items():
            if n > 64:
                continue
            for split in triton_ops.TEMPLATES_BY_OP["hc_pre"].knobs["SPLIT"]:
                for bk in (32, 64, 128):
                    cfg = dict(base, SPLIT=split, BM=16, BK=bk)
                    try:
                        row = run_case("hc_pre", n, cfg, bench, ceil, check=not args.no_check)
                    except Exception as e:  # noqa: BLE001
                        row = {"op": "hc_pre", "n": n, "config": cfg, "error": f"{type(e).__name__}: {e}"[-300:]}
                    row["case"] = label
                    splits.append(row)
                    print({k: v for k, v in row.items() if k not in ("op",)}, flush=True)
    # the block linear's K split (wo_a, fp32-compute linears) at the decode sizes
    if any(op in ops for op in ("grouped_linear", "linear")):
        for op in ("grouped_linear", "linear"):
            if op not in ops:
                continue
            for label, n in sizes.items():
                if n > 64:
                    continue
                for split in triton_ops.TEMPLATES_BY_OP[op].knobs["SPLIT"]:
                    for bn in (32, 64, 128):
                        cfg = dict(triton_ops.default_config(op, n, TARGET), SPLIT=split, BN=bn)
                        try:
                            row = run_case(op, n, cfg, bench, ceil, check=not args.no_check)
                        except Exception as e:  # noqa: BLE001
                            row = {"op": op, "n": n, "config": cfg, "error": f"{type(e).__name__}: {e}"[-300:]}
                        row["case"] = label
                        splits.append(row)
                        print({k: v for k, v in row.items() if k not in ("op",)}, flush=True)
    peers = []
    if not args.no_peer:
        peers = tilekernels_peer.compare(bench, ceil, ops)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda, "date": datetime.date.today().isoformat(), "ceilings": ceil,
           "timing": "cuda graph replay" if args.graphs else "eager launches (do_bench)",
           "rows": rows, "hc_pre_split": splits, "peer": peers}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, args.out)
    print("\n%-28s %-10s %-6s %9s %9s %6s" % ("op", "case", "check", "time_us", "floor_us", "f/t"))
    for r in rows:
        print("%-28s %-10s %-6s %9s %9s %6s" % (
            r["op"][:28], r["case"], r.get("check", "-")[:6], "%.1f" % r["time_us"] if "time_us" in r else "ERR",
            "%.1f" % r["floor_us"] if "floor_us" in r else "-",
            "%.2f" % r["floor_over_time"] if "floor_over_time" in r else "-"))
    if splits:
        print("\nsplit-K (op/case/split/BM/BN/BK = us, floor/time):")
        for r in splits:
            c = r["config"]
            t = "%.1f" % r["time_us"] if "time_us" in r else "ERR"
            f = "%.2f" % r["floor_over_time"] if "floor_over_time" in r else "-"
            print("  %s/%s/S%d/BM%d/BN%d/BK%d = %s %s" % (r.get("op", "hc_pre"), r["case"], c["SPLIT"], c["BM"],
                                                       c.get("BN", 0), c.get("BK", 0), t, f))
    for p in peers:
        print("peer:", p)
    print("copy ceiling %.2f TB/s" % (ceil["copy_bytes_per_s"] / 1e12))
    return 0 if all(r.get("check", "pass") == "pass" for r in rows) else 1


def moe_main(args):
    import moe_decode

    if args.dry_run:
        res = moe_decode.dry_run(args)
    else:
        import triton

        def bench(fn):
            if args.graphs:
                return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

        ceil = measure_ceilings(lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        res = moe_decode.run(args, bench, ceil)
        res.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__, ceilings=ceil,
                   timing="cuda graph replay" if args.graphs else "eager launches (do_bench)",
                   date=datetime.date.today().isoformat())
        print("copy ceiling %.2f TB/s" % (ceil["copy_bytes_per_s"] / 1e12))
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "moe_decode%s.json" % ("_dry" if args.dry_run else ""))
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", path)
    rows = res.get("rows", [])
    return 0 if all(r[k].get("check") == "pass" for r in rows for k in ("triton", "tilelang") if r[k]) else 1


if __name__ == "__main__":
    sys.exit(main())
