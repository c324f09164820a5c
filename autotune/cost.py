"""An analytic cost model of one kernel instance under one config, from the Target's capacities
(all of them modelled: datasheet peaks, never a measurement). It ranks the candidates of a call
where no hardware is present, and prunes them to the top-k where hardware is.

    time = max((bytes + split partials) / HBM bandwidth, FLOPs / peak)
           / (wave efficiency x latency hiding x K-loop efficiency x register fit)
           + launches x launch cost

- bytes and FLOPs: the op's own cost rule (ir/registry.py), the same for every config of a call;
- split partials: a K split's fp32 partials, written by every split and read back by the
  combine: bytes the op's rule does not see, which grow with the split;
- wave efficiency: idle cores below one program per core, and the empty slots of the last wave
  past the resident slots; filling more resident slots within one wave earns nothing (a memory-
  or latency-bound kernel does not turn occupancy into speed);
- latency hiding: resident warps per core times pipeline stages against what keeps HBM busy;
- K-loop efficiency: a program's pipeline fills before its first tile and drains after its
  last, so a program of few K tiles (a deep split, a deep tile) spends much of its life there;
- register fit: an fp32 accumulator tile past half a thread's registers spills;
- launches: every extra kernel of the instance (a split's sum, a combine) costs a launch.

Its rank agreement with the H200's measurements (autotune/db/sm90.jsonl's candidates) is
recomputed by bench/cost_model_rank.py; docs/performance.md has the numbers.
"""
from __future__ import annotations

import math
import random

from ..ir.registry import get_op

LAUNCH_S = 2.5e-6  # a kernel launch inside a CUDA graph (modelled)
WARPS_TO_HIDE = 16  # resident warps x stages per core that keep the memory pipes busy (modelled)
THREADS_PER_CORE = 2048
# the exposed start and end of a program's K loop, in K tiles of steady-state time: a memory
# round trip before the first tile's MMA and the accumulator's store after the last (modelled)
PIPELINE_FILL_TRIPS = 2


def work(spec) -> tuple[float, float]:
    """(bytes, FLOPs) of the call by its op's cost rule."""
    op = get_op(spec.op)
    c = op.cost(list(spec.in_types), list(spec.out_types), spec.attr)
    return float(c.bytes_read + c.bytes_written), float(c.flops)


def estimate(target, spec, source) -> float:
    """Modelled seconds of one call rendered as `source` (a KernelSource: its launches' grids,
    warps and stages come from the render, its tile and split knobs from its config)."""
    nbytes, flops = work(spec)
    cfg = source.meta.get("config", {})
    dtype = "fp8" if "fp8" in spec.key() else "bf16"
    peak = target.peak_flops.get(dtype) or max(target.peak_flops.values(), default=1e12)
    nbytes += split_partial_bytes(spec, cfg)
    ideal = max(nbytes / max(target.hbm_bytes_per_s, 1.0), flops / peak)
    launches = _launches(source)
    main = max(launches, key=lambda ln: _programs(ln["grid"]))  # the launch that carries the work
    eff = (_wave_efficiency(target, main) * _latency_hiding(target, main) * _k_loop_efficiency(spec, cfg)
           * _register_fit(target, cfg, main))
    return ideal / max(eff, 1e-3) + LAUNCH_S * len(launches)


