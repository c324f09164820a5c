"""A decode step's critical path, modelled on the CPU from a compiled plan and a measured profile:
each call of the step's graph costs the measured time of its launches (bench/runtime_sm90.py's
`by_launch` rows: kernel name and grid, microseconds a call) plus a fixed gap a launch, and the
calls' `deps` / `after` edges give the longest chain, which is what the two-lane step waits on.
The plan may have more layers than the profiled one (the per-call times are per shape, not per
layer). Kernels the profile's rows do not name take the mean of the same kernel at other grids,
else `--unknown-us`. The output is a model, not a measurement: it says which calls bound a step
and which run beside them.

    python bench/critical_path.py PLAN_DIR PROFILE.json [--bucket decode_b1] [--gap-us 1] [--layer N]
"""
import argparse
import collections
import json
import os


def launches(plan: dict, call: dict, bucket: str) -> list[tuple[str, str]]:
    """(kernel name, grid as the profiler writes it) of each launch the call's recipe makes."""
    launch = call["launch"].get(bucket)
    if not launch or "kernel" not in launch:
        return []
    kernel = plan["kernels"][launch["kernel"]]
    steps = [s for s in plan["recipes"].get(launch.get("recipe"), {}).get("steps", []) if "launch" in s]
    named = kernel.get("meta", {}).get("kernels")  # Triton: one entry a launch; TileLang: main + combine
    out = []
    for s in steps:
        i = s["launch"]
        if named:
            name = named[i]["entry"]
        elif i == 0:
            name = kernel.get("entry")
        else:
            name = kernel.get("meta", {}).get("combine", {}).get("entry") or "combine_kernel"
        out.append((name, str(list(s["grid"]) + [1] * (3 - len(s["grid"])))))
    return out


def model(plan: dict, profile: dict, bucket: str, gap_us: float, unknown_us: float, graph: str = "step_decode"):
    rows = profile["medium_profile"][bucket]["by_launch"]
    exact, by_name = {}, collections.defaultdict(list)
    for r in rows:
        name, _, grid = r["name"].partition(" grid=")
        exact[(name, grid)] = r["us_per_call"]
        by_name[name].append(r["us_per_call"])
    calls = plan["graphs"][graph]["calls"]
    cost, guessed = [], collections.Counter()
    for c in calls:
        t = 0.0
        for name, grid in launches(plan, c, bucket):
            if (name, grid) in exact:
                t += exact[(name, grid)]
            elif name in by_name:
                t += sum(by_name[name]) / len(by_name[name])
                guessed[name + " (other grids' mean)"] += 1
            else:
                t += unknown_us
                guessed[name] += 1
            t += gap_us
        cost.append(t)
    finish, prev = [0.0] * len(calls), [-1] * len(calls)
    for i, c in enumerate(calls):
        for d in list(c["deps"]) + list(c.get("after", [])):
            if finish[d] > finish[i]:
                finish[i], prev[i] = finish[d], d
        finish[i] += cost[i]
    end = max(range(len(calls)), key=finish.__getitem__)
    path = []
    while end >= 0:
        path.append(end)
        end = prev[end]
    return calls, cost, path[::-1], finish, guessed


def template(call: dict, bucket: str) -> str:
    return call["launch"].get(bucket, {}).get("template", call["op"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("plan", help="a compiled plan's directory (plan.json)")
    ap.add_argument("profile", help="bench/runtime_sm90.py's profile JSON (medium_profile.BUCKET.by_launch)")
    ap.add_argument("--bucket", default="decode_b1")
    ap.add_argument("--gap-us", type=float, default=1.0, help="added a launch (graph replay with PDL: about 1)")
    ap.add_argument("--unknown-us", type=float, default=1.5, help="a kernel the profile does not name")
    ap.add_argument("--layer", type=int, default=None, help="also list this layer's calls on the path")
    a = ap.parse_args()
    with open(os.path.join(a.plan, "plan.json")) as f:
        plan = json.load(f)
    with open(a.profile) as f:
        profile = json.load(f)
    calls, cost, path, finish, guessed = model(plan, profile, a.bucket, a.gap_us, a.unknown_us)
    on_path, everywhere = collections.Counter(), collections.Counter()
    for i in path:
        on_path[template(calls[i], a.bucket)] += cost[i]
    for i, c in enumerate(calls):
        everywhere[template(c, a.bucket)] += cost[i]
    print(f"{a.bucket} (modelled): critical path {finish[path[-1]]:.0f} us over {len(path)} of {len(calls)} calls; "
          f"all calls {sum(cost):.0f} us; {a.gap_us} us a launch")
    if guessed:
        print("  not in the profile's rows:", dict(guessed))
    print(f"  {'template':44s} {'on path us':>10s} {'all us':>8s}")
    for name, t in on_path.most_common():
        print(f"  {name:44s} {t:10.0f} {everywhere[name]:8.0f}")
    off = {n: t for n, t in everywhere.items() if n not in on_path}
    if off:
        print("  off the path:", ", ".join(f"{n} {t:.0f}" for n, t in sorted(off.items(), key=lambda kv: -kv[1])))
    if a.layer is not None:
        prefix = f"layers.{a.layer}."
        print(f"  layer {a.layer} on the path:")
        for i in path:
            w = [v for v in calls[i]["inputs"] if v.startswith(prefix)]
            if w:
                print(f"    {cost[i]:6.1f} us  {template(calls[i], a.bucket):40s} {w[0]}")


if __name__ == "__main__":
    main()
