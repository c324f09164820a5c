"""gemm_fp8's inflight program (tilelang_prefill_bf16.rows_inflight_program, off) checked at whole
tiles, as generated and under edits of its CUDA, one row a variant. On an H100 it lost its last K
step's MMAs at whole 128-row tiles, while its 200-row tiny case passed: with the last step's MMAs
left in flight across the K loop's exit, ptxas converted accumulator registers for the
(unguarded) stores ahead of the epilogue's wait. The program now waits for them in the last step
(docs/performance.md, thirty-seventh session). Run on the device machine:

    python bench/inflight_check.py [--rows SUBSTRING] [--out FILE]

Each row compiles with TileLang's cache off (a callback edits the generated CUDA), runs each shape
three times on the same inputs (bench/kernels_tilelang.py's gemm_fp8 case), and reports the max
relative error, the outputs past 2^-7 of their reference plus 2^-16 of the row's largest, and
whether the runs agree; then the step probe at 128 x 512 x 512: the weight all ones, every scale
1, x ones on one 64-deep K step at a time (every output 64), listing the steps that come out
wrong. Rows whose every shape passes are timed at the medium 4K's wo_b and wq_b beside sm90's
fp8 program, in the same run. A table last.
"""
import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels_tilelang as kt  # noqa: E402


def last_step_in_flight(code: str) -> str:
    """The bug back: the K loop's last step leaves its MMAs in flight (wait_group 1) across the
    loop's exit, as every step did before the thirty-seventh session, and the wait for every MMA
    after the loop, before the epilogue's stores."""
    return re.sub(r"if \(kk == \d+\) \{\s*tl::wait_wgmma<0>\(\);\s*\} else \{\s*tl::wait_wgmma<1>\(\);\s*\}(\s*)\}",
                  r"tl::wait_wgmma<1>();\1}\1tl::wait_wgmma<0>();", code)


def no_mma_in_flight(code: str) -> str:
    return code.replace("tl::wait_wgmma<1>();", "tl::wait_wgmma<0>();")


# (name, config over {"inflight": 1}, edit of the CUDA)
ROWS = [
    ("as generated", {}, None),
    ("last step's MMAs in flight (the bug)", {}, last_step_in_flight),
    ("no MMA in flight (control)", {}, no_mma_in_flight),
    ("one warpgroup a CTA", {"threads": 128, "block_N": 64}, None),
    ("256 x-rows", {"block_M": 256}, None),
    ("256 x-rows, last step's MMAs in flight", {"block_M": 256}, last_step_in_flight),
]
SHAPES = [(200, 256, 512), (128, 512, 512), (4096, 5120, 8192), (4096, 32768, 1280)]
TIMED = [("wo_b", 4096, 5120, 8192), ("wq_b", 4096, 32768, 1280)]


def build(case, edit):
    from tilelang.engine.callback import register_cuda_postproc

    register_cuda_postproc(lambda code, target: edit(code) if edit else code)
    return [kt.tlg.compile_kernel(p) for p in case["program"]()]


def check(case, ks):
    x = case["inputs"]()
    outs = [case["run"](ks, x).float() for _ in range(3)]
    torch.cuda.synchronize()
    ref = case["ref"](x).float()
    tol = ref.abs() * 2.0 ** -7 + ref.abs().amax(1, keepdim=True) * 2.0 ** -16
    return {"max_rel": max(kt.rel_err(o, ref)[0] for o in outs),
            "past_tol": max(int(((o - ref).abs() > tol).sum()) for o in outs), "outputs": ref.numel(),
            "same": all(torch.equal(outs[0], o) for o in outs)}


def step_probe(config, edit):
    """The K steps whose ones come out other than 64 (weight ones, scales 1, 128 x 512 x 512)."""
    M, N, K = 128, 512, 512
    ks = build(kt.gemm_fp8_case("probe", M, N, K, config, bf16=True), edit)
    W = torch.ones(N, K, device="cuda").to(torch.float8_e4m3fn).view(torch.uint8).view(torch.uint32)
    SW = torch.full((N // 32, K // 32), 127, device="cuda", dtype=torch.uint8).view(torch.uint32)
    wrong = []
    for s in range(K // 64):
        a = torch.zeros(M, K, device="cuda", dtype=torch.bfloat16)
        a[:, s * 64:(s + 1) * 64] = 1
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        ks[0](a, W, SW, out)
        torch.cuda.synchronize()
        if not torch.equal(out.float(), torch.full_like(out.float(), 64)):
            wrong.append(s)
    return wrong


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="", help="substring filter on row names ('|' between alternatives)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "inflight_check.json"))
    args = ap.parse_args()
    import tilelang
    import triton

    tilelang.disable_cache()  # each row's edit must reach its build
    results = []
    for name, over, edit in ROWS:
        if args.rows and not any(p in name for p in args.rows.split("|")):
            continue
        config = dict(kt.tlmp.ROWS_TILES, inflight=1, **over)
        row = {"row": name, "config": config, "shapes": {}}
        for M, N, K in SHAPES:
            case = kt.gemm_fp8_case("check", M, N, K, config, bf16=True)
            try:
                row["shapes"][f"{M}x{N}x{K}"] = check(case, build(case, edit))
            except Exception as e:  # noqa: BLE001  (a row that does not build or run is reported, not fatal)
                row["shapes"][f"{M}x{N}x{K}"] = {"error": f"{type(e).__name__}: {str(e)[-300:]}"}
        row["wrong_steps"] = step_probe(config, edit)
        row["pass"] = all(r.get("past_tol") == 0 and r.get("same") for r in row["shapes"].values())
        if row["pass"]:
            row["us"] = {}
            for label, M, N, K in TIMED:
                case = kt.gemm_fp8_case(label, M, N, K, config, bf16=True)
                ks, x = build(case, edit), case["inputs"]()
                row["us"][label] = 1e3 * triton.testing.do_bench(lambda: case["run"](ks, x), return_mode="median")
        print(json.dumps(row), flush=True)
        results.append(row)
    ref_us = {}
    for label, M, N, K in TIMED:  # sm90's program for these linears (fp8 MMAs, per-32 promotion)
        case = kt.gemm_fp8_case(label, M, N, K, shipped=True)
        ks, x = build(case, None), case["inputs"]()
        ref_us[label] = 1e3 * triton.testing.do_bench(lambda: case["run"](ks, x), return_mode="median")
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "tilelang": tilelang.__version__, "rows": results,
                   "sm90_program_us": ref_us}, f, indent=1)
    print(f"\n{'row':36s} {'pass':5s} {'wrong steps':12s} " + " ".join(f"{n:>14s}" for n, *_ in TIMED))
    print(f"{'sm90 fp8 program (us)':36s} {'':5s} {'':12s} " + " ".join(f"{ref_us[n]:14.1f}" for n, *_ in TIMED))
    for r in results:
        us = " ".join(f"{r['us'][n]:8.1f} {ref_us[n] / r['us'][n]:4.2f}x" for n, *_ in TIMED) if "us" in r else ""
        print(f"{r['row']:36s} {str(r['pass']):5s} {str(r['wrong_steps']):12s} {us}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
