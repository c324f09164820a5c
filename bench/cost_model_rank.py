"""The cost model's rank agreement with a measured tuning database, recomputed here (CPU, no GPU):
for every measured row that carries its candidates' times (autotune --measure writes them), each
candidate is rendered again for the row's target (through the render cache) and its time modelled
by autotune/cost.py as it is now; Spearman's rho of modelled vs measured p50 per instance, and its
mean per template, split into decode (rows <= 512) and prefill instances.

    python bench/cost_model_rank.py [autotune/db/sm90.jsonl] [--json OUT]

The candidates were rendered with the template code of the measuring session; a template changed
since renders what it renders now, so a row is a measurement of the config, not of this render.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DECODE_ROWS = 512


def rank_rows(rows: list[dict], jobs: int = 1) -> list[dict]:
    """Per measured row with >= 3 timed candidates: template, instance, bucket, rho."""
    from deepinfer.autotune import cost
    from deepinfer.autotune.tuner import parse_spec
    from deepinfer.codegen.instances import render_many
    from deepinfer.codegen.targets import get_target

    out = []
    for row in rows:
        cands = [c for c in row.get("candidates") or [] if c.get("p50") is not None]
        if not row.get("measured") or len(cands) < 3:
            continue
        target = get_target(row["fingerprint"]["target"])
        spec = parse_spec(row["spec"])
        srcs = render_many([(row["template"], spec, c["config"]) for c in cands], target, jobs,
                           on_error=lambda i, why: None)
        pairs = [(cost.estimate(target, spec, s), c["p50"]) for c, s in zip(cands, srcs) if s is not None]
        rho = cost.spearman([p[0] for p in pairs], [p[1] for p in pairs])
        out.append({"template": row["template"], "instance": row.get("instance"), "bucket": row["bucket"],
                    "candidates": len(pairs), "rho": rho,
                    "pairs_us": [[round(m * 1e6, 3), round(t, 3)] for m, t in pairs]})
    return out


def summary(per_row: list[dict]) -> dict[str, dict]:
    agg: dict[str, dict] = {}
    for r in per_row:
        if r["rho"] is None:
            continue
        kind = "decode" if r["bucket"] <= DECODE_ROWS else "prefill"
        for key in (r["template"], f"{r['template']} [{kind}]"):
            a = agg.setdefault(key, {"rho": []})
            a["rho"].append(r["rho"])
    for a in agg.values():
        a["mean_rho"] = sum(a["rho"]) / len(a["rho"])
        a["n"] = len(a["rho"])
    return agg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("db", nargs="?", default=str(Path(__file__).resolve().parents[1] / "autotune/db/sm90.jsonl"))
    p.add_argument("--json", help="write the per-instance rho and (modelled, measured) pairs here")
    p.add_argument("--jobs", type=int, default=1)
    args = p.parse_args(argv)
    rows = [json.loads(ln) for ln in Path(args.db).read_text().splitlines() if ln.strip()]
    per_row = rank_rows(rows, args.jobs)
    agg = summary(per_row)
    for r in per_row:
        rho = "n/a" if r["rho"] is None else f"{r['rho']:+.2f}"
        print(f"{r['template']:<28} {r['instance']} rows {r['bucket']:>6}  rho {rho}")
    print("mean rho per template:")
    for k in sorted(agg):
        print(f"  {k:<40} {agg[k]['mean_rho']:+.2f} over {agg[k]['n']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": per_row, "mean": agg}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
