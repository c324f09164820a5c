"""Tuning candidates built for a GPU machine that has no compiler: the first half of a measured
tuning run (`deepinfer autotune PLAN --build-candidates DIR`; the second is autotune/measure.py).

Per generated kernel instance of a compiled plan: the template's space is sampled (autotune/space.py),
rendered through the render cache in a process pool, pruned by legality, ranked by the cost model
(autotune/cost.py), and the top k plus the template default are built through the normal build
path and compile cache (codegen/build.py) with this host's toolchain, the one a compile here uses.
Each built candidate gets its host recipe, recorded as a compile records it (codegen/host_recipe.py)
at the instance's shapes and the input strides its plan's calls have, so the GPU machine runs it
through the runtime's own launch path: the recipe replayed over the cubins (runtime/host_recipe.py,
runtime/cuda_executor.load_instance).

DIR is self-contained, and JSON plus binaries (no pickle):
    manifest.json   format, target, the plan it came from, the building host, and per instance:
                    template, spec, calls per step, the fingerprint (its toolchain: this host's),
                    the settings it was built with, and its candidates: id, config, default or
                    not, modelled time, build status, the kernel record a plan would hold (files
                    relative to DIR), the host recipe, the sha256 of each file
    <inst>/<id>.*   the candidate's cubins (and a Triton kernel's launches.json)
Files are written atomically before the manifest, and the manifest as each instance's builds are
all in, so an interrupted build keeps what it finished; a rerun with the same settings skips the
instances the manifest holds (and the render and compile caches serve the rest of what was done).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..atomic import replace_file
from .tuner import (TuneError, calls_per_instance, config_key, fingerprint, generated_instances, language_of,
                    only_names, parse_spec)

FORMAT = "deepinfer-tuning-candidates"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


# ---- the manifest ----------------------------------------------------------------------------

def load_manifest(cand_dir) -> dict:
    """DIR's manifest, checked: a missing, damaged or foreign manifest is a TuneError of one line
    naming the file and the problem."""
    path = Path(cand_dir) / MANIFEST
    if not Path(cand_dir).is_dir():
        raise TuneError(f"{cand_dir}: no such directory")
    try:
        man = json.loads(path.read_text())
    except FileNotFoundError:
        raise TuneError(f"{path}: missing (build candidates with --build-candidates)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise TuneError(f"{path}: not JSON ({str(e).splitlines()[0]})") from None
    except RecursionError:
        raise TuneError(f"{path}: not JSON (nested too deeply)") from None
    why = _check_manifest(man)
    if why:
        raise TuneError(f"{path}: {why}")
    return man


def _check_manifest(man) -> str | None:
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        return "not a DeepInfer tuning-candidates manifest"
    if man.get("format_version") != FORMAT_VERSION:
        return f"format version {man.get('format_version')!r}, this DeepInfer reads {FORMAT_VERSION}"
    target = man.get("target")
    if not isinstance(target, dict) or not all(isinstance(target.get(k), str) for k in ("name", "arch")):
        return "target must name its name and arch"
    plan = man.get("plan")  # what a rerun and --apply match the plan against
    if not isinstance(plan, dict) or not all(isinstance(plan.get(k), str) for k in ("model", "config_hash")):
        return "plan must name its model and config_hash"
    if not isinstance(man.get("instances"), dict) or not isinstance(man.get("build"), dict):
        return "instances and build must be objects"
    for inst, e in man["instances"].items():
        why = _check_instance(e)
        if why:
            return f"instance {inst}: {why}"
    return None


_INSTANCE = {"template": str, "spec": str, "language": str, "calls": int, "fingerprint": dict, "settings": dict,
             "candidates": list}
_CANDIDATE = {"id": str, "config": dict, "default": bool, "status": str, "reason": str, "kernel": dict,
              "sha256": dict}


def _check_instance(e) -> str | None:
    if not isinstance(e, dict):
        return "not an object"
    for k, kind in _INSTANCE.items():
        if not isinstance(e.get(k), kind):
            return f"{k} is missing or not {kind.__name__}"
    if not isinstance(e["fingerprint"].get("toolchain"), dict):
        return "fingerprint names no toolchain"
    try:
        parse_spec(e["spec"])
    except Exception as err:  # noqa: BLE001  (any parse failure is a malformed spec)
        return f"spec {e['spec'][:60]!r} does not parse ({type(err).__name__})"
    for c in e["candidates"]:
        if not isinstance(c, dict):
            return "a candidate is not an object"
        for k, kind in _CANDIDATE.items():
            if not isinstance(c.get(k), kind):
                return f"candidate {c.get('id')!r}: {k} is missing or not {kind.__name__}"
        if c["status"] == "built" and not isinstance(c.get("recipe"), dict):
            return f"candidate {c['id']}: built, but no host recipe"
        for rel in c["sha256"]:
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                return f"candidate {c['id']}: {rel} is outside the directory"
    if sum(c["default"] for c in e["candidates"]) > 1:
        return "more than one default candidate"
    return None


def write_manifest(cand_dir, man: dict) -> None:
    """Written whole and atomically: a reader sees the old manifest or the new one."""
    replace_file(Path(cand_dir) / MANIFEST, json.dumps(man, indent=1, sort_keys=True).encode())


def damaged_files(cand_dir, cand: dict) -> list[str]:
    """The files of a candidate that are missing or do not match their recorded hash."""
    root = Path(cand_dir)
    bad = []
    for rel, digest in cand["sha256"].items():
        p = root / rel
        if not p.is_file() or hashlib.sha256(p.read_bytes()).hexdigest() != digest:
            bad.append(rel)
    return bad


# ---- building ----------------------------------------------------------------------------------

@dataclass
class BuildReport:
    cand_dir: Path
    built: list[str] = field(default_factory=list)  # instances built this run
    kept: list[str] = field(default_factory=list)  # instances the manifest held already
    no_case: dict[str, str] = field(default_factory=dict)  # instance -> its op, for which no input case exists
    candidates: int = 0
    failed: int = 0  # candidates whose build or recipe failed
    bytes: int = 0

    def summary(self) -> str:
        lines = [f"{self.cand_dir}: {len(self.built)} instances built ({self.candidates} candidates, {self.failed} "
                 f"failed), {len(self.kept)} kept from an earlier run, {self.bytes / 1e6:.1f} MB of kernels"]
        if self.no_case:
            ops = sorted(set(self.no_case.values()))
            lines.append(f"  skipped {len(self.no_case)} instances with no input case to measure them with "
                         f"(codegen/library/triton_check.spec_dims): {', '.join(ops)}")
        lines.append(f"  measure on the GPU machine: deepinfer autotune --measure {self.cand_dir} --db OUT.jsonl")
        return "\n".join(lines)


def build_candidates(plan_dir, cand_dir, *, only=None, top_k: int = 8, limit: int = 64, seed: int = 0,
                     jobs: int = 1, progress: bool = False) -> BuildReport:
    """Build the candidates of every generated instance of a compiled plan (of the `only`
    templates where given) into `cand_dir` (see the module docstring)."""
    from ..codegen.build import build_for
    from ..codegen.instances import render_many
    from ..codegen.library.triton_check import spec_dims
    from ..codegen.targets import get_manifest
    from ..codegen.template import templates
    from ..runtime.plan_file import load_plan
    from . import cost
    from .space import illegal, sample_configs
    if top_k < 1 or limit < 1:
        raise TuneError(f"--top-k and --limit must be at least 1, got {top_k} and {limit}")
    plan = load_plan(Path(plan_dir))
    if plan["options"].get("batch_invariant"):
        raise TuneError(f"{plan_dir}: a --batch-invariant plan keeps its row-independent configs; it takes no tuning")
    backend = get_manifest(plan["target"]["name"])
    target = backend.target
    known = templates()
    wanted = only_names(only, known, plan["kernels"])
    out = Path(cand_dir)
    man = _open_for(out, plan, target, plan_dir)
    settings = {"top_k": top_k, "limit": limit, "seed": seed}
    calls = calls_per_instance(plan)
    report = BuildReport(out)
    todo = []
    for inst, k in generated_instances(plan, known, wanted):
        spec = parse_spec(k["spec"])
        try:
            spec_dims(spec.op, spec.in_types, spec.attr)
        except LookupError:
            report.no_case[inst] = spec.op
            continue
        fp = fingerprint(target, k["template"])
        have = man["instances"].get(inst)
        if have and (have["spec"], have["template"], have["fingerprint"]["toolchain"], have["settings"]) == \
                (k["spec"], k["template"], fp["toolchain"], settings) \
                and not any(damaged_files(out, c) for c in have["candidates"]):
            report.kept.append(inst)
            continue
        configs, space = sample_configs(target, known[k["template"]], spec, limit, seed)
        todo.append((inst, k, spec, fp, configs, space))
    bar = _Bar(progress, sum(len(t[4]) for t in todo), "render")

    def rendered(batch, jobs_):  # per instance of the batch, its configs' sources (None: no render)
        items = [(k["template"], spec, cfg) for _, k, spec, _, configs, _ in batch for cfg in configs]
        srcs = render_many(items, target, jobs_, on_done=bar.tick, on_error=lambda i, why: None)
        cuts = [0]
        for t in batch:
            cuts.append(cuts[-1] + len(t[4]))
        return [srcs[a:b] for a, b in zip(cuts, cuts[1:])]

    def pick(inst, k, spec, fp, configs, space, sources):
        legal = [(cfg, src) for cfg, src in zip(configs, sources) if not illegal(backend, src)]
        ranked = cost.rank(target, spec, legal, seed)
        keep = [cfg for _, cfg in ranked[:top_k]]
        default = config_key(configs[0])  # space.sample_configs puts it first
        if default in {config_key(c) for c, _ in legal} and default not in {config_key(c) for c in keep}:
            keep.append(configs[0])  # what the table compares the best against
        by_key = {config_key(cfg): src for cfg, src in legal}
        modelled = {config_key(cfg): s * 1e6 for s, cfg in ranked}
        return (inst, k, spec, fp, {"space": space, "sampled": len(configs), "pruned": len(configs) - len(legal)},
                [(cfg, by_key[config_key(cfg)], modelled[config_key(cfg)], config_key(cfg) == default)
                 for cfg in keep])

    # TileLang renders lower (seconds each): all of them at once in the pool, through the render
    # cache. A Triton render formats text around its 65 KB kernels module: in this process, an
    # instance at a time, so only the picked sources stay in memory
    lowering = [t for t in todo if language_of(t[1]["template"]) == "cuda"]
    picks = [pick(*t, srcs) for t, srcs in zip(lowering, rendered(lowering, jobs))]
    picks += [pick(*t, rendered([t], 1)[0]) for t in todo if t not in lowering]
    bar.close()
    bar = _Bar(progress, sum(len(p[5]) for p in picks), "build")

    def finish(n: int, results: list) -> None:
        inst, k, spec, fp, counts, keep = picks[n]
        cands = [_candidate(out, plan, inst, f"c{i:02d}", k["template"], spec, cfg, src, r, us, default)
                 for i, ((cfg, src, us, default), r) in enumerate(zip(keep, results))]
        man["instances"][inst] = {"template": k["template"], "spec": k["spec"], "language": k["language"],
                                  "calls": calls[inst], "fingerprint": fp, "settings": settings, **counts,
                                  "candidates": cands}
        write_manifest(out, man)  # per instance as it completes: an interrupted build keeps what it finished
        report.built.append(inst)
        report.candidates += len(cands)
        report.failed += sum(c["status"] != "built" for c in cands)

    owner = [n for n, p in enumerate(picks) for _ in p[5]]
    first = {n: owner.index(n) for n in set(owner)}
    got: list = [None] * len(owner)
    left = [len(p[5]) for p in picks]

    def built(i: int, result) -> None:
        bar.tick()
        got[i] = result
        left[owner[i]] -= 1
        if not left[owner[i]]:
            finish(owner[i], got[first[owner[i]]:first[owner[i]] + len(picks[owner[i]][5])])

    for n, p in enumerate(picks):
        if not p[5]:  # nothing legal to build: recorded, so the table says so
            finish(n, [])
    build_for(backend, [src for p in picks for _, src, _, _ in p[5]], jobs=jobs, on_done=built)
    bar.close()
    report.bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
    return report


def _open_for(out: Path, plan: dict, target, plan_dir) -> dict:
    """The manifest to extend: DIR's own where it holds candidates of this plan's model and
    target, a new one where DIR is absent or empty."""
    ident = {"model": plan["model"]["id"], "config_hash": plan["model"]["config_hash"]}
    if out.exists() and not out.is_dir():
        raise TuneError(f"{out}: exists and is not a directory")
    if (out / MANIFEST).exists():
        man = load_manifest(out)
        mine = {k: man["plan"][k] for k in ident}
        if mine != ident or man["target"]["name"] != target.name:
            raise TuneError(f"{out}: holds candidates of {mine['model']} for {man['target']['name']}, not "
                            f"{ident['model']} for {target.name}; give another directory")
        man["plan"]["dir"] = str(plan_dir)
        return man
    if out.is_dir() and any(out.iterdir()):
        raise TuneError(f"{out}: holds files and no {MANIFEST}; give an empty or new directory")
    out.mkdir(parents=True, exist_ok=True)
    from ..version import VERSION

    return {"format": FORMAT, "format_version": FORMAT_VERSION, "target": {"name": target.name, "arch": target.arch},
            "plan": dict(ident, dir=str(plan_dir)), "build": {"host": socket.gethostname(), "deepinfer": VERSION,
                                           "date": datetime.date.today().isoformat()}, "instances": {}}


def _candidate(out: Path, plan: dict, inst: str, cid: str, template: str, spec, cfg: dict, src, res, us: float,
               default: bool) -> dict:
    from ..codegen.instances import kernel_record

    record, files = kernel_record(template, spec, cfg, src, res, f"{inst}/{cid}", with_source=False)
    status, reason, recipe = res.status, res.reason, None
    if status == "built":
        try:
            recipe = record_recipe(record, spec, _recorded_strides(plan, inst, spec))
        except Exception as e:  # noqa: BLE001  (a host that cannot run at this shape: the candidate fails)
            status, reason = "failed", f"host recipe: {(str(e).strip().splitlines() or [type(e).__name__])[-1]}"
    if status != "built":
        files = {}
    for rel, data in files.items():
        replace_file(out / rel, data)
    record["build"]["files"] = {art: rel for art, rel in record["build"]["files"].items() if rel in files}
    return {"id": cid, "config": cfg, "default": default, "modelled_us": us, "status": status, "reason": reason,
            "kernel": record, "recipe": recipe, "sha256": {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}}


def _parts(t) -> list:
    return [t.data, t.scale] if hasattr(t, "scale") else [t]


def _recorded_strides(plan: dict, inst: str, spec) -> list | None:
    """The input strides a call of `inst` at the instance's own shapes was recorded with (a view
    among the inputs keeps its layout), or None where no call has those shapes (an instance
    rendered for a canonical row count no bucket has): then contiguous."""
    from ..ir import shapes as sh

    want = [[sh.shape_str(p.storage_shape()) for p in _parts(t)] for t in spec.in_types]
    for g in plan["graphs"].values():
        for c in g["calls"]:
            for ln in c["launch"].values():
                if ln.get("kernel") == inst and ln.get("recipe") and \
                        [ln["shapes"].get(v) for v in c["inputs"]] == want:
                    return plan["recipes"][ln["recipe"]]["strides"]
    return None


def record_recipe(kernel: dict, spec, strides: list | None) -> dict:
    """The host recipe of one built kernel record at `spec`'s shapes: its template's host code run
    on meta tensors with `strides` (None: contiguous), as a compile records a call's."""
    import torch

    from ..codegen.host_recipe import record_tilelang, record_triton
    from ..codegen.library import triton_launchers
    from ..codegen.template import templates
    from ..ir import shapes as sh
    from ..ir.quant import QTensor
    from ..ir.registry import get_op

    flat = iter(strides or [])

    def meta(t):
        shape = tuple(sh.evaluate(t.storage_shape(), {}))
        stride = next(flat) if strides else torch.empty(shape, device="meta").stride()
        return torch.empty_strided(shape, stride, dtype=t.dtype.storage, device="meta")

    xs = [QTensor(meta(t.data), meta(t.scale)) if hasattr(t, "scale") else meta(t) for t in spec.in_types]
    attrs = get_op(spec.op).check_attrs(spec.attr)
    quantised = [hasattr(t, "scale") for t in spec.out_types]
    with torch.device("meta"):
        if kernel["language"] == "cuda":
            rec, _ = record_tilelang(templates()[kernel["template"]].host, kernel, xs, attrs, quantised)
        else:
            rec, _ = record_triton(getattr(triton_launchers, kernel["meta"]["launcher"]), kernel, xs, quantised)
    return rec


class _Bar:
    def __init__(self, enabled: bool, total: int, desc: str):
        self.bar = None
        if enabled and total and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="kernel", leave=False)

    def tick(self) -> None:
        if self.bar:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar:
            self.bar.close()
