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

__all__ = ["PlanError", "load_plan", "versions", "write_plan"]


def write_plan(plan: dict, files: dict[str, bytes], out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise PlanError(f"{out}: exists and is not a directory")

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


