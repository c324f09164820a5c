"""What a plan generates and what it leaves to torch, and how many device kernels a step launches.

Read off the plan itself (its kernels, call lists and host recipes), so the compile summary, the
plan's own record and `docs/kernels.md` count the same things."""
from __future__ import annotations

from collections import Counter

TORCH_TEMPLATES = ("torch_ref", "torch_device")  # run the op's reference: nothing to render or build

# aten ops a host recipe records that launch nothing on the device: allocation and views
_NO_KERNEL = ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view", "_unsafe_view",
              "as_strided", "alias", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
              "squeeze", "unflatten", "detach", "reshape", "_reshape_alias", "split", "split_with_sizes", "unbind",
              "view_as", "lift_fresh", "_to_copy_meta")


def _launches_kernel(step: dict) -> bool:
    if "launch" in step:
        return True
    name = step["op"].split(".")[1] if step["op"].startswith("aten.") else step["op"]
    return name not in _NO_KERNEL


def plan_coverage(plan: dict) -> dict:
    """instances per template, torch instances per op, and per bucket of every graph: the calls
    that run a kernel or a torch reference, and the device kernels they launch (a generated
    call's recipe: its launches plus the aten ops that are not views; a torch call counts as one,
    a lower bound), also per layer of the backbone."""
    kernels = plan["kernels"]
    per_template = Counter(k["template"] for k in kernels.values())
    torch_ops = Counter(k["spec"].split("(")[0] for k in kernels.values() if k["template"] in TORCH_TEMPLATES)
    recipes = plan.get("recipes", {})
    cfg = plan.get("model", {}).get("config", {})
    # (a multimodal config.json keeps the backbone's fields under text_config)
    layers = cfg.get("text_config", cfg).get("num_hidden_layers") or 1
    steps: dict[str, dict] = {}
    for gname, g in plan["graphs"].items():
        for bucket in plan["buckets"].get(gname, {}):
            calls = launches = torch_calls = 0
            for c in g["calls"]:
                entry = c["launch"].get(bucket)
                if c["kernel"] == "view" or entry is None:
                    continue
                calls += 1
                if entry.get("template") in TORCH_TEMPLATES:
                    torch_calls += 1
                    launches += 1
                elif entry.get("recipe") in recipes:
                    launches += sum(_launches_kernel(s) for s in recipes[entry["recipe"]]["steps"])
                else:  # a source kept unbuilt (AscendC without its compiler): its one kernel
                    launches += 1
            steps[f"{gname}/{bucket}"] = {"calls": calls, "torch_calls": torch_calls, "kernels": launches,
                                          "kernels_per_layer": round(launches / layers, 1)}
    return {"instances_per_template": dict(sorted(per_template.items(), key=lambda kv: (-kv[1], kv[0]))),
            "torch_instances": sum(torch_ops.values()),
            "torch_instances_per_op": dict(sorted(torch_ops.items(), key=lambda kv: (-kv[1], kv[0]))),
            "steps": steps}


def coverage_lines(cov: dict) -> list[str]:
    """The compile summary's lines for a coverage record."""
    gen = sum(v for t, v in cov["instances_per_template"].items() if t not in TORCH_TEMPLATES)
    lines = [f"  generated instances: {gen} on "
             f"{sum(1 for t in cov['instances_per_template'] if t not in TORCH_TEMPLATES)} templates; "
             f"torch instances: {cov['torch_instances']}"
             + (" (" + ", ".join(f"{op} {n}" for op, n in cov["torch_instances_per_op"].items()) + ")"
                if cov["torch_instances"] else "")]
    lines.append("  kernels per step: " + ", ".join(
        f"{name} {s['kernels']} ({s['kernels_per_layer']}/layer)" for name, s in cov["steps"].items()))
    return lines


def templates_per_op(instances: dict) -> dict[str, dict[str, int]]:
    """op -> template -> instances, from select_instances' (or a compile's) instance table."""
    out: dict[str, Counter] = {}
    for _, template, spec, _, _ in instances.values():
        out.setdefault(spec.op, Counter())[template] += 1
    return {op: dict(c) for op, c in sorted(out.items())}


def coverage_table(columns: dict[str, dict[str, dict[str, int]]]) -> str:
    """A markdown table, a row per op and a column per (target) heading: each cell the templates
    that serve the op's instances there, torch fallbacks marked."""
    ops = sorted({op for col in columns.values() for op in col})
    lines = ["| op | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for op in ops:
        cells = []
        for col in columns.values():
            per = col.get(op)
            if not per:
                cells.append("–")
                continue
            cells.append(", ".join(f"**torch fallback** ({n})" if t in TORCH_TEMPLATES else f"`{t}` ({n})"
                                   for t, n in sorted(per.items())))
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
