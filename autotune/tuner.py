"""Tuning a compiled plan: every generated instance's legal configs (autotune/space.py), ranked by
the cost model (autotune/cost.py), the top-k timed by a `timer` where hardware is present, the
best written to the tuning database after each instance (an interrupted run keeps what it
measured, and a rerun skips what it holds), and a table of what changed.

A timer is `timer(template, spec, config, source) -> {"p20", "p50", "p80", "repeats"}` in
microseconds, raising for a candidate that fails (a wrong result, a crash, a timeout): it is
recorded as failed and never wins. In CI a fake timer stands in for the GPU.
"""
from __future__ import annotations

import ast
import datetime
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..ir.text import parse_type
from . import cost
from .db import TuningDB, structure_key
from .space import candidates


class TuneError(ValueError):
    """A tuning run that cannot start: one line naming the problem."""


def parse_spec(key: str):
    """A KernelSpec from its key (`op(type, type, ...){attrs}`, as plans record instances): the
    output types follow from the op's rule."""
    from ..codegen.template import KernelSpec
    from ..ir.registry import get_op

    op, rest = key.split("(", 1)
    depth, i = 1, 0
    while depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    args, attrs = rest[:i - 1], ast.literal_eval(rest[i:] or "{}")
    parts, depth, cur = [], 0, ""
    for ch in args:
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    ins = tuple(parse_type(p) for p in parts)
    outs = tuple(get_op(op).infer_types(list(ins), attrs))
    return KernelSpec(op, tuple(sorted(attrs.items())), ins, outs)


def language_of(template: str) -> str:
    return {"triton": "triton", "tilelang": "cuda", "ascend": "ascendc"}.get(template.split("_", 1)[0], "torch")


def fingerprint(target, template: str, device: dict | None = None) -> dict:
    """What a measurement depends on: the device (None where none is present: rows can then only
    be borrowed), the toolchain that builds the template's language, and the template's code."""
    from ..codegen.build import toolchain_versions
    from ..codegen.instances import _template_code

    lang = language_of(template)
    tool = dict(toolchain_versions(lang, int("".join(ch for ch in target.arch if ch.isdigit()) or 0)))
    tool["template_code"] = _template_code(template)
    return on_device({"target": target.name, "arch": target.arch, "cores": target.cores, "toolchain": tool}, device)


def on_device(fp: dict, device: dict | None) -> dict:
    """A fingerprint made where the kernels are built, with the device that times them: the
    toolchain stays the building host's, since it decided the binaries the device ran."""
    d = device or {}
    return dict(fp, device=d.get("name"), cores=d.get("cores", fp.get("cores")), driver=d.get("driver"),
                runtime=d.get("runtime"))


def make_row(fp: dict, template: str, spec, spec_key: str, config: dict, timings: dict | None, *, measured: bool,
             status: str = "ok", **extra) -> dict:
    """A database row (autotune/db.py) for one call's best config; `extra` keys ride along (the
    candidates a measurement tried, the host that built them)."""
    structure, bucket = structure_key(spec)
    return {"fingerprint": fp, "template": template, "structure": structure, "spec": spec_key, "bucket": bucket,
            "config": config, "timings": timings, "status": status, "measured": measured,
            "provenance": {"host": socket.gethostname(), "date": datetime.date.today().isoformat(),
                           "source": "measured" if measured else "cost model"}, **extra}


def only_names(only, templates, instances=()) -> set[str] | None:
    """--only as a set of names (a comma-separated string or a list), None for all: template
    names, or instance ids (as plan.json names them); a name that is neither is an error naming
    the templates there are."""
    if only is None:
        return None
    names = {n.strip() for n in (only.split(",") if isinstance(only, str) else only) if n.strip()}
    if not names:  # (was: --only '' tuned every instance, --only , none)
        raise TuneError(f"--only names no template or instance, got {only!r}")
    unknown = sorted(names - set(templates) - set(instances))
    if unknown:
        raise TuneError(f"--only: no template or instance {unknown[0]!r} (templates: {', '.join(sorted(templates))})")
    return names


@dataclass
class Result:
    instance: str
    template: str
    spec: str
    calls: int  # calls per step, over the plan's buckets
    default_us: float
    tuned_us: float
    config: dict
    measured: bool
    pruned: int = 0
    failed: int = 0
    skipped: bool = False  # the database already held an exact row

    @property
    def speedup(self) -> float:
        return self.default_us / self.tuned_us if self.tuned_us else 1.0


@dataclass
class TuneRun:
    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0
    left: int = 0  # instances a budget left for a rerun


def calls_per_instance(plan: dict) -> Counter:
    n: Counter = Counter()
    for g in plan["graphs"].values():
        for c in g["calls"]:
            for launch in c["launch"].values():
                if launch.get("kernel"):
                    n[launch["kernel"]] += 1
    return n


def selected_plan(model: str, options) -> dict:
    """What a compile of `model` with `options` (passes/driver.CompileOptions) would record of its
    kernels (every instance's template and spec, and the calls that launch them per bucket),
    with nothing rendered or built: all a cost-model run reads of a plan. Template defaults
    only (no tuning database), so the instances are the untuned plan's."""
    import dataclasses

    from ..passes.driver import select_calls

    calls, instances = select_calls(model, dataclasses.replace(options, tuning_db="none"))
    return {"target": {"name": options.target},
            "kernels": {inst: {"template": t, "spec": spec.key()} for inst, t, spec, _, _ in instances.values()},
            "graphs": {name: {"calls": cs} for name, cs in calls.items()}}


