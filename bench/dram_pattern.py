"""DRAM read rate of the decode weight streams' access patterns, without their arithmetic: each
program reads ROWS rows' PIECE-byte pieces at STEPS K offsets (rows ROW_BYTES apart: the decode
GEMMs' order, `strided`), or the same bytes as one contiguous piece per step (a weight stored tile
by tile, `tiled`), U steps' loads issued before any is used. Timed from CUDA graphs against a copy
of the same bytes. Not a test; on the GPU machine:

    python bench/dram_pattern.py [--out FILE]

If `tiled` reads much faster than `strided` with enough loads in flight, storing the decode
weights tile by tile (a load-time layout) would pay; if not, the decode GEMMs' DRAM share is their
own issue and latency (docs/performance.md, thirty-second session).
"""
import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def read_kernel(w_ptr, out_ptr, ROW_BYTES: tl.constexpr, ROWS: tl.constexpr, STEPS: tl.constexpr,
                TILED: tl.constexpr, PIECE: tl.constexpr, U: tl.constexpr):
    t = tl.program_id(0)
    r = tl.arange(0, ROWS)
    c = tl.arange(0, PIECE // 4)
    acc = tl.zeros([ROWS, PIECE // 4], tl.int32)
    base = w_ptr + t.to(tl.int64) * (ROWS * ROW_BYTES)
    for s0 in range(0, STEPS, U):
        for u in tl.static_range(U):
            s = s0 + u
            if TILED:
                off = s * (ROWS * PIECE) + r[:, None] * PIECE + c[None, :] * 4
            else:
                off = r[:, None] * ROW_BYTES + s * PIECE + c[None, :] * 4
            acc += tl.load((base + off).to(tl.pointer_type(tl.int32)), cache_modifier=".cg")
    tl.store(out_ptr + t * ROWS * (PIECE // 4) + r[:, None] * (PIECE // 4) + c[None, :], acc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = []
    # (what, bytes, row bytes): the b1 w13 MoE call of the medium plan (6 experts x 4608 rows of
    # K 5120 as fp4) and lin8's wo_b (5120 rows of K 8192 as fp8)
    for what, total, rb in (("moe w13 b1", 432 * 64 * 2560, 2560), ("lin8 wo_b", 5120 * 8192, 8192)):
        w = torch.randint(0, 255, (total,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(w)
        tc = triton.testing.do_bench_cudagraph(lambda: dst.copy_(w), rep=200, return_mode="median")
        for prow, piece, u, warps in ((16, 128, 4, 4), (16, 128, 10, 4), (64, 128, 4, 8), (8, 128, 10, 2),
                                      (16, 256, 5, 4)):
            steps = rb // piece
            if steps % u:
                continue
            progs = total // (prow * rb)
            out = torch.empty(progs * prow * (piece // 4), dtype=torch.int32, device="cuda")
            for tiled in (0, 1):
                def fn():
                    read_kernel[(progs,)](w, out, ROW_BYTES=rb, ROWS=prow, STEPS=steps, TILED=tiled, PIECE=piece,
                                          U=u, num_warps=warps)
                fn()
                t = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
                row = {"case": what, "bytes": total, "rows_a_program": prow, "piece": piece, "unroll": u,
                       "warps": warps, "tiled": tiled, "us": t * 1e3, "copy_us": tc * 1e3,
                       "read_TBps": total / t / 1e9, "copy_TBps": 2 * total / tc / 1e9}
                rows.append(row)
                print("%-11s rows %2d piece %3d unroll %2d warps %d %-7s %7.2f us read %.2f TB/s (copy %.2f TB/s)"
                      % (what, prow, piece, u, warps, "tiled" if tiled else "strided", row["us"], row["read_TBps"],
                         row["copy_TBps"]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
