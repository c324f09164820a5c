"""A tuned plan without a compiler: the third step of a measured tuning run, on the GPU machine
(`deepinfer autotune PLAN --apply CANDS_DIR --db DB -o TUNED`).

The plan's graphs, calls and buckets stay as compiled. Per generated instance, the database is
looked up as a compile looks it up (autotune/db.py's ladder, with the fingerprint of the host that
built the candidates and this machine's device); where the row's config is one of the instance's
built candidates, that candidate's binaries and kernel record replace the instance's. The host
recipes of every call are then recorded again (codegen/host_recipe.host_recipes over the plan's own
IR), since a config can change what the host does around a launch (a split-K buffer, a grid). The
result is the plan a compile with `--tuning-db DB` would write on the building host, made where
only the runtime is installed. Rows measured at another bucket (the ladder's nearest rung) are
not taken here, where the instance can be measured itself, and a row whose config no candidate
holds is not either: both are reported, and the instance keeps its config.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from .candidates import damaged_files, load_manifest
from .db import provenance as row_provenance
from .db import structure_key
from .tuner import TuneError, calls_per_instance, config_key, on_device, parse_spec


@dataclass
class Applied:
    inst: str
    template: str
    calls: int
    old: dict
    new: dict
    rung: str
    default_us: float | None = None
    tuned_us: float | None = None


@dataclass
class ApplyReport:
    out: Path
    applied: list[Applied] = field(default_factory=list)
    kept: int = 0  # instances whose row is their own config (the default won)
    untuned: int = 0  # generated instances the database has no row for
    not_built: list[tuple[str, str]] = field(default_factory=list)  # (instance, why)

    def summary(self) -> str:
        lines = [f"{'instance':<8} {'template':<28} {'calls':>5} {'rung':<9} {'default us':>10} {'tuned us':>9}  config"]
        for a in sorted(self.applied, key=lambda a: a.inst):
            changed = {k: v for k, v in a.new.items() if a.old.get(k) != v}
            lines.append(f"{a.inst:<8} {a.template:<28} {a.calls:>5} {a.rung:<9} {_us(a.default_us):>10} "
                         f"{_us(a.tuned_us):>9}  " + " ".join(f"{k}={v}" for k, v in sorted(changed.items())))
        lines.append(f"wrote {self.out}: {len(self.applied)} instances retuned, {self.kept} kept their config "
                     f"(the default won), {self.untuned} without a row")
        for inst, why in self.not_built:
            lines.append(f"  {inst}: kept its config, {why}")
        return "\n".join(lines)


def _us(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def this_device() -> dict | None:
    """The GPU this machine would run the plan on, as measurements record it; None without one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    from .bench import Bench

    return Bench.device_info()


