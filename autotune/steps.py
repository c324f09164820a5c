"""The step-time curve per bucket, measured where a tuned plan is made and recorded in it, for the
speculative verifier's budget (spec §5.6: the verify rows a step takes are chosen from what each
bucket's step costs).

`deepinfer autotune PLAN --apply CANDS --db DB -o TUNED --step-curve` times every decode and verify
bucket of the tuned plan on this machine's GPU (runtime/plan_executor.time_step_buckets: a CUDA
graph per bucket, the median of repeats, random tokens in the scratch slot and page) and writes the
curve into TUNED's plan.json (`step_time_curve`: the device it was measured on, the date, and per
bucket its sequences, rows and seconds). An executor on a GPU of that name starts from it
(runtime/speculative.plan_step_curve) and its warm-up times only the buckets the curve lacks; on
another GPU the curve is not used, since a step's cost belongs to the device that ran it.
"""
from __future__ import annotations

import datetime
import socket
from pathlib import Path


def measure_step_curve(plan_dir, *, executor=None, reps: int = 5, max_seqs: int | None = None,
                       seed: int = 0) -> list[tuple[str, int, int, float]]:
    """(bucket, sequences, rows, seconds) of each decode and verify bucket of the plan, timed by
    `executor.warm_up` (default: the plan on this machine's GPU with weights generated there: a
    step's time does not depend on the weights' values)."""
    if executor is None:
        from ..models.checkpoint import GeneratedCheckpoint
        from ..models.config import config_from_dict
        from ..runtime.cuda_executor import CudaPlanExecutor
        from ..runtime.plan_file import load_plan

        model = load_plan(Path(plan_dir))["model"]
        cfg = config_from_dict(model["config"], model_id=model["id"])
        executor = CudaPlanExecutor(plan_dir, checkpoint=GeneratedCheckpoint(cfg, seed, device="cuda"),
                                    config_hash=cfg.config_hash)
        executor.step_time_curve = []  # measure every bucket, whatever the plan already holds
    return list(executor.warm_up(max_seqs, reps))


def record_step_curve(plan_dir, curve: list[tuple[str, int, int, float]], device: str) -> dict:
    """Write `curve`, measured on `device` (its name as torch reports it), into the plan's
    plan.json (the plan rewritten whole, its hashes again); returns the record."""
    from ..codegen.plan import write_plan
    from ..runtime.plan_file import load_plan

    root = Path(plan_dir)
    plan = load_plan(root)
    known = {b for g in plan["buckets"].values() for b in g}
    rows = []
    for bucket, seqs, n, seconds in curve:
        if bucket not in known:
            raise ValueError(f"step-time curve: {root} has no bucket {bucket!r}")
        if not (isinstance(seconds, (int, float)) and seconds > 0):
            raise ValueError(f"step-time curve: bucket {bucket} took {seconds!r} s")
        rows.append({"bucket": bucket, "seqs": int(seqs), "rows": int(n), "seconds": float(seconds)})
    record = {"device": device, "date": datetime.date.today().isoformat(), "host": socket.gethostname(),
              "source": "autotune", "buckets": rows}
    files = {rel: (root / rel).read_bytes() for rel in plan["files"]}
    body = {k: v for k, v in plan.items() if k not in ("format", "format_version", "files")}
    body["step_time_curve"] = record
    write_plan(body, files, root)
    load_plan(root)  # what was written reads back
    return record
