"""Writing a plan directory (the format and its reader: runtime/plan_file.py).

Written into a temporary directory beside the target and renamed into place (with fsync), so a
reader never sees a half-written plan and an existing plan survives a failed compile.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ..atomic import fsync_dir, write_new_file
from ..runtime.plan_file import PLAN_FORMAT, PLAN_VERSION, PlanError, canonical, load_plan, sha256, versions

__all__ = ["PlanError", "load_plan", "versions", "write_plan"]


def write_plan(plan: dict, files: dict[str, bytes], out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise PlanError(f"{out}: exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        hashes = {}
        for rel, data in sorted(files.items()):
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            write_new_file(p, data)
            hashes[rel] = sha256(data)
        body = dict(plan, format=PLAN_FORMAT, format_version=PLAN_VERSION, files=hashes)
        body["self_sha256"] = sha256(canonical(body))
        write_new_file(tmp / "plan.json", json.dumps(body, indent=1, sort_keys=True).encode())
        fsync_dir(tmp)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
        tmp.rename(out)
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


