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
