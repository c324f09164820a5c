"""Writing a plan directory (the format and its reader: runtime/plan_file.py).

Written into a temporary directory beside the target and swapped into place (atomic.replace_dir,
with fsync), so a reader never sees a half-written plan or no plan, and an existing plan survives
a failed compile.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..atomic import replace_dir, write_new_file
from ..runtime.plan_file import PLAN_FORMAT, PLAN_VERSION, PlanError, canonical, load_plan, sha256, versions

__all__ = ["PlanError", "check_plan_target", "load_plan", "versions", "write_plan"]


def check_plan_target(out_dir: str | os.PathLike) -> Path:
    """The directory a plan may be written to: absent, empty, or holding a plan (which the new one
    replaces). Anything else holds the user's files, which a replace would delete."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise PlanError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "plan.json").is_file():
        raise PlanError(f"{out}: holds files and no plan; give an empty or new directory (a plan directory is "
                        "replaced whole)")
    return out


def write_plan(plan: dict, files: dict[str, bytes], out_dir: str | os.PathLike) -> Path:
    out = check_plan_target(out_dir)

    def write(tmp: Path) -> None:
        hashes = {}
        for rel, data in sorted(files.items()):
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            write_new_file(p, data)
            hashes[rel] = sha256(data)
        body = dict(plan, format=PLAN_FORMAT, format_version=PLAN_VERSION, files=hashes)
        body["self_sha256"] = sha256(canonical(body))
        write_new_file(tmp / "plan.json", json.dumps(body, indent=1, sort_keys=True).encode())

    replace_dir(out, write)
    return out


