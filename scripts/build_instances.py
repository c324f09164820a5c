"""Render and build the kernel instances a compile would make for some templates (no plan
written) and report the ones that fail or spill: how a template change is checked against every
shape of the real model without a full compile.

    python scripts/build_instances.py --model v4.1-flash --target sm100 tilelang_gemm_fp8 tilelang_grouped_gemm_fp4
    python scripts/build_instances.py --model v4.1-flash --target sm100 --all
    python scripts/build_instances.py --target sm100 --ep 8 --dp 8 tilelang_grouped_gemm_fp4   # one rank of EP 8
"""
import argparse
import sys

from deepinfer.codegen.build import build_for
from deepinfer.codegen.instances import render_many
from deepinfer.codegen.targets import get_manifest, get_target
from deepinfer.passes.coverage import TORCH_TEMPLATES
from deepinfer.passes.driver import CompileOptions, select_instances


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("templates", nargs="*", help="templates whose instances to build")
    ap.add_argument("--all", action="store_true", help="every generated instance")
    ap.add_argument("--model", default="v4.1-flash")
    ap.add_argument("--target", default="sm100")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (the plan of one rank)")
    ap.add_argument("--dp", type=int, default=1, help="attention groups over the ranks")
    ap.add_argument("--tuning-db", help="as compile's: the configs a compile takes from it (default: the "
                    "target's shipped database; 'none': template defaults)")
    args = ap.parse_args(argv)
    inst = select_instances(args.model, CompileOptions(args.target, tuning_db=args.tuning_db, ep=args.ep,
                                                       dp=args.dp))
    gen = [v for v in inst.values() if v[1] not in TORCH_TEMPLATES and (args.all or v[1] in args.templates)]
    print(f"{len(gen)} instances", flush=True)
    target = get_target(args.target)
    sources = render_many([(t, s, c) for _, t, s, c, _ in gen], target, args.jobs, None)
    results = build_for(get_manifest(args.target), sources, jobs=args.jobs)
    bad = 0
    for (_, t, spec, cfg, _), res in zip(gen, results):
        spills = {k: (r.get("spill_stores", 0), r.get("spill_loads", 0)) for k, r in (res.resources or {}).items()
                  if r.get("spill_stores") or r.get("spill_loads")}
        if res.status not in ("built", "unbuilt") or spills:
            bad += 1
            print(f"{res.status} {t} {spec.key()[:100]} {cfg} spills={spills} {res.reason or ''}")
    print(f"{len(gen) - bad} of {len(gen)} instances built (or kept checked) without spills")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
