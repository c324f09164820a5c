"""An analytic cost model of one kernel instance under one config, from the Target's capacities
(all of them modelled: datasheet peaks, never a measurement). It ranks the candidates of a call
where no hardware is present, and prunes them to the top-k where hardware is.

    time = max(bytes / HBM bandwidth, FLOPs / peak) / (wave efficiency x latency hiding)
           + launches x launch cost

- bytes and FLOPs: the op's own cost rule (ir/registry.py), so every config of a call moves the
  same bytes; configs differ in how well they use the machine, not in the work;
- wave efficiency: programs over the target's cores in whole waves (a last wave a tenth full
  wastes nine tenths of it); programs resident per core from the threads each takes;
- latency hiding: resident warps per core times pipeline stages against what keeps HBM busy;
- launches: every extra kernel of the instance (a split's sum, a combine) costs a launch.
"""
from __future__ import annotations

import math
import random

from ..ir.registry import get_op

LAUNCH_S = 2.5e-6  # a kernel launch inside a CUDA graph (modelled)
WARPS_TO_HIDE = 16  # resident warps x stages per core that keep the memory pipes busy (modelled)
THREADS_PER_CORE = 2048


def work(spec) -> tuple[float, float]:
    """(bytes, FLOPs) of the call by its op's cost rule."""
    op = get_op(spec.op)
    c = op.cost(list(spec.in_types), list(spec.out_types), spec.attr)
    return float(c.bytes_read + c.bytes_written), float(c.flops)


def estimate(target, spec, source) -> float:
    """Modelled seconds of one call rendered as `source` (a KernelSource: its launches' grids,
    warps and stages come from the render)."""
    nbytes, flops = work(spec)
    dtype = "fp8" if "fp8" in spec.key() else "bf16"
    peak = target.peak_flops.get(dtype) or max(target.peak_flops.values(), default=1e12)
    ideal = max(nbytes / max(target.hbm_bytes_per_s, 1.0), flops / peak)
    launches = _launches(source)
    main = max(launches, key=lambda ln: _programs(ln["grid"]))  # the launch that carries the work
    eff = _wave_efficiency(target, main) * _latency_hiding(target, main)
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
    programs = _programs(ln["grid"])
    slots = max(target.cores, 1) * _resident(target, ln)
    waves = math.ceil(programs / slots)
    busy = min(programs, max(target.cores, 1))  # cores with work at all
    return (programs / (waves * slots)) ** 0.5 * busy / max(target.cores, 1) if programs else 0.0


def _latency_hiding(target, ln) -> float:
    programs = _programs(ln["grid"])
    per_core = min(_resident(target, ln), math.ceil(programs / max(target.cores, 1)))
    in_flight = per_core * ln["warps"] * max(ln["stages"], 1)
    return min(1.0, in_flight / WARPS_TO_HIDE)


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