def apply_tuning(plan_dir, cand_dir, db, out_dir, device: dict | None = None) -> ApplyReport:
    """Write the plan of `plan_dir` with the winners of `db` that `cand_dir` built to `out_dir`
    (see the module docstring). `device`: the device the rows are looked up for (default: this
    machine's GPU, none on a machine without one, where measured rows are borrowed)."""
    from ..codegen.host_recipe import host_recipes
    from ..codegen.plan import check_plan_target, write_plan
    from ..ir.text import parse_graph
    from ..passes.coverage import plan_coverage
    from ..runtime.plan_file import load_plan

    plan_dir, cand_dir, out = Path(plan_dir), Path(cand_dir), Path(out_dir)
    if out.resolve() == plan_dir.resolve():
        raise TuneError(f"{out}: is the plan being tuned; give another output directory (the untuned plan is kept)")
    check_plan_target(out)
    plan = load_plan(plan_dir)
    if plan["options"].get("batch_invariant"):
        raise TuneError(f"{plan_dir}: a --batch-invariant plan keeps its row-independent configs; it takes no tuning")
    man = load_manifest(cand_dir)
    ident = {"model": plan["model"]["id"], "config_hash": plan["model"]["config_hash"]}
    theirs = {k: man["plan"].get(k) for k in ident}
    if theirs != ident or man["target"]["name"] != plan["target"]["name"]:
        raise TuneError(f"{cand_dir}: holds candidates of {theirs['model']} for {man['target']['name']}, and "
                        f"{plan_dir} is {ident['model']} for {plan['target']['name']}")
    if device is None:
        device = this_device()
    files = {rel: (plan_dir / rel).read_bytes() for rel in plan.pop("files")}
    for k in ("format", "format_version"):
        plan.pop(k, None)
    report = ApplyReport(out)
    calls = calls_per_instance(plan)
    for inst, k in sorted(plan["kernels"].items()):
        if k.get("language") in (None, "torch"):
            continue
        e = man["instances"].get(inst)
        if e is None or e["spec"] != k["spec"] or e["template"] != k["template"]:
            report.untuned += 1
            continue
        spec = parse_spec(e["spec"])
        match, _ = db.lookup(on_device(e["fingerprint"], device), e["template"], spec)
        if match is None:
            report.untuned += 1
            continue
        if match.rung == "nearest":
            # here the instance can be measured itself; another bucket's winner slowed the b64
            # step of the medium plan on the H200 (docs/performance.md, 2026-12-02)
            report.not_built.append((inst, f"its only row was measured at {match.row['bucket']} rows, not "
                                           f"{structure_key(spec)[1]}: measure it (--measure resumes)"))
            continue
        want = dict(k["config"], **match.row["config"])
        provenance = row_provenance(match, db)
        if config_key(want) == config_key(k["config"]):
            k["tuning"] = provenance
            report.kept += 1
            continue
        cand = next((c for c in e["candidates"] if config_key(dict(k["config"], **c["config"])) == config_key(want)),
                    None)
        if cand is None or cand["status"] != "built" or damaged_files(cand_dir, cand):
            why = ("its row's config is not among the built candidates (compile with --tuning-db to take it)"
                   if cand is None or cand["status"] != "built" else "its candidate's files are missing or damaged")
            report.not_built.append((inst, why))
            continue
        plan["kernels"][inst] = _swap_in(inst, cand, files, cand_dir) | {"tuning": provenance}
        tried = {t["id"]: t for t in match.row.get("candidates") or []}
        base = next((t["p50"] for t in tried.values() if t["default"]), None)
        report.applied.append(Applied(inst, k["template"], calls.get(inst, 0), k["config"], want, match.rung, base,
                                      (match.row.get("timings") or {}).get("p50")))
    if report.applied:
        # every call's recipe again, over the plan's own graphs: a config can change the host's steps
        plan["recipes"] = {}
        for name, g_rec in plan["graphs"].items():
            for c in g_rec["calls"]:
                for ln in c["launch"].values():
                    ln.pop("recipe", None)
            g = parse_graph(files[g_rec["ir"]].decode())
            host_recipes(g, g_rec["calls"], plan["buckets"][name], plan["kernels"], plan["recipes"])
        plan["coverage"] = plan_coverage(plan)
    write_plan(plan, files, out)
    load_plan(out)  # what was written reads back: hashes, files, format
    return report


def _swap_in(inst: str, cand: dict, files: dict[str, bytes], cand_dir: Path) -> dict:
    """The candidate's kernel record, its binaries put where the plan keeps the instance's (the
    instance's old files, its rendered source too, are dropped: they describe another config)."""
    stem = f"kernels/{inst}"
    for rel in [r for r in files if r.startswith(stem + ".")]:
        del files[rel]
    record = dict(cand["kernel"])
    build = dict(record["build"])
    moved = {}
    for art, rel in build["files"].items():
        data = (cand_dir / rel).read_bytes()
        if hashlib.sha256(data).hexdigest() != cand["sha256"][rel]:
            raise TuneError(f"{cand_dir / rel}: does not match the manifest's hash (damaged)")
        new = stem + rel[len(rel.split(".", 1)[0]):]  # <inst>/<cid>.x -> kernels/<inst>.x
        files[new] = data
        moved[art] = new
    build["files"] = moved
    record["build"] = build
    return record

