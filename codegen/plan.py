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
    """The directory a plan may be written to: absent, empty, or holding a DeepInfer plan and
    nothing else (the new plan replaces it whole). Anything more is the user's, which a replace
    would delete: a plan.json of another program, or files beside a plan's own. (A plan of an
    older format or with a damaged hash is still a plan, and may be replaced.) Returns the
    directory to replace: a symbolic link's target."""
    out = Path(out_dir)
    if out.is_symlink():  # the plan replaces what the link names, and the link stays
        out = out.resolve()
    if out.exists() and not out.is_dir():
        raise PlanError(f"{out}: exists and is not a directory")
    for parent in out.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise PlanError(f"{out}: {parent} is a file, not a directory")
            break
    if not out.is_dir() or not any(out.iterdir()):
        return out
    hint = "give an empty or new directory (a plan directory is replaced whole)"
    try:
        body = json.loads((out / "plan.json").read_text())
    except FileNotFoundError:
        raise PlanError(f"{out}: holds files and no plan; {hint}") from None
    except (OSError, ValueError, RecursionError):
        body = None
    if not isinstance(body, dict) or body.get("format") != PLAN_FORMAT:
        raise PlanError(f"{out}: its plan.json is not a DeepInfer plan; {hint}")
    files = body.get("files") if isinstance(body.get("files"), dict) else {}
    own = {"plan.json"} | {str(rel).split("/")[0] for rel in files}
    foreign = sorted(e.name for e in out.iterdir() if e.name not in own)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise PlanError(f"{out}: holds {shown} beside its plan, which a new plan would delete; move them or {hint}")
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


