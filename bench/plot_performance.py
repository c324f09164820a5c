"""The plots of docs/performance.md from measured results (run here, not on the device; needs
matplotlib, which the package does not):

    python bench/plot_performance.py --e2e bench/results/e2e_medium_*.json \
        --kernels bench/results/tilelang_*.json bench/results/triton_*.json --out docs/img

- decode_floor.png (from --e2e, bench/e2e_medium.py's file): each decode bucket's step time
  against its byte floor by batch size, log-log, with the 2x / 1.6x lines of issue #19;
- roofline.png (from --kernels, kernels_tilelang.py / kernels_triton.py files): every timed case as
  achieved FLOP/s against arithmetic intensity under the copy-bandwidth and fp8 / bf16 roofs
  measured in the same run as it (the first file's ceilings draw the roofs).
Every plot's title names the GPU and date of its data.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_performance: matplotlib is not installed (pip install matplotlib)")
    return plt


def decode_points(res: dict) -> list[tuple[int, float, float]]:
    """(batch, step ms, floor ms) of each decode bucket of an e2e_medium.py result, by batch."""
    m = res.get("medium", {})
    pts = [(int(k.removeprefix("decode_b")), v["graph"]["wall_ms"], v["floor_ms"]) for k, v in m.items()
           if k.startswith("decode_b") and isinstance(v, dict) and "floor_ms" in v and "graph" in v]
    return sorted(pts)


def roofline_points(res: dict) -> list[tuple[str, float, float]]:
    """(case, FLOP per byte, achieved FLOP/s) of each timed case with bytes and FLOPs."""
    out = []
    for r in res.get("rows", []):
        t, b, f = r.get("time_us"), r.get("bytes"), r.get("flops")
        if t and b and f:
            out.append((r.get("name") or f"{r.get('op')} {r.get('case', '')}", f / b, f / (t * 1e-6)))
    return out


def plot_decode(res: dict, path: str) -> None:
    plt = _plt()
    pts = decode_points(res)
    if not pts:
        sys.exit("plot_performance: the --e2e file has no decode bucket with a floor (bench/e2e_medium.py writes them)")
    b, t, f = zip(*pts)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(b, t, "o-", label="decode step (CUDA graph)")
    ax.plot(b, f, "k--", label="byte floor")
    ax.plot(b, [2 * x for x in f], ":", color="gray", label="2x floor")
    ax.plot(b, [1.6 * x for x in f], ":", color="silver", label="1.6x floor")
    for x, y, z in pts:
        ax.annotate(f"{y / z:.2f}x", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="batch (sequences)", ylabel="ms per step",
           title=f"medium sm90 decode, {res.get('gpu', '?')}, {res.get('date', '?')}")
    ax.set_xticks(b, [str(x) for x in b])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_roofline(results: list[dict], path: str) -> None:
    plt = _plt()
    ceil = results[0].get("ceilings") or sys.exit("plot_performance: the first --kernels file has no ceilings")
    pts = [p for r in results for p in roofline_points(r)]
    if not pts:
        sys.exit("plot_performance: no timed case with bytes and FLOPs in the --kernels files")
    lo, hi = min(p[1] for p in pts) / 2, max(p[1] for p in pts) * 2
    xs = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    bw = ceil["copy_bytes_per_s"]
    fig, ax = plt.subplots(figsize=(7, 5))
    for peak, name in ((ceil["fp8_flops"], "fp8"), (ceil["bf16_flops"], "bf16")):
        ax.plot(xs, [min(bw * x, peak) for x in xs], "--", label=f"{name} roof ({peak / 1e12:.0f} TFLOP/s)")
    for name, ai, fl in pts:
        ax.plot(ai, fl, "o", ms=4)
        ax.annotate(name[:28], (ai, fl), fontsize=6, textcoords="offset points", xytext=(3, 2))
    ax.set(xscale="log", yscale="log", xlabel="FLOP per byte", ylabel="FLOP/s",
           title=f"kernels on the roofline (copy {bw / 1e12:.2f} TB/s), {results[0].get('gpu', '?')}, "
                 f"{results[0].get('date', '?')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--e2e", help="a bench/e2e_medium.py result")
    p.add_argument("--kernels", nargs="*", default=[], help="kernels_tilelang.py / kernels_triton.py results")
    p.add_argument("--out", default="docs/img")
    a = p.parse_args(argv)
    if not a.e2e and not a.kernels:
        p.error("give --e2e, --kernels or both")
    os.makedirs(a.out, exist_ok=True)
    if a.e2e:
        plot_decode(json.load(open(a.e2e)), os.path.join(a.out, "decode_floor.png"))
    if a.kernels:
        plot_roofline([json.load(open(f)) for f in a.kernels], os.path.join(a.out, "roofline.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