def _launches(source) -> list[dict]:
    ks = source.meta.get("kernels")
    if ks:
        return [{"grid": k["grid"], "warps": k["num_warps"], "stages": k["num_stages"]} for k in ks]
    cfg = source.meta.get("config", {})
    threads = math.prod(source.block) if source.block else 128
    return [{"grid": list(source.grid) or [1], "warps": max(1, threads // 32), "stages": cfg.get("stages", 2)}]


def _programs(grid) -> int:
    return math.prod(int(g) for g in grid) if grid else 1


def _resident(target, ln) -> int:
    return max(1, min(32, THREADS_PER_CORE // (32 * max(ln["warps"], 1))))


def _wave_efficiency(target, ln) -> float:
    """The share of the machine the programs keep busy. Below one program per core the idle
    cores are lost; past the resident slots programs run in waves and the last wave's empty
    slots are lost (the tail). In between every core works, and more resident programs per
    core are no faster for a memory- or latency-bound kernel: whether enough bytes are in
    flight is _latency_hiding's question, not occupancy's, so a partial single wave costs
    nothing here (rewarding it ranked the H200's decode GEMMs backwards)."""
    programs = _programs(ln["grid"])
    if not programs:
        return 0.0
    cores = max(target.cores, 1)
    if programs <= cores:
        return programs / cores
    slots = cores * _resident(target, ln)
    return 1.0 if programs <= slots else programs / (math.ceil(programs / slots) * slots)


def _latency_hiding(target, ln) -> float:
    programs = _programs(ln["grid"])
    per_core = min(_resident(target, ln), math.ceil(programs / max(target.cores, 1)))
    in_flight = per_core * ln["warps"] * max(ln["stages"], 1)
    return min(1.0, in_flight / WARPS_TO_HIDE)


def _register_fit(target, cfg: dict, ln) -> float:
    """1 where a program's fp32 accumulator tile (BM x BN over its threads) fits in half of a
    thread's registers (the other half holds the operand fragments, the dequantised weights and
    the addresses); past that the accumulator spills to local memory and comes back every K
    tile, slower in proportion to the excess. Registers proper come from the ptxas report after a
    build; this is the part a config decides before one."""
    bm, bn = cfg.get("BM", cfg.get("block_M")), cfg.get("BN", cfg.get("block_N"))
    if target.kind != "cuda" or not (isinstance(bm, int) and isinstance(bn, int)):
        return 1.0  # an Ascend cube unit accumulates in L0C, whose capacity legality already checks
    acc = bm * bn / (32 * max(ln["warps"], 1))
    room = max(target.regs_per_thread, 1) / 2
    return min(1.0, room / acc) if acc else 1.0


def _split(cfg: dict) -> int:
    """The K split a config asks for (the templates call it SPLIT or split_k); 1 without one."""
    for k in ("SPLIT", "split_k"):
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            return v
    return 1


def _contraction(spec) -> tuple[int, int, int] | None:
    """(rows, output columns, K) of a call contracting its first input with a weight (its second
    input: [N, K], or [E, N, K] per expert), None for a call without one."""
    if len(spec.in_types) < 2:
        return None
    x = getattr(spec.in_types[0], "data", spec.in_types[0]).shape
    w = getattr(spec.in_types[1], "data", spec.in_types[1]).shape
    if len(x) < 2 or len(w) < 2 or not all(isinstance(d, int) for d in (*x, *w)):
        return None
    return int(x[0]), int(w[-2]), int(w[-1])


def split_partial_bytes(spec, cfg: dict) -> float:
    """The bytes a K split adds: each of its splits writes an fp32 partial of the contraction's
    output (rows x output columns, zeros for an empty tile included) and the combine reads them
    back. The op's cost rule counts the output once, in its own dtype."""
    split = _split(cfg)
    mnk = _contraction(spec) if split > 1 else None
    if not mnk:
        return 0.0
    rows, n, _ = mnk
    return 2.0 * 4 * split * rows * n


def _k_loop_efficiency(spec, cfg: dict) -> float:
    """trips / (trips + fill) for a program's K loop of `trips` tiles (K over split x BK): the
    first tile's load latency is exposed before any MMA and the accumulator's store after the
    last, about PIPELINE_FILL_TRIPS tiles' worth, which a long loop amortises and a short one
    (a deep split) does not. 1 for a config with no K tile knob (BK or block_K)."""
    bk = cfg.get("BK", cfg.get("block_K"))
    mnk = _contraction(spec)
    if not isinstance(bk, int) or bk <= 0 or not mnk:
        return 1.0
    trips = max(1, math.ceil(mnk[2] / (_split(cfg) * bk)))
    return trips / (trips + PIPELINE_FILL_TRIPS)


def rank(target, spec, candidates: list[tuple[dict, object]], seed: int = 0) -> list[tuple[float, dict]]:
    """[(modelled seconds, config)] fastest first, for (config, rendered source) pairs. Configs
    the model cannot tell apart (knobs it does not see, such as stages past hiding the latency)
    come in a seeded random order, not the enumeration's: a top k of ties is then a sample of
    them, not k neighbours differing in the last knob."""
    scored = [(estimate(target, spec, src), cfg) for cfg, src in candidates]
    random.Random(seed).shuffle(scored)
    return sorted(scored, key=lambda t: round(t[0] * 1e9))  # to the nanosecond: float noise is no rank


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation of two equally long lists (ties take their average rank); None
    below 3 pairs or where one list is constant (no ranking to agree with)."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} and {len(ys)} values")
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else None


def agreement(manifest: dict, rows: list[dict]) -> dict[str, dict]:
    """How well the cost model ranked what was measured, per template: Spearman's correlation of
    the modelled and the measured (p50) times over the candidates of each measured instance
    (`manifest`: a candidates directory's, autotune/candidates.py; `rows`: measured database rows
    carrying their candidates), and its mean over the template's instances."""
    out: dict[str, dict] = {}
    for row in rows:
        e = manifest["instances"].get(row.get("instance"))
        if e is None or e["spec"] != row.get("spec") or not row.get("measured"):
            continue
        modelled = {c["id"]: c.get("modelled_us") for c in e["candidates"]}
        pairs = [(modelled[t["id"]], t["p50"]) for t in row.get("candidates") or []
                 if t.get("p50") is not None and modelled.get(t["id"]) is not None]
        rho = spearman([p[0] for p in pairs], [p[1] for p in pairs])
        t = out.setdefault(row["template"], {"instances": 0, "ranked": 0, "rho": []})
        t["instances"] += 1
        if rho is not None:
            t["ranked"] += 1
            t["rho"].append(rho)
    for t in out.values():
        t["mean_rho"] = sum(t["rho"]) / len(t["rho"]) if t["rho"] else None
    return out


def agreement_lines(agree: dict[str, dict]) -> list[str]:
    """The measure run's closing lines: per template, the cost model's mean rank correlation."""
    lines = ["cost model vs measured (Spearman's rho over each instance's candidates):"]
    for name, t in sorted(agree.items()):
        rho = "n/a" if t["mean_rho"] is None else f"{t['mean_rho']:+.2f}"
        lines.append(f"  {name:<34} mean rho {rho:>5} over {t['ranked']} of {t['instances']} instances")
    return lines