def tune(plan_dir, db: TuningDB, *, timer=None, device: dict | None = None, budget_s: float | None = None,
         only: str | None = None, top_k: int = 8, limit: int = 64, progress=None, jobs: int = 1) -> TuneRun:
    """`plan_dir`: a compiled plan's directory, or a plan-like dict (`selected_plan`)."""
    from ..codegen.instances import render_many
    from ..codegen.targets import get_manifest
    from ..codegen.template import templates
    from ..runtime.plan_file import load_plan

    plan = plan_dir if isinstance(plan_dir, dict) else load_plan(Path(plan_dir))
    manifest = get_manifest(plan["target"]["name"])
    target = manifest.target
    known = templates()
    wanted = only_names(only, known, plan["kernels"])
    calls = calls_per_instance(plan)
    todo = generated_instances(plan, known, wanted)
    run, t0 = TuneRun(), time.perf_counter()
    for n, (inst, k) in enumerate(todo):
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            run.left = len(todo) - n
            break
        if progress:
            progress(n, len(todo), k["template"])
        tpl, spec = known[k["template"]], parse_spec(k["spec"])
        fp = fingerprint(target, tpl.name, device)
        held = db.held(fp, tpl.name, spec)
        if held and held["status"] == "ok" and (held["measured"] or timer is None):
            run.results.append(Result(inst, tpl.name, k["spec"], calls[inst], _us(held), _us(held),
                                      held["config"], held["measured"], skipped=True))
            continue
        # through the render cache (a TileLang render lowers, seconds each), `jobs` at a time
        cands, pruned = candidates(manifest, tpl, spec, limit=limit, render_all=lambda cfgs: render_many(
            [(tpl.name, spec, c) for c in cfgs], target, jobs, on_error=lambda i, why: None))
        if not cands:
            continue
        ranked = cost.rank(target, spec, [(c.config, c.source) for c in cands])
        by_cfg = {config_key(c.config): c for c in cands}
        default = cands[0]  # space.candidates puts the default first
        failed = 0
        if timer is None:
            modelled = {config_key(cfg): s * 1e6 for s, cfg in ranked}
            default_us = modelled[config_key(default.config)]
            # a tie keeps the default: the model gives no reason to move
            best_cfg = default.config if round(default_us * 1e3) <= round(ranked[0][0] * 1e9) else ranked[0][1]
            best = {"p50": modelled[config_key(best_cfg)]}
        else:
            timed = {}
            pick = [cfg for _, cfg in ranked[:top_k]]
            if config_key(default.config) not in {config_key(c) for c in pick}:
                pick.append(default.config)
            for cfg in pick:
                try:
                    timed[config_key(cfg)] = (cfg, timer(tpl, spec, cfg, by_cfg[config_key(cfg)].source))
                except Exception:  # noqa: BLE001  (a failing candidate is recorded, never wins)
                    failed += 1
            if not timed:
                continue
            best_cfg, best = min(timed.values(), key=lambda t: t[1]["p50"])
            d = timed.get(config_key(default.config))
            default_us = d[1]["p50"] if d else float("nan")
        db.add(make_row(fp, tpl.name, spec, k["spec"], best_cfg, best, measured=timer is not None))
        if db.path:
            db.save()  # after each instance: an interrupted run keeps what it measured
        run.results.append(Result(inst, tpl.name, k["spec"], calls[inst], default_us, best["p50"], best_cfg,
                                  timer is not None, pruned, failed))
    run.seconds = time.perf_counter() - t0
    return run


def generated_instances(plan: dict, known: dict, wanted: set[str] | None) -> list[tuple[str, dict]]:
    """(instance, its plan record) of every generated kernel instance of the plan (torch
    references have no configs), of the `wanted` templates or instances only where given."""
    return [(inst, k) for inst, k in sorted(plan["kernels"].items())
            if k["template"] in known and language_of(k["template"]) != "torch"
            and (wanted is None or k["template"] in wanted or inst in wanted)]


def _us(row) -> float:
    return float(row["timings"]["p50"]) if row.get("timings") else float("nan")


def config_key(cfg: dict) -> str:
    return repr(sorted(cfg.items()))


def table(run: TuneRun, configs: bool = False) -> str:
    """kernel, calls per step, default and tuned time, speed-up, and the step time each saves
    (weighted by its calls); with `configs`, each row's instance, failed candidates and the
    config it took."""
    lines = [f"{'kernel':<34} {'calls':>5} {'default us':>11} {'tuned us':>9} {'speed-up':>8} {'step gain us':>12}"
             + (f" {'instance':<8} {'failed':>6}  config" if configs else "")]
    total = 0.0
    for r in sorted(run.results, key=lambda r: -_nan0((r.default_us - r.tuned_us) * r.calls)):
        gain = (r.default_us - r.tuned_us) * r.calls
        total += _nan0(gain)
        line = (f"{r.template[:34]:<34} {r.calls:>5} {r.default_us:>11.2f} {r.tuned_us:>9.2f} "
                f"{r.speedup:>7.2f}x {gain:>12.2f}")
        if configs:
            line += f" {r.instance:<8} {r.failed:>6}  " + (" ".join(f"{k}={v}" for k, v in sorted(r.config.items()))
                                                          if r.config else "(every candidate failed)")
        lines.append(line)
    kind = "measured" if any(r.measured for r in run.results) else "modelled (cost model, no hardware)"
    lines.append(f"{len(run.results)} instances, {kind}; step time saved {total:.1f} us per step over all buckets")
    return "\n".join(lines)


def _nan0(x: float) -> float:
    return x if x == x else 0.0
